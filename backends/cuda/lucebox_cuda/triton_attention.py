"""Triton attention for many queries at once: prefill (FlashAttention-2 forward) and static tree verification.

- `attention`: `TorchBackend.attention` for q `[B, Tq, Hq, D]` against k/v `[B, Tk, Hkv, D]`: causal (with
  an offset into the cache), a bool mask, both or neither. One program owns BLOCK_M query rows of one KV
  head, where a row is a (token, query head of the group) pair: the group's heads share every K/V tile a
  program loads (GQA without repeating K/V), and a short chunk still fills the block. Online softmax in
  fp32, products on tensor cores in q's dtype. Key blocks wholly above the causal diagonal are never
  visited; blocks wholly below it skip the mask arithmetic.
- `tree_attention`: `TorchBackend.tree_attention`, N tree nodes against a fixed window of the KV cache
  with the committed length `position` on the device, and `decode_attention`, the same kernel for one
  node. Flash-decoding over each node's own key sequence (the committed rows, then its path in order),
  cut into fixed splits from position 0 that a second kernel merges in order: a verified node gets the
  decode step's result for the same path to the bit. No host value depends on device data: the call
  records into a CUDA graph.

Triton 3.6's interpreter cannot take a loop bound that is a tensor (a program id or a loaded value;
triton-lang/triton#9171 under numpy >= 2.4), so each key loop has two drivers chosen by a constexpr: on
the GPU a runtime-bound `range` (which Triton software-pipelines), under the interpreter a fixed trip count
that skips blocks past the bound. Both run the same block body, which is what the CPU tests check.

`python -m lucebox_cuda.triton_attention` checks and times both kernels on a GPU at the 27B shapes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from .triton_ops import (
    KV_FORMATS,
    _device_scope,
    _dot_precision,
    _last_dim_contiguous,
    _load_kv_row_ptrs,
    _load_kv_rows,
    device_offset,
    grid_dependency,
)
from . import triton_path_combine
from .triton_path_combine import PATH_BLOCK_N, PATH_BLOCKS_PER_SPLIT, PATH_NARROW_SPLITS, split_bounds, split_count
from .pdl import triton_options
from .timing import median_ms as _median_ms
from .timing import relative_error as _relative_error
from triton.runtime.errors import TritonError

LOG2_E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2(e)), one multiply folded into scale


class BlockConfig(NamedTuple):
    """Tile sizes and launch shape of one attention kernel."""

    block_m: int  # query rows ((token, head) pairs) per program
    block_n: int  # key rows per loop step
    num_warps: int
    num_stages: int  # K/V tiles in flight (the GPU loop's software pipeline)


def prefill_config(head_dim: int, value_dim: int, dtype: torch.dtype, has_mask: bool = False) -> BlockConfig:
    """The prefill tiles, in one place. An H100/H200 block gets at most 227 KiB of shared memory and a
    thread 255 registers; the fp32 accumulator is block_m x Dv, the scores block_m x block_n. The choices
    below compile for sm_90 without register spills (ptxas -v on Triton 3.6's PTX; with a bool mask the
    16-bit 256-dim kernel spills about 40 bytes):

    - 16-bit, dims up to 128: 128 query rows, 64 keys, 8 warps, 3 stages (the usual FA2 tile; 128 KiB).
    - 16-bit, dims of 256 (Qwen3.5) without a mask: 128 query rows, 64 keys, 8 warps, 2 stages. Q (64 KiB)
      plus two stages of K and V (4 x 32 KiB) is 192 KiB. Measured on the H200 (`scripts/attention_sweep.py`,
      4096 query tokens at the 27B's heads): 364 TFLOP/s at offset 0 and 520-524 at offsets 61440 and 126976,
      against 199-227 for 64 x 64 (and 317 for torch's SDPA at depth), with bit-identical outputs (each row's
      arithmetic does not depend on how rows are grouped into programs). A 128K dense prefill spends half its
      time here. With a bool mask: 64 query rows, 64 keys, 8 warps, 2 stages (Q 32 KiB + 128 KiB), not yet
      measured at 128 rows (the mask's registers).
    - fp32 (a correctness path, not a fast one): fp32 products run on CUDA cores with the operands in
      registers, so only 16 query rows; 8 warps and one stage at 256 dims.
    - 16-bit, dims of 512 (Gemma-4's full layers): 32 query rows, 32 keys, 8 warps, 2 stages: Q (32 KiB) and
      two stages of K and V (4 x 32 KiB) is 160 KiB (64 x 64 would need 320 KiB).
    """
    wide = max(head_dim, value_dim) > 128
    if dtype == torch.float32:
        return BlockConfig(16, 32, 8, 1) if wide else BlockConfig(16, 32, 4, 2)
    if max(head_dim, value_dim) > 256:
        return BlockConfig(32, 32, 8, 2)
    if wide and not has_mask:
        return BlockConfig(128, 64, 8, 2)
    return BlockConfig(64, 64, 8, 2) if wide else BlockConfig(128, 64, 8, 3)


# -- shared block body ---------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST_DOT (the interpreter with bf16, whose tl.dot multiplies bf16
    operands as raw integers): the same operand values, multiplied as fp32."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_tile(ptrs, row_ok, dim_ok, ROWS_MASKED: tl.constexpr, DIMS_MASKED: tl.constexpr):
    """A [rows, dims] tile; masks only where some lane can be out of range (unmasked loads vectorise)."""
    if ROWS_MASKED and DIMS_MASKED:
        return tl.load(ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    elif ROWS_MASKED:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif DIMS_MASKED:
        return tl.load(ptrs, mask=dim_ok[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _softmax_step(acc, running_max, running_sum, q, k, v, seen, qk_scale,
                  APPLY_SEEN: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One key block of the online softmax: scores q k^T in base 2, then rescale and accumulate p v.

    `seen` [M, N] (used when APPLY_SEEN) masks scores to -inf. A row that has seen nothing yet keeps max
    -inf, so the shift falls back to 0 rather than giving exp2(-inf - -inf) = NaN.
    """
    scores = _dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, UPCAST_DOT) * qk_scale  # [M, N] fp32
    if APPLY_SEEN:
        scores = tl.where(seen, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    probs = tl.exp2(scores - shift[:, None])
    rescale = tl.exp2(running_max - shift)
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)
    # p is rounded to q's dtype for the tensor cores, as the reference rounds it before its product with v.
    acc = acc * rescale[:, None] + _dot(probs.to(q.dtype), v.to(q.dtype), DOT_PRECISION, UPCAST_DOT)
    return acc, new_max, running_sum


# -- prefill -------------------------------------------------------------------------------------------


@triton.jit
def _prefill_key_block(
    acc, running_max, running_sum, q, key_start,
    k_ptr, v_ptr, mask_ptr, token, row_ok, dims, value_dims, k_len, causal_offset, qk_scale,
    stride_kt, stride_vt, stride_mq, stride_mk,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EDGE: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Keys key_start .. key_start + BLOCK_N. EDGE: the block may cross the causal diagonal or the end of
    the keys, so those masks apply; otherwise every row sees every key of the block (save the user mask)."""
    keys = key_start + tl.arange(0, BLOCK_N)
    key_ok = keys < k_len
    key_rows = keys.to(tl.int64)  # row offsets past 2^31 elements in a long cache
    k = _load_tile(k_ptr + key_rows[:, None] * stride_kt + dims[None, :], key_ok, dims < HEAD_DIM,
                   EDGE, BLOCK_D != HEAD_DIM)
    v = _load_tile(v_ptr + key_rows[:, None] * stride_vt + value_dims[None, :], key_ok, value_dims < VALUE_DIM,
                   EDGE, BLOCK_DV != VALUE_DIM)
    seen = key_ok[None, :]
    if EDGE and CAUSAL:
        seen = seen & (keys[None, :] <= causal_offset + token[:, None])
    if HAS_MASK:
        allowed = tl.load(mask_ptr + token.to(tl.int64)[:, None] * stride_mq + key_rows[None, :] * stride_mk,
                          mask=row_ok[:, None] & key_ok[None, :], other=0)
        seen = seen & (allowed != 0)
    return _softmax_step(acc, running_max, running_sum, q, k, v, seen, qk_scale,
                         EDGE or HAS_MASK, DOT_PRECISION, UPCAST_DOT)


@triton.jit(do_not_specialize=["q_len", "k_len", "causal_offset"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, offset_ptr,
    q_len, k_len, causal_offset, qk_scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_mb, stride_mq, stride_mk,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    STATIC_TRIPS: tl.constexpr, OFFSET_ON_DEVICE: tl.constexpr,
):
    """BLOCK_M (token, head) rows of one KV head's query group against all the keys they may see.

    Row r of the packed order is token r // GROUP, query head kv_head * GROUP + r % GROUP. STATIC_TRIPS:
    0 on the GPU; under the interpreter the key blocks of the longest loop, its fixed trip count.
    OFFSET_ON_DEVICE: the causal offset is read from `offset_ptr` (a recorded prefill's start position, which
    a graph replays with new values), not passed by value.
    """
    if OFFSET_ON_DEVICE:
        causal_offset = tl.load(offset_ptr).to(tl.int32)
        # The window's rows past the piece may hold anything (NaN would survive a masked score as 0 * NaN): the
        # keys end where the by-value call's would.
        k_len = tl.minimum(k_len, causal_offset + q_len)
    # The GPU starts programs in order of id: the last query blocks, which see the most keys under the
    # causal rule, go first so that the short ones fill the tail.
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    batch = tl.program_id(1) // KV_HEADS
    kv_head = tl.program_id(1) % KV_HEADS
    packed = block * BLOCK_M + tl.arange(0, BLOCK_M)
    token = packed // GROUP
    head = kv_head * GROUP + packed % GROUP
    row_ok = token < q_len
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)

    q = tl.load(q_ptr + batch.to(tl.int64) * stride_qb + token.to(tl.int64)[:, None] * stride_qt
                + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    k_ptr += batch.to(tl.int64) * stride_kb + kv_head * stride_kh
    v_ptr += batch.to(tl.int64) * stride_vb + kv_head * stride_vh
    mask_ptr += batch.to(tl.int64) * stride_mb

    # Keys every row of the block sees, in whole blocks (no causal or bound mask), then up to the last
    # key any row sees. Causal: the first token of the block sees keys <= offset + first, the last <=
    # offset + last; key blocks past that are never visited.
    key_end = k_len
    full_end = k_len
    if CAUSAL:
        first_token = block * BLOCK_M // GROUP
        last_token = tl.minimum((block * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        key_end = tl.minimum(key_end, causal_offset + last_token + 1)
        full_end = tl.minimum(full_end, causal_offset + first_token + 1)
    full_end = full_end // BLOCK_N * BLOCK_N

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if STATIC_TRIPS == 0:
        for key_start in range(0, full_end, BLOCK_N):
            acc, running_max, running_sum = _prefill_key_block(
                acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, mask_ptr, token, row_ok, dims,
                value_dims, k_len, causal_offset, qk_scale, stride_kt, stride_vt, stride_mq, stride_mk,
                HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL, HAS_MASK, DOT_PRECISION, UPCAST_DOT)
        for key_start in range(full_end, key_end, BLOCK_N):
            acc, running_max, running_sum = _prefill_key_block(
                acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, mask_ptr, token, row_ok, dims,
                value_dims, k_len, causal_offset, qk_scale, stride_kt, stride_vt, stride_mq, stride_mk,
                HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, HAS_MASK, DOT_PRECISION, UPCAST_DOT)
    else:
        for step in range(STATIC_TRIPS):
            key_start = step * BLOCK_N
            if key_start < full_end:
                acc, running_max, running_sum = _prefill_key_block(
                    acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, mask_ptr, token, row_ok, dims,
                    value_dims, k_len, causal_offset, qk_scale, stride_kt, stride_vt, stride_mq, stride_mk,
                    HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL, HAS_MASK, DOT_PRECISION,
                    UPCAST_DOT)
        for step in range(STATIC_TRIPS):
            key_start = full_end + step * BLOCK_N
            if key_start < key_end:
                acc, running_max, running_sum = _prefill_key_block(
                    acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, mask_ptr, token, row_ok, dims,
                    value_dims, k_len, causal_offset, qk_scale, stride_kt, stride_vt, stride_mq, stride_mk,
                    HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, HAS_MASK, DOT_PRECISION,
                    UPCAST_DOT)

    # 0 / 0 = NaN for a row that sees no key, as the reference gives; padding rows (never stored) divide by 1.
    out = acc / tl.where(row_ok, running_sum, 1.0)[:, None]
    tl.store(out_ptr + batch.to(tl.int64) * stride_ob + token.to(tl.int64)[:, None] * stride_ot
             + head[:, None] * stride_oh + value_dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (value_dims[None, :] < VALUE_DIM))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
    causal_offset: int | torch.Tensor | None = None, mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None, config: BlockConfig | None = None,
) -> torch.Tensor:
    """`TorchBackend.attention`: q `[B, Tq, Hq, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]` (any strides
    but a contiguous last dim; Hq a multiple of Hkv) -> `[B, Tq, Hq, Dv]` in q's dtype.

    `causal_offset=p >= 0`: query i sees keys j <= p + i; p may be a `[1]` integer tensor on q's device,
    read by the kernel (never by the host: a graph records it). `mask`: bool `[Tq, Tk]` or `[B, Tq, Tk]` on q's
    device, True where a query may see a key; combined with the causal rule when both are given. Products
    in q's dtype with fp32 accumulation (the reference computes in fp32: expect bf16-sized differences).
    `out`: a `[B, Tq, Hq, Dv]` tensor of q's dtype with a contiguous last dim to write into. `config`:
    tiles other than `prefill_config`'s (for tuning).
    """
    batch, q_len, q_heads, head_dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    value_dim = v.shape[3]
    if (k.shape != (batch, k_len, kv_heads, head_dim) or v.shape[:3] != (batch, k_len, kv_heads)
            or q_heads % kv_heads or k_len == 0):
        raise ValueError(f"attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    on_device = device_offset(causal_offset, q)
    if out is None:
        out = torch.empty(batch, q_len, q_heads, value_dim, device=q.device, dtype=q.dtype)
    elif out.shape != (batch, q_len, q_heads, value_dim) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {q.dtype} tensor of shape {(batch, q_len, q_heads, value_dim)}")
    if q_len == 0:
        return out
    if mask is not None:
        if mask.shape[-2:] != (q_len, k_len) or mask.dim() not in (2, 3):
            raise ValueError(f"mask must be [Tq, Tk] or [B, Tq, Tk] = {(q_len, k_len)}, not {tuple(mask.shape)}")
        # Bytes the kernel reads as 0 / non-zero; a batch dim of stride 0 when one mask serves all.
        mask = mask.to(device=q.device, dtype=torch.bool).expand(batch, q_len, k_len).view(torch.uint8)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    group = q_heads // kv_heads
    config = config or prefill_config(head_dim, value_dim, q.dtype, has_mask=mask is not None)
    interpreted = not q.is_cuda
    mask_arg = mask if mask is not None else out  # never read without HAS_MASK
    mask_strides = mask.stride() if mask is not None else (0, 0, 0)
    grid = (triton.cdiv(q_len * group, config.block_m), batch * kv_heads)
    with _device_scope(q):
        _attention_kernel[grid](
            q, k, v, mask_arg, out, causal_offset if on_device else out,
            q_len, k_len, 0 if on_device else causal_offset or 0, scale * LOG2_E,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), *mask_strides,
            KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, VALUE_DIM=value_dim,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_DV=max(16, triton.next_power_of_2(value_dim)),
            CAUSAL=causal_offset is not None, HAS_MASK=mask is not None, DOT_PRECISION=_dot_precision(q.dtype),
            UPCAST_DOT=interpreted and q.dtype == torch.bfloat16,
            STATIC_TRIPS=triton.cdiv(k_len, config.block_n) if interpreted else 0, OFFSET_ON_DEVICE=on_device,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out


# -- tree verification and the decode step -------------------------------------------------------------


@triton.jit
def _path_key_block(
    acc, running_max, running_sum, q, block_start, end, committed, rank, other_ok, path_len, rows, k_ptr, v_ptr,
    node_k_ptr, node_v_ptr, dims, value_dims, scale, stride_kt, stride_vt, stride_nkt, stride_nvt,
    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, K_FORMAT: tl.constexpr, V_FORMAT: tl.constexpr, NODE_ROWS: tl.constexpr,
    RING: tl.constexpr,
):
    """Logical key positions block_start .. block_start + BLOCK_N of one node's sequence: one step of the
    online softmax (the same operations, in the same order, for every node and for the decode step)."""
    logical = block_start + tl.arange(0, BLOCK_N)
    row_ok = logical < end
    if RING:
        # A ring's logical sequence is its slots in slot order; slot s holds path position committed + t
        # with t = (s - committed) mod RING when t < path_len, else its committed row.
        t = (logical + (RING - committed % RING)) % RING
        from_node = t < path_len
    else:
        # Logical position committed + t holds the path's t-th node.
        t = logical - committed
        from_node = logical >= committed
    # The path's t-th node is index #{j : rank[j] <= t}.
    path_node = tl.sum(((rank[None, :] <= t[:, None]) & other_ok[None, :]).to(tl.int32), axis=1)
    if NODE_ROWS:  # node rows in their own tensor, the cache's rows where no path node sits
        row = tl.where(from_node, path_node, logical)
        row_ok = row_ok & (from_node | (row < rows))
        row = row.to(tl.int64)
        # One load of per-row pointers (the node rows are in the cache's storage format): a tile in shared
        # memory as large as the plain path's (two loads and a select would double it).
        k_rows = tl.where(from_node, node_k_ptr + row * stride_nkt, k_ptr + row * stride_kt)
        k = _load_kv_row_ptrs(k_rows, row_ok, dims, dims < HEAD_DIM, K_FORMAT)
    else:
        row = tl.where(logical < committed, logical, committed + path_node)
        # A path node past the window (a window shorter than the tree) is not seen; never in the engine.
        row_ok = row_ok & (row < rows)
        row = row.to(tl.int64)
        k = _load_kv_rows(k_ptr, row, row_ok, dims, dims < HEAD_DIM, stride_kt, K_FORMAT)
    # Products in q's dtype: the window is read once, never upcast in memory.
    scores = _dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, UPCAST_DOT) * scale  # [G, N] fp32
    scores = tl.where(row_ok[None, :], scores, float("-inf"))
    block_max = tl.maximum(running_max, tl.max(scores, axis=1))
    # -inf only when nothing was seen yet (a window shorter than the tree): shift by 0, not NaN.
    shift = tl.where(block_max == float("-inf"), 0.0, block_max)
    rescale = tl.exp(running_max - shift)
    probs = tl.exp(scores - shift[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)
    if NODE_ROWS:
        v_rows = tl.where(from_node, node_v_ptr + row * stride_nvt, v_ptr + row * stride_vt)
        v = _load_kv_row_ptrs(v_rows, row_ok, value_dims, value_dims < VALUE_DIM, V_FORMAT)
    else:
        v = _load_kv_rows(v_ptr, row, row_ok, value_dims, value_dims < VALUE_DIM, stride_vt, V_FORMAT)
    acc = acc * rescale[:, None] + _dot(probs.to(q.dtype), v.to(q.dtype), DOT_PRECISION, UPCAST_DOT)
    return acc, block_max, running_sum


@triton.jit
def _path_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, node_k_ptr, node_v_ptr, position_ptr, visible_ptr, max_ptr, sum_ptr, acc_ptr,
    nodes, rows, scale,
    stride_qn, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_nkt, stride_nkh, stride_nvt,
    stride_nvh, stride_visible_n,
    Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_NODES: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    K_FORMAT: tl.constexpr, V_FORMAT: tl.constexpr, NODE_ROWS: tl.constexpr, RING: tl.constexpr,
    STATIC_TRIPS: tl.constexpr, NARROW_SPLITS: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """Partial attention of one node's GROUP query heads (one KV head) over one split of its key sequence.

    A node's key sequence is its path as plain decoding would have laid it out: the committed rows
    0 .. position-1, then its ancestors and itself (the nodes its `visible` row allows, in index order)
    at logical positions position, position + 1, ... Key tiles are cut from that logical sequence in
    fixed splits from position 0 (the first NARROW_SPLITS of one BLOCK_N each, the rest of BLOCKS_PER_SPLIT x
    BLOCK_N: `split_bounds`), and a node row is fetched from wherever
    the tree put it (row position + i for node i, or row i of the node tensors with NODE_ROWS). With RING
    (a sliding layer's ring of RING slots, position p in slot p % RING) the sequence is the slots in slot
    order, the path's positions in their slots: what the decode step reads from the ring once the path is
    committed (NODE_ROWS then: the ring holds only committed rows). So a node computes exactly what the one-token decode
    step computes for the same token once its path is committed, to the bit: the same tiles, the same
    masks, the same order of every sum. Writes per (node, head, split) the max score, the sum of
    exp(score - max) and the unnormalised output. STATIC_TRIPS: 0 on the GPU; under the interpreter,
    BLOCKS_PER_SPLIT.
    """
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    node = tl.program_id(2)
    splits = tl.num_programs(1)
    group_index = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + group_index
    head_ok = group_index < GROUP
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    # The group's query heads are the rows of a small matrix, padded to the 16 rows tl.dot needs.
    q = tl.load(q_ptr + node * stride_qn + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)

    committed = tl.load(position_ptr)
    others = tl.arange(0, BLOCK_NODES)
    other_ok = others < nodes
    on_path = tl.load(visible_ptr + node * stride_visible_n + others, mask=other_ok, other=0).to(tl.int32)
    on_path = tl.where(other_ok & (on_path != 0), 1, 0)
    rank = tl.cumsum(on_path, axis=0)  # path nodes among 0 .. j
    path_len = tl.sum(on_path, axis=0)
    if RING:  # the slots of a ring that has wrapped, or those up to the node's position
        seen_end = tl.minimum(committed + path_len, RING)
    elif NODE_ROWS:  # the committed rows (the caller's window covers them), then the path
        seen_end = committed + path_len
    else:
        seen_end = tl.minimum(committed + path_len, rows)
    start, end = split_bounds(split, NARROW_SPLITS, BLOCKS_PER_SPLIT, BLOCK_N)
    end = tl.minimum(end, seen_end)

    running_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    k_ptr += kv_head * stride_kh
    v_ptr += kv_head * stride_vh
    node_k_ptr += kv_head * stride_nkh
    node_v_ptr += kv_head * stride_nvh
    if STATIC_TRIPS == 0:  # the GPU: a runtime-bound loop, which Triton software-pipelines
        for block_start in range(start, end, BLOCK_N):
            acc, running_max, running_sum = _path_key_block(
                acc, running_max, running_sum, q, block_start, end, committed, rank, other_ok, path_len, rows,
                k_ptr, v_ptr, node_k_ptr, node_v_ptr, dims, value_dims, scale, stride_kt, stride_vt, stride_nkt,
                stride_nvt, HEAD_DIM, VALUE_DIM, BLOCK_N, DOT_PRECISION, UPCAST_DOT, K_FORMAT, V_FORMAT, NODE_ROWS,
                RING)
    else:  # the interpreter: a fixed trip count and a skip (it cannot take a loop bound read from memory)
        for block in range(STATIC_TRIPS):
            block_start = start + block * BLOCK_N
            if block_start < end:
                acc, running_max, running_sum = _path_key_block(
                    acc, running_max, running_sum, q, block_start, end, committed, rank, other_ok, path_len,
                    rows, k_ptr, v_ptr, node_k_ptr, node_v_ptr, dims, value_dims, scale, stride_kt, stride_vt,
                    stride_nkt, stride_nvt, HEAD_DIM, VALUE_DIM, BLOCK_N, DOT_PRECISION, UPCAST_DOT, K_FORMAT, V_FORMAT,
                    NODE_ROWS, RING)

    # A split past the node's sequence stores max -inf, sum 0 and output 0: the combine adds exact zeros.
    partial = ((node * Q_HEADS + heads) * splits + split).to(tl.int64)  # x VALUE_DIM can pass 2^31
    tl.store(max_ptr + partial, running_max, mask=head_ok)
    tl.store(sum_ptr + partial, running_sum, mask=head_ok)
    tl.store(acc_ptr + partial[:, None] * VALUE_DIM + value_dims[None, :], acc,
             mask=head_ok[:, None] & (value_dims[None, :] < VALUE_DIM))


# 4 warps and two K/V tiles in flight (2 x 64 KiB at 256 dims in 16 bits): two programs can share an SM.
# Fixed too: the tile layout decides the order of each dot product's sums.
PATH_WARPS = 4
PATH_STAGES = 2


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, visible: torch.Tensor, *,
    scale: float, node_k: torch.Tensor | None = None, node_v: torch.Tensor | None = None, ring: int = 0,
    out: torch.Tensor | None = None, block_n: int = PATH_BLOCK_N, blocks_per_split: int = PATH_BLOCKS_PER_SPLIT,
    narrow_splits: int = PATH_NARROW_SPLITS, head_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """`TorchBackend.tree_attention` (and, with one node that sees itself, `decode_attention`): q
    `[1, N, Hq, D]`; k `[W, Hkv, D]`, v `[W, Hkv, Dv]` (the first W rows of the cache; rows `position + i`
    hold node i, unless `node_k`/`node_v` `[N, Hkv, D|Dv]` hold them), each values or a quantized cache's raw
    rows (uint8 Q8_0 `[W, Hkv, D / 32 * 34]`, Q4_0 / TQ3_0 `[W, Hkv, D / 32, 18 | 14]`, decoded in registers;
    node rows are values; over TQ3_0 K the query is rotated forward first, over TQ3_0 V the output back
    after); `position` `[1]` long and `visible` bool `[N, N]` (ancestors and self), both on q's device ->
    `[1, N, Hq, Dv]` in q's dtype. Node n
    sees the committed rows `< position` and its path. `ring` (with node rows): the cache is a sliding
    layer's ring of that many slots (position p in slot p % ring), each node seeing the last `ring` positions.

    Each node runs the decode step's arithmetic over its own path (see the split kernel): a verified
    node's output equals, bit for bit, what decoding its path token by token gives (the decode step calling
    this with one node, in the same mode). A fixed (N, W) gives a fixed launch, so the call records into a
    CUDA graph. `out`: a `[1, N, Hq, Dv]` tensor of q's dtype with a contiguous last dim to write into.
    `block_n`, `blocks_per_split`, `narrow_splits`: the fixed partition (`split_bounds`; tests use small
    ones; decode and verify must use the same). `head_gate` `[N, Hq]` (or `[1, N, Hq]`): each output times
    softplus(gate) per (node, head), in the merge (`triton_path_combine`), rounded as
    `lucebox_laguna.ops.softplus_head_gate` after this.
    """
    from lucebox_core.kv_quant import rotate_tq3, stored_dim, stored_format

    from .triton_gates import softplus_head_gate

    k_format, v_format = stored_format(k), stored_format(v)
    head_dim, value_dim = stored_dim(k), stored_dim(v)
    # Q4_0 / TQ3_0 windows `[W, Hkv, blocks, bytes]` are read as byte rows, like Q8_0's.
    k, v = (t.flatten(2) if t.dim() == 4 else t for t in (k, v))
    rows, kv_heads = k.shape[:2]
    _, nodes, q_heads, _ = q.shape
    node_rows = node_k is not None
    if (q.shape[0] != 1 or q.shape[3] != head_dim or v.shape[:2] != (rows, kv_heads) or q_heads % kv_heads
            or visible.shape != (nodes, nodes) or nodes == 0):
        raise ValueError(f"tree_attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"visible {tuple(visible.shape)}")
    if node_rows != (node_v is not None) or (ring and not node_rows) or ring < 0 or (node_rows and (
            node_k.shape != (nodes, kv_heads, head_dim) or node_v.shape != (nodes, kv_heads, value_dim)
            or not node_k.is_floating_point() or not node_v.is_floating_point())):
        raise ValueError(f"tree_attention node rows: node_k {None if node_k is None else tuple(node_k.shape)}, "
                         f"node_v {None if node_v is None else tuple(node_v.shape)} (values [N, Hkv, D] both, "
                         f"N = {nodes}), ring {ring} (needs node rows)")
    if out is None:
        out = torch.empty(1, nodes, q_heads, value_dim, device=q.device, dtype=q.dtype)
    elif out.shape != (1, nodes, q_heads, value_dim) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {q.dtype} tensor of shape {(1, nodes, q_heads, value_dim)}")
    if head_gate is not None:
        head_gate = head_gate.reshape(nodes, q_heads)
    if k_format == "tq3_0":  # the kernel reads TQ3_0 keys in their rotated domain: q . k = Rq . Rk
        q = rotate_tq3(q)
    # TQ3_0 values give the output in their rotated domain: the kernels write it here, rotated back below.
    kernel_out = torch.empty_like(out) if v_format == "tq3_0" else out
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    if node_rows:  # in the cache's storage format (they are rows as the cache reads them back)
        node_k = _last_dim_contiguous(_as_stored_like(node_k, k, k_format))
        node_v = _last_dim_contiguous(_as_stored_like(node_v, v, v_format))
    else:  # never read
        node_k = node_v = k
    visible = visible.to(torch.bool).view(torch.uint8)  # the kernel reads bytes: 0 or not
    if visible.stride(-1) != 1:
        visible = visible.contiguous()
    group = q_heads // kv_heads
    # Splits that cover every node's sequence: the window, or (node rows) the committed rows a window
    # covers plus the path; a ring's sequence is at most its slots. Splits past a sequence add exact zeros.
    sequence = rows if not node_rows else min(rows + nodes, ring) if ring else rows + nodes
    if block_n < 1 or blocks_per_split < 1 or narrow_splits < 0:  # e.g. a bad LUCEBOX_PATH_* override
        raise ValueError(f"tree_attention partition: block_n {block_n}, blocks_per_split {blocks_per_split}, "
                         f"narrow_splits {narrow_splits} (need >= 1, >= 1, >= 0)")
    splits = split_count(sequence, block_n, blocks_per_split, narrow_splits)
    interpreted = not q.is_cuda
    split_max = torch.empty(nodes * q_heads, splits, device=q.device, dtype=torch.float32)
    split_sum = torch.empty_like(split_max)
    split_acc = torch.empty(nodes * q_heads, splits, value_dim, device=q.device, dtype=torch.float32)
    with _device_scope(q):
        _path_attention_split_kernel[(kv_heads, splits, nodes)](
            q, k, v, node_k, node_v, position, visible, split_max, split_sum, split_acc,
            nodes, rows, scale,
            q.stride(1), q.stride(2), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            node_k.stride(0), node_k.stride(1), node_v.stride(0), node_v.stride(1), visible.stride(0),
            Q_HEADS=q_heads, GROUP=group, HEAD_DIM=head_dim, VALUE_DIM=value_dim,
            BLOCKS_PER_SPLIT=blocks_per_split, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_DV=max(16, triton.next_power_of_2(value_dim)),
            BLOCK_NODES=max(16, triton.next_power_of_2(nodes)),
            DOT_PRECISION=_dot_precision(q.dtype), UPCAST_DOT=interpreted and q.dtype == torch.bfloat16,
            K_FORMAT=KV_FORMATS[k_format], V_FORMAT=KV_FORMATS[v_format], NODE_ROWS=node_rows, RING=ring,
            STATIC_TRIPS=blocks_per_split if interpreted else 0, NARROW_SPLITS=narrow_splits,
            num_warps=PATH_WARPS, num_stages=PATH_STAGES, **triton_options(q),
        )
        # A TQ3_0 V's output is gated after its rotation back (below), as the reference rounds it.
        triton_path_combine.combine(split_max, split_sum, split_acc, kernel_out,
                                    head_gate if kernel_out is out else None)
    if kernel_out is not out:
        out.copy_(rotate_tq3(kernel_out, inverse=True))
        if head_gate is not None:
            out.copy_(softplus_head_gate(out[0], head_gate)[None])
    return out


def _as_stored_like(rows: torch.Tensor, cache: torch.Tensor, kind: str | None) -> torch.Tensor:
    """Node rows (values as the cache reads them back) in the storage of `cache` (a window as the kernel reads
    it, blocks as byte rows): blocks of `kind` again (re-quantizing decoded Q8_0 / Q4_0 rows gives back their
    bytes, TQ3_0's but for float rounding in the rotation) or the cache's dtype (values it holds exactly)."""
    from lucebox_core.kv import quantize_q8_0
    from lucebox_core.kv_quant import quantize_q4_0, quantize_tq3_0

    quantizers = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0, "tq3_0": quantize_tq3_0}
    if kind is not None:
        return quantizers[kind](rows)
    return rows.to(cache.dtype)


_ONE_NODE: dict[torch.device, torch.Tensor] = {}


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, *, scale: float,
                     out: torch.Tensor | None = None, block_n: int = PATH_BLOCK_N,
                     blocks_per_split: int = PATH_BLOCKS_PER_SPLIT,
                     narrow_splits: int = PATH_NARROW_SPLITS) -> torch.Tensor:
    """`TorchBackend.decode_attention` as a one-node `tree_attention`: the decode step and a verify pass
    run the same kernel over the same key partition, so they agree to the bit (q `[1, 1, Hq, D]`)."""
    one = _ONE_NODE.get(q.device)
    if one is None:
        one = _ONE_NODE[q.device] = torch.ones(1, 1, dtype=torch.bool, device=q.device)
    return tree_attention(q, k, v, position, one, scale=scale, out=out, block_n=block_n,
                          blocks_per_split=blocks_per_split, narrow_splits=narrow_splits)


# -- helpers -------------------------------------------------------------------------------------------


# -- GPU check and timing: python -m lucebox_cuda.triton_attention ------------------------------------

# 27B's full-attention layers: 24 query heads over 4 KV heads of 256 dims.
Q_HEADS_27B, KV_HEADS_27B, HEAD_DIM_27B = 24, 4, 256
# Relative error bounds against the fp32 oracle on the same (rounded) inputs.
ERROR_BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (query tokens, causal offset, dtype) of the prefill checks; the tile candidates are timed on the tuning case.
PREFILL_CASES = [(512, 0, torch.bfloat16), (512, 0, torch.float16), (512, 0, torch.float32),
                 (4096, 0, torch.bfloat16), (4096, 28672, torch.bfloat16)]
PREFILL_TUNING_CASE = (4096, 0, torch.bfloat16)
# (tree nodes, window rows, dtype) of the tree checks; the committed prefix fills the window up to 64 rows.
TREE_CASES = [(n, w, torch.bfloat16) for w in (8192, 32768) for n in (1, 8, 23, 64)] + [(8, 8192, torch.float32)]
# Prefill tiles `main` times besides `prefill_config`'s, for tuning (ptxas -v for sm_90: 128 x 32 on 8 warps
# takes 128 KiB and 254 registers, no spill; 64 x 32 on 4 warps 96 KiB, so two programs can share an SM,
# with a 12-byte spill).
PREFILL_CANDIDATES = (BlockConfig(128, 32, 8, 2), BlockConfig(64, 32, 4, 2))


def _sdpa_yardstick(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> Callable[[], Any]:
    """torch's fused attention on the same problem (K/V heads repeated for GQA, bottom-right causal)."""
    from torch.nn.attention.bias import causal_lower_right

    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    bias = causal_lower_right(q.shape[1], k.shape[1]) if offset else None
    return lambda: torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=bias, is_causal=not offset, scale=q.shape[3] ** -0.5)


def _check(label: str, dtype: torch.dtype, result: torch.Tensor, expected: torch.Tensor, failures: list[str]) -> float:
    error = _relative_error(result, expected)
    if not error <= ERROR_BOUNDS[dtype]:
        failures.append(f"{label} {dtype}: relative error {error:.2e} > {ERROR_BOUNDS[dtype]:.0e}")
    return error


def _prefill_rows(device: torch.device, oracle: Any, failures: list[str]) -> None:
    print(f"{'prefill (27B heads)':<34} {'dtype':<9} {'rel err':>9} {'ms':>8} {'TFLOP/s':>8} {'sdpa ms':>8}")
    for tokens, offset, dtype in PREFILL_CASES:
        keys = offset + tokens
        q = torch.randn(1, tokens, Q_HEADS_27B, HEAD_DIM_27B, device=device).to(dtype)
        k = torch.randn(1, keys, KV_HEADS_27B, HEAD_DIM_27B, device=device).to(dtype)
        v = torch.randn(1, keys, KV_HEADS_27B, HEAD_DIM_27B, device=device).to(dtype)
        scale = HEAD_DIM_27B**-0.5
        expected = oracle.attention(q.float(), k.float(), v.float(), scale=scale, causal_offset=offset)
        out = torch.full_like(q, float("nan"))
        label = f"Tq {tokens} offset {offset}"
        error = _check(f"attention {label}", dtype, attention(q, k, v, scale=scale, causal_offset=offset, out=out),
                       expected, failures)
        del expected
        # Useful work only: query i sees offset + i + 1 keys; two products of 2 * D flops per pair and head.
        flops = 4 * HEAD_DIM_27B * Q_HEADS_27B * (tokens * offset + tokens * (tokens + 1) // 2)
        run = functools.partial(attention, q, k, v, scale=scale, causal_offset=offset, out=out)
        ms = _median_ms(run)
        sdpa = "n/a"
        if dtype != torch.float32:
            with contextlib.suppress(Exception):  # no fused kernel for this case: leave the column at n/a
                sdpa = f"{_median_ms(_sdpa_yardstick(q, k, v, offset)):.3f}"
        name = str(dtype).removeprefix("torch.")
        print(f"{label:<34} {name:<9} {error:>9.2e} {ms:>8.3f} {flops / ms / 1e9:>8.1f} {sdpa:>8}")
        if (tokens, offset, dtype) == PREFILL_TUNING_CASE:
            for config in PREFILL_CANDIDATES:
                tiles = f"  tiles {config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}"
                try:
                    ms = _median_ms(functools.partial(run, config=config))
                except (TritonError, RuntimeError) as error:  # a candidate that does not fit is reported, not fatal
                    print(f"{tiles:<34} {name:<9} failed: {type(error).__name__}: {str(error)[:60]}")
                    continue
                print(f"{tiles:<34} {name:<9} {'':>9} {ms:>8.3f} {flops / ms / 1e9:>8.1f}")


def _tree_rows(device: torch.device, oracle: Any, reference: dict[torch.dtype, Any], failures: list[str]) -> None:
    from lucebox_core.speculative.trees import TreeIndex

    print(f"{'tree verify (27B heads)':<34} {'dtype':<9} {'rel err':>9} {'ms':>8} {'KV GB/s':>8} {'torch ms':>8}")
    for nodes, window, dtype in TREE_CASES:
        parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]  # a binary tree
        visible = TreeIndex.build(parents).visibility().to(device)
        position = torch.tensor([window - 64], device=device)  # the whole window in use
        q = torch.randn(1, nodes, Q_HEADS_27B, HEAD_DIM_27B, device=device).to(dtype)
        k = torch.randn(window, KV_HEADS_27B, HEAD_DIM_27B, device=device).to(dtype)
        v = torch.randn(window, KV_HEADS_27B, HEAD_DIM_27B, device=device).to(dtype)
        scale = HEAD_DIM_27B**-0.5
        expected = oracle.tree_attention(q.float(), k.float(), v.float(), position, visible, scale=scale)
        out = torch.full_like(q, float("nan"))
        label = f"N {nodes} window {window}"
        error = _check(f"tree_attention {label}", dtype,
                       tree_attention(q, k, v, position, visible, scale=scale, out=out), expected, failures)
        kv_bytes = (window - 64 + nodes) * KV_HEADS_27B * 2 * HEAD_DIM_27B * k.element_size()
        ms = _median_ms(functools.partial(tree_attention, q, k, v, position, visible, scale=scale, out=out))
        torch_ms = _median_ms(functools.partial(reference[dtype].tree_attention, q, k, v, position, visible,
                                                scale=scale))
        name = str(dtype).removeprefix("torch.")
        print(f"{label:<34} {name:<9} {error:>9.2e} {ms:>8.3f} {kv_bytes / ms / 1e6:>8.0f} {torch_ms:>8.3f}")


def _decode_rows(device: torch.device, oracle: Any, reference: dict, failures: list[str]) -> None:
    """The decode step's attention (one node) at 27B heads, plain and quantized windows (Q8_0, Q4_0, TQ3_0
    K/V, read in place), bf16."""
    from lucebox_core.kv import FullKVCache, KVLayerShape

    print(f"{'decode (27B heads, bf16)':<34} {'rel err':>9} {'ms':>8} {'torch ms':>8}")
    scale = HEAD_DIM_27B**-0.5
    for window, position, kind in ((4096, 3000, None), (32768, 32767, None), (32768, 1000, None),
                                   (32768, 30000, "q8_0"), (32768, 30000, "q4_0"), (32768, 30000, "tq3_0")):
        q = torch.randn(1, 1, Q_HEADS_27B, HEAD_DIM_27B, device=device).bfloat16()
        k = torch.randn(window, KV_HEADS_27B, HEAD_DIM_27B, device=device).bfloat16()
        v = torch.randn(window, KV_HEADS_27B, HEAD_DIM_27B, device=device).bfloat16()
        if kind is not None:  # the window as the cache stores it
            cache = FullKVCache({0: KVLayerShape(KV_HEADS_27B, HEAD_DIM_27B, HEAD_DIM_27B)}, window,
                                dtype=torch.bfloat16, device=device, k_type=kind, v_type=kind)
            cache.write(0, torch.arange(window, device=device), k, v)
            k, v = cache.gather(0, window)
        at = torch.tensor([position], device=device)
        expected = oracle.decode_attention(q.float(), k if kind else k.float(), v if kind else v.float(), at,
                                           scale=scale)
        out = torch.full_like(q, float("nan"))
        label = f"window {window} position {position}" + (f" {kind.upper()} K/V" if kind else "")
        error = _check(f"decode_attention {label}", torch.bfloat16,
                       decode_attention(q, k, v, at, scale=scale, out=out), expected, failures)
        ms = _median_ms(functools.partial(decode_attention, q, k, v, at, scale=scale, out=out))
        torch_ms = _median_ms(functools.partial(reference[torch.bfloat16].decode_attention, q, k, v, at, scale=scale))
        print(f"{label:<34} {error:>9.2e} {ms:>8.3f} {torch_ms:>8.3f}")


def _check_tree_graph_replay(device: torch.device, oracle: Any, failures: list[str]) -> None:
    """Record tree_attention in a CUDA graph, move the device position, replay: the output must follow."""
    from lucebox_core.speculative.trees import TreeIndex

    nodes, window = 23, 8192
    visible = TreeIndex.build([-1] + [(i - 1) // 3 for i in range(1, nodes)]).visibility().to(device)
    q = torch.randn(1, nodes, Q_HEADS_27B, HEAD_DIM_27B, device=device).bfloat16()
    k = torch.randn(window, KV_HEADS_27B, HEAD_DIM_27B, device=device).bfloat16()
    v = torch.randn(window, KV_HEADS_27B, HEAD_DIM_27B, device=device).bfloat16()
    position = torch.tensor([100], device=device)
    out = torch.empty_like(q)
    tree_attention(q, k, v, position, visible, scale=0.0625, out=out)  # compile outside the capture
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        tree_attention(q, k, v, position, visible, scale=0.0625, out=out)
    worst = 0.0
    for start in (5000, 17):
        position.fill_(start)
        graph.replay()
        expected = oracle.tree_attention(q.float(), k.float(), v.float(), position, visible, scale=0.0625)
        worst = max(worst, _check(f"tree_attention graph replay at {start}", torch.bfloat16, out, expected, failures))
    print(f"tree_attention N {nodes} window {window} replayed from a CUDA graph at 2 positions: rel err {worst:.2e}")


def main() -> int:
    """Check both kernels against the fp32 torch reference at the 27B shapes and time them; print tables.

    Outputs are poisoned with NaN before the checked run. Returns 1, naming the case, if a relative error
    exceeds its dtype's bound.
    """
    from lucebox_core.torch_backend import TorchBackend

    if not torch.cuda.is_available():
        print("no CUDA device: run the CPU tests (tests/test_triton_attention.py) instead")
        return 1
    device = torch.device("cuda")
    torch.manual_seed(0)
    oracle = TorchBackend(device, torch.float32, weight_cache_bytes=0)
    reference = {dtype: TorchBackend(device, dtype, weight_cache_bytes=0) for dtype in (torch.bfloat16, torch.float32)}
    failures: list[str] = []
    print(f"{torch.cuda.get_device_name(device)}, Triton {triton.__version__}, torch {torch.__version__}")
    _prefill_rows(device, oracle, failures)
    _decode_rows(device, oracle, reference, failures)
    _tree_rows(device, oracle, reference, failures)
    _check_tree_graph_replay(device, oracle, failures)
    for failure in failures:
        print("FAIL", failure)
    print("all attention checks within bounds" if not failures else f"{len(failures)} attention checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
