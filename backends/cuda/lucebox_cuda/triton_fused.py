"""Triton kernels for the fused ops of the decode step (`TorchBackend`'s "fused ops" section).

A 64-layer decode step written with plain torch ops is about 4,000 launches, and inside a CUDA graph each
still costs a couple of microseconds: more than the matrix-vector products of a small model. Each kernel
here replaces a chain of them:

- `add_rms_norm`: the residual add and the norm after it (two passes over the hidden row, one launch);
- `silu_mul`, `sigmoid_mul`: SwiGLU's middle and the attention output gate;
- `gated_rms_norm`: Gated DeltaNet's per-head output norm times silu(z);
- `qk_norm_rope`: per-head RMSNorm and NeoX RoPE of queries and keys, one program per (token, head);
- `gated_delta_decode_`: one Gated DeltaNet token from the convolved channels: L2 norms of q and k, the
  decay and write strength from their projections, the delta-rule update of the fp32 state in place and
  the readout.

Roundings follow the reference: where the torch composition rounds an intermediate to the activation
dtype (a norm's output before RoPE, silu's output before the product), the kernel rounds it too, so the
results agree to the last bit or two. Every wrapper accepts strided views (the halves of a stacked
projection) and runs under `TRITON_INTERPRET=1` on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .pdl import triton_options
from .triton_ops import DELTA_BLOCK_VALUES, _device_scope, grid_dependency

ELEMENTWISE_BLOCK = 1024


def _mergeable(x: torch.Tensor) -> bool:
    """Whether the dims before the last two merge into one stride (so `reshape` is a view)."""
    expected = None
    for size, stride in reversed(list(zip(x.shape[:-2], x.stride()[:-2]))):
        if size == 1:
            continue
        if expected is not None and stride != expected:
            return False
        expected = stride * size
    return True


def _outer_stride(x: torch.Tensor) -> int:
    for size, stride in reversed(list(zip(x.shape[:-2], x.stride()[:-2]))):
        if size != 1:
            return stride
    return x.shape[-2] * x.stride(-2) if x.dim() >= 2 else x.shape[-1]


def _row_layout(x: torch.Tensor) -> tuple[int, int, int]:
    """(rows per group, stride between rows of a group, stride between groups) of x's leading dims."""
    if x.stride(-1) != 1 or not _mergeable(x):
        raise ValueError(f"cannot index a tensor of shape {tuple(x.shape)} and strides {x.stride()} as rows")
    if x.dim() == 1:
        return 1, x.shape[0], x.shape[0]
    return x.shape[-2], x.stride(-2), _outer_stride(x)


