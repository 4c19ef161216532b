"""Triton block-sparse causal prefill attention: `lucebox_core.block_sparse.block_sparse_attention` on the GPU.

The selection (block mean-K, block scores, the keep rules) is the core's torch code: a few small matrix
products, cheap next to attention. The kernel runs the attention: one program per (query block m, query
head h) walks the key blocks mask[h, m] keeps, listed ascending on the host as compact indices. Every kept
block below the diagonal is whole (only the sequence's last block can be short, and it is never below the
diagonal), so those run with no masks at all; the diagonal block runs last with the causal rule and the
sequence's end. Online softmax in fp32 (`triton_attention._softmax_step`), products in q's dtype.

Under the interpreter (the CPU tests) a loop bound cannot be a loaded value (see `triton_attention`), so the
key loop has a fixed trip count there that skips past the kept count; on the GPU it is a runtime `range`.

`python -m lucebox_cuda.triton_block_sparse --check --bench` checks the kernel against dense attention under
the same mask on a GPU, then times dense against block-sparse attention at 32K/64K/128K tokens on
Qwen3-0.6B's shapes (16 query heads, 8 KV heads, d 128, bf16).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from lucebox_core import block_sparse
from lucebox_core.block_sparse import BlockSparseConfig

from .triton_attention import LOG2_E, _softmax_step
from .triton_ops import _device_scope, _dot_precision

# Block sizes the kernel takes: tl.dot needs 16 rows at least; 128 x 128 tiles at d 128 fit an H100/H200.
KERNEL_BLOCKS = (16, 32, 64, 128)
MAX_HEAD_DIM = 256


def kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: BlockSparseConfig) -> bool:
    """Whether the kernel runs these shapes (else the reference does): see `KERNEL_BLOCKS`, dims <= 256."""
    return (q.dim() == k.dim() == v.dim() == 3 and config.block in KERNEL_BLOCKS
            and max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIM and q.dtype in (torch.float32, torch.float16,
                                                                                 torch.bfloat16))


def kept_block_lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 `[Hq, blocks, blocks]` of the kept key blocks below the diagonal, ascending, first in each row,
    and int32 `[Hq, blocks]` their counts (the diagonal, always kept, is not listed)."""
    blocks = mask.shape[-1]
    below = mask & torch.ones(blocks, blocks, dtype=torch.bool, device=mask.device).tril(-1)
    # A stable sort of "not kept" puts the kept indices first, in ascending order.
    order = torch.sort((~below).to(torch.int8), dim=-1, stable=True).indices
    return order.to(torch.int32).contiguous(), below.sum(dim=-1).to(torch.int32).contiguous()


@triton.jit
def _key_tile(acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, rows, row_ok, dims, value_dims,
              tokens, qk_scale, stride_kt, stride_vt,
              HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, DIAGONAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
              UPCAST_DOT: tl.constexpr):
    """Keys key_start .. key_start + BLOCK_N for the query rows `rows`. DIAGONAL: the causal rule and the end
    of the sequence apply; below the diagonal every row sees every key of a (whole) block."""
    keys = key_start + tl.arange(0, BLOCK_N)
    key_rows = keys.to(tl.int64)
    dim_ok = dims[None, :] < HEAD_DIM
    value_ok = value_dims[None, :] < VALUE_DIM
    if DIAGONAL:
        key_ok = keys < tokens
        k = tl.load(k_ptr + key_rows[:, None] * stride_kt + dims[None, :], mask=key_ok[:, None] & dim_ok, other=0.0)
        v = tl.load(v_ptr + key_rows[:, None] * stride_vt + value_dims[None, :], mask=key_ok[:, None] & value_ok,
                    other=0.0)
        seen = key_ok[None, :] & (keys[None, :] <= rows[:, None])
    else:
        k = tl.load(k_ptr + key_rows[:, None] * stride_kt + dims[None, :], mask=dim_ok, other=0.0)
        v = tl.load(v_ptr + key_rows[:, None] * stride_vt + value_dims[None, :], mask=value_ok, other=0.0)
        seen = row_ok[:, None]  # unused: APPLY_SEEN is off below the diagonal
    return _softmax_step(acc, running_max, running_sum, q, k, v, seen, qk_scale, DIAGONAL, DOT_PRECISION,
                         UPCAST_DOT)


