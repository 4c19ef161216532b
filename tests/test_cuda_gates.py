"""Laguna's small ops (and Qwen3.5-MoE's router) as the CUDA backend's Triton kernels (lucebox_cuda.triton_gates, and the generic q/k
norm + RoPE kernel with YaRN's scale) against the family's torch references, run on the CPU by Triton's
interpreter, on random inputs; and a tiny Laguna model on the CUDA backend's kernel table for these ops
giving the reference's greedy tokens."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules are first imported

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")

import torch
from lucebox_cuda import norm_kernels, triton_attention, triton_fused, triton_gates, triton_norms
from triton.runtime.interpreter import InterpretedFunction

from lucebox_core.torch_backend import TorchBackend
from lucebox_laguna.ops import LAGUNA_OPS
from lucebox_qwen35.ops import QWEN35_OPS

if not isinstance(triton_gates._sigmoid_topk_kernel, InterpretedFunction) or not isinstance(
        triton_fused._qk_norm_rope_kernel, InterpretedFunction) or not isinstance(
        triton_attention._path_attention_split_kernel, InterpretedFunction):
    pytest.skip("the Triton kernels were imported earlier without TRITON_INTERPRET=1", allow_module_level=True)

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def reference(dtype: torch.dtype):
    return LAGUNA_OPS.bind(TorchBackend("cpu", dtype, kernel_table_for={}))


def assert_close(result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert result.dtype == expected.dtype and result.shape == expected.shape
    assert torch.isfinite(result).all()
    # bf16: within a few ulps (the interpreter truncates to bf16 where the GPU rounds to nearest).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)
    torch.testing.assert_close(result, expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("experts", "top_k", "tokens"), [(256, 8, 3), (48, 4, 5), (16, 1, 1)])
def test_sigmoid_route(dtype, experts, top_k, tokens):
    """The fused router equals the reference: the same experts in the same order, weights within fp32
    roundoff (the bias shifts the choice away from the plain top scores)."""
    gen = torch.Generator().manual_seed(experts + top_k)
    hidden = 64
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    proj = (torch.randn(experts, hidden, generator=gen) * 0.2).to(dtype)
    bias = torch.randn(experts, generator=gen) * 0.05
    ops = reference(dtype)
    want_weights, want_ids = ops.sigmoid_route(x, proj, bias, top_k, 2.5)
    weights, ids = triton_gates.sigmoid_topk(ops.linear(x, proj), bias, top_k, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-6)
    assert not torch.equal(ids, torch.topk(torch.sigmoid(ops.linear(x, proj).float()), top_k).indices) or top_k == 1 \
        or bias.abs().max() == 0  # the bias changed some choice: the kernel adds it


@pytest.mark.parametrize("experts", [256, 40])
def test_the_top_k_breaks_ties_toward_the_lower_index(experts):
    """Both routers' top-k (`triton_gates.top_k_passes`) on rows full of exact ties (logits from a handful of
    values, bf16-like): the chosen experts are the first TOP_K of a stable descending sort, in that order,
    as torch's stable sort gives."""
    gen = torch.Generator().manual_seed(experts)
    tokens, top_k = 4, 8
    logits = torch.randint(0, 5, (tokens, experts), generator=gen).float() * 0.25
    bias = torch.randint(0, 2, (experts,), generator=gen).float() * 0.5
    weights, ids = triton_gates.sigmoid_topk(logits, bias, top_k, 1.0)
    choice = torch.sigmoid(logits) + bias
    want = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids, want)
    chosen = torch.sigmoid(logits.gather(1, want))
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True), atol=1e-6, rtol=1e-6)
    probs = torch.softmax(logits, dim=-1)
    weights, ids = triton_norms.softmax_topk(logits, None, top_k)
    want = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids, want)
    chosen = probs.gather(1, want)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True), atol=1e-6, rtol=1e-6)


