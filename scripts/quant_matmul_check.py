"""On a GPU: Q4_K prefill products straight from the blocks (`lucebox_cuda.triton_quant_matmul`) against the
backend's dequantized tiles and cuBLAS (`CudaBackend.tiled_linear`), at the 27B's Q4_K shapes and 256 and
4096 rows: the relative difference to the product with the dequantized weight, and ms each after a warm-up
at each shape.

    python scripts/quant_matmul_check.py
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from lucebox_cuda.backend import CudaBackend
from lucebox_cuda.timing import median_ms, relative_error
from lucebox_cuda.triton_quant_matmul import q4_k_matmul

from lucebox_core.kquants import random_blocks
from lucebox_core.quants import QuantTensor, dequantize


def main() -> int:
    backend = CudaBackend("cuda", torch.bfloat16)
    q4_k = GGMLQuantizationType.Q4_K
    torch.manual_seed(0)
    for out_features, in_features in ((17408, 5120), (5120, 17408), (6144, 5120)):
        blocks = random_blocks(q4_k, out_features * in_features, 0.02, np.random.default_rng(0))
        data = torch.from_numpy(blocks.copy()).cuda()
        dense = dequantize(data, q4_k, (out_features, in_features)).to(torch.bfloat16)
        weight = QuantTensor("w", q4_k, (out_features, in_features), data)
        for rows in (256, 4096):
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            fused = lambda: q4_k_matmul(x, data, out_features)  # noqa: E731
            tiled = lambda: backend.tiled_linear(x, weight, "q4_k")  # noqa: E731
            error = relative_error(fused().float(), (x @ dense.T).float())
            print(f"{out_features}x{in_features} rows {rows}: fused {median_ms(fused):.3f} ms, dequant tiles + "
                  f"cuBLAS {median_ms(tiled):.3f} ms, relative difference {error:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
