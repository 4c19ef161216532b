"""A grouped GEMM for the routed experts of a mixture-of-experts layer over many tokens (prefill).

`moe_experts` of a family (Gemma-4's, `lucebox_gemma4.ops`) is, for T tokens routed to k experts each,
`out[t] = sum_k weights[t, k] * down_e(gelu_tanh(gate_e(x_t)) * up_e(x_t))` with `e = ids[t, k]`. Run as one
small product per expert, it costs a host sync and a handful of launches per expert (128 of them in a
Gemma-4 26B-A4B layer); here it is two products over every (token, expert) pair at once:

- `block_schedule`: the T*k pairs sorted by expert (stable; a counting sort in two small kernels) and laid
  out in blocks of `BLOCK_M` slots, each block holding pairs of one expert only (an expert's group padded up
  to whole blocks). Built on the device with no host sync, and sized by an upper bound of the block count,
  so the grids below are fixed by the shapes alone: blocks past the end are marked and their programs exit.
- `_gate_up_kernel`: per block and column tile, the tile of gate (weight rows j) and the matching tile of up
  (rows I + j of a fused stack, or rows j of a separate up stack) of the block's expert over the gathered
  token rows, GeGLU (or SwiGLU: Laguna, Qwen3.5-MoE) in the epilogue, stored as `act[pair]` at the pair's
  original index.
- `_down_kernel`: `act[pair] @ down_e.T`, times the pair's routing weight in fp32, stored per pair; the k
  pairs of each token are then summed in a fixed order (deterministic, unlike atomics).

The weights come in dense, in the activation dtype (`CudaBackend.dequantize_experts` decodes a GGUF stack
once per call into a reused scratch buffer). Roundings follow the reference: gate and up are rounded to the
activation dtype as the reference's product outputs are, GELU's output before the product with up (the
two-op `F.gelu(gate, approximate="tanh") * up`), the down product before the routing weight. The wrapper
runs under `TRITON_INTERPRET=1` on CPU tensors, which is how CI tests it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_norms import GELU_TANH_COEFF
from .pdl import triton_options
from .triton_ops import _device_scope, _dot_precision, grid_dependency

# Pair slots per block: an M tile of both products. 64 keeps the padding of a prefill's small groups (a
# 512-token chunk gives a 26B-A4B expert ~32 pairs on average) to one tile while filling a wgmma.
BLOCK_M = 64
# Pairs one schedule program compares with its expert per step.
SCHEDULE_CHUNK = 1024


class GroupedConfig(NamedTuple):
    """Tile sizes and launch shape of one of the grouped products."""

    block_n: int  # output columns per program (gate_up: of gate, and as many of up)
    block_k: int  # reduction step
    num_warps: int
    num_stages: int  # tiles in flight (the GPU loop's software pipeline)


def grouped_configs(dtype: torch.dtype) -> tuple[GroupedConfig, GroupedConfig]:
    """(gate_up, down) tiles for sm_90, timed on the H200 at 26B-A4B's shapes (512 and 4096 tokens, top-8 of
    128 experts). 16-bit: gate_up holds two 64 x 64 fp32 accumulators (64 registers a thread with 4 warps)
    and reads 24 KiB a stage (x, gate and up tiles; 4 stages); down one 64 x 256 accumulator over 8 warps and
    40 KiB a stage (3 stages): 15% faster than 64 x 128 at 512 tokens, where few M blocks fill the GPU.
    fp32 (a correctness path): products on CUDA cores with the operands in registers, so smaller tiles."""
    if dtype == torch.float32:
        return GroupedConfig(32, 32, 4, 2), GroupedConfig(64, 32, 4, 2)
    return GroupedConfig(64, 64, 4, 4), GroupedConfig(256, 64, 8, 3)


# -- the block schedule --------------------------------------------------------------------------------


def max_blocks(pairs: int, n_experts: int, block_m: int = BLOCK_M) -> int:
    """An upper bound of the blocks `block_schedule` fills, from the shapes alone: each of the at most
    min(E, pairs) hit experts pads its group by less than one block."""
    return triton.cdiv(pairs, block_m) + min(n_experts, pairs)


def block_schedule(ids: torch.Tensor, n_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped GEMM's schedule of the routed pairs `ids` `[T, k]` (pair `p` = token `p // k`, slot
    `p % k`), on ids' device with no host sync: `(slot_pair, block_expert)`.

    `slot_pair` `[max_blocks * block_m]` int32: the pair in each slot, -1 in padding; the pairs sorted by
    expert, stable (an expert's pairs in ascending order), each expert's group starting a block.
    `block_expert` `[max_blocks]` int32: the expert of each block's pairs, -1 past the last filled block.

    A counting sort in two launches of one program per expert, each scanning every pair (E x T*k compares,
    microseconds): `torch.sort`, cumsums and scatters were ~20 launches and 0.3-0.7 ms a layer on the H200.
    """
    flat = ids.reshape(-1)
    pairs, device = flat.numel(), flat.device
    blocks = max_blocks(pairs, n_experts, block_m)
    slot_pair = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=device)
    block_expert = torch.full((blocks,), -1, dtype=torch.int32, device=device)
    if pairs == 0:
        return slot_pair, block_expert
    flat = flat.contiguous()
    counts = torch.empty(n_experts, dtype=torch.int32, device=device)
    # The interpreter cannot loop to a runtime bound: there the trip count is a constant.
    trips = triton.cdiv(pairs, SCHEDULE_CHUNK) if not flat.is_cuda else 0
    with _device_scope(flat):
        _expert_counts_kernel[(n_experts,)](flat, counts, pairs, CHUNK=SCHEDULE_CHUNK, TRIPS=trips)
        _schedule_kernel[(n_experts,)](
            flat, counts, slot_pair, block_expert, pairs, N_EXPERTS=n_experts,
            EXPERTS_POW2=triton.next_power_of_2(n_experts), BLOCK_M=block_m, CHUNK=SCHEDULE_CHUNK, TRIPS=trips,
        )
    return slot_pair, block_expert


