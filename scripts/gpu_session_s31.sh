# Session 31's modes of scripts/gpu_session.sh (sourced by it; its helpers: step, synth, model, variants, llama_*).
#
#   bash scripts/gpu_session.sh s31-prefill  # ~7 min: recorded prefill pieces: the GPU tests, the 0.8B check (eager
#                                            #   against recorded pieces: logits, states, timings), then 0.8B pp512 /
#                                            #   pp300 recorded and eager (LUCEBOX_RECORDED_PREFILL=0) with nothing
#                                            #   beside them, llama-bench's; the 27B pp512 both ways. carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s31-table    # ~8.5 min: #17's table in one call, both engines, the governor's
#                                            #   decisions; the recorded prefill's GPU tests.   carry: .whl .llamacpp
#   bash scripts/gpu_session.sh s31-spec     # ~7 min: the recorded prefill tests; the 27B speculative rows with the
#                                            #   governor's repay rule.                            carry: .whl
#   bash scripts/gpu_session.sh s31-governor # ~4 min: auto forced 8.3 and auto with a drafter that accepts nothing,
#                                            #   plain runs measured whole.                        carry: .whl
#   bash scripts/gpu_session.sh s31-next     # ~5 min: recorded pieces replayed against eager ones on the 0.8B (also
#                                            #   at depth 4096), the unforced 27B row's JSON whole.  carry: .whl

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

spec_detail() {  # tag: `lucebox bench --json` rows on stdin, with what the speculation governor decided
  python3 -c "import json,sys
for r in json.loads(sys.stdin.read().splitlines()[-1]):
    print('$1', r['test'], round(r['tokens_per_s'], 1), r.get('mean_accepted_length', ''), r.get('governed_plain_tokens', ''),
          json.dumps(r['speculation']) if 'speculation' in r else '')"
}
export -f spec_detail

s31_table() {  # ~8.5 min: #17's table in one call: the recorded prefill's GPU tests, the 27B's rows (pp512, pp4096,
  #             tg128; forced DDTree 8.3 with budget 22 and auto; a drafter that accepts nothing with auto, the
  #             governor's decisions printed) while llama.cpp builds at low priority, then the 0.8B's (pp512, tg128)
  #             with nothing beside, llama-bench on both, the 27B tg128 at depth 32768 last.  carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  step synth-08b 60 synth 0.8b
  step synth-27b 90 synth 27b
  local m d; m=$(model 27b); d=$WORK/draft-27b.gguf
  ( python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$d" "$m" \
    > "$RES/synth_draft.log" 2>&1 ) &
  local writer=$!
  # TABLE_TESTS: the GPU tests run while llama.cpp builds (session 38's table: tests/test_given_sums_gpu.py).
  step gpu-tests "${TABLE_TESTS_S:-120}" env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short \
    -rf ${TABLE_TESTS:-tests/test_recorded_prefill.py}
  variants 27b "$m" "-p 512,4096 -n 128 -r 3" default
  wait "$writer"; tail -n1 "$RES/synth_draft.log"
  # The first speculative run compiles the tree kernels: 70 s was too short for it in session 31's call 2.
  step b22-forced 120 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget 22 \
    --force-accept 8.3 --json | spec_detail b22-forced"
  step auto-unforced 70 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 128 -r 2 --tree-budget auto \
    --json | spec_detail auto-unforced"
  step auto-forced 120 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget auto \
    --force-accept 8.3 --json | spec_detail auto-forced"
  llama_wait
  variants 08b "$(model 0.8b)" "-p 512 -n 128 -r 5" default
  llama_rows 08b -m "$(model 0.8b)" -p 512 -n 128 -r 5 && llama_rows 27b -m "$m" -p 512,4096 -n 128 -r 3
  variants 27b-d32k "$m" "-p 0 -n 128 -d 32768 -r 2" default
  llama_rows 27b-d32k -m "$m" -p 0 -n 128 -d 32768 -r 2
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s31_spec() {  # ~7 min: the recorded prefill's tests (nothing beside them), then the 27B's speculative rows with
  #            the governor's repay rule: a first forced run that compiles the tree kernels (150 s), a drafter
  #            that accepts nothing with auto (-n 128 and -n 256), the governor's decisions printed. carry: .whl
  step gpu-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    tests/test_recorded_prefill.py
  step synth-27b 90 synth 27b
  local m d; m=$(model 27b); d=$WORK/draft-27b.gguf
  step synth-draft 90 python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$d" "$m"
  step b22-forced 150 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget 22 \
    --force-accept 8.3 --json | spec_detail b22-forced"
  step auto-unforced 75 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 128 -r 2 --tree-budget auto \
    --json | spec_detail auto-unforced"
  step auto-unforced-256 75 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 \
    --tree-budget auto --json | spec_detail auto-unforced-256"
  return 0
}

s31_governor() {  # ~4 min: the 27B's speculative rows with plain runs measured whole: forced DDTree 8.3 with auto
  #                (the first run compiles the tree kernels), then a drafter that accepts nothing with auto. carry: .whl
  step synth-27b 90 synth 27b
  local m d; m=$(model 27b); d=$WORK/draft-27b.gguf
  step synth-draft 90 python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$d" "$m"
  step auto-forced 150 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 2 --tree-budget auto \
    --force-accept 8.3 --json | spec_detail auto-forced"
  step auto-unforced 75 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 128 -r 2 --tree-budget auto \
    --json | spec_detail auto-unforced"
  return 0
}

s31_next() {  # ~5 min, for the next session: the recorded prefill's replays against eager pieces on the 0.8B, also
  #            at depth 4096 (the split attention with a device offset), then the 27B drafter that accepts nothing
  #            with auto, its JSON kept whole (each run's rate, the probes and the last probe's ms). carry: .whl
  step synth-08b 60 synth 0.8b
  step check-08b 150 python3 scripts/recorded_prefill_check.py "$(model 0.8b)" --ctx 8192 \
    --pieces 512,300,1024,1024,1024,1024,40,300 --timed 512,64 --json "$RES/recorded_check_08b.json"
  step synth-27b 90 synth 27b
  local m d; m=$(model 27b); d=$WORK/draft-27b.gguf
  step synth-draft 90 python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$d" "$m"
  step auto-unforced 150 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 128 -r 3 --tree-budget auto \
    --json > $RES/auto_unforced.json; spec_detail auto-unforced < $RES/auto_unforced.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}
