# Session 31's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model, variants, llama_*).
#
#   bash scripts/gpu_session.sh s31-prefill  # ~7 min: recorded prefill pieces: the GPU tests, the 0.8B check (eager
#                                            #   against recorded pieces: logits, states, timings), then 0.8B pp512 /
#                                            #   pp300 recorded and eager (LUCEBOX_RECORDED_PREFILL=0) with nothing
#                                            #   beside them, llama-bench's; the 27B pp512 both ways. carry: .whl .llamacpp

s31_prefill() {
  LLAMA_NICE=19 llama_build_bg
  step synth-08b 60 synth 0.8b
  step gpu-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_recorded_prefill.py
  step check-08b 120 python3 scripts/recorded_prefill_check.py "$(model 0.8b)" --json "$RES/recorded_check_08b.json"
  ( synth 27b > "$RES/synth_27b.log" 2>&1 ) &
  local writer=$!
  llama_wait
  wait "$writer"; tail -qn1 "$RES"/synth_27b.log
  variants 08b "$(model 0.8b)" "-p 512,300 -n 0 -r 5" default eager:LUCEBOX_RECORDED_PREFILL=0
  llama_rows 08b -m "$(model 0.8b)" -p 512,300 -n 0 -r 5
  variants 27b "$(model 27b)" "-p 512 -n 0 -r 3" default eager:LUCEBOX_RECORDED_PREFILL=0
  llama_rows 27b -m "$(model 27b)" -p 512 -n 0 -r 3
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}
