"""Triton kernels for the norm chains and small elementwise ops of a sandwich-norm decoder (Gemma-4's).

A Gemma-4 layer norms everything: q, k and v per head, the attention output before the residual add, the
residual before the MLP, the MLP output before the next add, and in the MoE layout two more. Written as
plain torch ops each of those is several launches (the norm, the add, a scale, RoPE's cos/sin/cat), and in
a 60-layer decode step the launches, not the bytes, set the time. Each kernel here replaces a chain:

- `post_norm_residual`: `h' = (h + rms_norm(x, w_post)) * scalar`, then `rms_norm(h', w_next)` (the next
  norm is the following layer's input norm, or the pre-MLP norm): one row pass instead of five launches;
- `norm_sum`: `rms_norm(a, w_a) + rms_norm(b, w_b)` (the MoE block's two post norms);
- `qkv_norm_rope`: per-head RMSNorm of q, k and v (v without weight) and NeoX RoPE of q and k with given
  inverse frequencies (Gemma's full layers rotate only their first pairs: the others have frequency ~0);
- `gelu_tanh_mul`: GeGLU's middle, `gelu_tanh(gate) * up`;
- `softcap`: `tanh(x / cap) * cap` over the logits;
- `router_norm` and `softmax_topk`: the MoE router's input norm and its softmax, top-k, renormalisation
  and per-expert scale, around the router's product;
- `l2norm`: the generic op (`x / sqrt(sum(x^2) + eps)` per row; Qwen3.5's Gated DeltaNet q and k in prefill,
  seven torch launches each as the reference, twice in each of the 27B's 48 such layers a forward call).

Roundings follow the torch references in `lucebox_gemma4.ops` and `TorchBackend`: every intermediate the
reference rounds to the activation dtype (a norm's output before the add, the sum before the scalar), the
kernel rounds too. tanh is written through the sigmoid (`tanh(u) = 2 sigmoid(2u) - 1`, and GELU's
`0.5 (1 + tanh(u)) = sigmoid(2u)`), which the interpreter and every Triton version have; it differs from
torch's tanh by float32 roundoff only. Every wrapper runs under `TRITON_INTERPRET=1` on CPU tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_fused import ELEMENTWISE_BLOCK, _norm_rope_row, _row_layout
from .triton_gates import top_k_passes
from .pdl import triton_options
from .triton_ops import _device_scope, grid_dependency

GELU_TANH_COEFF = math.sqrt(2.0 / math.pi)


def _warps(n: int) -> int:
    return 8 if n > 2048 else 4


# -- residual chains ---------------------------------------------------------------------------------


@triton.jit
def _post_norm_residual_kernel(
    x_ptr, res_ptr, post_w_ptr, scalar_ptr, next_w_ptr, hidden_ptr, normed_ptr, n, eps,
    x_inner, x_row, x_outer, r_inner, r_row, r_outer,
    HAS_SCALAR: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    dtype = hidden_ptr.dtype.element_ty
    x = tl.load(x_ptr + (row // x_inner) * x_outer + (row % x_inner) * x_row + cols, mask=ok, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + (row // r_inner) * r_outer + (row % r_inner) * r_row + cols, mask=ok, other=0.0)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    post_w = tl.load(post_w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    normed_x = (x * inv_rms * post_w).to(dtype).to(tl.float32)
    hidden = (res.to(tl.float32) + normed_x).to(dtype)
    if HAS_SCALAR:
        hidden = (hidden.to(tl.float32) * tl.load(scalar_ptr).to(tl.float32)).to(dtype)
    tl.store(hidden_ptr + row * n + cols, hidden, mask=ok)
    if HAS_NEXT:
        h = hidden.to(tl.float32)
        inv_rms_h = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
        next_w = tl.load(next_w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(normed_ptr + row * n + cols, (h * inv_rms_h * next_w).to(dtype), mask=ok)


def post_norm_residual(x: torch.Tensor, residual: torch.Tensor, post_norm: torch.Tensor, eps: float,
                       scalar: torch.Tensor | None = None, next_norm: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`lucebox_gemma4.ops.post_norm_residual`: `(hidden, rms_norm(hidden, next_norm))` with
    `hidden = (residual + rms_norm(x, post_norm)) * scalar`, new contiguous tensors of residual's shape."""
    n = x.shape[-1]
    if x.shape != residual.shape or post_norm.numel() != n or (next_norm is not None and next_norm.numel() != n):
        raise ValueError(f"post_norm_residual shapes: x {tuple(x.shape)}, residual {tuple(residual.shape)}")
    hidden = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    normed = torch.empty_like(hidden) if next_norm is not None else None
    rows = x.numel() // n
    if rows:
        xi, xr, xo = _row_layout(x)
        ri, rr, ro = _row_layout(residual)
        with _device_scope(x):
            _post_norm_residual_kernel[(rows,)](
                x, residual, post_norm, scalar if scalar is not None else post_norm,
                next_norm if next_norm is not None else post_norm, hidden, normed if normed is not None else hidden,
                n, eps, xi, xr, xo, ri, rr, ro, HAS_SCALAR=scalar is not None, HAS_NEXT=next_norm is not None,
                BLOCK=triton.next_power_of_2(n), num_warps=_warps(n), **triton_options(x)
            )
    return hidden, normed


