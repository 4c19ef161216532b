"""Prefill attention with the key range cut into spans: flash-decoding for short chunks over a long cache.

`triton_attention.attention` gives each program BLOCK_M (token, query head) rows of one KV head and walks
every key those rows see in one loop. A chunk of a few hundred tokens over a long cache is then a few
programs on a GPU of 132 SMs, each walking the whole cache: the H200 (session 14, the 27B at depth 32K)
spent 85 ms on a 3-token forward call and 119 ms on a 256-token one, most of it in those few programs (4 and
48 of them). That is the second turn of a conversation restored from the prefix cache: its new tokens
arrive in short pieces cut at the turn boundaries, each attending to the whole conversation.

Here each program owns the same rows but one span of the keys (a whole number of key blocks); it leaves its
rows' unnormalised accumulator, running max and running sum in fp32, and `_combine` merges the spans (the
online softmax's rescaling, once per span). The block body is the prefill kernel's own
(`_prefill_key_block`): the same causal rule, offset and bool mask.

`key_splits` decides: only on a GPU, only when the plain grid leaves most SMs idle and the keys are many.
The decision depends on the shapes and the GPU alone, so the same prompt piece takes the same path in every
run (what the prefix cache's bit-exactness needs: a restored sequence prefills its suffix in the pieces a
cold prefill cuts there).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import triton_attention
from .triton_attention import LOG2_E, BlockConfig, _prefill_key_block, prefill_config
from .triton_ops import _device_scope, _dot_precision, _last_dim_contiguous, device_offset

# Below this many keys one loop per program is short enough; a span is at least this many keys too.
MIN_SPAN_KEYS = 1024
# Programs wanted per SM once split (two keep the SMs busy while the slowest spans finish).
PROGRAMS_PER_SM = 2


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def key_splits(q: torch.Tensor, k: torch.Tensor, *, has_mask: bool = False,
               multiprocessors: int | None = None) -> int:
    """How many key spans `attention` should use for q `[B, Tq, Hq, D]` against k `[B, Tk, Hkv, D]`: 1
    (the plain kernel) unless its grid fills at most half a wave of the GPU and the keys are many.
    `multiprocessors`: the SM count (default: the device's; the CPU, where the interpreter runs, has none
    and always gets 1)."""
    if multiprocessors is None:
        if not q.is_cuda:
            return 1
        multiprocessors = _multiprocessors(q.device.index if q.device.index is not None else torch.cuda.current_device())
    batch, q_len, q_heads, head_dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    if kv_heads == 0 or q_heads % kv_heads or k_len < 2 * MIN_SPAN_KEYS:
        return 1
    config = prefill_config(head_dim, head_dim, q.dtype, has_mask=has_mask)
    programs = triton.cdiv(q_len * (q_heads // kv_heads), config.block_m) * batch * kv_heads
    # Half a wave or more already: on the H200 at depth 32K, 96 programs (512 tokens) cut into 3 spans took
    # 1.49 ms against 1.17 plain, while 48 (259 tokens) in 6 spans took 0.83 against 1.15, and 4 (3 tokens)
    # in 32 spans 0.37 against 1.22 (session 14).
    if 2 * programs > multiprocessors:
        return 1
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * multiprocessors, programs), k_len // MIN_SPAN_KEYS))


@triton.jit(do_not_specialize=["q_len", "k_len", "causal_offset", "span"])
def _span_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr, offset_ptr,
    q_len, k_len, causal_offset, qk_scale, span,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_mb, stride_mq, stride_mk, stride_as, stride_ag, stride_ms, stride_mg,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    STATIC_TRIPS: tl.constexpr, OFFSET_ON_DEVICE: tl.constexpr,
):
    """BLOCK_M (token, head) rows of one KV head's query group against the keys of span `program_id(2)`
    (keys span * s .. span * (s + 1), `span` a multiple of BLOCK_N) that they may see. Writes the rows'
    accumulator (not divided by the sum), max and sum. STATIC_TRIPS: 0 on the GPU; under the interpreter
    the span's key blocks (a fixed trip count). OFFSET_ON_DEVICE: as the plain kernel's (spans past the keys
    the rows see are empty and weigh nothing in the merge)."""
    if OFFSET_ON_DEVICE:
        causal_offset = tl.load(offset_ptr).to(tl.int32)
        k_len = tl.minimum(k_len, causal_offset + q_len)
    block = tl.program_id(0)
    group_index = tl.program_id(1)  # batch * KV_HEADS + kv_head
    split = tl.program_id(2)
    batch = group_index // KV_HEADS
    kv_head = group_index % KV_HEADS
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

    # As the plain kernel: whole blocks every row sees (no mask arithmetic), then the edge up to the last
    # key any row of the block sees; both cut to this span.
    key_end = k_len
    full_end = k_len
    if CAUSAL:
        first_token = block * BLOCK_M // GROUP
        last_token = tl.minimum((block * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        key_end = tl.minimum(key_end, causal_offset + last_token + 1)
        full_end = tl.minimum(full_end, causal_offset + first_token + 1)
    full_end = full_end // BLOCK_N * BLOCK_N
    lo = split * span
    hi = tl.minimum(lo + span, key_end)
    full_hi = tl.minimum(full_end, hi)
    edge_lo = tl.maximum(full_hi, lo)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if STATIC_TRIPS == 0:
        for key_start in range(lo, full_hi, BLOCK_N):
            acc, running_max, running_sum = _prefill_key_block(
                acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, mask_ptr, token, row_ok, dims,
                value_dims, k_len, causal_offset, qk_scale, stride_kt, stride_vt, stride_mq, stride_mk,
                HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL, HAS_MASK, DOT_PRECISION, UPCAST_DOT)
        for key_start in range(edge_lo, hi, BLOCK_N):
            acc, running_max, running_sum = _prefill_key_block(
                acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, mask_ptr, token, row_ok, dims,
                value_dims, k_len, causal_offset, qk_scale, stride_kt, stride_vt, stride_mq, stride_mk,
                HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, HAS_MASK, DOT_PRECISION, UPCAST_DOT)
    else:
        for step in range(STATIC_TRIPS):
            key_start = lo + step * BLOCK_N
            if key_start < full_hi:
                acc, running_max, running_sum = _prefill_key_block(
                    acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, mask_ptr, token, row_ok, dims,
                    value_dims, k_len, causal_offset, qk_scale, stride_kt, stride_vt, stride_mq, stride_mk,
                    HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL, HAS_MASK, DOT_PRECISION,
                    UPCAST_DOT)
        for step in range(STATIC_TRIPS):
            key_start = edge_lo + step * BLOCK_N
            if key_start < hi:
                acc, running_max, running_sum = _prefill_key_block(
                    acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, mask_ptr, token, row_ok, dims,
                    value_dims, k_len, causal_offset, qk_scale, stride_kt, stride_vt, stride_mq, stride_mk,
                    HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, HAS_MASK, DOT_PRECISION,
                    UPCAST_DOT)

    rows = packed.to(tl.int64)
    acc_ptr += split.to(tl.int64) * stride_as + group_index.to(tl.int64) * stride_ag
    tl.store(acc_ptr + rows[:, None] * BLOCK_DV + value_dims[None, :], acc)
    offset = split.to(tl.int64) * stride_ms + group_index.to(tl.int64) * stride_mg + rows
    tl.store(max_ptr + offset, running_max)
    tl.store(sum_ptr + offset, running_sum)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
    causal_offset: int | torch.Tensor | None = None, mask: torch.Tensor | None = None, splits: int,
    out: torch.Tensor | None = None, config: BlockConfig | None = None,
) -> torch.Tensor:
    """`triton_attention.attention`'s contract (shapes, causal offset, also a `[1]` tensor read on the device,
    bool mask, q's dtype out) with the keys cut into `splits` spans of whole key blocks, merged afterwards."""
    batch, q_len, q_heads, head_dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    value_dim = v.shape[3]
    if (k.shape != (batch, k_len, kv_heads, head_dim) or v.shape[:3] != (batch, k_len, kv_heads)
            or q_heads % kv_heads or k_len == 0 or splits < 1):
        raise ValueError(f"attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"splits {splits}")
    on_device = device_offset(causal_offset, q)
    if out is None:
        out = torch.empty(batch, q_len, q_heads, value_dim, device=q.device, dtype=q.dtype)
    if q_len == 0:
        return out
    if mask is not None:
        if mask.shape[-2:] != (q_len, k_len) or mask.dim() not in (2, 3):
            raise ValueError(f"mask must be [Tq, Tk] or [B, Tq, Tk] = {(q_len, k_len)}, not {tuple(mask.shape)}")
        mask = mask.to(device=q.device, dtype=torch.bool).expand(batch, q_len, k_len).view(torch.uint8)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    group = q_heads // kv_heads
    config = config or prefill_config(head_dim, value_dim, q.dtype, has_mask=mask is not None)
    span = triton.cdiv(triton.cdiv(k_len, splits), config.block_n) * config.block_n
    splits = triton.cdiv(k_len, span)
    blocks = triton.cdiv(q_len * group, config.block_m)
    rows = blocks * config.block_m
    block_dv = max(16, triton.next_power_of_2(value_dim))
    acc = torch.empty(splits, batch * kv_heads, rows, block_dv, device=q.device, dtype=torch.float32)
    running_max = torch.empty(splits, batch * kv_heads, rows, device=q.device, dtype=torch.float32)
    running_sum = torch.empty_like(running_max)
    interpreted = not q.is_cuda
    mask_arg = mask if mask is not None else acc  # never read without HAS_MASK
    mask_strides = mask.stride() if mask is not None else (0, 0, 0)
    with _device_scope(q):
        _span_kernel[(blocks, batch * kv_heads, splits)](
            q, k, v, mask_arg, acc, running_max, running_sum, causal_offset if on_device else acc,
            q_len, k_len, 0 if on_device else causal_offset or 0, scale * LOG2_E, span,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), *mask_strides,
            acc.stride(0), acc.stride(1), running_max.stride(0), running_max.stride(1),
            KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, VALUE_DIM=value_dim,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_DV=block_dv,
            CAUSAL=causal_offset is not None, HAS_MASK=mask is not None, DOT_PRECISION=_dot_precision(q.dtype),
            UPCAST_DOT=interpreted and q.dtype == torch.bfloat16,
            STATIC_TRIPS=span // config.block_n if interpreted else 0, OFFSET_ON_DEVICE=on_device,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    merged = _combine(acc, running_max, running_sum)[:, : q_len * group, :value_dim]
    # Packed rows (token, head of the group) of each (batch, KV head) back to [B, Tq, Hq, Dv].
    merged = merged.reshape(batch, kv_heads, q_len, group, value_dim).permute(0, 2, 1, 3, 4)
    out.copy_(merged.reshape(batch, q_len, q_heads, value_dim))
    return out


def _combine(acc: torch.Tensor, running_max: torch.Tensor, running_sum: torch.Tensor) -> torch.Tensor:
    """The spans' partial results (`[S, G, M, Dv]`, `[S, G, M]` twice, scores in base 2) as one normalised
    `[G, M, Dv]`: each span rescaled to the overall max. A span whose rows saw nothing (max -inf, sum 0)
    weighs 0; a row no span saw gives 0 / 0 = NaN, as the reference does."""
    top = running_max.amax(dim=0)
    shift = torch.where(top == float("-inf"), 0.0, top)
    weight = torch.exp2(running_max - shift)
    total = (running_sum * weight).sum(dim=0)
    return (acc * weight[..., None]).sum(dim=0) / total[..., None]


def _main() -> None:  # pragma: no cover - needs a GPU
    """On a GPU, at the 27B's heads (24 query, 4 KV, dim 256, bf16): pieces of 3, 259 and 512 tokens at depth
    32K, split against plain (relative error and ms each, after a warm-up at each shape)."""
    from .timing import median_ms, relative_error

    torch.manual_seed(0)
    for tokens in (3, 259, 512, 4096):
        keys = 32768 + tokens
        q = torch.randn(1, tokens, 24, 256, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, keys, 4, 256, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, keys, 4, 256, device="cuda", dtype=torch.bfloat16)
        splits = key_splits(q, k)
        plain = lambda: triton_attention.attention(q, k, v, scale=1 / 16, causal_offset=keys - tokens)  # noqa: E731
        split = lambda: attention(q, k, v, scale=1 / 16, causal_offset=keys - tokens, splits=max(splits, 1))  # noqa: E731
        error = relative_error(split().float(), plain().float())
        print(f"tokens {tokens:5d} keys {keys}: {splits} spans, plain {median_ms(plain):.3f} ms, "
              f"split {median_ms(split):.3f} ms, relative difference {error:.2e}", flush=True)


if __name__ == "__main__":  # pragma: no cover
    _main()
