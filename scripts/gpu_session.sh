#!/usr/bin/env bash
# One entry point per planned device call (each under the 10-minute limit), run from the project's root:
#
#   bash scripts/gpu_session.sh check    # ~8-9 min: cuda_check (kernel cases, 4 Triton modules' checks, tiny
#                                        #   F32 and 0.8b Q4_K_M models vs torch f32; its matvec timings
#                                        #   left to the sweep), matvec_sweep.py (60 s timing budget),
#                                        #   verify_determinism.py on 0.8b, matvec_probe invariance, ncu counters,
#                                        #   decode profiles of 0.8b and 27b.          carry: .whl
#   bash scripts/gpu_session.sh bench-a  # ~6.5 min: PART=A of bench_vs_llamacpp.sh.  carry: .whl .llamacpp
#   bash scripts/gpu_session.sh bench-b  # ~6.5 min: PART=B (depths, memory at 32K). carry: .whl .llamacpp
#   bash scripts/gpu_session.sh bench-all  # PART=all: A and B in one call with one build; fits 10 minutes only
#                                        #   trimmed (REPS=2 DEPTH_REPS=2 SMALL_TESTS=pp512,pp4096,tg128
#                                        #   SKIP=llama-08b-depth DEADLINE=540).     carry: .whl .llamacpp
#   bash scripts/gpu_session.sh spec     # ~7 min: spec_bench.py on 27b Q4_K_M + llama.cpp's plain tg128.
#                                        #                                          carry: .whl .llamacpp
#   bash scripts/gpu_session.sh core     # ~6 min: after a change to the core's mechanisms (op dispatch, static
#                                        #   steps, KV interface): the CUDA-only tests, cuda_check (kernels and
#                                        #   whole models against torch), the attention module's check,
#                                        #   determinism on 0.8b.                     carry: .whl
#   bash scripts/gpu_session.sh gemma4-exact  # ~9 min: Gemma-4 verify == decode step to the bit (kernel, tiny models,
#                                        #   31B and 26B-A4B every node), forced DDTree 8.3 on the 31B, tg128 both
#                                        #   engines.                                 carry: .whl .llamacpp
#   bash scripts/gpu_session.sh demo-train  # ~9.5 min: train the demo pair (#22), its acceptance on the H200, the
#                                        #   31B's speculative step profile.          carry: .whl .llamacpp
#   bash scripts/gpu_session.sh long-context  # ~10 min (not run yet): 27b Q4_K_M decode at depth 8K/32K per KV
#                                         # type (f16 q8_0 q4_0 tq3_0), Triton q4_0/tq3_0 windows, 2nd-turn TTFT (prefix cache)
#   bash scripts/gpu_session.sh pflash   # ~9.5 min: #16's rows: block-sparse kernel check, 27B TTFT 32K/64K/128K dense and
#                                        #   with PFlash (synthetic Qwen3-0.6B scorer), llama.cpp pp32768. carry: .whl .llamacpp
#   bash scripts/gpu_session.sh hip-check  # ~2-3 min: the HIP backend's kernels (the shared sources built with the HIP
#                                        #   arithmetic, -DLUCEBOX_PORTABLE_GENERIC) against torch on this GPU:
#                                        #   scripts/hip_shared_source_check.py, then the pytest that runs it.
#                                        #                                          carry: .whl
#   bash scripts/gpu_session.sh same-call  # ~8 min: before/after in one call: same_call_bench.py on 27b
#                                        #   Q4_K_M (pp512, pp4096, tg128, forced DDTree 8.3 at -n 256 -r 3) for
#                                        #   the tree in .baseline (an older commit, `git archive`), then this
#                                        #   one, then the baseline again (the spread); determinism on 27b.
#                                        #                                          carry: .whl .baseline
#   bash scripts/gpu_session.sh spark-bench  # ~9 min: #14's Spark rows on synthetic Laguna-XS.2 Q4_K_M, skewed and
#                                        #   random routers: tg128 all on GPU, calibration, Spark at 60% of the
#                                        #   expert bytes, llama-bench all on GPU and --n-cpu-moe at the same
#                                        #   bytes (scripts/bench_spark.py).          carry: .whl .llamacpp
#   bash scripts/gpu_session.sh spark-bench-35b  # ~9 min: the same on the 35B-A3B (qwen35moe). carry: .whl .llamacpp
#   More modes (s21-fusion, s21-depth, ...): scripts/gpu_session_more.sh, sourced below.
# Env: COMMIT (recorded in every result: the device's copy has no .git), SKIP (step names to leave out, e.g.
# "profile-27b"; for bench-*: see bench_vs_llamacpp.sh; for spec: "llama" skips the build and llama-bench),
# SPEC_ARGS (extra spec_bench.py options), CHECK_FIRST (spec: attention kernel check and verify_determinism
# first), CHECK_ARGS (cuda_check.py options; default --skip-timing),
# SWEEP_BUDGET (s), SWEEP_ARGS (extra matvec_sweep.py options, e.g. --skip-correctness), DEADLINE (s, 570: later steps are cut short or skipped), OUT (set by the device tool).
# Everything comes back in at most 5 files under $OUT: log_MODE.txt (all output, also when killed),
# the mode's JSON and markdown, and MODE.tgz with every raw file.
set -o pipefail
MODE=${1:?usage: gpu_session.sh check|bench-a|bench-b|bench-all|spec|core|same-call}
export OUT=${OUT:-$PWD/out} PYTHONUNBUFFERED=1 LUCEBOX_HOME=${LUCEBOX_HOME:-/tmp/lh} WORK=${WORK:-/tmp/w}
export COMMIT=${COMMIT:-${LUCEBOX_COMMIT:-unknown}}
export RES=/tmp/gpu_session_$MODE
mkdir -p "$OUT" "$RES" "$WORK"
SECONDS=0
SKIP=" ${SKIP:-} "
DEADLINE=${DEADLINE:-570}  # seconds: no step runs past this (the device call's limit is 600)

install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site \
      . plugins/qwen35 plugins/gemma4 plugins/laguna backends/cuda backends/hip || return 1
  export PYTHONPATH=/tmp/site
  python3 -c 'import gguf, lucebox_core, lucebox_qwen35, lucebox_gemma4, lucebox_laguna, lucebox_cuda, torch, triton
print("torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__)'
}

pack() { [ -n "$(ls -A "$RES")" ] && tar czf "$OUT/$MODE.tgz" -C "$RES" . 2>/dev/null; return 0; }

step() {  # name timeout_s command...: timed, killed (with its children) at its timeout or the deadline
  local name=$1 limit=$2 rc; shift 2
  case "$SKIP" in *" $name "*) echo "[$SECONDS s] skip $name"; return 0 ;; esac
  (( limit > DEADLINE - SECONDS )) && limit=$((DEADLINE - SECONDS))
  if (( limit < 15 )); then echo "[$SECONDS s] skip $name: the call's deadline (${DEADLINE} s) is near"; return 1; fi
  local start=$SECONDS
  echo "[$SECONDS s] === $name (at most $limit s): $*"
  # Commands may be shell functions (exported below): a bash that timeout can kill with its children.
  timeout -k 10 "$limit" bash -c '"$@"' step "$@"
  rc=$?
  echo "[$SECONDS s] === $name done in $((SECONDS - start)) s (rc $rc)"
  pack
  return $rc
}

model() { echo "$WORK/qwen35-$1-q4_k_m.gguf"; }
synth() { [ -s "$(model "$1")" ] || python3 scripts/bench_vs_llamacpp.py synth "$1" q4_k_m "$(model "$1")"; }

