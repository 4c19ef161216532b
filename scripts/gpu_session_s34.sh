# Session 34's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model, spec_detail, and
# synth_draft_bg from gpu_session_s32.sh).
#
#   bash scripts/gpu_session.sh s34-floor    # ~1 min: megakernel_floor.py (the floor under a one-launch 0.8B step:
#                                            #   barriers alone, direct loads, a cp.async ring across barriers, three
#                                            #   barriers, at 1 and 2 blocks an SM). carry: .whl
#   bash scripts/gpu_session.sh s34          # ~4 min: s34-floor; test_gdn_replay.py with compiled kernels (the
#                                            #   kernel-level bit tests on the GPU); on the 27B, one speculative step's
#                                            #   parts at a forced 8.3 with LUCEBOX_GDN_REPLAY 0 and 1 (and 1 with
#                                            #   LUCEBOX_RECORDED_DRAFT_SYNC=1). carry: .whl
#   bash scripts/gpu_session.sh s34-commit   # ~6 min: the GPU tests of the replayed commit (its one-launch kernel
#                                            #   now takes layer 0's pointers and offsets), the recorded draft sync's;
#                                            #   on the 27B the step's parts at a forced 8.3 with the replay and the
#                                            #   recorded sync on, each alone, and both off; `lucebox bench` forced
#                                            #   budget 22 with both off and both on. carry: .whl

s34_floor() {
  step megakernel-floor 120 python3 scripts/megakernel_floor.py --blocks-per-sm 1 2 --json "$OUT/megakernel_floor.json"
  step megakernel-floor-partials 120 python3 scripts/megakernel_floor.py --blocks-per-sm 1 2 --schedule partials \
    --json "$OUT/megakernel_floor_partials.json"
  return 0
}

s34() {
  s34_floor
  step gdn-replay-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=line -rf \
    tests/test_gdn_replay.py
  step synth-27b 90 synth 27b
  local m d writer; m=$(model 27b); d=$WORK/draft-27b.gguf
  synth_draft_bg "$m" "$d"; writer=$!
  wait "$writer"; tail -n1 "$RES/synth_draft.log"
  spec_step_replays "$m" "$d"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s34_commit() {
  step gpu-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=line -rf \
    tests/test_gdn_replay.py tests/test_static_verify.py \
    tests/test_speculative.py::test_recorded_context_sync_projects_as_the_eager_one
  step synth-27b 90 synth 27b
  local m d writer r s; m=$(model 27b); d=$WORK/draft-27b.gguf
  synth_draft_bg "$m" "$d"; writer=$!
  wait "$writer"; tail -n1 "$RES/synth_draft.log"
  local pair
  for pair in 11 00; do  # the switches both on, both off; then the bench; then each alone
    r=${pair:0:1}; s=${pair:1:1}
    step "spec-step-replay$r-sync$s" 90 env LUCEBOX_GDN_REPLAY=$r LUCEBOX_RECORDED_DRAFT_SYNC=$s python3 \
      scripts/spec_step_profile.py "$m" "$d" --force-accept 8.3 -n 256 --json "$RES/spec_step_r${r}_s$s.json"
  done
  for r in 0 1; do
    step "b22-forced-both$r" 90 bash -c "LUCEBOX_GDN_REPLAY=$r LUCEBOX_RECORDED_DRAFT_SYNC=$r python3 -m \
      lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget 22 --force-accept 8.3 --json \
      | spec_detail b22-forced-both$r"
  done
  for pair in 10 01; do
    r=${pair:0:1}; s=${pair:1:1}
    step "spec-step-replay$r-sync$s" 90 env LUCEBOX_GDN_REPLAY=$r LUCEBOX_RECORDED_DRAFT_SYNC=$s python3 \
      scripts/spec_step_profile.py "$m" "$d" --force-accept 8.3 -n 256 --json "$RES/spec_step_r${r}_s$s.json"
  done
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}
