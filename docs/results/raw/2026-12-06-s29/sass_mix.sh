#!/bin/bash
# Session 29's SASS counter: registers, and the instruction mix of a kernel's longest loop (a GGUF block a warp for
# the mma kernels; two for the tiled kernel and the two-set mma_pp, whose loops hold two blocks).
#   NVFLAGS=... bash sass_mix.sh backends/cuda/lucebox_cuda/kernels "LUCEBOX_MATVEC_MMA(q4_k, bf16, 1)"
# nvcc: CUDA 13.0 (/usr/local/cuda-13.0); cuobjdump: the nvidia-cuda-cuobjdump wheel (13.5), unpacked to /tmp/cuobj
# (pip download --no-deps nvidia-cuda-cuobjdump; python3 -m zipfile -e THE.whl /tmp/cuobj), or CUOBJDUMP=path.
dir=$1; line=$2
printf '#include "matvec_mma.cu"\n#include "matvec_tiled.cu"\n%s\n' "$line" > /tmp/kk.cu
/usr/local/cuda-13.0/bin/nvcc $NVFLAGS -arch=sm_90 -cubin -O3 -I$dir -o /tmp/kk.cubin /tmp/kk.cu -Xptxas -v 2>&1 | grep -E "registers"
${CUOBJDUMP:-/tmp/cuobj/nvidia/cu13/bin/cuobjdump} -sass /tmp/kk.cubin | grep -E '^\s+/\*[0-9a-f]{4}\*/' > /tmp/kk.sass
# the longest backward-branch loop
python3 - <<'PY'
import re
lines=open('/tmp/kk.sass').read().splitlines()
addr=[int(re.search(r'/\*([0-9a-f]{4})\*/',l).group(1),16) for l in lines]
best=None
for i,l in enumerate(lines):
    m=re.search(r'BRA (0x[0-9a-f]+)',l)
    if m:
        t=int(m.group(1),16)
        if t<addr[i]:
            j=addr.index(t); n=i-j+1
            if best is None or n>best[0]: best=(n,j,i)
n,j,i=best
from collections import Counter
c=Counter()
for l in lines[j:i+1]:
    s=re.sub(r'^\s+/\*[0-9a-f]+\*/\s+','',l); s=re.sub(r'^@!?U?P[0-9T]+\s+','',s)
    c[s.split()[0].rstrip(';')]+=1
print('loop', n, 'instructions;', ', '.join(f'{k} {v}' for k,v in c.most_common(14)))
PY