check() {
  # The matvec timings come from the sweep (every variant), so cuda_check skips its own (CHECK_ARGS="" keeps them).
  step cuda_check 300 python3 scripts/cuda_check.py --out "$RES" --workdir "$WORK" --commit "$COMMIT" \
    ${CHECK_ARGS---skip-timing}
  cp "$RES/cuda_check.json" "$OUT/" 2>/dev/null
  [ -f scripts/matvec_sweep.py ] && step matvec_sweep 150 python3 scripts/matvec_sweep.py --out "$RES" \
    --budget-s "${SWEEP_BUDGET:-60}" ${SWEEP_ARGS:-}
  step synth-08b 30 synth 0.8b
  # Does every verified node get plain decoding's logits to the bit (what --force-accept and exact speculative
  # output need)? Chain and tree, every node against decoding its path.
  step determinism-08b 90 python3 scripts/verify_determinism.py "$(model 0.8b)" --json "$RES/determinism_default.json"
  # Is column j of a batch-N product bit-identical to row j's batch-1 product, per matvec variant?
  step matvec-invariance 90 python3 scripts/matvec_probe.py invariance --json "$RES/matvec_invariance.json"
  # Hardware counters of the main decode products (speed of light, memory, warp stalls, issue slots).
  step ncu-matvec 120 ncu_matvec
  step profile-08b 60 python3 scripts/bench_vs_llamacpp.py profile "$(model 0.8b)" --out "$RES"
  step synth-27b 60 synth 27b
  # The same on the 27B layout, whose products run the tuned kernels (several variants of one class per shape).
  step determinism-27b 150 python3 scripts/verify_determinism.py "$(model 27b)" --json "$RES/determinism_27b.json"
  step profile-27b 100 python3 scripts/bench_vs_llamacpp.py profile "$(model 27b)" --out "$RES"
}

ncu_matvec() {
  command -v ncu >/dev/null || { echo "ncu not on the PATH"; return 1; }
  ncu --clock-control none --kernel-name regex:matvec --launch-count 24 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 scripts/matvec_probe.py launch ${NCU_CASES:-q4_k:17408:5120:1:mma8 q4_k:17408:5120:1:pipe_w4_d4_m1_k1 \
    q6_k:17408:5120:1:pipe_w4_d3_m1_k1 q4_k:5120:17408:1:pipe_w4_d4_m2_k2 q4_k:17408:5120:23:mma \
    q4_k:17408:5120:1:simt} >"$RES/ncu_matvec.txt" 2>&1
  local rc=$?
  grep -E "matvec_|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per|Stall|L2 Cache Throughput|Executed Ipc A" "$RES/ncu_matvec.txt" | head -200
  return $rc
}
export -f ncu_matvec

spec() {
  local build=0
  case "$SKIP" in *" llama "*) ;; *) build=1 ;; esac
  if [ $build = 1 ]; then
    echo "[$SECONDS s] llama.cpp build in the background (~270 s)"
    (bash .llamacpp/build.sh > "$RES/llamacpp_build.log" 2>&1; echo "build rc $? at $SECONDS s" >> "$RES/llamacpp_build.log") &
  fi
  if [ -n "${CHECK_FIRST:-}" ]; then  # a kernel change since the last check: its module check and determinism first
    step attention-check 120 python3 -m lucebox_cuda.triton_attention
    step synth-08b 30 synth 0.8b
    step determinism-08b 90 python3 scripts/verify_determinism.py "$(model 0.8b)" --json "$RES/determinism_default.json"
  fi
  step synth-27b 60 synth 27b
  # SPEC_ARGS: extra spec_bench.py options (later ones win), e.g. for a CPU dry run of this mode.
  step spec_bench 420 python3 scripts/spec_bench.py --size 27b --workdir "$WORK" --out "$RES" ${SPEC_ARGS:-}
  if [ $build = 1 ]; then
    echo "[$SECONDS s] waiting for the llama.cpp build"; wait; tail -2 "$RES/llamacpp_build.log"
    step llama-tg 90 sh -c "/tmp/llamacpp/build/bin/llama-bench -m $(model 27b) -ngl 99 -fa 1 -p 0 -n 128 -r 3 \
      -o json > $RES/llama_27b_tg.json"
  fi
  python3 scripts/spec_bench.py table "$RES/spec_bench.json" --llama "$RES"/llama_*.json --md "$OUT/spec_bench.md"
  cp "$RES/spec_bench.json" "$OUT/" 2>/dev/null
}

core() {
  step cuda-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graph.py \
    tests/test_quants.py tests/test_cuda_plugin.py tests/test_ops.py tests/test_static_step.py -x
  step cuda_check 240 python3 scripts/cuda_check.py --out "$RES" --workdir "$WORK" --commit "$COMMIT" --skip-timing
  cp "$RES/cuda_check.json" "$OUT/" 2>/dev/null
  step attention-check 90 python3 -m lucebox_cuda.triton_attention
  step synth-08b 30 synth 0.8b
  step determinism-08b 90 python3 scripts/verify_determinism.py "$(model 0.8b)" --json "$RES/determinism_default.json"
  step bench-08b 60 python3 -m lucebox_core.cli bench -m "$(model 0.8b)" -p 512 -n 64 -r 2 --json
}

laguna_cuda() {  # ~1 min: Laguna on the CUDA backend (routed-expert kernel vs reference, greedy tokens vs torch)
  step laguna-cuda 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_laguna_cuda.py
}

long_context() {  # issue 15's rows without KVFlash: KV types' decode at depth, the Triton q4_0/tq3_0 windows,
  # and the second-turn TTFT with and without the prefix cache (RAM, disk) on a 32K conversation
  step synth-27b 90 synth 27b
  step triton-kv 120 python3 -m lucebox_cuda.triton_attention
  step ttft-32k 240 python3 scripts/bench_prefix_cache.py -m "$(model 27b)" --context 32768 --reps 3 \
    --json "$RES/prefix_cache_ttft.json"
  for kv in f16 q8_0 q4_0 tq3_0; do
    step "decode-$kv" 200 sh -c "python3 -m lucebox_core.cli bench -m $(model 27b) -p 0 -n 64 -d 8192,32768 -r 2 \
      -c 33000 -ctk $kv -ctv $kv --json > $RES/decode_$kv.json"
  done
}

pflash() {  # ~9.5 min: issue #16's rows: the block-sparse kernel's check and timing, the qwen3 family's CUDA tests,
  #          then 27B Q4_K_M TTFT at 32K/64K/128K dense and with PFlash (synthetic Qwen3-0.6B scorer, keep 0.05),
  #          the scorer's block-sparse vs dense pass; llama.cpp's pp32768 after (the build meanwhile).
  #          carry: .whl .llamacpp
  llama_build_bg
  step block-sparse 60 python3 -m lucebox_cuda.triton_block_sparse --check --bench --lengths 131072 --repeats 3
  step synth-27b 90 synth 27b
  step synth-scorer 40 python3 -m lucebox_core.cli synth --arch qwen3 --size 0.6b --type q8_0 -o "$WORK/qwen3-0.6b-q8_0.gguf"
  step bench-pflash 300 python3 scripts/bench_pflash.py --target "$(model 27b)" --scorer "$WORK/qwen3-0.6b-q8_0.gguf" \
    --lengths ${PFLASH_LENGTHS:-32768,65536,131072} --keep 0.05 --json "$RES/pflash.json"
  if llama_wait; then
    step llama-pp 120 sh -c "$LB -m $(model 27b) -ngl 99 -fa 1 -p ${LLAMA_PP:-32768} -n 0 -r 1 -o json > $RES/llama_pp.json; \
      python3 -c 'import json,sys; [print(r[\"n_prompt\"], round(r[\"avg_ts\"],1)) for r in json.load(open(sys.argv[1]))]' $RES/llama_pp.json"
  fi
  step qwen3-cuda 90 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_qwen3_cuda.py -x
  cp "$RES"/pflash.json "$RES"/llama_pp.json "$OUT/" 2>/dev/null
  return 0
}

