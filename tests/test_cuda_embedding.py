"""The embedding lookup on the GPU (skipped without a CUDA device): one dequant kernel over the rows the device ids
name (`CudaBackend.lookup_rows`, the `embedding` op) against gguf's own numpy dequantization, each weight format
the kernels decode, bf16 and f32, ids repeated and out of order; and recorded in a graph, it follows the ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _table(ggml_type, rows, cols, seed):
    from lucebox_core.kquants import random_blocks
    from lucebox_core.quants import QuantTensor

    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    if ggml_type in (Q.Q4_K, Q.Q6_K):  # gguf's numpy code decodes the K-quants but does not encode them
        raw = random_blocks(ggml_type, rows * cols, 0.05, rng)
    else:
        raw = quants.quantize(values, ggml_type) if ggml_type != Q.F32 else values
    data = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8).copy())
    return QuantTensor("token_embd.weight", ggml_type, (rows, cols), data), quants.dequantize(
        np.ascontiguousarray(raw).reshape(-1).view(np.uint8), ggml_type).reshape(rows, cols)


@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F16, Q.F32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_matches_gguf(ggml_type, dtype):
    from lucebox_cuda.backend import CudaBackend

    ops = CudaBackend(dtype=dtype)
    table, dense = _table(ggml_type, 300, 512, seed=int(ggml_type))
    ids = torch.tensor([[7, 299, 0], [7, 150, 3]], device="cuda")
    got = ops.embedding(ids, table)
    assert got.shape == (2, 3, 512) and got.dtype == dtype
    expected = torch.from_numpy(dense[ids.cpu().numpy()]).to(dtype)
    # f32: the kernel's fp32 affine map against numpy's, ulps of the block's scale apart; bf16: a rounding
    # either side (an ulp where the fp32 values straddle a rounding boundary).
    relative = 1e-6 if dtype == torch.float32 else 2**-8
    assert (got.cpu().double() - expected.double()).abs().max() <= relative * np.abs(dense).max()
    assert (got.cpu().double() - expected.double()).abs().mean() <= relative * np.abs(dense).mean()


def test_recorded_lookup_follows_the_ids():
    from lucebox_cuda.backend import CudaBackend

    ops = CudaBackend(dtype=torch.bfloat16)
    table, _ = _table(Q.Q4_K, 64, 256, seed=1)
    ids = torch.tensor([3], device="cuda")
    ops.embedding(ids, table)  # compiles and uploads outside the recording
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.embedding(ids, table)
    for token in (5, 63, 0):
        ids.fill_(token)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ops.embedding(torch.tensor([token], device="cuda"), table))
    assert not torch.equal(out, ops.embedding(torch.tensor([5], device="cuda"), table))