@triton.jit
def _norm_sum_kernel(
    a_ptr, wa_ptr, b_ptr, wb_ptr, out_ptr, n, eps,
    a_inner, a_row, a_outer, b_inner, b_row, b_outer,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    dtype = out_ptr.dtype.element_ty
    a = tl.load(a_ptr + (row // a_inner) * a_outer + (row % a_inner) * a_row + cols, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + (row // b_inner) * b_outer + (row % b_inner) * b_row + cols, mask=ok, other=0.0).to(tl.float32)
    wa = tl.load(wa_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    wb = tl.load(wb_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    na = (a / tl.sqrt(tl.sum(a * a, axis=0) / n + eps) * wa).to(dtype).to(tl.float32)
    nb = (b / tl.sqrt(tl.sum(b * b, axis=0) / n + eps) * wb).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (na + nb).to(dtype), mask=ok)


def norm_sum(a: torch.Tensor, a_norm: torch.Tensor, b: torch.Tensor, b_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """`lucebox_gemma4.ops.norm_sum`: `rms_norm(a, a_norm) + rms_norm(b, b_norm)`, a new tensor like a."""
    n = a.shape[-1]
    if a.shape != b.shape or a.dtype != b.dtype or a_norm.numel() != n or b_norm.numel() != n:
        raise ValueError(f"norm_sum shapes: a {tuple(a.shape)}, b {tuple(b.shape)}")
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    rows = a.numel() // n
    if rows:
        ai, ar, ao = _row_layout(a)
        bi, br, bo = _row_layout(b)
        with _device_scope(a):
            _norm_sum_kernel[(rows,)](a, a_norm, b, b_norm, out, n, eps, ai, ar, ao, bi, br, bo,
                                      BLOCK=triton.next_power_of_2(n), num_warps=_warps(n), **triton_options(a))
    return out


# -- attention inputs --------------------------------------------------------------------------------


@triton.jit
def _norm_row(src_ptr, w_ptr, dst_ptr, eps, head_dim, BLOCK_D: tl.constexpr):
    dims = tl.arange(0, BLOCK_D)
    ok = dims < head_dim
    x = tl.load(src_ptr + dims, mask=ok, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    w = tl.load(w_ptr + dims, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_ptr + dims, (x * inv_rms * w).to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _qkv_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, vw_ptr, inv_freq_ptr, pos_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
    q_heads, kv_heads, head_dim, eps,
    q_tok, q_head, k_tok, k_head, v_tok, v_head,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    token = tl.program_id(0)
    head = tl.program_id(1)
    position = tl.load(pos_ptr + token)
    if head < q_heads:
        _norm_rope_row(q_ptr + token * q_tok + head * q_head, qw_ptr, inv_freq_ptr,
                       q_out_ptr + (token * q_heads + head) * head_dim, position, eps, head_dim, head_dim, BLOCK_D, 1.0)
    elif head < q_heads + kv_heads:
        kv = head - q_heads
        _norm_rope_row(k_ptr + token * k_tok + kv * k_head, kw_ptr, inv_freq_ptr,
                       k_out_ptr + (token * kv_heads + kv) * head_dim, position, eps, head_dim, head_dim, BLOCK_D, 1.0)
    else:
        kv = head - q_heads - kv_heads
        _norm_row(v_ptr + token * v_tok + kv * v_head, vw_ptr, v_out_ptr + (token * kv_heads + kv) * head_dim,
                  eps, head_dim, BLOCK_D)


def qkv_norm_rope(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_norm: torch.Tensor,
                  k_norm: torch.Tensor, v_norm: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`lucebox_gemma4.ops.qkv_norm_rope` for batch 1: query `[1, T, H, D]`, key and value `[1, T, Hkv, D]`
    (strided views, value may be key itself), positions `[T]` on the device, inv_freq `[D / 2]` fp32 ->
    new contiguous q, k, v (one program per token and head)."""
    batch, tokens, q_heads, head_dim = query.shape
    kv_heads = key.shape[2]
    if (batch != 1 or key.shape != (1, tokens, kv_heads, head_dim) or value.shape != key.shape
            or inv_freq.numel() != head_dim // 2 or head_dim % 2):
        raise ValueError(f"qkv_norm_rope shapes: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)}, inv_freq {tuple(inv_freq.shape)}")
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        raise ValueError("qkv_norm_rope needs the head dim contiguous")
    positions = positions.reshape(-1)
    if positions.numel() != tokens:
        raise ValueError(f"{positions.numel()} positions for {tokens} tokens")
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    v_out = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    if tokens:
        with _device_scope(query):
            _qkv_norm_rope_kernel[(tokens, q_heads + 2 * kv_heads)](
                query, key, value, q_norm, k_norm, v_norm, inv_freq.to(torch.float32), positions, q_out, k_out, v_out,
                q_heads, kv_heads, head_dim, eps,
                query.stride(1), query.stride(2), key.stride(1), key.stride(2), value.stride(1), value.stride(2),
                BLOCK_D=triton.next_power_of_2(head_dim), **triton_options(query)
            )
    return q_out, k_out, v_out


# -- elementwise -------------------------------------------------------------------------------------


@triton.jit
def _gelu_tanh_mul_kernel(
    gate_ptr, up_ptr, out_ptr, n, coeff,
    g_inner, g_row, g_outer, u_inner, u_row, u_outer,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + (row // g_inner) * g_outer + (row % g_inner) * g_row + cols, mask=ok, other=0.0)
    u = tl.load(up_ptr + (row // u_inner) * u_outer + (row % u_inner) * u_row + cols, mask=ok, other=0.0)
    g32 = g.to(tl.float32)
    inner = coeff * (g32 + 0.044715 * g32 * g32 * g32)
    gelu = (g32 * tl.sigmoid(2.0 * inner)).to(dtype).to(tl.float32)  # 0.5 (1 + tanh(u)) = sigmoid(2u)
    tl.store(out_ptr + row * n + cols, (gelu * u.to(tl.float32)).to(dtype), mask=ok)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`lucebox_gemma4.ops.gelu_tanh_mul`: `gelu_tanh(gate) * up` (GELU rounded to the dtype before the
    product, as the two-op reference), a new contiguous tensor."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gelu_tanh_mul shapes: {tuple(gate.shape)} and {tuple(up.shape)}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.shape[-1]
    rows = gate.numel() // n if n else 0
    if rows:
        gi, gr, go = _row_layout(gate)
        ui, ur, uo = _row_layout(up)
        block = min(ELEMENTWISE_BLOCK, triton.next_power_of_2(n))
        with _device_scope(gate):
            _gelu_tanh_mul_kernel[(rows, math.ceil(n / block))](gate, up, out, n, GELU_TANH_COEFF,
                                                                gi, gr, go, ui, ur, uo, BLOCK=block,
                                                                **triton_options(gate))
    return out


@triton.jit
def _softcap_kernel(x_ptr, out_ptr, numel, cap, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    z = x / cap
    # tanh(z) from exp(-2|z|): no overflow for large logits, and odd by construction.
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(z < 0, -t, t)
    tl.store(out_ptr + offsets, (t * cap).to(out_ptr.dtype.element_ty), mask=ok)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """`lucebox_gemma4.ops.softcap`: `tanh(x / cap) * cap` in fp32, in x's dtype (a new tensor)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        block = ELEMENTWISE_BLOCK
        with _device_scope(x):
            _softcap_kernel[(math.ceil(x.numel() / block),)](x, out, x.numel(), float(cap), BLOCK=block,
                                                             **triton_options(x))
    return out


# -- the MoE router ----------------------------------------------------------------------------------


@triton.jit
def _router_norm_kernel(h_ptr, scale_ptr, out_ptr, n, eps, root_scale, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    h = tl.load(h_ptr + row * n + cols, mask=ok, other=0.0).to(tl.float32)
    x = h * (1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps))
    scale = tl.load(scale_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (x * scale * root_scale).to(out_ptr.dtype.element_ty), mask=ok)


def router_norm(h: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """The router's input: `rms_norm(h) * scale / sqrt(hidden)` (a norm without weight), in h's dtype,
    `h` `[T, hidden]`."""
    h = h.contiguous()
    n = h.shape[-1]
    out = torch.empty_like(h)
    if h.numel():
        with _device_scope(h):
            _router_norm_kernel[(h.numel() // n,)](h, scale, out, n, eps, n**-0.5, BLOCK=triton.next_power_of_2(n),
                                                  num_warps=_warps(n), **triton_options(h))
    return out


@triton.jit
def softmax_topk_row(logits_ptr, expert_scale_ptr, experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                     HAS_SCALE: tl.constexpr):
    """One token's routing from its logits row in memory -> (weights [TOP_K] fp32, ids [TOP_K] int64). The
    loads bypass L1 (`.cg`): `triton_router` calls this on logits other programs have just written."""
    cols = tl.arange(0, BLOCK_E)
    ok = cols < experts
    logits = tl.load(logits_ptr + cols, mask=ok, other=-float("inf"), cache_modifier=".cg").to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    ids = top_k_passes(probs, cols, ok, experts, TOP_K)
    # The chosen probabilities gathered from the row (a NaN stays NaN: a NaN row's weights say so).
    values = tl.sum(tl.where(cols[None, :] == ids[:, None], probs[None, :], 0.0), axis=1)
    total = tl.sum(values, axis=0)
    if HAS_SCALE:
        return values / total * tl.load(expert_scale_ptr + ids).to(tl.float32), ids
    return values / total, ids


@triton.jit
def _softmax_topk_kernel(logits_ptr, expert_scale_ptr, weights_ptr, ids_ptr, experts,
                         TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, HAS_SCALE: tl.constexpr,
                         PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0)
    slots = tl.arange(0, TOP_K)
    weights, ids = softmax_topk_row(logits_ptr + row * experts, expert_scale_ptr, experts, TOP_K, BLOCK_E, HAS_SCALE)
    tl.store(weights_ptr + row * TOP_K + slots, weights)
    tl.store(ids_ptr + row * TOP_K + slots, ids)


def softmax_topk(logits: torch.Tensor, per_expert_scale: torch.Tensor | None,
                 top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its product: softmax of `logits` `[T, E]` in fp32, the top `top_k` renormalised to
    sum 1 and times their `per_expert_scale` (None: no scale) -> weights `[T, k]` fp32, ids `[T, k]` long
    (descending)."""
    logits = logits.contiguous()
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
    if tokens:
        with _device_scope(logits):
            scale = weights if per_expert_scale is None else per_expert_scale.to(torch.float32)  # unread if None
            _softmax_topk_kernel[(tokens,)](logits, scale, weights, ids, experts, TOP_K=top_k,
                                            BLOCK_E=triton.next_power_of_2(experts),
                                            HAS_SCALE=per_expert_scale is not None, **triton_options(logits))
    return weights, ids


# -- L2 norm (the generic op) ---------------------------------------------------------------------------


@triton.jit
def _l2norm_kernel(x_ptr, out_ptr, n, heads, token_stride, head_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # output row (token, head), x's row at its own strides
    token = row // heads
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + token * token_stride + (row - token * heads) * head_stride + cols, mask=ok,
                other=0.0).to(tl.float32)
    normed = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) + eps))
    tl.store(out_ptr + row * n + cols, normed.to(out_ptr.dtype.element_ty), mask=ok)


def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """x as `[tokens, heads, n]` without a copy where its strides allow (last dim contiguous, leading dims one
    stride): the Gated DeltaNet's q and k are head splits of the convolution's output, and copying them first was two
    launches a layer (a tenth of the 0.8B's prefill launches, session 30)."""
    shaped = x.reshape(1, 1, -1) if x.dim() == 1 else x
    try:
        rows = shaped.view(-1, shaped.shape[-2], shaped.shape[-1])
    except RuntimeError:  # leading dims that do not merge into one stride
        rows = shaped.contiguous().view(-1, shaped.shape[-2], shaped.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`TorchBackend.l2norm`: `x / sqrt(sum(x^2) + eps)` over the last dim in fp32, rounded to x's dtype, one
    program a row, read at x's strides; the result is contiguous."""
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        rows = _head_rows(x)
        with _device_scope(x):
            _l2norm_kernel[(x.numel() // n,)](rows, out, n, rows.shape[1], rows.stride(0), rows.stride(1), eps,
                                              BLOCK=triton.next_power_of_2(n), num_warps=_warps(n))
    return out