def test_a_row_with_nan_still_routes_to_real_distinct_experts():
    """A NaN hidden state must not turn into an expert id past the stack (the expert kernels address weights
    by id): NaN ranks as -inf, so the ids stay distinct and in range, the NaN experts last."""
    experts, top_k = 40, 8
    logits = torch.randn(3, experts, generator=torch.Generator().manual_seed(5))
    logits[0, [3, 17]] = float("nan")
    logits[1] = float("nan")
    logits[2, 9] = float("inf")
    for weights, ids in (triton_gates.sigmoid_topk(logits, torch.zeros(experts), top_k, 1.0),
                         triton_norms.softmax_topk(logits, None, top_k)):
        assert ((ids >= 0) & (ids < experts)).all()
        assert all(len(set(row.tolist())) == top_k for row in ids)
    weights, ids = triton_gates.sigmoid_topk(logits, torch.zeros(experts), top_k, 1.0)
    assert not {3, 17} & set(ids[0].tolist())  # finite scores come before NaN ones
    assert ids[1].tolist() == list(range(top_k))  # all NaN: by index


def test_sigmoid_route_refuses_bad_shapes():
    with pytest.raises(ValueError, match="top_k 3"):
        triton_gates.sigmoid_topk(torch.randn(2, 16), torch.zeros(16), 3, 1.0)
    with pytest.raises(ValueError, match="bias"):
        triton_gates.sigmoid_topk(torch.randn(2, 16), torch.zeros(8), 4, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softplus_head_gate(dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_dim = 4, 6, 48
    out = torch.randn(1, tokens, heads, head_dim, generator=gen).to(dtype)
    gate = (torch.randn(1, tokens, heads, generator=gen) * 8).to(dtype)
    gate[0, 0, 0], gate[0, 1, 1], gate[0, 2, 2] = 25.0, -30.0, 20.0  # above, far below and at the threshold
    # a strided gate, as a slice of a fused projection's output
    wide = torch.randn(1, tokens, heads + 5, generator=gen).to(dtype)
    wide[..., :heads] = gate
    for g in (gate, wide[..., :heads]):
        assert_close(triton_gates.softplus_head_gate(out, g), reference(dtype).softplus_head_gate(out, g), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotated", "factor"), [(128, 64, 1.1386), (64, 64, 1.0), (48, 16, 0.8)])
def test_qk_norm_rope_scaled(dtype, head_dim, rotated, factor):
    """Partial rotation with YaRN's magnitude on the rotated dims only, from strided projection slices."""
    gen = torch.Generator().manual_seed(head_dim + rotated)
    tokens, heads, kv_heads = 3, 4, 2
    both = torch.randn(1, tokens, (heads + kv_heads) * head_dim, generator=gen).to(dtype) * 3
    query = both[..., : heads * head_dim].reshape(1, tokens, heads, head_dim)
    key = both[..., heads * head_dim :].reshape(1, tokens, kv_heads, head_dim)
    q_norm, k_norm = ((torch.rand(head_dim, generator=gen) + 0.5).to(dtype) for _ in range(2))
    positions = torch.tensor([5, 900, 31000])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotated, 2, dtype=torch.float32) / rotated)) * 0.7
    args = (query, key, q_norm, k_norm, positions, inv_freq, factor, EPS)
    want_q, want_k = reference(dtype).qk_norm_rope_scaled(*args)
    got_q, got_k = triton_fused.qk_norm_rope(query, key, q_norm, k_norm, positions, rotated, 0.0, EPS,
                                             inv_freq=inv_freq, attention_factor=factor)
    assert_close(got_q, want_q, dtype)
    assert_close(got_k, want_k, dtype)
    if factor != 1.0:  # the factor reaches the rotated dims only
        plain_q, _ = triton_fused.qk_norm_rope(query, key, q_norm, k_norm, positions, rotated, 0.0, EPS,
                                               inv_freq=inv_freq)
        assert torch.equal(got_q[..., rotated:], plain_q[..., rotated:])
        assert not torch.allclose(got_q[..., :rotated].float(), plain_q[..., :rotated].float())


def test_the_backend_takes_the_ops():
    """The kernel table's accept checks take the model's shapes (so a Laguna decode step runs these kernels)."""
    ops = TorchBackend("cpu", torch.float32, kernel_table_for={})
    x, bias = torch.randn(1, 32), torch.zeros(16)
    assert norm_kernels.accepts_sigmoid_route(ops, x, None, bias, 4, 2.5)
    assert not norm_kernels.accepts_sigmoid_route(ops, x, None, bias, 3, 2.5)
    out, gate = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4)
    assert norm_kernels.accepts_softplus_head_gate(ops, out, gate)
    assert not norm_kernels.accepts_softplus_head_gate(ops, out, torch.randn(1, 1, 3))
    q, k = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 2, 16)
    w, pos, freq = torch.ones(16), torch.tensor([3]), torch.ones(4)
    assert norm_kernels.accepts_qk_norm_rope_scaled(ops, q, k, w, w, pos, freq, 1.5, EPS)
    assert not norm_kernels.accepts_qk_norm_rope_scaled(ops, q, k, w, w, pos, torch.ones(9), 1.5, EPS)


