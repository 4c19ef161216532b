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
