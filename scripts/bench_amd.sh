#!/usr/bin/env bash
# Lucebox vs llama.cpp on an AMD GPU (RDNA3 / RDNA3.5 / RDNA4): the same benchmark and the same table as the
# NVIDIA run (scripts/bench_vs_llamacpp.sh), with the hip backend and a HIP build of llama-bench.
#
# On the AMD machine, from the project's root, with a ROCm build of torch and Lucebox installed
# (pip install lucebox-core lucebox-qwen lucebox-hip, or the README's editable setup):
#
#   LLAMA_BENCH=~/llama.cpp/build/bin/llama-bench bash scripts/bench_amd.sh
#
# llama.cpp for the card: cmake -B build -DGGML_HIP=ON -DAMDGPU_TARGETS=gfx1100 && cmake --build build -j
# (gfx1151 for Strix Halo, gfx1201 for RX 9070; `rocminfo | grep gfx` names yours). Without it, SKIP=llama
# runs Lucebox's side alone. HIP_VISIBLE_DEVICES picks the card on a machine with several.
#
# Env as for bench_vs_llamacpp.sh (OUT, WORK, REPS, SKIP, LUCEBOX_KV, SMALL/BIG, *_TESTS); PART defaults to
# `all` and there is no device-call deadline here. Writes $OUT/bench_all.{json,md,tgz}.
set -uo pipefail
cd "$(dirname "$0")/.."
export BACKEND=hip PART=${PART:-all} DEADLINE=${DEADLINE:-100000} STEP_TIMEOUT=${STEP_TIMEOUT:-7200}
export LLAMA_BENCH=${LLAMA_BENCH:-$PWD/llama.cpp/build/bin/llama-bench}

# Fail early, with the backend's own reason, rather than benchmark the torch fallback.
reason=$(python3 - <<'PY'
from lucebox_core.plugins import registry
[hip] = [b for b in registry().kernel_backends() if b.name == "hip"] or [None]
print("lucebox-hip is not installed" if hip is None else hip.is_available()[1])
PY
)
if [ -n "$reason" ]; then
  echo "the hip backend cannot run here: $reason" >&2
  exit 2
fi
if [ ! -x "$LLAMA_BENCH" ] && [[ " ${SKIP:-} " != *" llama "* ]]; then
  echo "no llama-bench at $LLAMA_BENCH: build llama.cpp with -DGGML_HIP=ON (see the top of this script)," \
       "set LLAMA_BENCH, or SKIP=llama for Lucebox's side alone" >&2
  exit 2
fi
export SKIP="${SKIP:-} build"  # never the CUDA build of .llamacpp/build.sh
exec bash scripts/bench_vs_llamacpp.sh
