"""The Laguna family's own ops: references in plain torch, which a backend may replace by kernels.

They are named ops (`lucebox_core.ops`): the model calls them on `LAGUNA_OPS.bind(backend)`; each reference
takes `ops` first, so its calls to generic ops (`linear`, `rms_norm`, `silu_mul`...) go to the backend's
kernels. Conventions: token-major `[B, T, H, D]`; expert stacks `[E, rows, cols]` as in the GGUF. The routed
SwiGLU experts are the core's generic `moe_experts_swiglu` (Qwen3.5-MoE runs the same products).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lucebox_core.ops import OpSet

LAGUNA_OPS = OpSet("laguna")


@LAGUNA_OPS.reference
def rope_scaled(ops: Any, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                attention_factor: float) -> torch.Tensor:
    """NeoX RoPE on the first `2 * len(inv_freq)` dims of each head (pair j = dims (j, j + len(inv_freq))),
    those dims also multiplied by `attention_factor` (YaRN's magnitude scale; transformers multiplies cos and
    sin by it), the other dims passed through unscaled. x `[B, T, H, D]`, positions `[T]`, inv_freq fp32."""
    half = inv_freq.shape[0]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, half]
    cos = (angles.cos() * attention_factor)[None, :, None, :]
    sin = (angles.sin() * attention_factor)[None, :, None, :]
    xf = x.float()
    first, second, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)
    return rotated.to(x.dtype)


@LAGUNA_OPS.reference
def qk_norm_rope_scaled(
    ops: Any, query: torch.Tensor, key: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k RMS-normed per head (standard `w * x`), then rotated by `rope_scaled`."""
    query = ops.rope_scaled(ops.rms_norm(query, q_norm, eps), positions, inv_freq, attention_factor)
    key = ops.rope_scaled(ops.rms_norm(key, k_norm, eps), positions, inv_freq, attention_factor)
    return query, key


@LAGUNA_OPS.reference
def softplus_head_gate(ops: Any, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Laguna's per-head attention output gate: `out [B, T, H, D] * softplus(gate [B, T, H])` (softplus in fp32)."""
    return out * F.softplus(gate.float()).to(out.dtype)[..., None]


@LAGUNA_OPS.reference
def gated_tree_attention(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor,
                         visible: torch.Tensor, gate: torch.Tensor, *, scale: float,
                         node_k: torch.Tensor | None = None, node_v: torch.Tensor | None = None,
                         ring: int = 0) -> torch.Tensor:
    """The generic `tree_attention` (the static decode step's attention: one node), then the per-head output
    gate `softplus_head_gate` with `gate` `[1, N, H]`. One op so that a backend can apply the gate where the
    attention writes its output (one launch fewer a layer)."""
    out = ops.tree_attention(q, k, v, position, visible, scale=scale, node_k=node_k, node_v=node_v, ring=ring)
    return ops.softplus_head_gate(out, gate)


@LAGUNA_OPS.reference
def sigmoid_route(ops: Any, x: torch.Tensor, proj: Any, selection_bias: torch.Tensor, top_k: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Laguna's router on the normed input `x` `[T, hidden]`: scores `sigmoid(x proj^T)` in fp32; the experts
    chosen by the top `top_k` of `scores + selection_bias` (the bias only chooses); their scores renormalised
    to sum 1 and multiplied by `scale` (the routed sum's factor, 2.5). Weights `[T, top_k]` fp32, ids long."""
    scores = torch.sigmoid(ops.linear(x, proj).float())
    _, ids = torch.topk(scores + selection_bias.float(), top_k, dim=-1)
    weights = scores.gather(-1, ids)
    return weights / weights.sum(dim=-1, keepdim=True) * scale, ids
