# Session 35's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model, and variants /
# bench_rows from gpu_session_more.sh).
#
#   bash scripts/gpu_session.sh s35          # ~4 min: the megakernel (LUCEBOX_MEGAKERNEL): its GPU tests (S35_TESTS:
#                                            #   more test files); the 0.8B tg128 default / megakernel (no L2 prefetch,
#                                            #   the default since its calls; 1 layer ahead; S35_MORE: more variants) /
#                                            #   row-major weights; the megakernel's phases (megakernel_profile.py),
#                                            #   prefetch 0 and 1. (Calls 3-4 ran it with prefetch 1 the default.)
#                                            #   carry: .whl

s35() {
  ( synth 0.8b > "$RES/synth_08b.log" 2>&1 ) &
  local writer=$! m
  step mega-tests 300 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_megakernel_gpu.py ${S35_TESTS:-}
  wait "$writer"; tail -qn1 "$RES"/synth_*.log
  m=$(model 0.8b)
  variants 08b "$m" "-p 0 -n 128 -r 3" default mega:LUCEBOX_MEGAKERNEL=1 \
    mega-p1:LUCEBOX_MEGAKERNEL=1,LUCEBOX_MEGAKERNEL_PREFETCH=1 ${S35_MORE:-} rowmajor:LUCEBOX_TILED_WEIGHTS=0
  step mega-phases 90 python3 scripts/megakernel_profile.py "$m" --json "$RES/megakernel_phases.json"
  step mega-phases-p1 90 env LUCEBOX_MEGAKERNEL_PREFETCH=1 python3 scripts/megakernel_profile.py "$m" \
    --json "$RES/megakernel_phases_p1.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}
