#!/usr/bin/env bash
# Lucebox vs llama.cpp, same synthetic Q4_K_M files, same machine, same run; prints one table per model.
#
# Run on the GPU machine from the project's root with `.llamacpp` and `.whl` (the gguf wheel) carried:
#     PART=full bash scripts/bench_vs_llamacpp.sh      # everything (longer than one 10-minute device call)
#     PART=quick bash scripts/bench_vs_llamacpp.sh     # 0.8b pp512/pp4096/tg128, 27b pp512/tg128 (default)
# llama.cpp is built in the background (`.llamacpp/build.sh`, ~4.5 min, skipped if built) while Lucebox
# runs. Output (logs, JSON, the table) goes to $OUT (default ./bench_out). LUCEBOX_COMMIT names the
# commit where the tree carries no .git.
set -uo pipefail
export PYTHONUNBUFFERED=1
PART=${PART:-quick}
OUT=${OUT:-$PWD/bench_out}
W=${WORK:-/tmp/w}
mkdir -p "$OUT" "$W"
SECONDS=0

if ! python3 -c 'import lucebox_core, lucebox_qwen35, lucebox_cuda' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . plugins/qwen35 backends/cuda || exit 1
  export PYTHONPATH=/tmp/site
fi
export LUCEBOX_HOME=${LUCEBOX_HOME:-/tmp/lh}

[ "$PART" = min ] || (nice -n 5 bash .llamacpp/build.sh > "$OUT/llamacpp_build.log" 2>&1; echo "build rc $?" >> "$OUT/llamacpp_build.log") &
BUILD_PID=$!

commit=${LUCEBOX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
echo "date $(date -u +%Y-%m-%dT%H:%MZ) | GPU $gpu | lucebox $commit | part $PART" | tee "$OUT/header.txt"

synth() {  # size -> path
  local path=$W/$1-q4_k_m.gguf
  [ -s "$path" ] || python3 scripts/bench_vs_llamacpp.py synth "$1" q4_k_m "$path" > /dev/null
  echo "$path"
}

lucebox() {  # label model args...: one lucebox bench --json run
  local label=$1 model=$2; shift 2
  echo "[$SECONDS s] lucebox $label $*"
  python3 scripts/bench_vs_llamacpp.py bench "$model" "$@" > "$OUT/lucebox_$label.json" 2> "$OUT/lucebox_$label.err" \
    || { echo "lucebox $label failed:"; tail -5 "$OUT/lucebox_$label.err"; }
}

llama() {  # label model args...
  local label=$1 model=$2; shift 2
  echo "[$SECONDS s] llama-bench $label $*"
  /tmp/llamacpp/build/bin/llama-bench -m "$model" -ngl 99 -fa 1 "$@" -o json > "$OUT/llama_$label.json" 2> "$OUT/llama_$label.err" \
    || { echo "llama-bench $label failed:"; tail -5 "$OUT/llama_$label.err"; }
}

small=$(synth 0.8b)
if [ "$PART" = min ]; then  # the least that answers the question: 0.8b and 27b pp512 + tg128, both engines
  lucebox 08b_pp "$small" -p 512 -n 128 -r 2
  [ -x /tmp/llamacpp/build/bin/llama-bench ] && llama 08b_pp "$small" -p 512 -n 128 -r 2
  python3 scripts/bench_vs_llamacpp.py profile "$small" --out "$OUT" 2>&1 | tee "$OUT/profile_08b.txt"
  big=$(synth 27b)  # 27b: the decode profile alone (graph step time at depth 16), then the bench if time is left
  python3 scripts/bench_vs_llamacpp.py profile "$big" --out "$OUT" 2>&1 | tee "$OUT/profile_27b.txt"
  [ -x /tmp/llamacpp/build/bin/llama-bench ] && llama 27b_pp "$big" -p 512 -n 128 -r 2
  lucebox 27b_pp "$big" -p 512 -n 128 -r 2
  for m in 08b 27b; do python3 scripts/bench_vs_llamacpp.py table --label "$m" --llama "$OUT"/llama_${m}_*.json \
    --lucebox "$OUT"/lucebox_${m}_*.json; done 2>&1 | tee "$OUT/table.md"
  exit 0
fi
big=$(synth 27b)
echo "[$SECONDS s] files written"

if [ "$PART" = full ]; then
  lucebox 08b_pp "$small" -p 512,4096 -n 128 -r 3
  lucebox 08b_depth "$small" -p 0 -n 128 -d 8192,32768 -r 3
  lucebox 27b_pp "$big" -p 512,4096 -n 128 -r 3
  lucebox 27b_depth "$big" -p 0 -n 128 -d 8192,32768 -r 3
else
  lucebox 08b_pp "$small" -p 512,4096 -n 128 -r 3
  lucebox 27b_pp "$big" -p 512 -n 128 -r 2
fi
python3 scripts/bench_vs_llamacpp.py profile "$small" --out "$OUT" 2>&1 | tee "$OUT/profile_08b.txt"
python3 scripts/bench_vs_llamacpp.py profile "$big" --out "$OUT" 2>&1 | tee "$OUT/profile_27b.txt"

echo "[$SECONDS s] waiting for the llama.cpp build"
wait $BUILD_PID
tail -2 "$OUT/llamacpp_build.log"
if [ -x /tmp/llamacpp/build/bin/llama-bench ]; then
  if [ "$PART" = full ]; then
    llama 08b_pp "$small" -p 512,4096 -n 128 -r 3
    llama 08b_depth "$small" -p 0 -n 128 -d 8192,32768 -r 3
    llama 27b_pp "$big" -p 512,4096 -n 128 -r 3
    llama 27b_depth "$big" -p 0 -n 128 -d 8192,32768 -r 3
  else
    llama 08b_pp "$small" -p 512,4096 -n 128 -r 3
    llama 27b_pp "$big" -p 512 -n 128 -r 2
  fi
fi

{
  cat "$OUT/header.txt"
  python3 scripts/bench_vs_llamacpp.py table --label "Qwen3.5-0.8B layout, Q4_K_M" \
    --llama "$OUT"/llama_08b_*.json --lucebox "$OUT"/lucebox_08b_*.json
  python3 scripts/bench_vs_llamacpp.py table --label "Qwen3.5-27B layout, Q4_K_M" \
    --llama "$OUT"/llama_27b_*.json --lucebox "$OUT"/lucebox_27b_*.json
} 2>&1 | tee "$OUT/table.md"
echo "[$SECONDS s] done"
