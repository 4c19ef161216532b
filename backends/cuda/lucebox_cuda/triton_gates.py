"""Triton kernels for a gated-attention, sigmoid-routed MoE decoder's small ops (Laguna's names).

Written as torch ops, each of these is a chain of launches that in a 40-layer decode step costs more than
its bytes: the router's sigmoid, bias, top-k (a sort), gather, sum and division are eight; the per-head
output gate's softplus, cast and product four. One program per token (router) or per token and head (gate):

- `sigmoid_topk`: after the router's product, `scores = sigmoid(logits)` in fp32, the top `top_k` of
  `scores + selection_bias` (the bias only chooses), their scores renormalised to sum 1 and times `scale`;
- `softplus_head_gate`: `out * softplus(gate)` per head, softplus in fp32 rounded to the activation dtype
  before the product, as the two-op reference.

Roundings follow the torch references in `lucebox_laguna.ops`. The top-k takes the k-th largest on the k-th
pass (`top_k_passes`: descending, the lowest index among equals, as torch.topk on distinct values). Every
wrapper runs under `TRITON_INTERPRET=1` on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import _device_scope

SOFTPLUS_THRESHOLD = 20.0  # torch's default: above it softplus(x) is x


FLOAT_LOWEST = tl.constexpr(-3.4028234663852886e38)  # fp32's lowest finite: a NaN score's place in the order


@triton.jit
def top_k_passes(choice, cols, ok, experts, TOP_K: tl.constexpr):
    """The TOP_K largest of `choice` [BLOCK_E] -> their ids [TOP_K] int64, descending, the lowest index among
    equals (torch.topk on distinct values, a stable sort on ties): one (value, index) reduction a pass.

    A NaN or -inf score ranks below every real one but above a taken or padding slot (-inf), so even a row of
    NaN (a NaN hidden state) routes to TOP_K distinct real experts, never to an id past the stack. Session 22
    tried counting each expert's rank in one pass of [E, E] comparisons instead: on the H200 the one-launch
    router went from 7.7 to 11.4 us a layer, so the passes stay."""
    remaining = tl.where(ok, tl.where(choice >= FLOAT_LOWEST, choice, FLOAT_LOWEST), -float("inf"))
    slots = tl.arange(0, TOP_K)
    ids = tl.zeros([TOP_K], dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        index = tl.argmax(remaining, axis=0, tie_break_left=True)
        ids = tl.where(slots == k, index.to(tl.int64), ids)
        remaining = tl.where(cols == index, -float("inf"), remaining)
    return tl.minimum(ids, experts - 1)


@triton.jit
def sigmoid_topk_row(logits_ptr, bias_ptr, experts, scale, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token's routing from its logits row in memory -> (weights [TOP_K] fp32, ids [TOP_K] int64). The
    loads bypass L1 (`.cg`): `triton_router` calls this on logits other programs have just written."""
    cols = tl.arange(0, BLOCK_E)
    ok = cols < experts
    logits = tl.load(logits_ptr + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    choice = tl.sigmoid(logits) + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    ids = top_k_passes(choice, cols, ok, experts, TOP_K)
    # The chosen scores read back and put through the same sigmoid: the very values above, without the bias.
    values = tl.sigmoid(tl.load(logits_ptr + ids, cache_modifier=".cg").to(tl.float32))
    total = tl.sum(values, axis=0)
    return values / total * scale, ids


@triton.jit
def _sigmoid_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, experts, logits_row, scale,
                         TOP_K: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0)
    slots = tl.arange(0, TOP_K)
    weights, ids = sigmoid_topk_row(logits_ptr + row * logits_row, bias_ptr, experts, scale, TOP_K, BLOCK_E)
    tl.store(weights_ptr + row * TOP_K + slots, weights)
    tl.store(ids_ptr + row * TOP_K + slots, ids)


def sigmoid_topk(logits: torch.Tensor, selection_bias: torch.Tensor, top_k: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its product: logits `[T, E]` (any float dtype, rows may be strided) -> weights
    `[T, k]` fp32 and ids `[T, k]` long, descending by `sigmoid(logits) + selection_bias`."""
    tokens, experts = logits.shape
    if selection_bias.numel() != experts or top_k <= 0 or top_k & (top_k - 1) or top_k > experts:
        raise ValueError(f"sigmoid_topk: {experts} experts, bias {tuple(selection_bias.shape)}, top_k {top_k}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
    if tokens:
        with _device_scope(logits):
            _sigmoid_topk_kernel[(tokens,)](logits, selection_bias.to(torch.float32).contiguous(), weights, ids,
                                            experts, logits.stride(0), float(scale),
                                            TOP_K=top_k, BLOCK_E=triton.next_power_of_2(experts))
    return weights, ids


@triton.jit
def softplus_fp32(x, threshold):
    """torch's softplus of fp32 `x`: x above `threshold`, else log1p(exp(x)). log1p(u) as log(w) * u / (w - 1),
    w = 1 + u (exact where w rounds to 1: then u): accurate for tiny u, and the interpreter has no libdevice.
    Shared with `triton_gdn_glue`'s Gated DeltaNet gates."""
    u = tl.exp(x)
    w = 1.0 + u
    # The unused branch divides by 1, not 0 (no inf * 0 left behind in masked-off lanes).
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.where(x > threshold, x, log1p)


@triton.jit
def _softplus_head_gate_kernel(out_ptr, gate_ptr, res_ptr, heads, head_dim, out_token, out_head, gate_token,
                               threshold, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    ok = dims < head_dim
    dtype = res_ptr.dtype.element_ty
    g = tl.load(gate_ptr + token * gate_token + head).to(tl.float32)
    soft = softplus_fp32(g, threshold).to(dtype).to(tl.float32)
    x = tl.load(out_ptr + token * out_token + head * out_head + dims, mask=ok, other=0.0).to(tl.float32)
    tl.store(res_ptr + (token * heads + head) * head_dim + dims, (x * soft).to(dtype), mask=ok)


def softplus_head_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`out [B, T, H, D] * softplus(gate [B, T, H])` per head -> a new contiguous tensor like `out`. The
    leading dims of each must merge into one token stride (views of a projection's output do)."""
    *lead, heads, head_dim = out.shape
    if tuple(gate.shape) != (*lead, heads) or out.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError(f"softplus_head_gate shapes: out {tuple(out.shape)}, gate {tuple(gate.shape)}")
    tokens = out.numel() // max(heads * head_dim, 1)
    flat_out = out.reshape(tokens, heads, head_dim)  # a view where the leading dims merge, else a copy
    flat_gate = gate.reshape(tokens, heads)
    result = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    if tokens and heads:
        with _device_scope(out):
            _softplus_head_gate_kernel[(tokens, heads)](
                flat_out, flat_gate, result, heads, head_dim, flat_out.stride(0), flat_out.stride(1),
                flat_gate.stride(0), SOFTPLUS_THRESHOLD, BLOCK_D=triton.next_power_of_2(head_dim))
    return result