@triton.jit
def _expert_counts_kernel(ids_ptr, counts_ptr, pairs, CHUNK: tl.constexpr, TRIPS: tl.constexpr):
    """counts[e] = pairs routed to expert e (program e); TRIPS: 0 on the GPU, else the chunk count."""
    expert = tl.program_id(0)
    hits = tl.zeros([CHUNK], dtype=tl.int32)
    for step in range(TRIPS if TRIPS > 0 else tl.cdiv(pairs, CHUNK)):
        offsets = step * CHUNK + tl.arange(0, CHUNK)
        routed = tl.load(ids_ptr + offsets, mask=offsets < pairs, other=-1)
        hits += (routed == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(hits, 0))


@triton.jit
def _schedule_kernel(
    ids_ptr, counts_ptr, slot_pair_ptr, block_expert_ptr, pairs,
    N_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    TRIPS: tl.constexpr,
):
    """Program e places expert e's pairs: its group starts at block sum_{e' < e} ceil(count / BLOCK_M), and
    a pair's rank in it is the number of earlier pairs routed to e (a running count plus a chunk's cumsum),
    so the order is stable. The slot of rank 0 in each block writes the block's expert."""
    expert = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_POW2)
    counts = tl.load(counts_ptr + experts, mask=experts < N_EXPERTS, other=0)
    first_block = tl.sum(tl.where(experts < expert, (counts + BLOCK_M - 1) // BLOCK_M, 0), 0)
    placed = tl.zeros([], dtype=tl.int32)  # this expert's pairs in earlier chunks
    for step in range(TRIPS if TRIPS > 0 else tl.cdiv(pairs, CHUNK)):
        offsets = step * CHUNK + tl.arange(0, CHUNK)
        routed = tl.load(ids_ptr + offsets, mask=offsets < pairs, other=-1)
        hit = routed == expert
        hits = hit.to(tl.int32)
        rank = placed + tl.cumsum(hits, 0) - hits
        tl.store(slot_pair_ptr + first_block * BLOCK_M + rank, offsets, mask=hit)
        tl.store(block_expert_ptr + first_block + rank // BLOCK_M, tl.full([CHUNK], 0, tl.int32) + expert,
                 mask=hit & (rank % BLOCK_M == 0))
        placed += tl.sum(hits, 0)


# -- the kernels ---------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc + a @ b in fp32. UPCAST_DOT (the interpreter with bf16, whose tl.dot multiplies bf16 operands as
    raw integers): the same operand values, multiplied as fp32."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _block_rows(slot_pair_ptr, block, BLOCK_M: tl.constexpr):
    """The pairs of one block's slots and which of them are real (padding slots read pair 0's row, in
    bounds, and are never stored)."""
    pair = tl.load(slot_pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair >= 0
    return tl.where(row_ok, pair, 0).to(tl.int64), row_ok


@triton.jit
def _gate_up_kernel(
    x_ptr, gate_ptr, up_ptr, act_ptr, slot_pair_ptr, block_expert_ptr,
    top_k, coeff, stride_x, stride_ge, stride_gr, stride_ue, stride_ur, stride_act,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    SILU: tl.constexpr,
):
    """act[pair, j] = act_fn(x[token] . gate_e[j]) * (x[token] . up_e[j]) for the pairs of one block and one
    tile of j; gate and up `[E, INTER, HIDDEN]` (the halves of one fused stack, or two stacks); act_fn
    gelu_tanh (GeGLU) or, with SILU, silu (SwiGLU)."""
    # Column tiles of one block are neighbours in launch order: they share the block's gathered x rows.
    n_tiles = tl.cdiv(INTER, BLOCK_N)
    block = tl.program_id(0) // n_tiles
    n_tile = tl.program_id(0) % n_tiles
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # past the last filled block of the fixed grid
        return
    pair, row_ok = _block_rows(slot_pair_ptr, block, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    if not EVEN_N:
        cols = tl.where(col_ok, cols, 0)  # in-bounds rows for the tail tile's unused columns
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + (pair // top_k)[:, None] * stride_x + ks[None, :]
    rows = cols[None, :].to(tl.int64)
    gate_tile = gate_ptr + expert.to(tl.int64) * stride_ge + rows * stride_gr + ks[:, None]  # [BLOCK_K, BLOCK_N]
    up_tile = up_ptr + expert.to(tl.int64) * stride_ue + rows * stride_ur + ks[:, None]
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_tile)
            b_gate = tl.load(gate_tile)
            b_up = tl.load(up_tile)
        else:
            k_ok = k0 + ks < HIDDEN
            a = tl.load(x_tile, mask=k_ok[None, :], other=0.0)
            b_gate = tl.load(gate_tile, mask=k_ok[:, None], other=0.0)
            b_up = tl.load(up_tile, mask=k_ok[:, None], other=0.0)
        gate = _dot(a, b_gate, gate, DOT_PRECISION, UPCAST_DOT)
        up = _dot(a, b_up, up, DOT_PRECISION, UPCAST_DOT)
        x_tile += BLOCK_K
        gate_tile += BLOCK_K
        up_tile += BLOCK_K
    dtype = act_ptr.dtype.element_ty
    # The reference rounds each product to the activation dtype, then the activation's output before the
    # product with up (the two-op `F.gelu(gate, approximate="tanh") * up`, `F.silu(gate) * up`).
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if SILU:
        activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    else:
        inner = coeff * (gate + 0.044715 * gate * gate * gate)
        activated = (gate * tl.sigmoid(2.0 * inner)).to(dtype).to(tl.float32)  # 0.5 (1 + tanh(u)) = sigmoid(2u)
    tl.store(act_ptr + pair[:, None] * stride_act + cols[None, :], (activated * up).to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, weights_ptr, out_ptr, slot_pair_ptr, block_expert_ptr,
    stride_act, stride_we, stride_wr, stride_out,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """out[pair, j] = weights[pair] * (act[pair] . w_e[j]) in fp32 for the pairs of one block and one tile of
    j; w `[E, HIDDEN, INTER]`, out `[pairs, HIDDEN]`."""
    n_tiles = tl.cdiv(HIDDEN, BLOCK_N)
    block = tl.program_id(0) // n_tiles
    n_tile = tl.program_id(0) % n_tiles
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pair, row_ok = _block_rows(slot_pair_ptr, block, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HIDDEN
    if not EVEN_N:
        cols = tl.where(col_ok, cols, 0)
    ks = tl.arange(0, BLOCK_K)
    a_tile = act_ptr + pair[:, None] * stride_act + ks[None, :]
    w_tile = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wr + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_tile)
            b = tl.load(w_tile)
        else:
            k_ok = k0 + ks < INTER
            a = tl.load(a_tile, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_tile, mask=k_ok[:, None], other=0.0)
        acc = _dot(a, b, acc, DOT_PRECISION, UPCAST_DOT)
        a_tile += BLOCK_K
        w_tile += BLOCK_K
    # The reference's down product comes out in the activation dtype and is weighted in fp32.
    routing = tl.load(weights_ptr + pair)
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * routing[:, None]
    tl.store(out_ptr + pair[:, None] * stride_out + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


# -- the wrappers --------------------------------------------------------------------------------------


class Schedule(NamedTuple):
    """`block_schedule`'s result, with the tile height it was built for (both products use it)."""

    slot_pair: torch.Tensor
    block_expert: torch.Tensor
    block_m: int

    @classmethod
    def build(cls, ids: torch.Tensor, n_experts: int, block_m: int = BLOCK_M) -> Schedule:
        return cls(*block_schedule(ids, n_experts, block_m), block_m)


def _precision(x: torch.Tensor) -> dict[str, object]:
    # bf16 under the interpreter: products of the same values, as fp32 (see `_dot`).
    return dict(DOT_PRECISION=_dot_precision(x.dtype), UPCAST_DOT=not x.is_cuda and x.dtype == torch.bfloat16)


def gate_up_geglu(x: torch.Tensor, gate_up: torch.Tensor, top_k: int, schedule: Schedule,
                  config: GroupedConfig | None = None) -> torch.Tensor:
    """The first grouped product: x `[T, hidden]`, gate_up `[E, 2I, hidden]` in x's dtype (rows [gate | up]
    per expert) -> act `[T * k, I]`, `gelu_tanh(gate) * up` of each pair (pair `p`: token `p // top_k`) in
    x's dtype. The kernel reads `gate_up` in stream order, so work queued after this call on the same stream
    (the down stack decoded into the same scratch) may overwrite it."""
    rows = gate_up.shape[1]
    if gate_up.dim() != 3 or rows % 2:
        raise ValueError(f"gate_up_geglu: gate_up {tuple(gate_up.shape)} is not [E, 2I, hidden]")
    gate_up = gate_up.contiguous()
    return _gate_up(x, gate_up[:, : rows // 2], gate_up[:, rows // 2 :], top_k, schedule, config, silu=False)


def gate_up_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, top_k: int, schedule: Schedule,
                   config: GroupedConfig | None = None) -> torch.Tensor:
    """`gate_up_geglu` for SwiGLU experts over separate gate and up stacks `[E, I, hidden]` (Laguna's and
    Qwen3.5-MoE's): act `[T * k, I]`, `silu(gate) * up` of each pair, in x's dtype."""
    return _gate_up(x, gate, up, top_k, schedule, config, silu=True)


def _gate_up(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, top_k: int, schedule: Schedule,
             config: GroupedConfig | None, *, silu: bool) -> torch.Tensor:
    n_experts, inter, hidden = gate.shape
    if (x.dim() != 2 or x.shape[1] != hidden or up.shape != gate.shape or gate.dtype != x.dtype
            or up.dtype != x.dtype or gate.stride(-1) != 1 or up.stride(-1) != 1):
        raise ValueError(f"grouped gate/up product shapes: x {tuple(x.shape)} {x.dtype}, gate {tuple(gate.shape)} "
                         f"{gate.dtype}, up {tuple(up.shape)} {up.dtype} (rows contiguous)")
    config = config or grouped_configs(x.dtype)[0]
    x = x.contiguous()
    act = torch.empty(x.shape[0] * top_k, inter, dtype=x.dtype, device=x.device)
    if act.shape[0] == 0:
        return act
    grid = (schedule.block_expert.numel() * triton.cdiv(inter, config.block_n),)
    with _device_scope(x):
        _gate_up_kernel[grid](
            x, gate, up, act, schedule.slot_pair, schedule.block_expert,
            top_k, GELU_TANH_COEFF, x.stride(0), gate.stride(0), gate.stride(1), up.stride(0), up.stride(1),
            act.stride(0),
            HIDDEN=hidden, INTER=inter, BLOCK_M=schedule.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            EVEN_K=hidden % config.block_k == 0, EVEN_N=inter % config.block_n == 0, **_precision(x), SILU=silu,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return act


def down_weighted_sum(act: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, schedule: Schedule,
                      config: GroupedConfig | None = None) -> torch.Tensor:
    """The second grouped product and the sum over each token's pairs: act `[T * k, I]`, down
    `[E, hidden, I]` in act's dtype, weights `[T, k]` (routing weights, fp32) -> `[T, hidden]` in act's
    dtype, `sum_k weights[t, k] * (act[t * k + k'] @ down_e.T)` with the products and the sum in fp32."""
    tokens, top_k = weights.shape
    n_experts, hidden, inter = down.shape
    if act.shape != (tokens * top_k, inter) or down.dtype != act.dtype:
        raise ValueError(f"down_weighted_sum shapes: act {tuple(act.shape)} {act.dtype}, down {tuple(down.shape)} "
                         f"{down.dtype}, weights {tuple(weights.shape)}")
    config = config or grouped_configs(act.dtype)[1]
    act, down = act.contiguous(), down.contiguous()
    weights = weights.to(torch.float32).reshape(-1).contiguous()
    per_pair = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=act.device)
    if tokens * top_k:
        grid = (schedule.block_expert.numel() * triton.cdiv(hidden, config.block_n),)
        with _device_scope(act):
            _down_kernel[grid](
                act, down, weights, per_pair, schedule.slot_pair, schedule.block_expert,
                act.stride(0), down.stride(0), down.stride(1), per_pair.stride(0),
                HIDDEN=hidden, INTER=inter, BLOCK_M=schedule.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                EVEN_K=inter % config.block_k == 0, EVEN_N=hidden % config.block_n == 0, **_precision(act),
                num_warps=config.num_warps, num_stages=config.num_stages,
            )
    # Each token's k pairs summed in slot order, in fp32 as the reference accumulates (no atomics: the same
    # bits every run).
    return per_pair.view(tokens, top_k, hidden).sum(1).to(act.dtype)


def moe_grouped(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
    up: torch.Tensor | None = None, block_m: int = BLOCK_M, configs: tuple[GroupedConfig, GroupedConfig] | None = None,
) -> torch.Tensor:
    """`lucebox_gemma4.ops.moe_experts` on dense expert weights: x `[T, hidden]` (bf16, f16 or f32), gate_up
    `[E, 2I, hidden]` (rows [gate | up] per expert) and down `[E, hidden, I]` in x's dtype, weights `[T, k]`
    (fp32), ids `[T, k]` (integers) -> `[T, hidden]` in x's dtype. With `up` (`[E, I, hidden]`), `gate_up` is
    the gate stack alone and the experts are SwiGLU's (the core's `moe_experts_swiglu`). No host sync (every
    size comes from the shapes), so consecutive layers queue without waiting on the GPU. (The CUDA ops, in
    `op_kernels`, run the two halves themselves, decoding the stacks into one scratch buffer just before their
    product.)

    `block_m`, `configs`: tiles other than `BLOCK_M` and `grouped_configs`' (tests, tuning)."""
    gate_up_config, down_config = configs or grouped_configs(x.dtype)
    if down.shape[:2] != (gate_up.shape[0], gate_up.shape[2]) or weights.shape != ids.shape:
        raise ValueError(f"moe_grouped shapes: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
                         f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    schedule = Schedule.build(ids, gate_up.shape[0], block_m)
    if up is None:
        act = gate_up_geglu(x, gate_up, ids.shape[1], schedule, gate_up_config)
    else:
        act = gate_up_swiglu(x, gate_up, up, ids.shape[1], schedule, gate_up_config)
    return down_weighted_sum(act, down, weights, schedule, down_config)


# -- the few-pair path's combine (decode, verify) -----------------------------------------------------------


@triton.jit
def _combine_pairs_kernel(rows_ptr, weights_ptr, out_ptr, hidden, logit_ptr, routed, TOP_K: tl.constexpr,
                          BLOCK: tl.constexpr, SHARED: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # in slot order, as the reference's sum over k
        row = tl.load(rows_ptr + (token * TOP_K + k) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        total += row * tl.load(weights_ptr + token * TOP_K + k)
    if SHARED:  # the shared expert's row of this token, after the routed ones
        shared = tl.load(rows_ptr + (routed + token) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            shared = shared * tl.sigmoid(tl.load(logit_ptr + token).to(tl.float32))
        total += shared
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def combine_pairs(rows: torch.Tensor, weights: torch.Tensor, *, shared: bool = False,
                  shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """`sum_k weights[t, k] * rows[t * k_count + k]` in fp32, in rows' dtype: the experts' down outputs of each
    token (`rows` `[T * k, hidden]`, pair-major as the pair kernel writes them) weighted and summed in one
    launch instead of four. `shared`: rows `[T * k + T, hidden]`, the last T a shared expert's, added with
    weight 1, or `sigmoid(shared_logit[t])` (`[T, 1]`, Qwen3.5-MoE's gate)."""
    tokens, top_k = weights.shape
    hidden = rows.shape[-1]
    rows = rows.contiguous()
    out = torch.empty(tokens, hidden, dtype=rows.dtype, device=rows.device)
    gated = shared and shared_logit is not None
    logit = shared_logit.reshape(-1).contiguous() if gated else weights
    if tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        with _device_scope(rows):
            _combine_pairs_kernel[(tokens, triton.cdiv(hidden, block))](
                rows, weights.to(torch.float32).contiguous(), out, hidden, logit, tokens * top_k, TOP_K=top_k,
                BLOCK=block, SHARED=shared, GATED=gated, **triton_options(rows))
    return out
