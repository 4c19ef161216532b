"""The sandwich-norm decoder's ops `lucebox-cuda` runs as Triton kernels (`triton_norms`), each with its check.

These are op names a family defines (Gemma-4's `lucebox_gemma4.ops`: `qkv_norm_rope`, `post_norm_residual`,
`norm_sum`, `gelu_tanh_mul`, `softcap`, `moe_route`); the backend knows only the names and the reference's
signature, registered like every other kernel (`plugin.py`). Each `accepts_<op>` says whether the kernel
takes these arguments; where it does not, the family's reference runs.

At the end, the same for a gated-attention, sigmoid-routed MoE decoder (Laguna's `qk_norm_rope_scaled`,
`sigmoid_route`, `softplus_head_gate`, `gated_tree_attention`): `triton_gates`, the generic q/k norm + RoPE
kernel with a scale, and the path attention with the gate in its merge.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from lucebox_core.quants import QuantTensor

from .op_kernels import (
    _cache_attention,
    _optional,
    _rows_indexable,
    _triton_takes,
    accepts_tree_attention,
    triton_attention,
    triton_fused,
)

triton_norms = functools.cache(lambda: _optional("triton_norms"))

# The router kernel keeps a token's expert scores in registers: up to this many experts.
MAX_ROUTED_EXPERTS = 1024


def _available(ops: Any, *tensors: torch.Tensor) -> bool:
    return triton_norms() is not None and _triton_takes(ops, *tensors)


def accepts_qkv_norm_rope(ops: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_norm: torch.Tensor,
                          k_norm: torch.Tensor, v_norm: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                          eps: float) -> bool:
    return (_available(ops, query, key, value, q_norm, k_norm, v_norm, positions, inv_freq) and query.dim() == 4
            and query.shape[0] == 1 and key.shape == value.shape and key.shape[:2] == query.shape[:2]
            and key.shape[3] == query.shape[3] and inv_freq.numel() * 2 == query.shape[3]
            and all(t.stride(-1) == 1 for t in (query, key, value)))


def qkv_norm_rope(ops: Any, query, key, value, q_norm, k_norm, v_norm, positions, inv_freq, eps):
    return triton_norms().qkv_norm_rope(query, key, value, q_norm, k_norm, v_norm, positions, inv_freq, eps)


def accepts_post_norm_residual(ops: Any, x: torch.Tensor, residual: torch.Tensor, post_norm: torch.Tensor, eps: float,
                               scalar: torch.Tensor | None = None, next_norm: torch.Tensor | None = None) -> bool:
    extra = tuple(t for t in (scalar, next_norm) if t is not None)
    return (_available(ops, x, residual, post_norm, *extra) and x.shape == residual.shape and x.dtype == residual.dtype
            and (scalar is None or scalar.numel() == 1) and _rows_indexable(x, residual))


def post_norm_residual(ops: Any, x, residual, post_norm, eps, scalar=None, next_norm=None):
    return triton_norms().post_norm_residual(x, residual, post_norm, eps, scalar, next_norm)


def accepts_norm_sum(ops: Any, a: torch.Tensor, a_norm: torch.Tensor, b: torch.Tensor, b_norm: torch.Tensor,
                     eps: float) -> bool:
    return (_available(ops, a, a_norm, b, b_norm) and a.shape == b.shape and a.dtype == b.dtype
            and _rows_indexable(a, b))


def norm_sum(ops: Any, a, a_norm, b, b_norm, eps):
    return triton_norms().norm_sum(a, a_norm, b, b_norm, eps)


def accepts_gelu_tanh_mul(ops: Any, gate: torch.Tensor, up: torch.Tensor) -> bool:
    return _available(ops, gate, up) and gate.shape == up.shape and gate.dtype == up.dtype and _rows_indexable(gate, up)


def gelu_tanh_mul(ops: Any, gate, up):
    return triton_norms().gelu_tanh_mul(gate, up)


def accepts_softcap(ops: Any, x: torch.Tensor, cap: float) -> bool:
    return _available(ops, x) and cap > 0


def softcap(ops: Any, x, cap):
    return triton_norms().softcap(x, cap)


def accepts_moe_route(ops: Any, h: torch.Tensor, proj: Any, scale: torch.Tensor, per_expert_scale: torch.Tensor,
                      top_k: int, eps: float) -> bool:
    experts = per_expert_scale.numel()
    return (_available(ops, h, scale, per_expert_scale) and h.dim() == 2 and per_expert_scale.dtype == torch.float32
            and experts <= MAX_ROUTED_EXPERTS and 0 < top_k <= experts and top_k & (top_k - 1) == 0)


def moe_route(ops: Any, h, proj, scale, per_expert_scale, top_k, eps):
    """Three launches: the router's input norm, its product (the backend's `linear`), then softmax, top-k,
    renormalisation and per-expert scale in one kernel (torch's softmax and topk are a dozen)."""
    norms = triton_norms()
    logits = ops.linear(norms.router_norm(h, scale, eps), proj)
    return norms.softmax_topk(logits, per_expert_scale, top_k)


# -- a gated-attention, sigmoid-routed MoE decoder's ops (Laguna's names), in `triton_gates` ---------------

triton_gates = functools.cache(lambda: _optional("triton_gates"))
triton_router = functools.cache(lambda: _optional("triton_router"))


def accepts_qk_norm_rope_scaled(ops: Any, query: torch.Tensor, key: torch.Tensor, q_norm: torch.Tensor,
                                k_norm: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                                attention_factor: float, eps: float) -> bool:
    return (triton_fused() is not None and _triton_takes(ops, query, key, q_norm, k_norm, positions, inv_freq)
            and query.dim() == 4 and query.shape[0] == 1 and key.shape[:2] == query.shape[:2]
            and key.shape[3] == query.shape[3] and 2 * inv_freq.numel() <= query.shape[3]
            and query.stride(-1) == 1 and key.stride(-1) == 1)


def qk_norm_rope_scaled(ops: Any, query, key, q_norm, k_norm, positions, inv_freq, attention_factor, eps):
    """The generic q/k norm and RoPE kernel with the rotated dims' cos and sin times `attention_factor`."""
    return triton_fused().qk_norm_rope(query, key, q_norm, k_norm, positions, 2 * inv_freq.numel(), 0.0, eps,
                                       inv_freq=inv_freq.to(torch.float32), attention_factor=attention_factor)


def accepts_sigmoid_route(ops: Any, x: torch.Tensor, proj: Any, selection_bias: torch.Tensor, top_k: int,
                          scale: float) -> bool:
    experts = selection_bias.numel()
    return (triton_gates() is not None and _triton_takes(ops, x, selection_bias) and x.dim() == 2
            and experts <= MAX_ROUTED_EXPERTS and 0 < top_k <= experts and top_k & (top_k - 1) == 0)


def _on_device(ops: Any, *weights: Any) -> tuple[Any, ...]:
    """The weights as the backend holds them on its device: a GGUF tensor's bytes are the file's memory map
    until `device_weight` uploads them (once, at the first call: a warm-up, never a capture)."""
    upload = getattr(getattr(ops, "backend", ops), "device_weight", None)
    if upload is None:
        return weights
    return tuple(upload(w) if isinstance(w, QuantTensor) and w.device != ops.device else w for w in weights)


def sigmoid_route(ops: Any, x, proj, selection_bias, top_k, scale):
    """A few tokens over a float router: one launch (`triton_router`: product, sigmoid, biased top-k,
    renormalisation and scale). Else two: the backend's `linear`, then the rest in one kernel (torch's chain
    is eight)."""
    taken = _one_launch_router(ops, x, proj)
    if taken is not None:
        router, device_proj = taken
        return router.route(x, device_proj, top_k, selection_bias=selection_bias, scale=scale)
    return triton_gates().sigmoid_topk(ops.linear(x, proj), selection_bias, top_k, scale)


def _one_launch_router(ops: Any, x: torch.Tensor, proj: Any) -> tuple[Any, Any] | None:
    """(`triton_router`, the router's device copy: `_on_device`) when it takes these tokens, else None."""
    router = triton_router()
    if router is None or not router.enabled() or not router.few(x):
        return None
    (device_proj,) = _on_device(ops, proj)
    return (router, device_proj) if router.takes(x, device_proj) else None


def accepts_gated_tree_attention(ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor,
                                 visible: torch.Tensor, gate: torch.Tensor, *, scale: float,
                                 node_k: torch.Tensor | None = None, node_v: torch.Tensor | None = None,
                                 ring: int = 0) -> bool:
    return (triton_gates() is not None and _triton_takes(ops, gate)
            and accepts_tree_attention(ops, q, k, v, position, visible, scale=scale, node_k=node_k, node_v=node_v,
                                       ring=ring)
            and tuple(gate.shape) == tuple(q.shape[:3]) and gate.stride(-1) == 1)


def gated_tree_attention(ops: Any, q, k, v, position, visible, gate, *, scale, node_k=None, node_v=None, ring=0):
    """The path attention with the softplus gate applied in its merge kernel (`triton_path_combine`): the
    gate's own launch is gone. A quantized window whose kernel does not build takes the two ops apart."""
    extra = {"node_k": node_k, "node_v": node_v, "ring": ring}
    return _cache_attention(
        ops, lambda: triton_attention().tree_attention(q, k, v, position, visible, scale=scale, head_gate=gate, **extra),
        lambda: ops.softplus_head_gate(ops.tree_attention(q, k, v, position, visible, scale=scale, **extra), gate),
        k, v)


def accepts_softplus_head_gate(ops: Any, out: torch.Tensor, gate: torch.Tensor) -> bool:
    return (triton_gates() is not None and _triton_takes(ops, out, gate) and out.dim() >= 2
            and tuple(gate.shape) == tuple(out.shape[:-1]) and out.stride(-1) == 1 and gate.stride(-1) == 1)


def softplus_head_gate(ops: Any, out, gate):
    return triton_gates().softplus_head_gate(out, gate)


# -- a softmax-routed MoE's router (Qwen3.5-MoE's name), on `triton_norms`' router kernel -------------------


def accepts_softmax_topk_route(ops: Any, x: torch.Tensor, proj: Any, top_k: int) -> bool:
    experts = proj.shape[0]
    return (_available(ops, x) and x.dim() == 2 and experts <= MAX_ROUTED_EXPERTS and 0 < top_k <= experts
            and top_k & (top_k - 1) == 0)


def softmax_topk_route(ops: Any, x, proj, top_k):
    """A few tokens over a float router: one launch (`triton_router`). Else two: the router's product, then
    softmax, top-k and renormalisation in one kernel (Gemma-4's, without its per-expert scale)."""
    taken = _one_launch_router(ops, x, proj)
    if taken is not None:
        router, device_proj = taken
        return router.route(x, device_proj, top_k)
    return triton_norms().softmax_topk(ops.linear(x, proj), None, top_k)


def accepts_softmax_topk_route_gated(ops: Any, x: torch.Tensor, proj: Any, shared_gate: Any, top_k: int) -> bool:
    router = triton_router()
    return (router is not None and router.enabled() and router.few(x) and _available(ops, x)
            and accepts_softmax_topk_route(ops, x, proj, top_k) and router.takes(x, *_on_device(ops, proj, shared_gate)))


def softmax_topk_route_gated(ops: Any, x, proj, shared_gate, top_k):
    """The router and the shared expert's one-row gate in one launch (`triton_router`: the gate is one more
    row); a prefill chunk takes the two ops apart."""
    proj, shared_gate = _on_device(ops, proj, shared_gate)
    return triton_router().route(x, proj, top_k, shared_gate=shared_gate)