@triton.jit
def _diagonal_block(acc, running_max, running_sum, q, block_start, k_ptr, v_ptr, rows, row_ok, dims, value_dims,
                    tokens, qk_scale, stride_kt, stride_vt,
                    HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    UPCAST_DOT: tl.constexpr):
    """The query block's own key block, in tiles of BLOCK_N keys, with the causal rule and the sequence's end.
    The first tile holds each row's first key, so no row's running max is still -inf after it."""
    for tile in range(0, BLOCK // BLOCK_N):  # a loop, not unrolled: unrolled tiles spill registers
        acc, running_max, running_sum = _key_tile(
            acc, running_max, running_sum, q, block_start + tile * BLOCK_N, k_ptr, v_ptr, rows, row_ok, dims,
            value_dims, tokens, qk_scale, stride_kt, stride_vt, HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV,
            True, DOT_PRECISION, UPCAST_DOT)
    return acc, running_max, running_sum


@triton.jit(do_not_specialize=["tokens", "blocks"])
def _block_sparse_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, kept_ptr, count_ptr,
    tokens, blocks, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, STATIC_TRIPS: tl.constexpr,
):
    """Query block m (rows m * BLOCK ..) of query head h over its kept key blocks, then its diagonal."""
    # Late query blocks keep the most key blocks: start them first so that short ones fill the tail.
    m = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = m * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < tokens
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    k_ptr += kv_head * stride_kh
    v_ptr += kv_head * stride_vh
    list_ptr = kept_ptr + (head * blocks + m).to(tl.int64) * blocks
    count = tl.load(count_ptr + head * blocks + m)

    running_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32)
    # The kept blocks below the diagonal as one flat run of BLOCK_N-key tiles (no unrolled inner loop: the
    # tiles of one block would be live together and spill registers).
    TILES: tl.constexpr = BLOCK // BLOCK_N
    if STATIC_TRIPS == 0:
        for t in range(0, count * TILES):
            key_start = tl.load(list_ptr + t // TILES) * BLOCK + (t % TILES) * BLOCK_N
            acc, running_max, running_sum = _key_tile(
                acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, rows, row_ok, dims, value_dims, tokens,
                qk_scale, stride_kt, stride_vt, HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, False,
                DOT_PRECISION, UPCAST_DOT)
    else:
        for t in range(STATIC_TRIPS):
            if t < count * TILES:
                key_start = tl.load(list_ptr + t // TILES) * BLOCK + (t % TILES) * BLOCK_N
                acc, running_max, running_sum = _key_tile(
                    acc, running_max, running_sum, q, key_start, k_ptr, v_ptr, rows, row_ok, dims, value_dims,
                    tokens, qk_scale, stride_kt, stride_vt, HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, False,
                    DOT_PRECISION, UPCAST_DOT)
    acc, running_max, running_sum = _diagonal_block(
        acc, running_max, running_sum, q, m * BLOCK, k_ptr, v_ptr, rows, row_ok, dims, value_dims, tokens,
        qk_scale, stride_kt, stride_vt, HEAD_DIM, VALUE_DIM, BLOCK, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION,
        UPCAST_DOT)
    # Every valid row sees at least itself; padding rows (never stored) divide by 1.
    out = acc / tl.where(row_ok, running_sum, 1.0)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + value_dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (value_dims[None, :] < VALUE_DIM))


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: BlockSparseConfig | None = None,
                           mask: torch.Tensor | None = None, *, scale: float | None = None, block_n: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """`lucebox_core.block_sparse.block_sparse_attention` with the attention in Triton: q `[T, Hq, D]`,
    k `[T, Hkv, D]`, v `[T, Hkv, Dv]` (any strides but a contiguous last dim) -> `[T, Hq, Dv]` in q's dtype.
    The mask (given, or the config's selection in torch) is cut to the causal blocks, diagonal kept.
    `block_n`: keys per tile inside a block (default 64, 32 for dims over 128), `num_warps` / `num_stages`:
    for tuning."""
    config = config or BlockSparseConfig()
    block_sparse.check_inputs(q, k, v)
    if not kernel_takes(q, k, v, config):
        raise ValueError(f"triton block_sparse_attention takes blocks {KERNEL_BLOCKS} and dims <= {MAX_HEAD_DIM} "
                         f"in f32/f16/bf16, not block {config.block}, q {q.dtype} {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}")
    tokens, q_heads, head_dim = q.shape
    value_dim = v.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    mask = block_sparse._checked_mask(mask, q, k, config, scale).to(q.device)
    kept, counts = kept_block_lists(mask)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(tokens, q_heads, value_dim, device=q.device, dtype=q.dtype)
    blocks = mask.shape[-1]
    interpreted = not q.is_cuda
    wide = max(head_dim, value_dim) > 128
    if block_n is None:
        # 128 query rows x 64 keys is the dense prefill's tile at d 128 (ptxas -v, sm_90: 380 bytes of spills
        # here against its 424); at d 256, 32 keys keep the spills near that.
        block_n = min(config.block, 32 if wide else 64)
    if block_n < 16 or config.block % block_n or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two from 16 up to the block ({config.block}), not {block_n}")
    if num_warps is None:
        num_warps = 8 if config.block >= 128 or wide else 4
    if num_stages is None:
        num_stages = 1 if q.dtype == torch.float32 else 2 if wide else 3
    with _device_scope(q):
        _block_sparse_kernel[(blocks, q_heads)](
            q, k, v, out, kept, counts, tokens, blocks, scale * LOG2_E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            GROUP=q_heads // k.shape[1], HEAD_DIM=head_dim, VALUE_DIM=value_dim, BLOCK=config.block,
            BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_DV=max(16, triton.next_power_of_2(value_dim)),
            DOT_PRECISION=_dot_precision(q.dtype), UPCAST_DOT=interpreted and q.dtype == torch.bfloat16,
            STATIC_TRIPS=blocks * (config.block // block_n) if interpreted else 0,
            num_warps=num_warps, num_stages=num_stages,
        )
    return out


# -- micro-benchmark (a GPU) -------------------------------------------------------------------------------


def structured_inputs(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q/k/v with block structure a real prompt has and plain noise lacks (on noise every block scores
    alike and nothing is skipped): keys carry a per-block strength along a direction the queries share."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape_q, shape_kv = (tokens, q_heads, head_dim), (tokens, kv_heads, head_dim)
    direction = torch.randn(head_dim, device=device, generator=generator)
    direction = direction / direction.norm() * head_dim ** 0.5
    strength = torch.randn(-(-tokens // 128), device=device, generator=generator).repeat_interleave(128)[:tokens]
    q = torch.randn(shape_q, device=device, generator=generator) + direction
    k = torch.randn(shape_kv, device=device, generator=generator) + 2 * strength[:, None, None] * direction
    v = torch.randn(shape_kv, device=device, generator=generator)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _seconds(function, repeats: int) -> float:
    function()  # warm-up: compiles this shape's kernels and fills the caches
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        function()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return sorted(times)[len(times) // 2]


def bench(lengths: list[int], config: BlockSparseConfig, repeats: int, q_heads: int = 16, kv_heads: int = 8,
          head_dim: int = 128) -> list[dict]:
    from .triton_attention import attention

    rows = []
    for tokens in lengths:
        q, k, v = structured_inputs(tokens, q_heads, kv_heads, head_dim, torch.bfloat16, "cuda")
        scale = head_dim ** -0.5
        mask = block_sparse.block_mask(q, k, config, scale)
        dense = _seconds(lambda: attention(q[None], k[None], v[None], scale=scale, causal_offset=0), repeats)
        select = _seconds(lambda: block_sparse.block_mask(q, k, config, scale), repeats)
        sparse = _seconds(lambda: block_sparse_attention(q, k, v, config, mask, scale=scale), repeats)
        row = {"tokens": tokens, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": "bf16",
               "alpha": config.alpha, "kept_fraction": round(block_sparse.kept_fraction(mask), 4),
               "dense_s": dense, "selection_s": select, "sparse_attention_s": sparse,
               "speedup": dense / (select + sparse), "speedup_attention_only": dense / sparse}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def check(lengths: list[int], config: BlockSparseConfig) -> float:
    """The kernel against dense attention under the same block mask, on the GPU, in bf16 and fp32 (a few
    thousand tokens: the dense reference is O(S^2)); one JSON line a case; returns the worst relative error."""
    worst = 0.0
    for tokens in lengths:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = structured_inputs(tokens, 16, 8, 128, dtype, "cuda", seed=tokens)
            mask = block_sparse.block_mask(q, k, config)
            expected = block_sparse.dense_attention_with_block_mask(q.float(), k.float(), v.float(), mask,
                                                                    block=config.block)
            result = block_sparse_attention(q, k, v, config, mask)
            error = ((result.double() - expected.double()).norm() / expected.double().norm()).item()
            worst = max(worst, error)
            print(json.dumps({"check": "block_sparse_attention", "tokens": tokens, "dtype": str(dtype),
                              "kept_fraction": round(block_sparse.kept_fraction(mask), 4), "relative_error": error}),
                  flush=True)
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lucebox_cuda.triton_block_sparse",
                                     description="Time dense against block-sparse prefill attention on a GPU "
                                                 "(Qwen3-0.6B's shapes: 16/8 heads, d 128, bf16); one JSON line a row.")
    parser.add_argument("--bench", action="store_true", help="run the benchmark")
    parser.add_argument("--check", action="store_true",
                        help="first check the kernel against dense attention under the same mask (bf16, fp32)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072], help="prompt tokens")
    parser.add_argument("--alpha", type=float, default=0.85, help="score threshold (PFlash's server default 0.85)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per shape (the median is printed)")
    args = parser.parse_args(argv)
    if not (args.bench or args.check):
        parser.print_help()
        return 0
    if not torch.cuda.is_available():
        print("the benchmark and the check need a CUDA GPU", file=sys.stderr)
        return 2
    config = BlockSparseConfig(alpha=args.alpha)
    if args.check and check([1000, 4096], config) > 1e-2:
        print("block_sparse_attention: the kernel disagrees with dense attention under the same mask", file=sys.stderr)
        return 1
    if args.bench:
        bench(args.lengths, config, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