# -- residual add + RMSNorm ----------------------------------------------------------------------------


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, normed_ptr, sum_ptr, n, eps,
    x_inner, x_row, x_outer, r_inner, r_row, r_outer,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x_off = (row // x_inner) * x_outer + (row % x_inner) * x_row
    r_off = (row // r_inner) * r_outer + (row % r_inner) * r_row
    x = tl.load(x_ptr + x_off + cols, mask=ok, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + r_off + cols, mask=ok, other=0.0).to(tl.float32)
    # The sum is rounded to the stream's dtype and normalised from there, as the reference does.
    summed = (x + res).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * n + cols, summed, mask=ok)
    s = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * n + cols, (s * inv_rms * w).to(normed_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`TorchBackend.add_rms_norm`: `(rms_norm(residual + x), residual + x)`, both new contiguous tensors
    of residual's shape and dtype."""
    if x.shape != residual.shape or weight.numel() != x.shape[-1]:
        raise ValueError(f"add_rms_norm shapes: x {tuple(x.shape)}, residual {tuple(residual.shape)}, "
                         f"weight {tuple(weight.shape)}")
    n = x.shape[-1]
    summed = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    normed = torch.empty_like(summed)
    rows = x.numel() // n
    if rows == 0:
        return normed, summed
    xi, xr, xo = _row_layout(x)
    ri, rr, ro = _row_layout(residual)
    with _device_scope(x):
        _add_rms_norm_kernel[(rows,)](
            x, residual, weight, normed, summed, n, eps, xi, xr, xo, ri, rr, ro,
            BLOCK=triton.next_power_of_2(n), num_warps=8 if n > 2048 else 4, **triton_options(x),
        )
    return normed, summed


# -- elementwise gates ---------------------------------------------------------------------------------


@triton.jit
def _gate_kernel(
    a_ptr, b_ptr, out_ptr, n,
    a_inner, a_row, a_outer, b_inner, b_row, b_outer,
    SIGMOID: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """SIGMOID: out = a * sigmoid(b); else out = silu(a) * b. The activation is rounded to the output
    dtype before the product, as the two-op reference does."""
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    a = tl.load(a_ptr + (row // a_inner) * a_outer + (row % a_inner) * a_row + cols, mask=ok, other=0.0)
    b = tl.load(b_ptr + (row // b_inner) * b_outer + (row % b_inner) * b_row + cols, mask=ok, other=0.0)
    a32 = a.to(tl.float32)
    b32 = b.to(tl.float32)
    if SIGMOID:
        out = a32 * tl.sigmoid(b32).to(out_ptr.dtype.element_ty).to(tl.float32)
    else:
        out = (a32 * tl.sigmoid(a32)).to(out_ptr.dtype.element_ty).to(tl.float32) * b32
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _gate(a: torch.Tensor, b: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    if a.shape != b.shape:
        raise ValueError(f"gate shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    n = a.shape[-1]
    rows = a.numel() // n if n else 0
    if rows == 0:
        return out
    ai, ar, ao = _row_layout(a)
    bi, br, bo = _row_layout(b)
    block = min(ELEMENTWISE_BLOCK, triton.next_power_of_2(n))
    with _device_scope(a):
        _gate_kernel[(rows, math.ceil(n / block))](a, b, out, n, ai, ar, ao, bi, br, bo, SIGMOID=sigmoid, BLOCK=block,
                                                   **triton_options(a))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`TorchBackend.silu_mul`: `silu(gate) * up`, a new contiguous tensor."""
    return _gate(gate, up, sigmoid=False)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`TorchBackend.sigmoid_mul`: `x * sigmoid(gate)`, a new contiguous tensor."""
    return _gate(x, gate, sigmoid=True)


@triton.jit
def _add_sigmoid_gated_kernel(base_ptr, x_ptr, gate_ptr, out_ptr, n, BLOCK: tl.constexpr,
                              PDL: tl.constexpr = False):
    """out = base + x * sigmoid(gate[row]), each intermediate rounded to the output dtype as the reference's
    three ops round it (the sigmoid, the product, the sum)."""
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dtype = out_ptr.dtype.element_ty
    gate = tl.sigmoid(tl.load(gate_ptr + row).to(tl.float32)).to(dtype).to(tl.float32)
    x = tl.load(x_ptr + row * n + cols, mask=ok, other=0.0).to(tl.float32)
    base = tl.load(base_ptr + row * n + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (base + (x * gate).to(dtype).to(tl.float32)).to(dtype), mask=ok)


def add_sigmoid_gated(base: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`TorchBackend.add_sigmoid_gated`: `base + x * sigmoid(gate)` for contiguous `base`, `x` `[..., n]` and
    `gate` `[..., 1]` (one logit a row), one launch instead of three."""
    base, x, gate = base.contiguous(), x.contiguous(), gate.contiguous()
    out = torch.empty_like(base)
    n = base.shape[-1]
    rows = base.numel() // n if n else 0
    if rows:
        block = min(ELEMENTWISE_BLOCK, triton.next_power_of_2(n))
        with _device_scope(base):
            _add_sigmoid_gated_kernel[(rows, math.ceil(n / block))](base, x, gate, out, n, BLOCK=block,
                                                                    **triton_options(base))
    return out


# -- gated RMSNorm ---------------------------------------------------------------------------------------


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, n, eps,
    x_inner, x_row, x_outer, z_inner, z_row, z_outer,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + (row // x_inner) * x_outer + (row % x_inner) * x_row + cols, mask=ok, other=0.0)
    z = tl.load(z_ptr + (row // z_inner) * z_outer + (row % z_inner) * z_row + cols, mask=ok, other=0.0)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    normed = (x32 * inv_rms * w).to(dtype).to(tl.float32)
    z32 = z.to(tl.float32)
    gate = (z32 * tl.sigmoid(z32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (normed * gate).to(dtype), mask=ok)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`TorchBackend.gated_rms_norm`: `rms_norm(x) * silu(z)` per row of the last dim, a new tensor."""
    if x.shape != z.shape or weight.numel() != x.shape[-1]:
        raise ValueError(f"gated_rms_norm shapes: x {tuple(x.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1]
    rows = x.numel() // n
    if rows == 0:
        return out
    xi, xr, xo = _row_layout(x)
    zi, zr, zo = _row_layout(z)
    with _device_scope(x):
        _gated_rms_norm_kernel[(rows,)](x, z, weight, out, n, eps, xi, xr, xo, zi, zr, zo,
                                        BLOCK=triton.next_power_of_2(n), **triton_options(x))
    return out


# -- q/k RMSNorm + RoPE ----------------------------------------------------------------------------------


@triton.jit
def _norm_rope_row(src_ptr, w_ptr, inv_freq_ptr, dst_ptr, position, eps, head_dim, rot_dim,
                   BLOCK_D: tl.constexpr, attention_factor):
    """RMSNorm one head's row (rounded to the output dtype, as the reference's norm output is), then
    rotate its first rot_dim dims NeoX style: dim i pairs with i + rot_dim/2. `attention_factor` scales
    cos and sin (YaRN's magnitude on the rotated dims; 1 leaves them exact)."""
    dims = tl.arange(0, BLOCK_D)
    ok = dims < head_dim
    half = rot_dim // 2
    x = tl.load(src_ptr + dims, mask=ok, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    w = tl.load(w_ptr + dims, mask=ok, other=0.0).to(tl.float32)
    dtype = dst_ptr.dtype.element_ty
    normed = (x * inv_rms * w).to(dtype).to(tl.float32)
    # The partner of each rotated dim, normalised the same way (a second read of the same row beats a
    # shuffle across the row's threads).
    first_half = dims < half
    rotated = dims < rot_dim
    partner = tl.where(first_half, dims + half, dims - half)
    partner_ok = rotated & ok
    px = tl.load(src_ptr + partner, mask=partner_ok, other=0.0).to(tl.float32)
    pw = tl.load(w_ptr + partner, mask=partner_ok, other=0.0).to(tl.float32)
    partner_normed = (px * inv_rms * pw).to(dtype).to(tl.float32)
    freq_index = tl.where(first_half, dims, dims - half)
    inv_freq = tl.load(inv_freq_ptr + freq_index, mask=partner_ok, other=0.0)
    angle = position.to(tl.float32) * inv_freq
    cos = tl.cos(angle) * attention_factor
    sin = tl.sin(angle) * attention_factor
    # first' = first*cos - second*sin; second' = second*cos + first*sin
    out = tl.where(rotated, normed * cos + tl.where(first_half, -partner_normed, partner_normed) * sin, normed)
    tl.store(dst_ptr + dims, out.to(dtype), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, inv_freq_ptr, pos_ptr, q_out_ptr, k_out_ptr,
    q_heads, kv_heads, head_dim, rot_dim, eps, attention_factor,
    q_tok, q_head, k_tok, k_head,
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
                       q_out_ptr + (token * q_heads + head) * head_dim, position, eps, head_dim, rot_dim, BLOCK_D,
                       attention_factor)
    else:
        kv = head - q_heads
        _norm_rope_row(k_ptr + token * k_tok + kv * k_head, kw_ptr, inv_freq_ptr,
                       k_out_ptr + (token * kv_heads + kv) * head_dim, position, eps, head_dim, rot_dim, BLOCK_D,
                       attention_factor)


def rope_inv_freq(rot_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """The reference's inverse frequencies, computed by the same torch expression (so angles agree)."""
    half = rot_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, device=device, dtype=torch.float32) * 2 / rot_dim))


def qk_norm_rope(
    query: torch.Tensor, key: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
    positions: torch.Tensor, rot_dim: int, theta: float, eps: float, *, inv_freq: torch.Tensor | None = None,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`TorchBackend.qk_norm_rope` for batch 1: query `[1, T, Hq, D]`, key `[1, T, Hkv, D]` (strided views
    are fine), positions `[T]` or `[1, T]` integers on the device -> new contiguous query and key.
    `attention_factor`: cos and sin times it (YaRN's scale of the rotated dims; Laguna's full layers)."""
    batch, tokens, q_heads, head_dim = query.shape
    kv_heads = key.shape[2]
    if batch != 1 or key.shape[:2] != (1, tokens) or key.shape[3] != head_dim or rot_dim > head_dim or rot_dim % 2:
        raise ValueError(f"qk_norm_rope shapes: query {tuple(query.shape)}, key {tuple(key.shape)}, rot_dim {rot_dim}")
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("qk_norm_rope needs the head dim contiguous")
    positions = positions.reshape(-1)
    if positions.numel() != tokens:
        raise ValueError(f"{positions.numel()} positions for {tokens} tokens")
    if inv_freq is None:
        inv_freq = rope_inv_freq(rot_dim, theta, query.device)
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if tokens == 0:
        return q_out, k_out
    with _device_scope(query):
        _qk_norm_rope_kernel[(tokens, q_heads + kv_heads)](
            query, key, q_norm, k_norm, inv_freq, positions, q_out, k_out,
            q_heads, kv_heads, head_dim, rot_dim, eps, float(attention_factor),
            query.stride(1), query.stride(2), key.stride(1), key.stride(2),
            BLOCK_D=triton.next_power_of_2(head_dim), **triton_options(query),
        )
    return q_out, k_out


# -- Gated DeltaNet decode token -------------------------------------------------------------------------


@triton.jit
def _gated_delta_decode_kernel(
    mixed_ptr, a_ptr, b_ptr, ssm_a_ptr, dt_bias_ptr, state_ptr, out_ptr,
    scale, key_heads, value_heads, key_channels,
    stride_mb, stride_ab, stride_bb,
    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One token for one (sequence, value head) and BLOCK_V of its value dims, from the convolved q, k,
    v channels. Each program reads its state slice before writing it back, so the update is in place."""
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    sequence_head = tl.program_id(0)
    batch = sequence_head // value_heads
    head = sequence_head % value_heads
    key_head = head % key_heads  # tiled heads, the GGUF order
    key_dims = tl.arange(0, BLOCK_K)
    value_dims = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_ok = key_dims < KEY_DIM
    value_ok = value_dims < VALUE_DIM
    row = mixed_ptr + batch * stride_mb
    dtype = out_ptr.dtype.element_ty

    q = tl.load(row + key_head * KEY_DIM + key_dims, mask=key_ok, other=0.0).to(tl.float32)
    k = tl.load(row + key_channels + key_head * KEY_DIM + key_dims, mask=key_ok, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * key_channels + head * VALUE_DIM + value_dims, mask=value_ok, other=0.0).to(tl.float32)
    # L2 norms with eps inside the root, rounded to the activation dtype as the reference's l2norm output.
    q = (q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)).to(dtype).to(tl.float32) * scale
    k = (k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)).to(dtype).to(tl.float32)
    beta = tl.sigmoid(tl.load(b_ptr + batch * stride_bb + head).to(tl.float32)).to(dtype).to(tl.float32)
    # g = ssm_a * softplus(a + dt_bias) in fp32 (softplus is linear past 20, as torch's).
    pre = tl.load(a_ptr + batch * stride_ab + head).to(tl.float32) + tl.load(dt_bias_ptr + head)
    softplus = tl.where(pre > 20.0, pre, tl.log(1.0 + tl.exp(tl.minimum(pre, 20.0))))
    decay = tl.exp(tl.load(ssm_a_ptr + head) * softplus)

    tile = (sequence_head * KEY_DIM + key_dims[:, None]) * VALUE_DIM + value_dims[None, :]
    tile_ok = key_ok[:, None] & value_ok[None, :]
    state = tl.load(state_ptr + tile, mask=tile_ok, other=0.0) * decay
    update = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state += k[:, None] * update[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(state_ptr + tile, state, mask=tile_ok)
    tl.store(out_ptr + sequence_head * VALUE_DIM + value_dims, out.to(dtype), mask=value_ok)


def gated_delta_decode_(
    mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, num_k_heads: int, head_k_dim: int,
) -> torch.Tensor:
    """the qwen35 family's `gated_delta_decode_` reference (`lucebox_qwen35.ops`): mixed `[B, C]`, a, b `[B, H_v]`, ssm_a, dt_bias `[H_v]` fp32,
    state `[B, H_v, D_k, D_v]` fp32 contiguous (updated in place) -> o `[B, 1, H_v, D_v]` in mixed's dtype."""
    batch, value_heads, key_dim, value_dim = state.shape
    key_channels = num_k_heads * head_k_dim
    if (key_dim != head_k_dim or mixed.shape != (batch, 2 * key_channels + value_heads * value_dim)
            or a.shape != (batch, value_heads) or b.shape != (batch, value_heads) or value_heads % num_k_heads
            or state.dtype != torch.float32 or not state.is_contiguous()):
        raise ValueError(f"gated_delta_decode_ shapes: mixed {tuple(mixed.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, state {tuple(state.shape)} {state.dtype}")
    if mixed.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("gated_delta_decode_ needs the last dims contiguous")
    out = torch.empty(batch, 1, value_heads, value_dim, device=mixed.device, dtype=mixed.dtype)
    block_values = min(DELTA_BLOCK_VALUES, triton.next_power_of_2(value_dim))
    grid = (batch * value_heads, math.ceil(value_dim / block_values))
    with _device_scope(mixed):
        _gated_delta_decode_kernel[grid](
            mixed, a, b, ssm_a, dt_bias, state, out,
            key_dim**-0.5, num_k_heads, value_heads, key_channels,
            mixed.stride(0), a.stride(0), b.stride(0),
            KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_values,
            **triton_options(mixed),
        )
    return out


# -- Gated DeltaNet over the nodes of a candidate tree ----------------------------------------------------


@triton.jit
def _delta_node_step(
    state, mixed_ptr, a_ptr, b_ptr, node, stride_mn, stride_an, stride_bn, head, key_head, key_channels,
    scale, a_log, dt, key_dims, key_ok, value_dims, value_ok, dtype, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
):
    """One node's step from `state` (its parent's, fp32 registers): the arithmetic of
    `_gated_delta_decode_kernel`, shared by the tree walk and the path replay so that both give a node the
    same bits. Returns (the state after the node, its output)."""
    row = mixed_ptr + node.to(tl.int64) * stride_mn
    q = tl.load(row + key_head * KEY_DIM + key_dims, mask=key_ok, other=0.0).to(tl.float32)
    k = tl.load(row + key_channels + key_head * KEY_DIM + key_dims, mask=key_ok, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * key_channels + head * VALUE_DIM + value_dims, mask=value_ok, other=0.0).to(tl.float32)
    q = (q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)).to(dtype).to(tl.float32) * scale
    k = (k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)).to(dtype).to(tl.float32)
    beta = tl.sigmoid(tl.load(b_ptr + node * stride_bn + head).to(tl.float32)).to(dtype).to(tl.float32)
    pre = tl.load(a_ptr + node * stride_an + head).to(tl.float32) + dt
    softplus = tl.where(pre > 20.0, pre, tl.log(1.0 + tl.exp(tl.minimum(pre, 20.0))))
    state = state * tl.exp(a_log * softplus)
    update = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state += k[:, None] * update[None, :]
    return state, tl.sum(state * q[:, None], axis=0)


@triton.jit
def _gated_delta_tree_kernel(
    mixed_ptr, a_ptr, b_ptr, ssm_a_ptr, dt_bias_ptr, state_ptr, parents_ptr, out_ptr, states_ptr,
    nodes, scale, key_heads, value_heads, key_channels,
    stride_mn, stride_an, stride_bn,
    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ALL_STATES: tl.constexpr = True, BLOCK_N: tl.constexpr = 16,
):
    """`_gated_delta_decode_kernel` for every node in index order, one program per (value head, slice of
    value dims). A node whose parent is the previous node keeps the state in registers; any other reloads
    its parent's state from what this program already wrote (or the committed state for a root).
    ALL_STATES false: a node's state is written only where a later node reloads it (BLOCK_N >= nodes)."""
    head = tl.program_id(0)
    key_head = head % key_heads
    key_dims = tl.arange(0, BLOCK_K)
    value_dims = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_ok = key_dims < KEY_DIM
    value_ok = value_dims < VALUE_DIM
    tile_ok = key_ok[:, None] & value_ok[None, :]
    slice_in_head = key_dims[:, None] * VALUE_DIM + value_dims[None, :]
    head_state = KEY_DIM * VALUE_DIM
    initial = state_ptr + head.to(tl.int64) * head_state + slice_in_head
    state = tl.load(initial, mask=tile_ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    a_log = tl.load(ssm_a_ptr + head)
    dt = tl.load(dt_bias_ptr + head)
    children = tl.arange(0, BLOCK_N)
    parent_of_child = tl.load(parents_ptr + children, mask=children < nodes, other=-2).to(tl.int32)
    i = 0
    while i < nodes:  # a while loop: Triton 3.6's interpreter cannot take an argument as a range() bound
        parent = tl.load(parents_ptr + i).to(tl.int32)
        if parent != i - 1:  # the registers hold node i-1's state: fetch the parent's
            parent_state = states_ptr + (parent.to(tl.int64) * value_heads + head) * head_state + slice_in_head
            state = tl.load(tl.where(parent < 0, initial, parent_state), mask=tile_ok, other=0.0)
        state, out = _delta_node_step(
            state, mixed_ptr, a_ptr, b_ptr, i, stride_mn, stride_an, stride_bn, head, key_head, key_channels,
            scale, a_log, dt, key_dims, key_ok, value_dims, value_ok, dtype, KEY_DIM, VALUE_DIM)
        tl.store(out_ptr + (i * value_heads + head).to(tl.int64) * VALUE_DIM + value_dims, out.to(dtype), mask=value_ok)
        keep = tile_ok
        if not ALL_STATES:  # kept only for a child that is not the next node (the next continues in registers)
            reloaded = tl.sum(((parent_of_child == i) & (children != i + 1)).to(tl.int32), axis=0) > 0
            keep = tile_ok & reloaded
        tl.store(states_ptr + (i * value_heads + head).to(tl.int64) * head_state + slice_in_head, state, mask=keep)
        # A later node may reload this state, which other threads of the program wrote.
        tl.debug_barrier()
        i += 1


def _check_tree_shapes(op: str, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, state: torch.Tensor,
                       index: torch.Tensor, num_k_heads: int, head_k_dim: int) -> None:
    """The shapes `gated_delta_tree` and `gated_delta_path_` take (`index`: parents `[N]`, or a path `[L]`)."""
    _, value_heads, key_dim, value_dim = state.shape
    nodes = mixed.shape[1]
    key_channels = num_k_heads * head_k_dim
    if (mixed.shape[0] != 1 or key_dim != head_k_dim or mixed.shape[2] != 2 * key_channels + value_heads * value_dim
            or a.shape != (1, nodes, value_heads) or b.shape != (1, nodes, value_heads) or index.dim() != 1
            or value_heads % num_k_heads or state.dtype != torch.float32 or not state.is_contiguous()):
        raise ValueError(f"{op} shapes: mixed {tuple(mixed.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"state {tuple(state.shape)} {state.dtype}, index {tuple(index.shape)}")
    if mixed.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"{op} needs the last dims contiguous")


def gated_delta_tree(
    mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, parents: torch.Tensor, num_k_heads: int, head_k_dim: int, *, all_states: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """the qwen35 family's `gated_delta_tree` reference (`lucebox_qwen35.ops`): mixed `[1, N, C]`, a, b `[1, N, H_v]`, ssm_a, dt_bias `[H_v]` fp32,
    state `[1, H_v, D_k, D_v]` fp32 contiguous (not modified), parents `[N]` long on the device ->
    (o `[1, N, H_v, D_v]` in mixed's dtype, node states `[N, H_v, D_k, D_v]` fp32). One launch.
    `all_states` false: `gated_delta_tree_reloaded`, only the states a later node reloads are written."""
    _check_tree_shapes("gated_delta_tree", mixed, a, b, state, parents, num_k_heads, head_k_dim)
    _, value_heads, key_dim, value_dim = state.shape
    nodes = mixed.shape[1]
    if parents.shape != (nodes,):
        raise ValueError(f"gated_delta_tree: parents {tuple(parents.shape)} for {nodes} nodes")
    out = torch.empty(1, nodes, value_heads, value_dim, device=mixed.device, dtype=mixed.dtype)
    node_states = torch.empty(nodes, value_heads, key_dim, value_dim, device=mixed.device, dtype=torch.float32)
    block_values = min(DELTA_BLOCK_VALUES, triton.next_power_of_2(value_dim))
    with _device_scope(mixed):
        _gated_delta_tree_kernel[(value_heads, math.ceil(value_dim / block_values))](
            mixed, a, b, ssm_a, dt_bias, state, parents.contiguous(), out, node_states,
            nodes, key_dim**-0.5, num_k_heads, value_heads, num_k_heads * head_k_dim,
            mixed.stride(1), a.stride(1), b.stride(1),
            KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_values,
            ALL_STATES=all_states, BLOCK_N=max(16, triton.next_power_of_2(nodes)),
        )
    return out, node_states


@triton.jit
def _gated_delta_path_kernel(
    mixed_ptr, a_ptr, b_ptr, ssm_a_ptr, dt_bias_ptr, state_ptr, path_ptr,
    steps, scale, key_heads, key_channels,
    stride_mn, stride_an, stride_bn,
    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """The tree walk's steps along one path of its nodes, from the state in place: the state after the
    path's last node, as the tree walk computed it, without the walk having written it."""
    head = tl.program_id(0)
    _replay_path(state_ptr, mixed_ptr, a_ptr, b_ptr, path_ptr, steps, stride_mn, stride_an, stride_bn, head,
                 head % key_heads, key_channels, scale, tl.load(ssm_a_ptr + head), tl.load(dt_bias_ptr + head),
                 mixed_ptr.dtype.element_ty, KEY_DIM, VALUE_DIM, BLOCK_K, BLOCK_V)


@triton.jit
def _replay_path(
    state_ptr, mixed_ptr, a_ptr, b_ptr, path_ptr, steps, stride_mn, stride_an, stride_bn, head, key_head,
    key_channels, scale, a_log, dt, dtype, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Value head `head`'s slice (program_id(1)) of the state at `state_ptr` advanced in place along the path's
    `steps` nodes: the path kernel's body, and the all-layer commit's (`triton_commit`)."""
    key_dims = tl.arange(0, BLOCK_K)
    value_dims = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_ok = key_dims < KEY_DIM
    value_ok = value_dims < VALUE_DIM
    tile_ok = key_ok[:, None] & value_ok[None, :]
    tile = head.to(tl.int64) * (KEY_DIM * VALUE_DIM) + key_dims[:, None] * VALUE_DIM + value_dims[None, :]
    state = tl.load(state_ptr + tile, mask=tile_ok, other=0.0)
    j = 0
    while j < steps:
        node = tl.load(path_ptr + j).to(tl.int32)
        state, _ = _delta_node_step(
            state, mixed_ptr, a_ptr, b_ptr, node, stride_mn, stride_an, stride_bn, head, key_head, key_channels,
            scale, a_log, dt, key_dims, key_ok, value_dims, value_ok, dtype, KEY_DIM, VALUE_DIM)
        j += 1
    tl.store(state_ptr + tile, state, mask=tile_ok)


def gated_delta_path_(
    mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, path: torch.Tensor, num_k_heads: int, head_k_dim: int,
) -> None:
    """the qwen35 family's `gated_delta_path_` reference (`lucebox_qwen35.ops`): a tree's inputs as
    `gated_delta_tree` takes them, `state` `[1, H_v, D_k, D_v]` fp32 advanced in place along `path` `[L]`
    (node indices on the device, each the parent of the next). One launch; `path` is never read on the host."""
    _check_tree_shapes("gated_delta_path_", mixed, a, b, state, path, num_k_heads, head_k_dim)
    _, value_heads, key_dim, value_dim = state.shape
    if path.shape[0] == 0:
        return
    block_values = min(DELTA_BLOCK_VALUES, triton.next_power_of_2(value_dim))
    with _device_scope(mixed):
        _gated_delta_path_kernel[(value_heads, math.ceil(value_dim / block_values))](
            mixed, a, b, ssm_a, dt_bias, state, path.contiguous(),
            path.shape[0], key_dim**-0.5, num_k_heads, num_k_heads * head_k_dim,
            mixed.stride(1), a.stride(1), b.stride(1),
            KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_values,
        )


# -- GPU check and timing: python -m lucebox_cuda.triton_fused -------------------------------------------


def main() -> int:
    """Check every fused kernel against the `TorchBackend` composition on the GPU at the 27B decode shapes
    (fresh random inputs, the reference run in fp32 on the same rounded inputs) and time both."""
    import functools

    from lucebox_core.ops import with_family_ops
    from lucebox_core.torch_backend import TorchBackend

    from .timing import median_ms as _median_ms
    from .timing import relative_error as _relative_error

    if not torch.cuda.is_available():
        print("no CUDA device: run the CPU tests (tests/test_triton_fused.py) instead")
        return 1
    device = torch.device("cuda")
    torch.manual_seed(0)
    oracle = with_family_ops(TorchBackend(device, torch.float32, weight_cache_bytes=0))
    bounds = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}
    failures = []
    print(f"{'op':<40} {'dtype':<9} {'rel err':>9} {'triton ms':>10} {'torch ms':>9}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        reference = with_family_ops(TorchBackend(device, dtype, weight_cache_bytes=0))

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, device=device) * scale).to(dtype)

        stacked = randn(1, 1, 2 * 17408, scale=2)
        qkvz = randn(1, 1, 10240 + 6144)
        qg = randn(1, 1, 24, 512)
        ab = randn(1, 96, scale=3)
        mixed = randn(1, 10240)
        cases = [
            ("add_rms_norm 5120", add_rms_norm, "add_rms_norm",
             (randn(1, 1, 5120), randn(1, 1, 5120, scale=4), randn(5120), 1e-6)),
            ("add_rms_norm 4096 x 5120", add_rms_norm, "add_rms_norm",
             (randn(1, 4096, 5120), randn(1, 4096, 5120, scale=4), randn(5120), 1e-6)),
            ("silu_mul 17408 (stacked halves)", silu_mul, "silu_mul", tuple(stacked.split([17408, 17408], -1))),
            ("sigmoid_mul 24 x 256 (per-head gate)", sigmoid_mul, "sigmoid_mul",
             (randn(1, 1, 24, 256), qg[..., 256:])),
            ("gated_rms_norm 48 x 128 (z view)", gated_rms_norm, "gated_rms_norm",
             (randn(1, 1, 48, 128), qkvz[..., 10240:].reshape(1, 1, 48, 128), randn(128), 1e-6)),
            ("qk_norm_rope 24+4 heads x 256, rot 64", qk_norm_rope, "qk_norm_rope",
             (qg[..., :256], randn(1, 1, 4, 256), randn(256), randn(256),
              torch.tensor([30000], device=device), 64, 1e7, 1e-6)),
            ("gated_delta_decode_ 16/48 heads", gated_delta_decode_, "gated_delta_decode_",
             (mixed, ab[:, 48:], ab[:, :48], -4 * torch.rand(48, device=device), torch.randn(48, device=device),
              torch.randn(1, 48, 128, 128, device=device), 16, 128)),
        ]
        tree_mixed = randn(1, 23, 10240)
        tree_ab = randn(1, 23, 96, scale=3)
        parents = torch.tensor([-1] + [i // 2 for i in range(22)], device=device)
        cases.append(("gated_delta_tree 16/48 heads, 23 nodes", gated_delta_tree, "gated_delta_tree",
                      (tree_mixed, tree_ab[..., 48:], tree_ab[..., :48], -4 * torch.rand(48, device=device),
                       torch.randn(48, device=device), torch.randn(1, 48, 128, 128, device=device), parents, 16, 128)))
        for label, kernel, op, args in cases:
            upcast = tuple(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args)
            if op == "gated_delta_decode_":  # in place: each side gets its own copy of the state
                args = (*args[:5], args[5].clone(), *args[6:])
                upcast = (*upcast[:5], upcast[5].clone(), *upcast[6:])
            expected = getattr(oracle, op)(*upcast)
            result = kernel(*args)
            expected = expected if isinstance(expected, tuple) else (expected,)
            result = result if isinstance(result, tuple) else (result,)
            error = max(_relative_error(a, b) for a, b in zip(result, expected))
            if op == "gated_delta_decode_":
                error = max(error, _relative_error(args[5], upcast[5]))
            triton_ms = _median_ms(functools.partial(kernel, *args))
            torch_ms = _median_ms(functools.partial(getattr(reference, op), *args))
            name = str(dtype).removeprefix("torch.")
            print(f"{label:<40} {name:<9} {error:>9.2e} {triton_ms:>10.4f} {torch_ms:>9.4f}")
            if not error <= bounds[dtype]:
                failures.append(f"{label} {name}: relative error {error:.2e} > {bounds[dtype]:.0e}")
    for failure in failures:
        print("FAIL", failure)
    print("all fused kernels within bounds" if not failures else f"{len(failures)} fused kernel checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
