# Session 34's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model).
#
#   bash scripts/gpu_session.sh s34-floor    # ~1 min: megakernel_floor.py (the floor under a one-launch 0.8B step:
#                                            #   barriers alone, direct loads, a cp.async ring across barriers, at 1
#                                            #   and 2 blocks an SM). carry: .whl

s34_floor() {
  step megakernel-floor 120 python3 scripts/megakernel_floor.py --blocks-per-sm 1 2 --json "$OUT/megakernel_floor.json"
  return 0
}