# (query heads, KV heads, window rows, committed position, ring): a full layer's window, a sliding layer's
# ring that has wrapped and one not yet full (the decode step's one node, its row beside the cache).
GATED_CASES = [(8, 2, 96, 70, 0), (8, 2, 32, 75, 32), (6, 3, 64, 20, 64)]


@pytest.mark.parametrize(("q_heads", "kv_heads", "rows", "position", "ring"), GATED_CASES)
def test_gated_tree_attention(q_heads, kv_heads, rows, position, ring):
    """The gate applied in the attention's merge equals the two ops: to the reference within roundoff (fp32),
    and to the kernels' own attention then gate kernel bit for bit (f16, where every rounding shows)."""
    gen = torch.Generator().manual_seed(rows + position + ring)
    dim = 32
    one_node = torch.ones(1, 1, dtype=torch.bool)
    pos = torch.tensor([position])
    for dtype in (torch.float32, torch.float16):
        q = torch.randn(1, 1, q_heads, dim, generator=gen).to(dtype)
        k, v = (torch.randn(rows, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
        node_k, node_v = (torch.randn(1, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
        gate = (torch.randn(1, 1, q_heads, generator=gen) * 3).to(dtype)  # softplus over its curved part
        extra = {"node_k": node_k, "node_v": node_v, "ring": ring} if ring else {}
        window_k, window_v = (k, v) if ring else (k[:position + 1], v[:position + 1])
        fused = triton_attention.tree_attention(q, window_k, window_v, pos, one_node, scale=0.25, head_gate=gate,
                                                block_n=16, blocks_per_split=1, **extra)
        if dtype == torch.float32:
            ops = reference(dtype)
            want = ops.gated_tree_attention(q, window_k, window_v, pos, one_node, gate, scale=0.25, **extra)
            assert_close(fused, want, dtype)
        else:
            plain = triton_attention.tree_attention(q, window_k, window_v, pos, one_node, scale=0.25, block_n=16,
                                                    blocks_per_split=1, **extra)
            assert torch.equal(fused, triton_gates.softplus_head_gate(plain, gate))
            assert not torch.equal(fused, plain)


def test_the_model_takes_the_gated_attention_kernel():
    """Laguna's decode step shapes (the gate a slice of the fused projection's output) are the kernel's."""
    ops = TorchBackend("cpu", torch.float32, kernel_table_for={})
    q, k, v = torch.randn(1, 1, 8, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    projected = torch.randn(1, 1, 8 * 16 + 8)
    gate = projected[..., 8 * 16 :]
    args = (q, k, v, torch.tensor([30]), torch.ones(1, 1, dtype=torch.bool))
    assert norm_kernels.accepts_gated_tree_attention(ops, *args, gate, scale=0.25)
    assert not norm_kernels.accepts_gated_tree_attention(ops, *args, torch.randn(1, 1, 7), scale=0.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("experts", "top_k", "tokens"), [(256, 8, 3), (64, 4, 5)])
def test_softmax_topk_route(dtype, experts, top_k, tokens):
    """Qwen3.5-MoE's router on the router kernel without a per-expert scale: the reference's experts, in order,
    and its renormalised weights within fp32 roundoff."""
    gen = torch.Generator().manual_seed(experts * top_k)
    x = torch.randn(tokens, 64, generator=gen).to(dtype)
    proj = (torch.randn(experts, 64, generator=gen) * 0.3).to(dtype)
    ops = QWEN35_OPS.bind(TorchBackend("cpu", dtype, kernel_table_for={}))
    want_weights, want_ids = ops.softmax_topk_route(x, proj, top_k)
    weights, ids = triton_norms.softmax_topk(ops.linear(x, proj), None, top_k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-6)
    assert norm_kernels.accepts_softmax_topk_route(ops, x, proj, top_k)
    assert not norm_kernels.accepts_softmax_topk_route(ops, x, proj, 3)
