"""The sandwich-norm kernels (lucebox_cuda.triton_norms: Gemma-4's norm chains, GeGLU, soft-cap, router)
against the family's torch references, run on the CPU by Triton's interpreter, on random inputs."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module is first imported

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")

import torch
from lucebox_cuda import triton_norms
from triton.runtime.interpreter import InterpretedFunction

from lucebox_core.torch_backend import TorchBackend
from lucebox_gemma4.ops import GEMMA4_OPS

if not isinstance(triton_norms._norm_sum_kernel, InterpretedFunction):
    pytest.skip("lucebox_cuda.triton_norms was imported earlier without TRITON_INTERPRET=1", allow_module_level=True)

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def reference(dtype: torch.dtype):
    return GEMMA4_OPS.bind(TorchBackend("cpu", dtype, kernel_table_for={}))


def assert_close(result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert result.dtype == expected.dtype and result.shape == expected.shape
    assert torch.isfinite(result).all()
    # bf16: within a few ulps (Triton's interpreter truncates to bf16 where the GPU rounds to nearest, so
    # bit equality is checked on the GPU, `scripts/gemma4_gpu_check.py`).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)
    torch.testing.assert_close(result, expected, **tol)


def strided_pair(rows: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two halves of one stacked projection output (strided views, as the model passes them)."""
    both = (torch.randn(1, rows, 2 * n, generator=gen) * 3).to(dtype)
    return both[..., :n], both[..., n:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("scalar", "next_norm"), [(False, False), (True, True), (False, True)])
