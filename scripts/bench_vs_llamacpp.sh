#!/usr/bin/env bash
# Lucebox vs llama.cpp on the same synthetic Q4_K_M files, same machine, same run (issue #5's benchmark).
# Run on the GPU machine from the project's root, `.llamacpp` and `.whl` carried. Each part fits one
# 10-minute device call, the llama.cpp build (~4.5 min, 16 cores, in the background from the start) included:
#
#   PART=A bash scripts/bench_vs_llamacpp.sh  # ~6-7 min: 0.8b pp512/pp4096/tg128/tg128@d8192/@d32768,
#                                             #   27b pp512/pp4096/tg128; both engines
#   PART=B bash scripts/bench_vs_llamacpp.sh  # ~6-7 min: 27b tg128 @ d8192 and d32768, both engines; Lucebox's
#                                             #   peak memory at a 32K context with f16 and q8_0 KV
#   PART=all ...                              # A then B (one build): ~11 min, more than one call
#
# Env: OUT (./bench_out), WORK (/tmp/w: the GGUF files, reused when there), REPS (3), DEPTH_REPS (3),
# SKIP (words; a step is skipped when a word names it or a dash-separated part of its name, e.g.
# "llama" = no build and no llama-bench, "memory", "08b", "lucebox-27b-depth"), LUCEBOX_KV (a KV type
# for Lucebox's bench; default the backend's, bf16, the size of llama.cpp's f16), COMMIT (the commit to
# record: the device's copy of the tree has no .git), STEP_TIMEOUT (s, 420), DEADLINE (s, 560: steps are cut
# short or skipped past it; run under gpu_session.sh, whose install takes ~20 s first).
# Writes $OUT/bench_$PART.{json,md} (rewritten after every step, so a killed call still returns the table
# so far) and $OUT/bench_$PART.tgz (every raw output and log).
set -uo pipefail
export PYTHONUNBUFFERED=1
PART=${PART:-A}
OUT=${OUT:-$PWD/bench_out}
W=${WORK:-/tmp/w}
RES=/tmp/bench_res_$PART
REPS=${REPS:-3}
DEPTH_REPS=${DEPTH_REPS:-3}
SKIP=" ${SKIP:-} "
DEADLINE=${DEADLINE:-560}  # seconds from the start: no step runs past it (a device call ends at 600)
LLAMA_BENCH=${LLAMA_BENCH:-/tmp/llamacpp/build/bin/llama-bench}
BACKEND=${BACKEND:-cuda}  # hip on an AMD GPU (scripts/bench_amd.sh sets it)
SMALL=${SMALL:-0.8b} BIG=${BIG:-27b}  # dry runs on a CPU: SMALL=tiny BIG=tiny BACKEND=torch SKIP=memory
SMALL_TESTS=${SMALL_TESTS:-pp512,pp4096,tg128,tg128@d8192,tg128@d32768}
BIG_TESTS=${BIG_TESTS:-pp512,pp4096,tg128}
DEPTH_TESTS=${DEPTH_TESTS:-tg128@d8192,tg128@d32768}
PY="python3 scripts/bench_vs_llamacpp.py"
mkdir -p "$OUT" "$W" "$RES"
SECONDS=0

if ! python3 -c "import lucebox_core, lucebox_qwen35, lucebox_cuda$([ "$BACKEND" = hip ] && echo ', lucebox_hip')" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . plugins/qwen35 backends/cuda \
    $([ "$BACKEND" = hip ] && echo backends/hip) || exit 1
  export PYTHONPATH=/tmp/site
fi
export LUCEBOX_HOME=${LUCEBOX_HOME:-/tmp/lh}

