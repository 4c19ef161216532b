"""The Gemma-4 family's own ops: references in plain torch, which a backend may replace by kernels.

They are named ops (`lucebox_core.ops`): the model calls them on `GEMMA4_OPS.bind(backend)`; a backend that
registers a kernel under the same name (`lucebox_op_kernels`) runs it wherever its check accepts the
arguments. Each reference takes `ops` first, so its calls to generic ops (`linear`, `rms_norm`...) go to the
backend's kernels too.

Conventions: token-major `[B, T, H, D]`; expert tensors `[E, rows, cols]` as in the GGUF (`ffn_gate_up_exps`
rows are `[gate | up]` halves of each expert).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lucebox_core.ops import OpSet

GEMMA4_OPS = OpSet("gemma4")


@GEMMA4_OPS.reference
def gelu_tanh_mul(ops: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU: `gelu_tanh(gate) * up` (transformers' `gelu_pytorch_tanh`, ggml's GELU)."""
    return F.gelu(gate, approximate="tanh") * up


@GEMMA4_OPS.reference
def rope_neox_freqs(ops: Any, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE over the whole head with explicit frequencies: x `[B, T, H, D]`, positions `[T]`,
    inv_freq `[D / 2]` fp32 (pair j = dims (j, j + D/2) turns by `position * inv_freq[j]`; a zero or
    vanishing frequency leaves its pair as it is: Gemma-4's full layers rotate only their first pairs)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    xf = x.float()
    first, second = xf.chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.to(x.dtype)


@GEMMA4_OPS.reference
def qkv_norm_rope(
    ops: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
    v_norm: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention inputs of a layer: q and k RMS-normed per head then rotated (`rope_neox_freqs`), v
    RMS-normed per head (`v_norm`: ones, v's norm has no weight). query `[B, T, H, D]`, key and value
    `[B, T, Hkv, D]` (value may be key itself: full layers without `attn_v`)."""
    query = ops.rope_neox_freqs(ops.rms_norm(query, q_norm, eps), positions, inv_freq)
    rotated_key = ops.rope_neox_freqs(ops.rms_norm(key, k_norm, eps), positions, inv_freq)
    return query, rotated_key, ops.rms_norm(value, v_norm, eps)


@GEMMA4_OPS.reference
def post_norm_residual(
    ops: Any, x: torch.Tensor, residual: torch.Tensor, post_norm: torch.Tensor, eps: float,
    scalar: torch.Tensor | None = None, next_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gemma's sandwich-norm residual step: `hidden = (residual + rms_norm(x, post_norm)) * scalar` (no
    scalar: times 1), and the norm that reads it next, `rms_norm(hidden, next_norm)` (None without one)."""
    hidden = residual + ops.rms_norm(x, post_norm, eps)
    if scalar is not None:
        hidden = hidden * scalar
    return hidden, None if next_norm is None else ops.rms_norm(hidden, next_norm, eps)


@GEMMA4_OPS.reference
def norm_sum(ops: Any, a: torch.Tensor, a_norm: torch.Tensor, b: torch.Tensor, b_norm: torch.Tensor,
             eps: float) -> torch.Tensor:
    """`rms_norm(a, a_norm) + rms_norm(b, b_norm)`: the MoE block's dense and routed outputs, each post-normed."""
    return ops.rms_norm(a, a_norm, eps) + ops.rms_norm(b, b_norm, eps)


@GEMMA4_OPS.reference
def softcap(ops: Any, x: torch.Tensor, cap: float) -> torch.Tensor:
    """`tanh(x / cap) * cap` in fp32 (Gemma's final logit soft-capping), back in x's dtype."""
    return (torch.tanh(x.float() / cap) * cap).to(x.dtype)


@GEMMA4_OPS.reference
def moe_route(
    ops: Any, h: torch.Tensor, proj: Any, scale: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma-4's router on the residual `h` `[T, hidden]`: `rmsnorm(h) * scale / sqrt(hidden)` (a norm without
    weight), expert logits, softmax in fp32, the top `top_k` renormalised to sum 1, each times its
    expert's `per_expert_scale`. Returns weights `[T, top_k]` fp32 and expert ids `[T, top_k]` (long), all
    on the device (no host round trip)."""
    hidden = h.shape[-1]
    x = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)
    x = (x * scale.float() * hidden**-0.5).to(h.dtype)
    probs = torch.softmax(ops.linear(x, proj).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * per_expert_scale.float()[ids], ids


@GEMMA4_OPS.reference
def moe_experts(
    ops: Any, x: torch.Tensor, gate_up_exps: Any, down_exps: Any, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts: `sum_k weights[t, k] * down_e(gelu_tanh(gate_e(x)) * up_e(x))` with `e = ids[t, k]`,
    x `[T, hidden]`. The reference dequantizes the expert tensors (kept by the backend's weight cache)
    and runs each expert that any token picked on the tokens that picked it."""
    gate_up = ops.dense(gate_up_exps)  # [E, 2I, hidden]
    down = ops.dense(down_exps)  # [E, hidden, I]
    inter = down.shape[-1]
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(ids).tolist():
        token, slot = torch.where(ids == expert)
        gate, up = F.linear(x[token], gate_up[expert]).split([inter, inter], dim=-1)
        y = F.linear(ops.gelu_tanh_mul(gate, up), down[expert])
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)


@GEMMA4_OPS.reference
def moe_experts_paged(
    ops: Any, x: torch.Tensor, gate_up_exps: Any, down_exps: Any, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`moe_experts` over paged stacks (Spark's `ExpertPages`: a few experts in device slots, every expert in a
    host stack, a device table `where[e]`, the slot holding expert e or -1): expert e's blocks are slot
    `where[e]`'s where it is resident, else host row e; equal bit for bit to the op over the whole stacks. The
    reference gathers the chosen experts' rows (a host sync: no graph records it) and runs `moe_experts` on
    them, in the same expert order; it counts the routed pairs into the first stack's `counts`."""
    gate_up_exps.count(ids)
    chosen, local = torch.unique(ids, return_inverse=True)
    return ops.moe_experts(x, gate_up_exps.gather(chosen), down_exps.gather(chosen), weights, local.reshape(ids.shape))
