"""The path (tree / decode) attention's partition of a key sequence into splits, and its second half: the
splits' partial results merged into each output.

`triton_attention.tree_attention`'s split kernel leaves, per (node, query head, split), the max score, the
sum of exp(score - max) and the unnormalised output over that split's keys. This kernel merges them, one
program per (node, head) and block of value dims, `SPLIT_CHUNK` splits at a time: one vector load of their
maxima, sums and outputs, reduced across the chunk, then added to the running total chunk after chunk.

Why chunks in a fixed order, and not one loop over the splits nor one reduction over all of them: the decode
step and a verified node reach the same key sequence with different split counts (a verify's window covers
the tree too, a larger window has more splits past the sequence). Every split past a node's sequence holds
max -inf, sum 0 and output 0, so it weighs exactly 0; within a chunk it sits where the shorter call's mask
puts an exact 0, and a chunk of zeros adds +0 to the total. The reduction tree of one chunk is fixed by its
constexpr shape, so both calls sum the same numbers in the same order: the bits agree. A chunk rather than a
split a step keeps a long context's merge short (session 20's profile: the combine ran one dependent load
chain per split).

`head_gate`: the (node, head) output times softplus(gate), rounded as the two-op reference (Laguna's per-head
output gate, `lucebox_laguna.ops.softplus_head_gate`): saves that op's launch after every attention.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import triton_options
from .triton_gates import SOFTPLUS_THRESHOLD, softplus_fp32
from .triton_ops import grid_dependency


def _whole_number_setting(name: str, default: int) -> int:
    """An environment override read at import: a whole number, or an error naming the variable (its range is
    checked where the partition is used, `triton_attention.tree_attention`)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a whole number") from None


# Key rows per loop step, and the path kernel's partition (`split_bounds`): the first PATH_NARROW_SPLITS
# splits of one block, then splits of PATH_BLOCKS_PER_SPLIT blocks. Fixed (never chosen from the window,
# the node count or the position): the partition of a node's key sequence, and so the rounding of its
# result, then depends only on the sequence. Session 22 on the H200 (Laguna-XS.2, tg128 at a 640-token
# context, with PDL): one block a split everywhere 387 tok/s against 362 with four, since a short context
# then spreads over 4x the programs; but one block a split everywhere is also 4x the merge's scratch at
# long contexts (a 65-node verify of the 27B at 128K: ~3.3 GB instead of ~0.8). The narrow head gives the
# first 2048 rows one block a split and keeps the long tail at four (128K: 536 splits instead of 512).
# `LUCEBOX_PATH_BLOCKS_PER_SPLIT` / `LUCEBOX_PATH_NARROW_SPLITS` override them for a whole process (A/B).
PATH_BLOCK_N = 64
PATH_BLOCKS_PER_SPLIT = _whole_number_setting("LUCEBOX_PATH_BLOCKS_PER_SPLIT", 4)
PATH_NARROW_SPLITS = _whole_number_setting("LUCEBOX_PATH_NARROW_SPLITS", 32)


