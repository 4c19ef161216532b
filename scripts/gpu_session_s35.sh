# Session 35's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model, and variants /
# bench_rows from gpu_session_more.sh).
#
#   bash scripts/gpu_session.sh s35          # ~7 min: the megakernel (LUCEBOX_MEGAKERNEL): its GPU tests and the
#                                            #   persistent pieces' (their bodies now take the megakernel's shared
#                                            #   buffer); the 0.8B tg128 default / megakernel at 2 and 1 blocks an SM /
#                                            #   row-major weights; the megakernel's phases (megakernel_profile.py);
#                                            #   0.8B step profiles with it, default, row-major. carry: .whl

s35() {
  ( synth 0.8b > "$RES/synth_08b.log" 2>&1 ) &
  local writer=$! m
  step mega-tests 300 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_megakernel_gpu.py tests/test_gdn_persistent_gpu.py tests/test_attention_persistent_gpu.py \
    tests/test_ffn_persistent_gpu.py
  wait "$writer"; tail -qn1 "$RES"/synth_*.log
  m=$(model 0.8b)
  variants 08b "$m" "-p 0 -n 128 -r 3" default mega:LUCEBOX_MEGAKERNEL=1 \
    mega1:LUCEBOX_MEGAKERNEL=1,LUCEBOX_MEGAKERNEL_BLOCKS=1 rowmajor:LUCEBOX_TILED_WEIGHTS=0
  step mega-phases 90 python3 scripts/megakernel_profile.py "$m" --json "$RES/megakernel_phases.json"
  mkdir -p "$RES/p08b-mega" "$RES/p08b-default" "$RES/p08b-rowmajor"
  step profile-08b-mega 60 env LUCEBOX_PDL=0 LUCEBOX_MEGAKERNEL=1 python3 scripts/bench_vs_llamacpp.py profile "$m" \
    --out "$RES/p08b-mega"
  step profile-08b-default 60 env LUCEBOX_PDL=0 python3 scripts/bench_vs_llamacpp.py profile "$m" \
    --out "$RES/p08b-default"
  step profile-08b-rowmajor 60 env LUCEBOX_PDL=0 LUCEBOX_TILED_WEIGHTS=0 python3 scripts/bench_vs_llamacpp.py \
    profile "$m" --out "$RES/p08b-rowmajor"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}
