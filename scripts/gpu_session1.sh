#!/usr/bin/env bash
# One device call: build llama.cpp, cross-check synthetic files, time the 27b writer, llama-bench it.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . plugins/qwen35 || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
SECONDS=0
bash .llamacpp/build.sh 2>&1 | tail -3
echo "build done at $SECONDS s"
mkdir -p /tmp/w
python3 scripts/llamacpp_crosscheck.py /tmp/w --files tiny:f32,tiny:q8_0,tiny:q4_k_m,0.8b:q4_k_m 2>&1 | tee $OUT/crosscheck.log
cp /tmp/w/crosscheck.json $OUT/ 2>/dev/null
echo "crosscheck done at $SECONDS s"
python3 -m lucebox_core.cli synth --arch qwen35 --size 0.8b --type q4_k_m -o /tmp/w/08b.gguf >/dev/null
python3 -m lucebox_core.cli bench -m /tmp/w/08b.gguf --device cuda -p 512 -n 32 -r 2 2>&1 | tee $OUT/lucebox_torch_08b.txt
/tmp/llamacpp/build/bin/llama-bench -m /tmp/w/08b.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 3 2>&1 | tee $OUT/llama_08b.txt
echo "0.8b done at $SECONDS s"
{ time python3 -m lucebox_core.cli synth --arch qwen35 --size 27b --type q4_k_m -o /tmp/w/27b.gguf ; } 2>&1 | tee $OUT/synth27b.txt
python3 -m lucebox_core.cli info /tmp/w/27b.gguf | tee -a $OUT/synth27b.txt
/tmp/llamacpp/build/bin/llama-bench -m /tmp/w/27b.gguf -ngl 99 -fa 1 -p 512 -n 64 -r 2 2>&1 | tee $OUT/llama_27b.txt
echo "all done at $SECONDS s"
