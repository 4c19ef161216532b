"""Prefill products straight from Q4_K blocks (lucebox_cuda.triton_quant_matmul) against the dequantized
product, run on the CPU by Triton's interpreter: random blocks (every byte random but finite d and dmin, so
every 6-bit scale and min pattern occurs), the project's decoder and gguf's numpy one as references, shapes
that are not whole tiles."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module is first imported

import numpy as np
import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")

import torch
from gguf import GGMLQuantizationType, quants
from lucebox_cuda import triton_quant_matmul
from triton.runtime.interpreter import InterpretedFunction

from lucebox_core.quants import dequantize

if not isinstance(triton_quant_matmul._q4_k_matmul_kernel, InterpretedFunction):
    pytest.skip("lucebox_cuda.triton_quant_matmul was imported earlier without TRITON_INTERPRET=1",
                allow_module_level=True)

Q4_K = GGMLQuantizationType.Q4_K


def random_q4_k(out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Raw Q4_K bytes of an `[out_features, in_features]` matrix: random scales, mins and quants, and small
    positive or negative fp16 d / dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out_features * in_features // 256, 144), dtype=np.uint8)
    halves = (rng.standard_normal((blocks.shape[0], 2)) * 1e-3).astype(np.float16)
    blocks[:, 0:4] = halves.view(np.uint8).reshape(-1, 4)
    return blocks.reshape(-1)


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(5, 40, 512), (70, 24, 256), (1, 64, 768)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q4_k_matmul_matches_the_dequantized_product(rows, out_features, in_features, dtype):
    raw = random_q4_k(out_features, in_features, seed=rows + out_features)
    data = torch.from_numpy(raw.copy())
    dense = dequantize(data, Q4_K, (out_features, in_features))
    # gguf's numpy decoder agrees with the project's (the reference is independent of the kernel's reading).
    np.testing.assert_array_equal(quants.dequantize(raw, Q4_K).reshape(out_features, in_features), dense.numpy())
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
    config = triton_quant_matmul.MatmulConfig(16, 16, 4, 1)  # several tiles each way even at these sizes
    result = triton_quant_matmul.q4_k_matmul(x, data, out_features, config)
    expected = x.float() @ dense.to(dtype).float().T  # weights rounded to the activation dtype, as the tile is
    assert result.dtype == dtype and result.shape == (rows, out_features)
    error = ((result.float() - expected).norm() / expected.norm()).item()
    assert error < 1e-2


def test_q4_k_matmul_refuses_what_it_does_not_take():
    data = torch.zeros(144 * 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 256"):
        triton_quant_matmul.q4_k_matmul(torch.zeros(2, 300, dtype=torch.bfloat16), data, 4)
    with pytest.raises(ValueError, match="not a Q4_K"):
        triton_quant_matmul.q4_k_matmul(torch.zeros(2, 256, dtype=torch.bfloat16), data, 5)