skipped() {  # step name -> true if SKIP names it or one of its dash-separated parts
  local word part
  for word in $SKIP; do
    [ "$word" = "$1" ] && return 0
    for part in ${1//-/ }; do [ "$word" = "$part" ] && return 0; done
  done
  return 1
}

pack() {  # the merged table so far, and every raw file
  $PY table "$RES"/*.json --json "$OUT/bench_$PART.json" --md "$OUT/bench_$PART.md" > /dev/null 2> "$RES/table.err"
  tar czf "$OUT/bench_$PART.tgz" -C "$RES" . 2>/dev/null
}

step() {  # name estimate_s command...: run one step unless skipped, with its time and a timeout
  local name=$1 estimate=$2; shift 2
  if skipped "$name"; then echo "[$SECONDS s] skip $name"; return 0; fi
  local limit=${STEP_TIMEOUT:-420}
  (( limit > DEADLINE - SECONDS )) && limit=$((DEADLINE - SECONDS))
  if (( limit < 15 )); then echo "[$SECONDS s] skip $name: the deadline (${DEADLINE} s) is near"; return 0; fi
  local start=$SECONDS
  echo "[$SECONDS s] $name (estimate ${estimate} s): $*"
  # Steps may be shell functions (exported below): run them in a bash that timeout can kill with its children.
  timeout -k 10 "$limit" bash -c '"$@"' step "$@" 2>&1 | tee "$RES/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "[$SECONDS s] $name done in $((SECONDS - start)) s (rc $rc)"
  pack
  return 0
}

model() { echo "$W/qwen35-$1-q4_k_m.gguf"; }
synth() { [ -s "$(model "$1")" ] && echo "reusing $(model "$1")" || $PY synth "$1" q4_k_m "$(model "$1")"; }
lucebox() {  # size tests reps
  $PY lucebox "$(model "$1")" --backend "$BACKEND" --tests "$2" -r "$3" ${LUCEBOX_KV:+--cache-type $LUCEBOX_KV} \
    --json "$RES/lucebox_$1_${2//[,@]/_}.json"
}
llama() {  # size label llama-bench args...
  local size=$1 label=$2; shift 2
  [ -x $LLAMA_BENCH ] || { echo "no llama-bench (see $RES/llamacpp_build.log)"; return 1; }
  $LLAMA_BENCH -m "$(model "$size")" -ngl 99 -fa 1 "$@" -o json > "$RES/llama_${size}_$label.json"
}

export W RES PY LLAMA_BENCH BACKEND LUCEBOX_KV=${LUCEBOX_KV:-}
export -f model synth lucebox llama

gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
[ -n "$gpu" ] || gpu=$(python3 -c 'import torch; print(torch.cuda.get_device_name(), "HIP", torch.version.hip)' 2>&1 | tail -1)
echo "part $PART: bench_vs_llamacpp ($BACKEND backend) on $gpu"
need_llama=0
for s in llama-08b llama-08b-depth llama-27b llama-27b-depth; do skipped "$s" || need_llama=1; done
if [ $need_llama = 1 ] && ! skipped build && [ ! -x "$LLAMA_BENCH" ]; then
  echo "[$SECONDS s] llama.cpp build in the background (estimate 270 s; skipped when built)"
  (bash .llamacpp/build.sh > "$RES/llamacpp_build.log" 2>&1; echo "build rc $? at $SECONDS s" >> "$RES/llamacpp_build.log") &
  BUILD_PID=$!
fi
step header 5 $PY header --part "$PART" --json "$RES/header_$PART.json"

part_a_lucebox() {
  step synth-08b 10 synth "$SMALL"
  step synth-27b 30 synth "$BIG"
  step lucebox-08b 60 lucebox "$SMALL" "$SMALL_TESTS" "$REPS"
  step lucebox-27b 90 lucebox "$BIG" "$BIG_TESTS" "$REPS"
}
part_b_lucebox() {
  step synth-27b 30 synth "$BIG"
  step lucebox-27b-depth 120 lucebox "$BIG" "$DEPTH_TESTS" "$DEPTH_REPS"
  step memory-27b 120 $PY memory "$(model "$BIG")" --backend "$BACKEND" --ctx 32768 --cache-types f16,q8_0 --decode 64 \
    --json "$RES/memory_27b.json"
}
part_a_llama() {
  step llama-08b 40 llama "$SMALL" pp -p 512,4096 -n 128 -r "$REPS"
  step llama-08b-depth 40 llama "$SMALL" depth -p 0 -n 128 -d 8192,32768 -r "$REPS"
  step llama-27b 50 llama "$BIG" pp -p 512,4096 -n 128 -r "$REPS"
}
part_b_llama() {
  step llama-27b-depth 80 llama "$BIG" depth -p 0 -n 128 -d 8192,32768 -r "$DEPTH_REPS"
}

case $PART in
  A) part_a_lucebox ;;
  B) part_b_lucebox ;;
  all) part_a_lucebox; part_b_lucebox ;;
  *) echo "PART must be A, B or all"; exit 2 ;;
esac
if [ -n "${BUILD_PID:-}" ]; then
  echo "[$SECONDS s] waiting for the llama.cpp build"
  wait "$BUILD_PID"
  tail -2 "$RES/llamacpp_build.log"
fi
case $PART in
  A) part_a_llama ;;
  B) part_b_llama ;;
  all) part_a_llama; part_b_llama ;;
esac
pack
cat "$OUT/bench_$PART.md"
echo "[$SECONDS s] part $PART done"