@triton.jit
def split_bounds(split, NARROW_SPLITS: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key rows [start, end) of a split: the first NARROW_SPLITS splits one block each (a short context
    still spreads over many programs), every later one BLOCKS_PER_SPLIT blocks (a long one keeps the merge's
    scratch and splits bounded). A function of the split index alone, so of the position alone."""
    narrow = tl.minimum(split, NARROW_SPLITS)
    start = (narrow + (split - narrow) * BLOCKS_PER_SPLIT) * BLOCK_N
    width = tl.where(split < NARROW_SPLITS, BLOCK_N, BLOCKS_PER_SPLIT * BLOCK_N)
    return start, start + width


def split_count(sequence: int, block_n: int, blocks_per_split: int, narrow_splits: int) -> int:
    """How many splits of `split_bounds`' partition cover a key sequence of `sequence` rows."""
    narrow = min(triton.cdiv(sequence, block_n), narrow_splits)
    return narrow + triton.cdiv(max(sequence - narrow_splits * block_n, 0), block_n * blocks_per_split)


SPLIT_CHUNK = 16  # splits merged per step: part of the arithmetic, so fixed (never chosen per call)
COMBINE_BLOCK_VALUES = 64  # value dims one program merges


# `splits` never specialised: Triton would make a 1 a constant (a window of 64 keys or fewer), which its
# loop passes do not take, and decode and verify calls, with different split counts, run one binary.
@triton.jit(do_not_specialize=["splits"])
def _path_attention_combine_kernel(
    max_ptr, sum_ptr, acc_ptr, gate_ptr, out_ptr, splits, stride_on, stride_oh, stride_gn, threshold,
    Q_HEADS: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_DV: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0).to(tl.int64)  # node * Q_HEADS + head
    chunk = tl.arange(0, CHUNK)
    value_dims = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    value_ok = value_dims < VALUE_DIM
    first = row * splits
    # The largest max over every split (finite: split 0 holds position 0, which every node sees).
    top = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    start = 0
    while start < splits:  # a while loop: the interpreter cannot take an argument as a range() bound
        index = start + chunk
        top = tl.maximum(top, tl.load(max_ptr + first + index, mask=index < splits, other=float("-inf")))
        start += CHUNK
    top = tl.max(top, axis=0)
    total = tl.zeros([1], dtype=tl.float32)
    out = tl.zeros([BLOCK_DV], dtype=tl.float32)
    start = 0
    while start < splits:
        index = start + chunk
        ok = index < splits
        weight = tl.exp(tl.load(max_ptr + first + index, mask=ok, other=float("-inf")) - top)  # 0 when empty
        total += tl.sum(tl.load(sum_ptr + first + index, mask=ok, other=0.0) * weight, axis=0)
        partial = tl.load(acc_ptr + (first + index)[:, None] * VALUE_DIM + value_dims[None, :],
                          mask=ok[:, None] & value_ok[None, :], other=0.0)
        out += tl.sum(partial * weight[:, None], axis=0)
        start += CHUNK
    dtype = out_ptr.dtype.element_ty
    result = (out / total).to(dtype)
    node, head = row // Q_HEADS, row % Q_HEADS
    if GATED:  # softplus in fp32 rounded to the output's dtype, then the product rounded (the reference's ops)
        soft = softplus_fp32(tl.load(gate_ptr + node * stride_gn + head).to(tl.float32), threshold)
        result = (result.to(tl.float32) * soft.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + node * stride_on + head * stride_oh + value_dims, result, mask=value_ok)


def combine(split_max: torch.Tensor, split_sum: torch.Tensor, split_acc: torch.Tensor, out: torch.Tensor,
            head_gate: torch.Tensor | None = None) -> None:
    """Merge `split_max`, `split_sum` `[N * Hq, S]` and `split_acc` `[N * Hq, S, Dv]` (fp32) into `out`
    `[1, N, Hq, Dv]` (a contiguous last dim); `head_gate` `[N, Hq]` (last dim contiguous): each (node, head)
    output times softplus of its gate. The caller holds the device scope."""
    _, nodes, q_heads, value_dim = out.shape
    splits = split_max.shape[1]
    if head_gate is not None and (tuple(head_gate.shape) != (nodes, q_heads) or head_gate.stride(-1) != 1):
        raise ValueError(f"head_gate must be [{nodes}, {q_heads}] with a contiguous last dim, "
                         f"not {tuple(head_gate.shape)}")
    block = min(COMBINE_BLOCK_VALUES, triton.next_power_of_2(value_dim))
    gate = head_gate if head_gate is not None else split_max  # never read without GATED
    _path_attention_combine_kernel[(nodes * q_heads, triton.cdiv(value_dim, block))](
        split_max, split_sum, split_acc, gate, out, splits, out.stride(1), out.stride(2),
        gate.stride(0), SOFTPLUS_THRESHOLD,
        Q_HEADS=q_heads, VALUE_DIM=value_dim, CHUNK=SPLIT_CHUNK, BLOCK_DV=block, GATED=head_gate is not None,
        **triton_options(out),
    )