def test_post_norm_residual(dtype, scalar, next_norm):
    gen = torch.Generator().manual_seed(1)
    n = 320  # not a power of two
    x, _ = strided_pair(5, n, dtype, gen)
    residual = torch.randn(1, 5, n, generator=gen).to(dtype)
    post = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    scale = torch.tensor([0.37]).to(dtype) if scalar else None
    follow = (torch.rand(n, generator=gen) + 0.5).to(dtype) if next_norm else None
    hidden, normed = triton_norms.post_norm_residual(x, residual, post, EPS, scale, follow)
    want_hidden, want_normed = reference(dtype).post_norm_residual(x, residual, post, EPS, scale, follow)
    assert_close(hidden, want_hidden, dtype)
    if next_norm:
        assert_close(normed, want_normed, dtype)
    else:
        assert normed is None and want_normed is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_sum(dtype):
    gen = torch.Generator().manual_seed(2)
    a, b = strided_pair(7, 256, dtype, gen)
    wa, wb = ((torch.rand(256, generator=gen) + 0.5).to(dtype) for _ in range(2))
    assert_close(triton_norms.norm_sum(a, wa, b, wb, EPS), reference(dtype).norm_sum(a, wa, b, wb, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotated", "shared_kv"), [(64, 32, False), (128, 16, True), (48, 24, False)])
def test_qkv_norm_rope(dtype, head_dim, rotated, shared_kv):
    """Sliding-like heads (every pair turns), and full-like ones (few pairs turn, V is the raw K)."""
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 3, 4, 2
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    projected = (torch.randn(1, tokens, q_size + 2 * kv_size, generator=gen) * 2).to(dtype)
    query = projected[..., :q_size].reshape(1, tokens, heads, head_dim)
    key = projected[..., q_size:q_size + kv_size].reshape(1, tokens, kv_heads, head_dim)
    value = key if shared_kv else projected[..., q_size + kv_size:].reshape(1, tokens, kv_heads, head_dim)
    q_norm, k_norm = ((torch.rand(head_dim, generator=gen) + 0.5).to(dtype) for _ in range(2))
    v_norm = torch.ones(head_dim, dtype=dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    inv_freq[rotated:] = 1e-30 * inv_freq[rotated:]  # llama.cpp's 1e30 divisors of the unrotated pairs
    positions = torch.tensor([5, 1000, 70000])
    got = triton_norms.qkv_norm_rope(query, key, value, q_norm, k_norm, v_norm, positions, inv_freq, EPS)
    want = reference(dtype).qkv_norm_rope(query, key, value, q_norm, k_norm, v_norm, positions, inv_freq, EPS)
    for result, expected in zip(got, want, strict=True):
        # RoPE angles at position 70,000 carry fp32 roundoff of ~1e-3 rad between cos/sin implementations.
        torch.testing.assert_close(result.float(), expected.float(), atol=3e-2 if dtype == torch.bfloat16 else 2e-3,
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul(dtype):
    gen = torch.Generator().manual_seed(3)
    gate, up = strided_pair(4, 1500, dtype, gen)  # more than one column block
    assert_close(triton_norms.gelu_tanh_mul(gate, up), reference(dtype).gelu_tanh_mul(gate, up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap(dtype):
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(1, 3000, generator=gen) * 40).to(dtype)  # past the cap both ways, and near 0
    logits[0, :3] = torch.tensor([0.0, 1e-4, -500.0]).to(dtype)
    got = triton_norms.softcap(logits, 30.0)
    assert got.abs().max() <= 30.0
    assert_close(got, reference(dtype).softcap(logits, 30.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (128, 8), (12, 4)])
def test_router_matches_moe_route(dtype, experts, top_k):
    """The router's norm, then (after the product) softmax, top-k, renormalisation and per-expert scale."""
    gen = torch.Generator().manual_seed(experts)
    hidden = 192
    h = (torch.randn(6, hidden, generator=gen) * 5).to(dtype)
    scale = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    proj = (torch.randn(experts, hidden, generator=gen)).to(dtype)
    per_expert_scale = torch.rand(experts, generator=gen) + 0.5
    ops = reference(dtype)
    want_weights, want_ids = ops.moe_route(h, proj, scale, per_expert_scale, top_k, EPS)
    h32 = h.float()
    router_input = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS) * scale.float() * hidden**-0.5).to(dtype)
    assert_close(triton_norms.router_norm(h, scale, EPS), router_input, dtype)
    logits = ops.linear(router_input, proj)  # the reference's own input: ids must then agree exactly
    weights, ids = triton_norms.softmax_topk(logits, per_expert_scale, top_k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 96])
def test_l2norm_matches_the_generic_reference(dtype, head_dim):
    """The generic `l2norm` op's kernel (Qwen3.5's Gated DeltaNet q and k in prefill) against
    `TorchBackend.l2norm`, on a strided view as the model passes it (a head split of a projection)."""
    gen = torch.Generator().manual_seed(head_dim)
    both = (torch.randn(1, 7, 4, 2 * head_dim, generator=gen) * 3).to(dtype)
    x = both[..., :head_dim]
    result = triton_norms.l2norm(x, EPS)
    expected = TorchBackend("cpu", dtype, kernel_table_for={}).l2norm(x, EPS)
    assert_close(result, expected, dtype)
    norms = result.float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("layout", ["conv split", "heads apart", "unmergeable", "one row"])
def test_l2norm_reads_head_splits_at_their_strides(layout):
    """The model's q and k: head splits of the convolution's output [B, T, C] reshaped to [B, T, H, D] (read in
    place); also heads apart, leading dims that do not merge (copied first) and one row. Each row must equal the
    reference's, the result contiguous."""
    gen = torch.Generator().manual_seed(3)
    heads, dim = 4, 32
    conv = torch.randn(2, 5, 3 * heads * dim + 16, generator=gen).to(torch.bfloat16)
    if layout == "conv split":
        x = conv[..., heads * dim: 2 * heads * dim].reshape(2, 5, heads, dim)
        assert x.stride(-2) == dim and not x.is_contiguous()  # the view the kernel reads in place
    elif layout == "heads apart":
        x = conv[..., : 2 * heads * dim].reshape(2, 5, heads, 2 * dim)[..., :dim]
    elif layout == "unmergeable":
        x = conv[..., : heads * dim].reshape(2, 5, heads, dim).transpose(0, 1)
    else:
        x = conv[0, 0, :dim]
    result = triton_norms.l2norm(x, EPS)
    assert result.shape == x.shape and result.is_contiguous()
    expected = TorchBackend("cpu", torch.bfloat16, kernel_table_for={}).l2norm(x, EPS)
    assert_close(result, expected, torch.bfloat16)