final_rows() {  # ~4.5 min: the 128K dense prefill with the 128 x 64 attention tiles (and PFlash beside it), the
  #              second-turn TTFT of a 32K conversation with pinned snapshots, memory at 256K/128K, Spark's GPU test.
  step synth-27b 60 synth 27b
  step synth-scorer 30 python3 -m lucebox_core.cli synth --arch qwen3 --size 0.6b --type q8_0 -o "$WORK/qwen3-0.6b-q8_0.gguf"
  step bench-pflash 110 python3 scripts/bench_pflash.py --target "$(model 27b)" --scorer "$WORK/qwen3-0.6b-q8_0.gguf" \
    --lengths 131072 --keep 0.05 --skip-scorer-dense --json "$RES/pflash.json"
  step ttft-32k 60 python3 scripts/bench_prefix_cache.py -m "$(model 27b)" --context 32768 --reps 2 \
    --json "$RES/prefix_cache_ttft.json"
  step memory 45 sh -c "python3 scripts/memory_at_context.py -m $(model 27b) -c 262144 -ctk tq3_0 -ctv tq3_0 --json $RES/memory.jsonl; \
    python3 scripts/memory_at_context.py -m $(model 27b) -c 131072 -ctk tq3_0 -ctv tq3_0 --json $RES/memory.jsonl; \
    python3 scripts/memory_at_context.py -m $(model 27b) -c 131072 --json $RES/memory.jsonl; cat $RES/memory.jsonl"
  step spark-cuda 40 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_spark.py -k gpu -x
  cp "$RES"/*.json "$RES"/*.jsonl "$OUT/" 2>/dev/null
  return 0
}

governor() {  # ~9 min: #17 item 3 (speculation that never loses to plain) on the 27B Q4_K_M with a full-size random
  #            drafter (it accepts nothing: the worst case): plain tg128, DDTree auto unforced (the governor),
  #            forced 8.3 with auto and with budget 22, the plain engine's rate beside each; then #15's KVFlash GPU
  #            check on the 27B (paging bytes through the side stream, per-token ms at 8 pools deep beside the full
  #            cache at one pool), the second-turn TTFT of a 32K conversation, memory at 256K TQ3_0.
  #            carry: .whl
  step synth-27b 60 synth 27b
  step synth-draft 60 python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$WORK/draft-27b.gguf" "$(model 27b)"
  local m d; m=$(model 27b); d=$WORK/draft-27b.gguf
  step auto-unforced 120 sh -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 128 -r 3 --tree-budget auto \
    --json > $RES/auto_unforced.json; python3 -c 'import json,sys; [print(json.dumps(r)) for r in json.loads(open(sys.argv[1]).read().splitlines()[-1])]' $RES/auto_unforced.json"
  step auto-forced 80 sh -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 3 --tree-budget auto \
    --force-accept 8.3 --json > $RES/auto_forced.json; python3 -c 'import json,sys; [print(json.dumps(r)) for r in json.loads(open(sys.argv[1]).read().splitlines()[-1])]' $RES/auto_forced.json"
  step b22-forced 80 sh -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 3 --tree-budget 22 \
    --force-accept 8.3 --json > $RES/b22_forced.json; python3 -c 'import json,sys; [print(json.dumps(r)) for r in json.loads(open(sys.argv[1]).read().splitlines()[-1])]' $RES/b22_forced.json"
  step kvflash-check 90 sh -c "python3 scripts/kvflash_gpu_check.py -m $m --device cuda:0 --pool 4096 --depth-pools 8 \
    --policies lru,qk -n 64 > $RES/kvflash_check.json"
  step ttft-32k 70 python3 scripts/bench_prefix_cache.py -m "$m" --context 32768 --reps 2 \
    --json "$RES/prefix_cache_ttft.json"
  step memory-256k-tq3 30 python3 scripts/memory_at_context.py -m "$m" -c 262144 -ctk tq3_0 -ctv tq3_0 \
    --json "$RES/memory.jsonl"
  step attention-sweep 60 sh -c "env TRITON_INTERPRET=0 python3 scripts/attention_sweep.py > $RES/attention_sweep.jsonl; \
    cat $RES/attention_sweep.jsonl"
  step multi-device 80 sh -c "python3 scripts/multi_device_check.py --size 0.8b --tokens 32 > $RES/multi_device.json; \
    tail -c 3000 $RES/multi_device.json"
  step spark-cuda 50 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_spark.py -k gpu -x
  cp "$RES"/*.json "$RES"/*.jsonl "$OUT/" 2>/dev/null
  return 0
}

long_a() {  # ~9.5 min: the 128K rows of #15 and #16 in one call (the 27B synthesized once): PFlash TTFT at 128K
  #          with the scorer's sparse and dense passes; decode at depth 0 and 131072 with KVFlash pools of 4096 (lru,
  #          qk; per-token times, to see where a slow row loses), the full cache at depth 0; llama.cpp pp131072 and
  #          tg64 at depth 131072 (no warm-up: each prefill alone is a minute).   carry: .whl .llamacpp
  llama_build_bg
  step synth-27b 60 synth 27b
  step synth-scorer 30 python3 -m lucebox_core.cli synth --arch qwen3 --size 0.6b --type q8_0 -o "$WORK/qwen3-0.6b-q8_0.gguf"
  step bench-pflash 150 python3 scripts/bench_pflash.py --target "$(model 27b)" --scorer "$WORK/qwen3-0.6b-q8_0.gguf" \
    --lengths 131072 --keep 0.05 --json "$RES/pflash.json"
  step kvflash 150 python3 scripts/bench_kvflash.py -m "$(model 27b)" --depths 0,131072 --full-depths 0 --pool 4096 \
    -n 64 -r 1 --json "$RES/kvflash.json"
  if llama_wait; then
    step llama-pp-128k 90 sh -c "$LB -m $(model 27b) -ngl 99 -fa 1 -p 131072 -n 0 -r 1 --no-warmup -o json \
      > $RES/llama_pp_128k.json; python3 -c 'import json,sys; [print(r[\"n_prompt\"], round(r[\"avg_ts\"],1)) for r in json.load(open(sys.argv[1]))]' $RES/llama_pp_128k.json"
    step llama-tg-d128k 100 sh -c "$LB -m $(model 27b) -ngl 99 -fa 1 -p 0 -n 64 -d 131072 -r 1 --no-warmup -o json \
      > $RES/llama_tg_d128k.json; python3 -c 'import json,sys; [print(r[\"n_depth\"], r[\"n_gen\"], round(r[\"avg_ts\"],1)) for r in json.load(open(sys.argv[1]))]' $RES/llama_tg_d128k.json"
  fi
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

long_pflash() {  # ~8 min: #16's PFlash rows and #15's long-context rows in one call (the 27B synthesized once):
  #               PFlash TTFT at 32K and 128K with the scorer's sparse/dense pass; decode at depth 131072 with
  #               the full f16 cache and KVFlash pools of 4096 (lru, qk) beside depth 0; the second-turn TTFT of
  #               a 32K conversation with the prefix cache; memory at 256K with TQ3_0; Spark's and the
  #               multi-device GPU checks; llama.cpp tg64 at depth 131072 (f16, no warm-up: its prefill alone is
  #               a minute).   carry: .whl .llamacpp
  llama_build_bg
  step synth-27b 60 synth 27b
  step synth-scorer 30 python3 -m lucebox_core.cli synth --arch qwen3 --size 0.6b --type q8_0 -o "$WORK/qwen3-0.6b-q8_0.gguf"
  step bench-pflash 130 python3 scripts/bench_pflash.py --target "$(model 27b)" --scorer "$WORK/qwen3-0.6b-q8_0.gguf" \
    --lengths ${PFLASH_LENGTHS:-32768,131072} --keep 0.05 --json "$RES/pflash.json"
  step kvflash 130 python3 scripts/bench_kvflash.py -m "$(model 27b)" --depths ${KVFLASH_DEPTHS:-0,131072} --pool 4096 \
    -n 64 -r 1 --json "$RES/kvflash.json"
  step ttft-32k 70 python3 scripts/bench_prefix_cache.py -m "$(model 27b)" --context 32768 --reps 2 \
    --json "$RES/prefix_cache_ttft.json"
  step memory-256k-tq3 30 python3 scripts/memory_at_context.py -m "$(model 27b)" -c 262144 -ctk tq3_0 -ctv tq3_0 \
    --json "$RES/memory.jsonl"
  step spark-cuda 50 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_spark.py -k gpu -x
  if llama_wait; then
    step llama-tg-d128k 80 sh -c "$LB -m $(model 27b) -ngl 99 -fa 1 -p 0 -n 64 -d 131072 -r 1 --no-warmup -o json \
      > $RES/llama_tg_d128k.json; python3 -c 'import json,sys; [print(r[\"n_depth\"], r[\"n_gen\"], round(r[\"avg_ts\"],1)) for r in json.load(open(sys.argv[1]))]' $RES/llama_tg_d128k.json"
  fi
  step multi-device 60 sh -c "python3 scripts/multi_device_check.py --size 0.8b --tokens 32 > $RES/multi_device.json"
  step memory-128k 40 sh -c "python3 scripts/memory_at_context.py -m $(model 27b) -c 131072 -ctk tq3_0 -ctv tq3_0 --json $RES/memory.jsonl; \
    python3 scripts/memory_at_context.py -m $(model 27b) -c 131072 --json $RES/memory.jsonl"
  cp "$RES"/*.json "$RES"/*.jsonl "$OUT/" 2>/dev/null
  return 0
}

hip_check() {  # the HIP backend's arithmetic on an NVIDIA GPU (no AMD card is reachable): see the header
  step hip-shared-source 420 python3 scripts/hip_shared_source_check.py
  step hip-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_hip_shared_source.py \
    tests/test_hip_plugin.py -x
}

same_call() {
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/old \
    .baseline .baseline/plugins/qwen35 .baseline/backends/cuda || { echo "baseline install failed"; return 1; }
  step synth-27b 90 synth 27b
  step synth-draft 60 python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$WORK/draft-27b.gguf" "$(model 27b)"
  local args="$(model 27b) $WORK/draft-27b.gguf --reps 3 --spec-n 256 --force 8.3"
  step before 150 env PYTHONPATH=/tmp/old:/tmp/site python3 scripts/same_call_bench.py $args --label before \
    --out "$RES/before.json"
  step after 150 python3 scripts/same_call_bench.py $args --label after --out "$RES/after.json"
  step determinism-27b 150 python3 scripts/verify_determinism.py "$(model 27b)" --json "$RES/determinism_27b.json"
  step before-again 150 env PYTHONPATH=/tmp/old:/tmp/site python3 scripts/same_call_bench.py $args \
    --label before-again --out "$RES/before_again.json"
  # The whole-model check of cuda_check (tiny F32 and 0.8B Q4_K_M through the CUDA backend against torch f32).
  step model-check 120 python3 scripts/cuda_check.py --out "$RES" --workdir "$WORK" --commit "$COMMIT" \
    --skip-timing --skip-correctness --skip-triton
  python3 scripts/same_call_bench.py table "$RES/before.json" "$RES/after.json" | tee "$OUT/same_call.md"
  [ -f "$RES/before_again.json" ] && python3 scripts/same_call_bench.py table "$RES/before.json" \
    "$RES/before_again.json" | tee -a "$OUT/same_call.md"
  cp "$RES"/before*.json "$RES"/after.json "$RES"/determinism_27b.json "$OUT/" 2>/dev/null
  return 0
}

same_call_prefill() {  # the prefill and decode rows only, before and after interleaved, more repetitions
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/old \
    .baseline .baseline/plugins/qwen35 .baseline/backends/cuda || { echo "baseline install failed"; return 1; }
  step synth-27b 90 synth 27b
  local args="$(model 27b) --reps ${REPS:-9} --skip-spec"
  for round in 1 2; do
    step before-$round 100 env PYTHONPATH=/tmp/old:/tmp/site python3 scripts/same_call_bench.py $args \
      --label before-$round --out "$RES/before_$round.json"
    step after-$round 100 python3 scripts/same_call_bench.py $args --label after-$round --out "$RES/after_$round.json"
  done
  python3 scripts/same_call_bench.py table "$RES"/before_1.json "$RES"/after_1.json | tee "$OUT/same_call_prefill.md"
  python3 scripts/same_call_bench.py table "$RES"/before_2.json "$RES"/after_2.json | tee -a "$OUT/same_call_prefill.md"
  python3 scripts/same_call_bench.py table "$RES"/before_1.json "$RES"/before_2.json | tee -a "$OUT/same_call_prefill.md"
  cp "$RES"/before_*.json "$RES"/after_*.json "$OUT/" 2>/dev/null
  return 0
}

bench_cli() {  # `lucebox bench` itself on 27b Q4_K_M with a drafter: every row kind, forced acceptance FORCED
  step synth-27b 90 synth 27b
  step synth-draft 60 python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$WORK/draft-27b.gguf" "$(model 27b)"
  step bench-27b 300 sh -c "python3 -m lucebox_core.cli bench -m $(model 27b) -md $WORK/draft-27b.gguf -p 512,4096 \
    -n 256 -r 3 --force-accept 8.3 ${BENCH_ARGS:-} > $OUT/bench_27b.txt; cat $OUT/bench_27b.txt"
  step bench-27b-json 200 sh -c "python3 -m lucebox_core.cli bench -m $(model 27b) -p 0 -n 128 -d 0,8192 -r 3 --json \
    > $OUT/bench_27b_depth.json; cat $OUT/bench_27b_depth.json"
}

spec_rows() { python3 -c "import json,sys
for r in json.loads(sys.stdin.read().splitlines()[-1]): print('$1', r['test'], round(r['tokens_per_s'], 1))"; }
export -f spec_rows

g4model() { echo "$WORK/gemma4-$1-q4_k_m.gguf"; }
g4synth() { [ -s "$(g4model "$1")" ] || python3 -m lucebox_core.cli synth --arch gemma4 --size "$1" --type q4_k_m \
  -o "$(g4model "$1")"; }
llama_build_bg() {  # the llama.cpp build in the background (~270 s on 16 cores), unless SKIP names "llama"
  case "$SKIP" in *" llama "*) return 0 ;; esac
  echo "[$SECONDS s] llama.cpp build in the background"
  # LLAMA_NICE: the build's priority, for modes whose timed rows run meanwhile (their host work comes first)
  (nice -n "${LLAMA_NICE:-0}" bash .llamacpp/build.sh > "$RES/llamacpp_build.log" 2>&1
   echo "build rc $? at $SECONDS s" >> "$RES/llamacpp_build.log") &
}
llama_wait() { case "$SKIP" in *" llama "*) return 1 ;; esac; echo "[$SECONDS s] waiting for the llama.cpp build"; wait
  tail -2 "$RES/llamacpp_build.log"; [ -x /tmp/llamacpp/build/bin/llama-bench ]; }
LB=/tmp/llamacpp/build/bin/llama-bench

gemma4_a() {  # ~6-9 min: GPU checks of Gemma-4's kernels and tiny models, 26B-A4B and 31B Q4_K_M pp512 / pp4096
  #             / tg128, both engines, same files (the llama.cpp build meanwhile), then forced DDTree 8.3 on the
  #             31B with a full-size random drafter (REPS: repetitions, default 3).   carry: .whl .llamacpp
  llama_build_bg
  step gemma4-check 150 python3 scripts/gemma4_gpu_check.py --workdir "$WORK" --json "$RES/gemma4_check.json"
  step synth-26b 120 g4synth 26b-a4b
  step lucebox-26b 120 sh -c "python3 -m lucebox_core.cli bench -m $(g4model 26b-a4b) -p 512,4096 -n 128 -r ${REPS:-3} --json \
    > $RES/lucebox_26b.json; cat $RES/lucebox_26b.json"
  step synth-31b 150 g4synth 31b
  step lucebox-31b 120 sh -c "python3 -m lucebox_core.cli bench -m $(g4model 31b) -p 512,4096 -n 128 -r ${REPS:-3} --json \
    > $RES/lucebox_31b.json; cat $RES/lucebox_31b.json"
  if llama_wait; then
    for m in 26b-a4b 31b; do
      step llama-$m 90 sh -c "$LB -m $(g4model $m) -ngl 99 -fa 1 -p 512,4096 -n 128 -r ${REPS:-3} -o json > $RES/llama_$m.json; \
        cat $RES/llama_$m.json | python3 -c 'import json,sys; [print(r[\"n_prompt\"], r[\"n_gen\"], round(r[\"avg_ts\"],1)) for r in json.load(sys.stdin)]'"
    done
  fi
  step synth-draft 60 python3 -m lucebox_core.cli synth --arch gemma4-dflash-draft --size full --type q8_0 \
    --target "$(g4model 31b)" -o "$WORK/gemma4-31b-draft-q8_0.gguf"
  step lucebox-31b-spec 150 sh -c "python3 -m lucebox_core.cli bench -m $(g4model 31b) -md $WORK/gemma4-31b-draft-q8_0.gguf \
    -p 0 -n 256 -r ${REPS:-3} --force-accept 8.3 --json > $RES/lucebox_31b_spec.json; cat $RES/lucebox_31b_spec.json"
}

gemma4_b() {  # ~9 min: decode at depth 32768 both engines, 26B-A4B memory at a 32K context, forced DDTree 8.3 on the
  #             31B with a full-size random drafter (files reused from gemma4_a on a warm machine).  carry: .whl .llamacpp
  llama_build_bg
  step synth-26b 120 g4synth 26b-a4b
  step synth-31b 150 g4synth 31b
  for m in 26b-a4b 31b; do
    step lucebox-$m-depth 150 sh -c "python3 -m lucebox_core.cli bench -m $(g4model $m) -p 0 -n 128 -d 32768 -r 2 --json \
      > $RES/lucebox_${m}_depth.json; cat $RES/lucebox_${m}_depth.json"
  done
  step memory-26b 120 python3 scripts/bench_vs_llamacpp.py memory "$(g4model 26b-a4b)" --ctx 32768 --cache-types f16 \
    --decode 16 --json "$RES/memory_26b.json"
  if llama_wait; then
    for m in 26b-a4b 31b; do
      step llama-$m-depth 120 sh -c "$LB -m $(g4model $m) -ngl 99 -fa 1 -p 0 -n 128 -d 32768 -r 2 -o json > $RES/llama_${m}_depth.json; \
        cat $RES/llama_${m}_depth.json | python3 -c 'import json,sys; [print(r[\"n_depth\"], r[\"n_gen\"], round(r[\"avg_ts\"],1)) for r in json.load(sys.stdin)]'"
    done
  fi
  for m in 31b 26b-a4b; do  # last: cut first when the call's deadline is near
    step profile-$m 60 python3 scripts/bench_vs_llamacpp.py profile "$(g4model $m)" --out "$RES"
  done
}

gemma4_final() {  # ~9.5 min, right after gemma4-dev on the warm machine (its files, build and sweep table): every
  #                 benchmark row of both engines on the same files in this one call, short repetitions, then the
  #                 26B-A4B's memory at 32K and the profiles while the deadline allows.  carry: .whl .llamacpp
  [ -s "$WORK/matvec_sweep.json" ] && export LUCEBOX_MATVEC_TUNED=$WORK/matvec_sweep.json
  echo "LUCEBOX_MATVEC_TUNED=${LUCEBOX_MATVEC_TUNED:-}"
  local skip=$SKIP
  SKIP="$skip gemma4-check "
  REPS=${REPS:-2} gemma4_a
  for m in 26b-a4b 31b; do
    step lucebox-$m-depth 100 sh -c "python3 -m lucebox_core.cli bench -m $(g4model $m) -p 0 -n 128 -d 32768 -r 1 --json \
      > $RES/lucebox_${m}_depth.json; cat $RES/lucebox_${m}_depth.json"
    step llama-$m-depth 100 sh -c "$LB -m $(g4model $m) -ngl 99 -fa 1 -p 0 -n 128 -d 32768 -r 1 -o json > $RES/llama_${m}_depth.json; \
      cat $RES/llama_${m}_depth.json | python3 -c 'import json,sys; [print(r[\"n_depth\"], r[\"n_gen\"], round(r[\"avg_ts\"],1)) for r in json.load(sys.stdin)]'"
  done
  SKIP=$skip
  step memory-26b 90 python3 scripts/bench_vs_llamacpp.py memory "$(g4model 26b-a4b)" --ctx 32768 --cache-types f16 \
    --decode 16 --json "$RES/memory_26b.json"
  for m in 31b 26b-a4b; do
    step profile-$m 60 python3 scripts/bench_vs_llamacpp.py profile "$(g4model $m)" --out "$RES"
  done
}

gemma4_all() {  # gemma4_a's and gemma4_b's Lucebox rows, the llama.cpp build meanwhile, its depth rows last
  llama_build_bg
  local skip=$SKIP
  SKIP="$skip llama "
  gemma4_a
  gemma4_b
  SKIP=$skip
  if llama_wait; then
    for m in 26b-a4b 31b; do
      step llama-$m-depth 120 sh -c "$LB -m $(g4model $m) -ngl 99 -fa 1 -p 0 -n 128 -d 32768 -r 2 -o json > $RES/llama_${m}_depth.json; \
        cat $RES/llama_${m}_depth.json | python3 -c 'import json,sys; [print(r[\"n_depth\"], r[\"n_gen\"], round(r[\"avg_ts\"],1)) for r in json.load(sys.stdin)]'"
    done
  fi
}

gemma4_profile() {  # ~4 min: where a decode step's GPU time goes (torch.profiler over graph replays), 26B-A4B and
  #                   31B Q4_K_M; then the 26B-A4B's peak memory at a 32K context.   carry: .whl
  for m in 26b-a4b 31b; do
    step synth-$m 120 g4synth $m
    step profile-$m 100 python3 scripts/bench_vs_llamacpp.py profile "$(g4model $m)" --out "$RES"
  done
  step memory-26b 120 python3 scripts/bench_vs_llamacpp.py memory "$(g4model 26b-a4b)" --ctx 32768 --cache-types f16 \
    --decode 16 --json "$RES/memory_26b.json"
}

gemma4_dev() {  # ~9 min: the first of three chained calls (each started within the machine's idle release, so
  #               /tmp/w and the llama.cpp build stay): Gemma-4's kernel checks, the matvec sweep on its shapes
  #               (its table left in $WORK/matvec_sweep.json for LUCEBOX_MATVEC_TUNED), both Q4_K_M files, the
  #               llama.cpp build meanwhile. Then gemma4-a and gemma4-b with SKIP=gemma4-check.   carry: .whl .llamacpp
  llama_build_bg
  step gemma4-check 150 python3 scripts/gemma4_gpu_check.py --workdir "$WORK" --json "$RES/gemma4_check.json"
  step matvec-sweep-gemma4 200 python3 scripts/matvec_sweep.py --out "$RES" --model gemma4 --skip-correctness \
    --budget-s "${SWEEP_BUDGET:-100}"
  cp "$RES/matvec_sweep.json" "$WORK/matvec_sweep.json" 2>/dev/null
  for m in 26b-a4b 31b; do step synth-$m 150 g4synth $m; done
  llama_wait
}

gemma4_exact() {  # ~9 min: Gemma-4's verify pass as the decode step's tree attention: the kernel checked bit for bit at
  #                 the 31B's shapes, tiny models (static verify under graphs vs eager), every verified node of the
  #                 31B (ring wrapped) and the 26B-A4B (ring wrapping inside the tree) against decoding its path,
  #                 then the forced DDTree 8.3 row on the 31B beside plain tg128 of both engines, same files.
  #                 carry: .whl .llamacpp
  llama_build_bg
  step gemma4-check 100 python3 scripts/gemma4_gpu_check.py --checks tree --workdir "$WORK" \
    --json "$RES/gemma4_check.json"
  step synth-31b 150 g4synth 31b
  step synth-draft 60 python3 -m lucebox_core.cli synth --arch gemma4-dflash-draft --size full --type q8_0 \
    --target "$(g4model 31b)" -o "$WORK/gemma4-31b-draft-q8_0.gguf"
  step determinism-31b 120 python3 scripts/verify_determinism.py "$(g4model 31b)" --prefix 1500 \
    --json "$RES/determinism_31b.json"
  step lucebox-31b-spec 150 sh -c "python3 -m lucebox_core.cli bench -m $(g4model 31b) -md $WORK/gemma4-31b-draft-q8_0.gguf \
    -p 0 -n 256 -r 2 --force-accept 8.3 --json > $RES/lucebox_31b_spec.json; cat $RES/lucebox_31b_spec.json"
  step lucebox-31b 100 sh -c "python3 -m lucebox_core.cli bench -m $(g4model 31b) -p 0 -n 128 -r 2 --json \
    > $RES/lucebox_31b.json; cat $RES/lucebox_31b.json"
  if llama_wait; then
    step llama-31b 60 sh -c "$LB -m $(g4model 31b) -ngl 99 -fa 1 -p 0 -n 128 -r 2 -o json > $RES/llama_31b.json; \
      cat $RES/llama_31b.json | python3 -c 'import json,sys; [print(r[\"n_prompt\"], r[\"n_gen\"], round(r[\"avg_ts\"],1)) for r in json.load(sys.stdin)]'"
  fi
  step synth-26b 120 g4synth 26b-a4b
  step determinism-26b 100 python3 scripts/verify_determinism.py "$(g4model 26b-a4b)" --prefix 1020 \
    --json "$RES/determinism_26b.json"
  cp "$RES"/determinism_*.json "$RES"/gemma4_check.json "$OUT/" 2>/dev/null
  return 0
}

demo_train() {  # ~9.5 min: issue #22's run: train the demo pair (scripts/train_demo.py, TRAIN_BUDGET s), its real
  #               acceptance on the H200 (demo_acceptance.py), then Gemma-4 31B's speculative step profile under
  #               forced DDTree 8.3 beside llama.cpp's tg128 (the build meanwhile). The pair's parts come back in
  #               $OUT/parts, everything else in the tgz.   carry: .whl .llamacpp
  llama_build_bg
  step train-demo $((${TRAIN_BUDGET:-300} + 30)) python3 scripts/train_demo.py --out /tmp/demo --cache-dir /tmp/demo-cache \
    --budget-s "${TRAIN_BUDGET:-300}"
  cp /tmp/demo/*.json "$RES/" 2>/dev/null
  mkdir -p "$OUT/parts" && cp /tmp/demo/parts/* "$OUT/parts/" 2>/dev/null
  local target=/tmp/demo/lucebox-demo-qwen35-stdlib-q8_0.gguf draft=/tmp/demo/lucebox-demo-qwen35-stdlib-dflash-draft-q8_0.gguf
  step demo-acceptance 100 python3 scripts/demo_acceptance.py --target "$target" --draft "$draft" --device cuda \
    --prompts 12 -n 96 --out "$RES/acceptance_h200.json"
  step spec-profile-demo 60 python3 scripts/spec_step_profile.py "$target" "$draft" -n 96 \
    --json "$RES/spec_profile_demo.json"
  step synth-31b 60 g4synth 31b
  step synth-draft 40 python3 -m lucebox_core.cli synth --arch gemma4-dflash-draft --size full --type q8_0 \
    --target "$(g4model 31b)" -o "$WORK/gemma4-31b-draft-q8_0.gguf"
  step spec-profile-31b 90 python3 scripts/spec_step_profile.py "$(g4model 31b)" "$WORK/gemma4-31b-draft-q8_0.gguf" \
    --force-accept 8.3 -n 256 --json "$RES/spec_profile_31b.json"
  if llama_wait; then
    step llama-31b 40 sh -c "$LB -m $(g4model 31b) -ngl 99 -fa 1 -p 0 -n 128 -r 2 -o json > $RES/llama_31b.json; \
      cat $RES/llama_31b.json | python3 -c 'import json,sys; [print(r[\"n_prompt\"], r[\"n_gen\"], round(r[\"avg_ts\"],1)) for r in json.load(sys.stdin)]'"
  fi
  return 0
}

server_gpu() {  # ~5 min: after server/engine changes: the CUDA-only tests, grammar-constrained decoding through the
  #               served default model on the GPU (the mask computed ahead, CUDA events between threads) idle and
  #               busy, and a speculative generate on the 0.8B with a drafter (padding suppressed on the device).
  #               carry: .whl (with litestar, uvicorn and their pure-Python dependencies)
  step cuda-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graph.py \
    tests/test_quants.py tests/test_cuda_plugin.py tests/test_ops.py tests/test_static_step.py -x
  step constrained 120 python3 scripts/constrained_decode_bench.py -n 48 -r 2 --busy 8
  step synth-08b 30 synth 0.8b
  step synth-draft-08b 30 python3 -m lucebox_core.cli synth --arch qwen35-dflash-draft --target "$(model 0.8b)" \
    -o "$WORK/draft-08b.gguf"
  step generate-08b 60 sh -c "python3 -m lucebox_core.cli generate -m $(model 0.8b) -p 'def add(a, b):' -n 64 --temp 0 --json \
    | tail -1 > $RES/plain.json; python3 -m lucebox_core.cli generate -m $(model 0.8b) -md $WORK/draft-08b.gguf \
    -p 'def add(a, b):' -n 64 --temp 0 --force-accept 5 --json | tail -1 > $RES/spec.json; python3 -c 'import json
a, b = (json.load(open(\"$RES/\" + n)) for n in (\"plain.json\", \"spec.json\"))
print(\"plain\", round(a[\"decode_tokens_per_s\"], 1), \"spec forced 5\", round(b[\"decode_tokens_per_s\"], 1),
      \"same tokens:\", a[\"token_ids\"] == b[\"token_ids\"])'"
}

bench_probe() {  # the forced speculative row of `lucebox bench` (two contexts) beside same_call_bench's, twice
  step synth-27b 90 synth 27b
  step synth-draft 60 python3 -c "from lucebox_qwen35 import draft_synth; import sys
draft_synth.write(sys.argv[1], size='full', type='q4_k_m', seed=1, target=sys.argv[2])" "$WORK/draft-27b.gguf" "$(model 27b)"
  local m d; m=$(model 27b); d=$WORK/draft-27b.gguf
  for i in 1 2; do
    step bench-c4096-$i 100 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -p 0 -n 256 -r 3 --force-accept 8.3 \
      --json | spec_rows c4096"
    step bench-c300-$i 100 bash -c "python3 -m lucebox_core.cli bench -m $m -md $d -c 300 -p 0 -n 256 -r 3 \
      --force-accept 8.3 --json | spec_rows c300"
    step same-call-$i 100 python3 scripts/same_call_bench.py $m $d --label same-call-$i --prompts 16 --n-gen 8 --reps 3
  done
}

# -- Spark (#14): expert offload against all on the GPU and llama.cpp's --n-cpu-moe, same files ----------------
SPARK_SKEW=${SPARK_SKEW:-0.9}  # the skewed file's router skew: about this share of picks in 35% of the experts
SPARK_RESIDENCY=${SPARK_RESIDENCY:-0.6}  # the experts' bytes resident with Spark / left on the GPU by llama.cpp
export SPARK_SKEW SPARK_RESIDENCY
sparkmodel() { echo "$WORK/$1-$2-q4_k_m${3:+-skew$3}.gguf"; }  # arch size [skew]
spark_synth() {  # arch size: the skewed and the random-router file, written side by side (~75 s each)
  local skewed uniform pids=()
  skewed=$(sparkmodel "$1" "$2" "$SPARK_SKEW") uniform=$(sparkmodel "$1" "$2")
  [ -s "$skewed" ] || { python3 -m lucebox_core.cli synth --arch "$1" --size "$2" --type q4_k_m \
    --router-skew "$SPARK_SKEW" -o "$skewed" & pids+=($!); }
  [ -s "$uniform" ] || { python3 -m lucebox_core.cli synth --arch "$1" --size "$2" --type q4_k_m -o "$uniform" &
    pids+=($!); }
  local pid rc=0; for pid in "${pids[@]}"; do wait "$pid" || rc=1; done; ls -la "$WORK"; return $rc
}
export -f sparkmodel spark_synth

spark_rows() {  # arch size: bench_spark.py and llama-bench on the skewed file, then on the random-router one
  #              (beside the skewed file's full row; llama.cpp all on GPU once: it does not depend on the routers)
  local skewed uniform
  skewed=$(sparkmodel "$1" "$2" "$SPARK_SKEW") uniform=$(sparkmodel "$1" "$2")
  step "spark-$1-skewed" 250 python3 scripts/bench_spark.py lucebox -m "$skewed" --residency "$SPARK_RESIDENCY" \
    --calibrate 2048 --calibrate-seconds "${SPARK_CALIBRATE_S:-40}" --phase-timeout 150 \
    --json "$RES/spark_$1_skewed.json"
  # llama.cpp's rows before the random-router file's: they are the targets' other side (the build is done by now)
  if llama_wait; then
    step "llama-$1-skewed" 110 python3 scripts/bench_spark.py llama -m "$skewed" --residency "$SPARK_RESIDENCY" \
      --llama-bench "$LB" --timeout 80 --json "$RES/llama_$1_skewed.json"
  fi
  step "spark-$1-uniform" 120 python3 scripts/bench_spark.py lucebox -m "$uniform" --residency "$SPARK_RESIDENCY" \
    --phases calibrate,spark --calibrate 2048 --calibrate-seconds "${SPARK_UNIFORM_CALIBRATE_S:-25}" -r 2 \
    --phase-timeout 80 --json "$RES/spark_$1_uniform.json"
  [ -x "$LB" ] && step "llama-$1-uniform" 60 python3 scripts/bench_spark.py llama -m "$uniform" \
    --residency "$SPARK_RESIDENCY" --llama-bench "$LB" --rows offload --timeout 50 --json "$RES/llama_$1_uniform.json"
  python3 scripts/bench_spark.py report "$RES"/spark_$1_*.json "$RES"/llama_$1_*.json --md "$OUT/spark_bench_$1.md"
  cp "$RES"/spark_$1_*.json "$RES"/llama_$1_*.json "$OUT/" 2>/dev/null
  return 0
}

spark_bench() {  # ~9 min: #14's rows on Laguna-XS.2 Q4_K_M (synthetic): skewed routers (SPARK_SKEW) and random
  #               ones (close to uniform: a cache's worst case); tg128 all on GPU, a calibration (2048 tokens or
  #               40 s of decoding writes the profile), Spark at SPARK_RESIDENCY of the expert bytes (hit rate,
  #               bytes moved, peak GPU memory); llama-bench all on GPU and --n-cpu-moe at the same expert
  #               bytes. The llama.cpp build runs meanwhile at nice 19.       carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  step spark-synth 170 spark_synth laguna xs2
  spark_rows laguna xs2
}

spark_bench_35b() {  # ~9 min: the same on Qwen3.5-35B-A3B's layout (qwen35moe), the xs2 files removed first (disk)
  #                   carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  rm -f "$WORK"/laguna-xs2-q4_k_m*.gguf*
  step spark-synth 170 spark_synth qwen35moe 35b-a3b
  spark_rows qwen35moe 35b-a3b
}

laguna_profile() {  # ~2 min: where a Laguna-XS.2 decode step's time goes (torch.profiler over graph replays). carry: .whl
  local m; m=$(sparkmodel laguna xs2)
  step synth-laguna 120 sh -c "[ -s $m ] || python3 -m lucebox_core.cli synth --arch laguna --size xs2 --type q4_k_m -o $m"
  step profile-laguna 120 python3 scripts/bench_vs_llamacpp.py profile "$m" --out "$RES"
  cp "$RES"/profile_*.json "$OUT/" 2>/dev/null
  return 0
}

fused_prefill() {  # ~4 min (not run yet): #17 item 5's first step, Q4_K prefill products straight from the blocks
  #                (lucebox_cuda.triton_quant_matmul) against the dequantized tiles + cuBLAS at the 27B's shapes,
  #                then the 27B's pp512/pp4096 and the second-turn TTFT with LUCEBOX_FUSED_PREFILL off and on.
  #                carry: .whl
  step fused-check 120 python3 scripts/quant_matmul_check.py
  step synth-27b 60 synth 27b
  step prefill-tiles 80 python3 -m lucebox_core.cli bench -m "$(model 27b)" -p 512,4096 -n 0 -r 2
  step prefill-fused 80 env LUCEBOX_FUSED_PREFILL=1 python3 -m lucebox_core.cli bench -m "$(model 27b)" -p 512,4096 -n 0 -r 2
  step ttft-fused 110 env LUCEBOX_FUSED_PREFILL=1 python3 scripts/bench_prefix_cache.py -m "$(model 27b)" \
    --context 32768 --reps 3 --json "$RES/prefix_cache_ttft_fused.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s18_check() {  # ~8 min: session 18's changes: the expert products on tensor cores (moe_matvec_mma.cu), Spark's
  #            promotions on a copy stream, the gated shared expert in one launch. The GPU tests of the MoE
  #            kernels, Laguna, qwen35moe, Gemma-4's routed experts and Spark's paged steps; the kernels' variants
  #            timed (scripts/moe_matvec_bench.py); then laguna_rows, llama.cpp built meanwhile. carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  step gpu-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=8 \
    tests/test_moe_matvec_cuda.py tests/test_cuda_embedding.py tests/test_laguna_cuda.py tests/test_qwen35moe_cuda.py \
    tests/test_spark_graphed.py -k "cuda or gpu or routed_expert or tensor_core or pair or shared or lookup"  # (not test_cuda_moe_grouped: it sets TRITON_INTERPRET=1)
  step moe-bench 90 python3 scripts/moe_matvec_bench.py --layers 24 --json "$RES/moe_matvec_bench.json"
  laguna_rows
  step host-laguna 120 python3 scripts/decode_overhead.py -m "$(sparkmodel laguna xs2)" -n 64 --bench-loop --top 30 \
    --json "$RES/overhead_laguna.json"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
}

laguna_rows() {  # ~5 min: Laguna-XS.2's step profile, pp512/pp2048/tg128 beside llama-bench on the same file (its
  #              build started by the caller, `llama_build_bg`).                 carry: .whl .llamacpp
  laguna_profile
  local m; m=$(sparkmodel laguna xs2)
  step lucebox-laguna 150 sh -c "python3 -m lucebox_core.cli bench -m $m -p 512,2048 -n 128 -r 3 --json \
    > $RES/lucebox_laguna.json; cat $RES/lucebox_laguna.json"
  if llama_wait; then
    step llama-laguna 120 sh -c "$LB -m $m -ngl 99 -fa 1 -p 512,2048 -n 128 -r 3 -o json > $RES/llama_laguna.json; \
      python3 -c 'import json,sys; [print(r[\"n_prompt\"], r[\"n_gen\"], round(r[\"avg_ts\"],1)) for r in json.load(open(sys.argv[1]))]' $RES/llama_laguna.json"
  fi
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

spark_profile() {  # ~4.5 min (not run yet): where Spark's step spends its ~1.5 ms over the all-GPU step on the
  #               skewed Laguna-XS.2 file: a calibration (the routing profile beside the file), then the decode
  #               step's profile at SPARK_RESIDENCY (whole steps: promotions and accounting included) and all on
  #               the GPU.                                                              carry: .whl
  local skewed; skewed=$(sparkmodel laguna xs2 "$SPARK_SKEW")
  step synth-laguna 120 sh -c "[ -s $skewed ] || python3 -m lucebox_core.cli synth --arch laguna --size xs2 \
    --type q4_k_m --router-skew $SPARK_SKEW -o $skewed"
  step calibrate 100 python3 scripts/bench_spark.py lucebox -m "$skewed" --residency "$SPARK_RESIDENCY" \
    --phases calibrate --calibrate 2048 --calibrate-seconds 40 --phase-timeout 90 --json "$RES/calibration.json"
  step profile-spark 100 python3 scripts/bench_vs_llamacpp.py profile "$skewed" --spark "$SPARK_RESIDENCY" --out "$RES"
  step profile-full 90 python3 scripts/bench_vs_llamacpp.py profile "$skewed" --out "$RES"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s17_final() {  # ~7.5 min: session 17's changes on Qwen3.5-35B-A3B (qwen35moe, skewed routers): the shared expert's
  #             gate as a one-row product, Spark's gate and up in one paged launch. The GPU tests of qwen35moe
  #             on CUDA and of the paged ops; the step's profile, all on the GPU and at SPARK_RESIDENCY; the
  #             Spark rows; llama-bench beside (built meanwhile, nice 19).      carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  step gpu-tests 150 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_cuda_embedding.py tests/test_qwen35moe_cuda.py tests/test_laguna_cuda.py tests/test_spark_graphed.py \
    -k "cuda or gpu or lookup or routed_expert"
  local m; m=$(sparkmodel qwen35moe 35b-a3b "$SPARK_SKEW")
  step synth-35b 60 sh -c "[ -s $m ] || python3 -m lucebox_core.cli synth --arch qwen35moe --size 35b-a3b \
    --type q4_k_m --router-skew $SPARK_SKEW -o $m"
  step profile-35b 60 python3 scripts/bench_vs_llamacpp.py profile "$m" --out "$RES"
  step lucebox-35b 60 sh -c "python3 -m lucebox_core.cli bench -m $m -p 512 -n 128 -r 3 --json > $RES/lucebox_35b.json; \
    cat $RES/lucebox_35b.json"
  step spark-35b 150 python3 scripts/bench_spark.py lucebox -m "$m" --residency "$SPARK_RESIDENCY" \
    --calibrate 2048 --calibrate-seconds 30 --phase-timeout 90 --json "$RES/spark_qwen35moe_skewed.json"
  step profile-spark-35b 60 python3 scripts/bench_vs_llamacpp.py profile "$m" --spark "$SPARK_RESIDENCY" --out "$RES"
  if llama_wait; then
    step llama-35b 80 python3 scripts/bench_spark.py llama -m "$m" --residency "$SPARK_RESIDENCY" \
      --llama-bench "$LB" --timeout 70 --json "$RES/llama_qwen35moe_skewed.json"
    step llama-35b-pp 40 sh -c "$LB -m $m -ngl 99 -fa 1 -p 512 -n 0 -r 3 -o json > $RES/llama_35b_pp.json; \
      python3 -c 'import json,sys; [print(r[\"n_prompt\"], r[\"n_gen\"], round(r[\"avg_ts\"],1)) for r in json.load(open(sys.argv[1]))]' $RES/llama_35b_pp.json"
  fi
  python3 scripts/bench_spark.py report "$RES"/spark_qwen35moe_*.json "$RES"/llama_qwen35moe_*.json \
    --md "$OUT/spark_bench_qwen35moe.md"
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

s19_spark() {  # ~8 min: Spark's promotions (default, and --spark-promote PROMOTE_SIZES) on the skewed files of
  #             ARCHS (qwen35moe:35b-a3b laguna:xs2), the paged steps' GPU tests (TESTS=1) first, llama.cpp's rows
  #             beside (built meanwhile: SKIP=llama for host-paced rows without it). PHASES: bench_spark's.                                                           carry: .whl .llamacpp
  LLAMA_NICE=19 llama_build_bg
  [ -n "${TESTS:-}" ] && step gpu-tests 200 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
    --durations=5 tests/test_spark_graphed.py -k gpu
  local pair arch size m run
  for pair in ${ARCHS:-qwen35moe:35b-a3b}; do
    arch=${pair%%:*} size=${pair#*:} m=$(sparkmodel "${pair%%:*}" "${pair#*:}" "$SPARK_SKEW")
    step "synth-$arch" 60 sh -c "[ -s $m ] || python3 -m lucebox_core.cli synth --arch $arch --size $size \
      --type q4_k_m --router-skew $SPARK_SKEW -o $m"
    run="python3 scripts/bench_spark.py lucebox -m $m --residency $SPARK_RESIDENCY --phase-timeout 90"
    step "spark-$arch" 150 $run --phases "${PHASES:-full,calibrate,spark}" --calibrate 2048 --calibrate-seconds 30 \
      --json "$RES/spark_${arch}_skewed.json"
    for promote in ${PROMOTE_SIZES:-0}; do
      step "spark-$arch-promote-$promote" 50 $run --phases spark --promote "$promote" \
        --json "$RES/spark_${arch}_promote$promote.json"
    done
  done
  for pair in ${ARCHS:-qwen35moe:35b-a3b}; do
    arch=${pair%%:*} m=$(sparkmodel "${pair%%:*}" "${pair#*:}" "$SPARK_SKEW")
    llama_wait && step "llama-$arch" 80 python3 scripts/bench_spark.py llama -m "$m" --residency "$SPARK_RESIDENCY" \
      --llama-bench "$LB" --timeout 70 --json "$RES/llama_${arch}_skewed.json"
    python3 scripts/bench_spark.py report "$RES"/spark_"$arch"_*.json "$RES"/llama_"$arch"_*.json \
      --md "$OUT/spark_bench_$arch.md"
  done
  cp "$RES"/*.json "$OUT/" 2>/dev/null
  return 0
}

session() {
  echo "gpu_session $MODE, commit $COMMIT, $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  step install 120 install || { echo "install failed"; return 1; }
  export PYTHONPATH=/tmp/site
  case $MODE in
    check) check ;;
    bench-a) PART=A bash scripts/bench_vs_llamacpp.sh ;;
    bench-b) PART=B bash scripts/bench_vs_llamacpp.sh ;;
    bench-all) PART=all bash scripts/bench_vs_llamacpp.sh ;;  # A and B, one build: trim REPS/tests to fit
    spec) spec ;;
    core) core ;;
    same-call) same_call ;;
    hip-check) hip_check ;;
    long-context) long_context ;;
    pflash) pflash ;;
    long-pflash) long_pflash ;;
    long-a) long_a ;;
    governor) governor ;;
    final-rows) final_rows ;;
    laguna-cuda) laguna_cuda ;;
    same-call-prefill) same_call_prefill ;;
    bench-cli) bench_cli ;;
    bench-probe) bench_probe ;;
    gemma4-a) gemma4_a ;;
    gemma4-b) gemma4_b ;;
    gemma4-all) gemma4_all ;;
    gemma4-profile) gemma4_profile ;;
    gemma4-dev) gemma4_dev ;;
    gemma4-final) gemma4_final ;;
    gemma4-exact) gemma4_exact ;;
    demo-train) demo_train ;;
    server-gpu) server_gpu ;;
    spark-bench) spark_bench ;;
    spark-bench-35b) spark_bench_35b ;;
    laguna-profile) laguna_profile ;;
    s18-check) s18_check ;;
    laguna-rows) LLAMA_NICE=19 llama_build_bg; laguna_rows ;;
    spark-profile) spark_profile ;;
    s17-final) s17_final ;;
    fused-prefill) fused_prefill ;;
    s19-spark) s19_spark ;;
    s20-probe) step zero-copy 90 python3 scripts/zero_copy_probe.py --json "$OUT/zero_copy.json"; spark_profile ;;
    s20-spark) s19_spark; for m in $(sparkmodel laguna xs2 "$SPARK_SKEW") ${PROFILE_35B:+$(sparkmodel qwen35moe 35b-a3b "$SPARK_SKEW")}; do
      step profile-spark 90 python3 scripts/bench_vs_llamacpp.py profile "$m" --spark "$SPARK_RESIDENCY" --out "$RES"
      step profile-full 60 python3 scripts/bench_vs_llamacpp.py profile "$m" --out "$RES"; done; cp "$RES"/*.json "$OUT/" ;;
    *) if declare -F "${MODE//-/_}" > /dev/null; then "${MODE//-/_}"  # a mode of gpu_session_more.sh
       else echo "unknown mode $MODE (see this file's and gpu_session_more.sh's headers)"; return 2; fi ;;
  esac
  pack
  echo "[$SECONDS s] gpu_session $MODE done"
}

for modes in scripts/gpu_session_more.sh scripts/gpu_session_s3[1-9].sh; do source "$modes"; done
export -f synth model install g4synth g4model
session 2>&1 | tee "$OUT/log_$MODE.txt"
