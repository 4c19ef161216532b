"""Triton kernels for Gated DeltaNet over many tokens: chunked prefill, tree verification, and the
short causal convolutions that feed them, with torch-facing wrappers.

Each wrapper takes the tensors of the reference op of the same name (the qwen35 family's, `lucebox_qwen35.ops`)
and gives the same result; the recurrent state is fp32 and every kernel accumulates in fp32. No host
value depends on device data (tree parents are read on the device), so every wrapper can be recorded in
a CUDA graph. Value head `h` reads key head `h % H_k` (the tiled GGUF order).

- `gated_delta_rule_chunked`: two launches. `_chunk_inverse_kernel`, one program per (chunk, value
  head), builds the chunk's unit lower-triangular system `I + A` (A_ts = beta_t exp(G_t - G_s) k_t.k_s,
  s < t) and writes its inverse (forward substitution, fp32). `_chunk_scan_kernel`, one program per
  (value head, slice of value dims), walks the chunks in order with its state slice in registers:
  updates `U = inv (beta V - beta exp(G) K S)`, outputs `exp(G) Q S + ((Q K^T) * D) U`, next state
  `exp(G_last) S + (exp(G_last - G) K)^T U`. The matmuls are `tl.dot`: exact fp32 ("ieee") for fp32
  activations; on tensor cores for half ones: with bf16, every product with q or k is bf16 against a
  hi/lo bf16 split of the fp32 side (~16 bits), the two products of fp32 intermediates (the inverse,
  the intra-chunk attention) TF32 (~11 bits); with f16, all TF32. Both below the activations' rounding.
- `gated_delta_rule_sequential`: the same op one token at a time (`_walk_kernel` along a chain), the
  simple oracle and fallback; one program per (value head, slice of value dims).
- `gated_delta_rule_tree`: `_walk_kernel` over the nodes of a tree in index order; a node whose parent
  is not the previous node reloads its parent's state from the node states the program already wrote.
- `causal_conv1d`: the prefill depthwise convolution, one program per (block of tokens, block of channels);
  optionally SiLU and the state updated in place (the family's `causal_conv1d_silu_`).
- `causal_conv1d_tree`: the qwen35 family's `causal_conv1d_tree` reference (`lucebox_qwen35.ops`) in one launch; each node's window is its own
  ancestry, then the committed state.

The wrappers run under `TRITON_INTERPRET=1` on CPU tensors too (that is how tests/test_triton_gdn.py
checks them). `python -m lucebox_cuda.triton_gdn` checks and times every kernel on a GPU at 27B shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .timing import median_ms as _median_ms
from .timing import relative_error as _relative_error
from .triton_ops import _device_scope, _dot_precision, _last_dim_contiguous

# The bf16 chunk scan at 4 warps takes the full 255 registers a thread (ptxas for sm_90 at 27B shapes,
# default pipelining: ~100 bytes spilled at 32 value dims a program, ~none at 16), so two programs fit
# an SM; `scan_block_values` picks the value-dim slice that keeps every program resident at once.
SCAN_WARPS = 4
SCAN_PROGRAMS_PER_SM = 2
# Value dims one tree/sequential walk program owns, and its warps: small programs, as each token is a
# short dependent step (27B: 384 programs of ~220 registers a thread at 2 warps).
WALK_BLOCK_VALUES = 16
WALK_WARPS = 2
# Chunk sizes the chunked kernels take: tl.dot needs >= 16 rows, and the forward substitution over a
# [C, C] tile in registers grows as C^3.
CHUNK_SIZES = (16, 32, 64)
# Tokens and channels one convolution program owns.
CONV_BLOCK_TOKENS = 16
CONV_BLOCK_CHANNELS = 256


def _interpreted() -> bool:
    """Whether Triton runs these kernels in its interpreter (TRITON_INTERPRET=1 when they were defined)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_chunk_scan_kernel, InterpretedFunction)


# -- Gated DeltaNet, chunked (prefill) -----------------------------------------------------------------


@triton.jit
def _chunk_inverse_kernel(
    k_ptr, g_ptr, beta_ptr, inverse_ptr,
    tokens, key_heads, value_heads, chunks,
    stride_kb, stride_kt, stride_kh, stride_gb, stride_gt, stride_gh, stride_betab, stride_betat, stride_betah,
    KEY_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """inverse[b, h, n] = (I + A)^-1 for chunk n of value head h, A_ts = beta_t exp(G_t - G_s) k_t.k_s
    (s < t); tokens past the end get beta = 0 and g = 0, so their rows of A are zero."""
    chunk = tl.program_id(0)
    sequence_head = tl.program_id(1)
    batch = sequence_head // value_heads
    head = sequence_head % value_heads
    key_head = head % key_heads
    positions = chunk * CHUNK + tl.arange(0, CHUNK)
    token_ok = positions < tokens
    positions = positions.to(tl.int64)
    key_dims = tl.arange(0, BLOCK_K)

    if BLOCK_K == KEY_DIM:  # a mask constant along the key dims lets the load vectorise
        key_mask = token_ok[:, None]
    else:
        key_mask = token_ok[:, None] & (key_dims[None, :] < KEY_DIM)
    k = tl.load(k_ptr + batch * stride_kb + positions[:, None] * stride_kt + key_head * stride_kh + key_dims[None, :],
                mask=key_mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + batch * stride_gb + positions * stride_gt + head * stride_gh, mask=token_ok, other=0.0)
    beta = tl.load(beta_ptr + batch * stride_betab + positions * stride_betat + head * stride_betah,
                   mask=token_ok, other=0.0).to(tl.float32)
    log_decay = tl.cumsum(g.to(tl.float32), axis=0)  # G_t

    # Built transposed, system_t[s, t] = A_ts: k k^T is symmetric, and with s on the rows the column of A
    # that the substitution reads for row t is a row-wise reduction.
    rows = tl.arange(0, CHUNK)[:, None]
    cols = tl.arange(0, CHUNK)[None, :]
    affinity = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)  # [C, C], k_s . k_t
    later = cols > rows
    # Mask the exponent, not the product: above the diagonal G_t - G_s > 0 could overflow.
    pair_decay = tl.exp(tl.where(later, log_decay[None, :] - log_decay[:, None], float("-inf")))
    system_t = affinity * pair_decay * beta[None, :]

    # Forward substitution for the inverse, row t = e_t - sum_{s<t} A_ts inverse[s]: rows before t are
    # final, and A_ts = 0 for s >= t, so the rows not yet computed (still identity) add nothing.
    inverse = tl.where(rows == cols, 1.0, 0.0)
    for t in range(1, CHUNK):
        a_row = tl.sum(tl.where(cols == t, system_t, 0.0), axis=1)  # [C] over s: A_ts
        combination = tl.sum(a_row[:, None] * inverse, axis=0)  # [C] over columns
        inverse = tl.where(rows == t, inverse - combination[None, :], inverse)

    base = (sequence_head * chunks + chunk).to(tl.int64) * (CHUNK * CHUNK)
    tl.store(inverse_ptr + base + rows * CHUNK + cols, inverse)


@triton.jit
def _split_bf16(x):
    """fp32 x as a pair of bf16 tensors, x ~ hi + lo to ~16 significant bits (better than TF32's 11)."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot_split(a, b_hi, b_lo, INTERPRETED: tl.constexpr):
    """a @ (b_hi + b_lo) for bf16 a: two bf16 tensor-core products, fp32 accumulation. The interpreter
    multiplies bf16 dot operands as raw integers (Triton 3.6), so there the operands go up to fp32."""
    if INTERPRETED:
        a, b_hi, b_lo = a.to(tl.float32), b_hi.to(tl.float32), b_lo.to(tl.float32)
    return tl.dot(a, b_lo, tl.dot(a, b_hi))


@triton.jit
def _scan_chunk(
    state, chunk, q_base, k_base, v_base, g_base, beta_base, inverse_base, out_ptr,
    tokens, scale, head, batch, value_heads, key_dims, key_ok, value_dims, value_ok,
    stride_qt, stride_kt, stride_vt, stride_gt, stride_betat,
    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_BF16: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One chunk of `_chunk_scan_kernel`: writes the chunk's outputs, returns the state after it.

    SPLIT_BF16 (bf16 activations): q and k stay bf16 and every product with them runs on bf16 tensor
    cores against a hi/lo bf16 split of the fp32 operand; q and k then feed the tensor cores from shared
    memory rather than as fp32 copies in registers, which would spill. Otherwise q and k go to fp32 and
    the products run at DOT_PRECISION.
    """
    rows = tl.arange(0, CHUNK)[:, None]
    cols = tl.arange(0, CHUNK)[None, :]
    positions = chunk * CHUNK + tl.arange(0, CHUNK)
    token_ok = positions < tokens
    positions = positions.to(tl.int64)
    if BLOCK_K == KEY_DIM:  # a mask constant along the key dims lets the loads vectorise
        key_mask = token_ok[:, None]
    else:
        key_mask = token_ok[:, None] & key_ok[None, :]
    value_mask = token_ok[:, None] & value_ok[None, :]
    q = tl.load(q_base + positions[:, None] * stride_qt + key_dims[None, :], mask=key_mask, other=0.0)
    k = tl.load(k_base + positions[:, None] * stride_kt + key_dims[None, :], mask=key_mask, other=0.0)
    v = tl.load(v_base + positions[:, None] * stride_vt + value_dims[None, :], mask=value_mask, other=0.0)
    g = tl.load(g_base + positions * stride_gt, mask=token_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_base + positions * stride_betat, mask=token_ok, other=0.0).to(tl.float32)
    inverse = tl.load(inverse_base + chunk * (CHUNK * CHUNK) + rows * CHUNK + cols)

    log_decay = tl.cumsum(g, axis=0)  # G_t; padded tokens have g = 0, so G_last is the real last one
    chunk_log_decay = tl.sum(g, axis=0)
    decay = tl.exp(log_decay)

    # K S and Q S against the state at the chunk start, and Q K^T.
    if SPLIT_BF16:
        state_hi, state_lo = _split_bf16(state)
        predicted = _dot_split(k, state_hi, state_lo, INTERPRETED)  # [C, BV]
        from_state = _dot_split(q, state_hi, state_lo, INTERPRETED)
        if INTERPRETED:
            affinity = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            affinity = tl.dot(q, tl.trans(k))  # bf16 products are exact in fp32
    else:
        q, k = q.to(tl.float32), k.to(tl.float32)
        predicted = tl.dot(k, state, input_precision=DOT_PRECISION)
        from_state = tl.dot(q, state, input_precision=DOT_PRECISION)
        affinity = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)

    # U = inverse (beta V - beta exp(G) K S): the delta-rule updates of the chunk's tokens.
    targets = beta[:, None] * (v.to(tl.float32) - decay[:, None] * predicted)
    updates = tl.dot(inverse, targets, input_precision=DOT_PRECISION)

    # O = exp(G) Q S + ((Q K^T) * D) U, D_ts = exp(G_t - G_s) for s <= t; q's scale applied here.
    pair_decay = tl.exp(tl.where(cols <= rows, log_decay[:, None] - log_decay[None, :], float("-inf")))
    out = from_state * (decay * scale)[:, None]
    out += tl.dot(affinity * pair_decay * scale, updates, input_precision=DOT_PRECISION)
    out_rows = ((batch * tokens + positions) * value_heads + head) * VALUE_DIM
    tl.store(out_ptr + out_rows[:, None] + value_dims[None, :], out.to(out_ptr.dtype.element_ty), mask=value_mask)

    # S <- exp(G_last) S + K^T (exp(G_last - G) U): the decay to the chunk end scales U's rows, so K
    # enters the product as loaded.
    decayed_updates = updates * tl.exp(chunk_log_decay - log_decay)[:, None]
    if SPLIT_BF16:
        updates_hi, updates_lo = _split_bf16(decayed_updates)
        written = _dot_split(tl.trans(k), updates_hi, updates_lo, INTERPRETED)
    else:
        written = tl.dot(tl.trans(k), decayed_updates, input_precision=DOT_PRECISION)
    return state * tl.exp(chunk_log_decay) + written


@triton.jit
def _chunk_scan_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, inverse_ptr, state_ptr, out_ptr, new_state_ptr,
    tokens, scale, key_heads, value_heads, chunks,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_gb, stride_gt, stride_gh, stride_betab, stride_betat, stride_betah,
    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_BF16: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The chunks of one (sequence, value head) in order, for BLOCK_V of its value dims: the state's
    columns are independent in the delta rule, so a column slice is a whole problem."""
    sequence_head = tl.program_id(0)
    batch = sequence_head // value_heads
    head = sequence_head % value_heads
    key_head = head % key_heads
    key_dims = tl.arange(0, BLOCK_K)
    value_dims = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_ok = key_dims < KEY_DIM
    value_ok = value_dims < VALUE_DIM

    # The state is [B, H_v, D_k, D_v], contiguous, fp32.
    tile = (sequence_head * KEY_DIM + key_dims[:, None]).to(tl.int64) * VALUE_DIM + value_dims[None, :]
    tile_ok = key_ok[:, None] & value_ok[None, :]
    state = tl.load(state_ptr + tile, mask=tile_ok, other=0.0)

    q_base = q_ptr + batch * stride_qb + key_head * stride_qh
    k_base = k_ptr + batch * stride_kb + key_head * stride_kh
    v_base = v_ptr + batch * stride_vb + head * stride_vh
    g_base = g_ptr + batch * stride_gb + head * stride_gh
    beta_base = beta_ptr + batch * stride_betab + head * stride_betah
    inverse_base = inverse_ptr + sequence_head.to(tl.int64) * chunks * (CHUNK * CHUNK)
    if INTERPRETED:
        # Triton 3.6's interpreter cannot take a loop bound passed as an argument under numpy >= 2.4
        # (range() converts a 1-element array to int); a while loop is equivalent. The GPU keeps the
        # for loop, which the compiler can software-pipeline.
        chunk = 0
        while chunk < chunks:
            state = _scan_chunk(state, chunk, q_base, k_base, v_base, g_base, beta_base, inverse_base, out_ptr,
                                tokens, scale, head, batch, value_heads, key_dims, key_ok, value_dims, value_ok,
                                stride_qt, stride_kt, stride_vt, stride_gt, stride_betat,
                                KEY_DIM, VALUE_DIM, CHUNK, BLOCK_K, DOT_PRECISION, SPLIT_BF16, INTERPRETED)
            chunk += 1
    else:
        for chunk in range(chunks):
            state = _scan_chunk(state, chunk, q_base, k_base, v_base, g_base, beta_base, inverse_base, out_ptr,
                                tokens, scale, head, batch, value_heads, key_dims, key_ok, value_dims, value_ok,
                                stride_qt, stride_kt, stride_vt, stride_gt, stride_betat,
                                KEY_DIM, VALUE_DIM, CHUNK, BLOCK_K, DOT_PRECISION, SPLIT_BF16, INTERPRETED)
    tl.debug_barrier()  # the new state may overwrite the old (`_state_out`): every thread's read lands first
    tl.store(new_state_ptr + tile, state, mask=tile_ok)


def _check_delta_shapes(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor) -> None:
    batch, tokens, key_heads, _ = k.shape
    value_heads = v.shape[2]
    if (q.shape != k.shape or v.shape[:2] != (batch, tokens) or g.shape != (batch, tokens, value_heads)
            or beta.shape != g.shape or value_heads % key_heads):
        raise ValueError(f"{op} shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")


def _initial_state(state: torch.Tensor | None, v: torch.Tensor, key_dim: int) -> torch.Tensor:
    batch, _, value_heads, value_dim = v.shape
    if state is None:
        return torch.zeros(batch, value_heads, key_dim, value_dim, device=v.device, dtype=torch.float32)
    if state.shape != (batch, value_heads, key_dim, value_dim):
        raise ValueError(f"state shape {tuple(state.shape)}, expected {(batch, value_heads, key_dim, value_dim)}")
    return state.float().contiguous()


def _state_out(new_state: torch.Tensor | None, state: torch.Tensor) -> torch.Tensor:
    """Where a scan writes the new state: a new tensor, or `new_state` (fp32, contiguous, the state's shape).
    That may be the state itself: each program reads its own tile of it whole before writing the tile, and
    no other program reads that tile."""
    if new_state is None:
        return torch.empty_like(state)
    if new_state.shape != state.shape or new_state.dtype != torch.float32 or not new_state.is_contiguous():
        raise ValueError(f"new_state must be a contiguous fp32 tensor of shape {tuple(state.shape)}")
    return new_state


def _strides(tensor: torch.Tensor, dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(tensor.stride(d) for d in dims)


def scan_block_values(programs_per_slice: int, value_dim: int, device: torch.device) -> int:
    """Value dims per chunk-scan program: the smallest of 16, 32, 64 (more programs, shorter dependent
    steps) whose `programs_per_slice * ceil(value_dim / block)` programs all fit the GPU at once.
    27B (48 value heads of 128): 32; 0.8B (16 heads): 16. On the CPU (the interpreter): 16."""
    if device.type != "cuda":
        return 16
    slots = SCAN_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    for block in (16, 32):
        if programs_per_slice * triton.cdiv(value_dim, block) <= slots:
            return block
    return 64


def gated_delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None, chunk_size: int = 64, scale: float | None = None, *,
    block_values: int | None = None, num_warps: int = SCAN_WARPS, num_stages: int | None = None,
    new_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """the qwen35 family's `gated_delta_rule_chunked` reference (`lucebox_qwen35.ops`): q, k `[B, T, H_k, D_k]` (L2-normalised), v `[B, T, H_v, D_v]`,
    g (fp32 log decay) and beta `[B, T, H_v]`, state `[B, H_v, D_k, D_v]` fp32 or None (zeros; not
    modified) -> (o `[B, T, H_v, D_v]` in v's dtype, the new fp32 state).

    `chunk_size` must be one of `CHUNK_SIZES`. The keywords tune the scan launch (value dims per program,
    default `scan_block_values`; warps; pipeline stages) and change no result beyond rounding; `new_state`:
    where to write the new state (`_state_out`), `state` itself to update it in place.
    """
    _check_delta_shapes("gated_delta_rule_chunked", q, k, v, g, beta)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size {chunk_size} not one of {CHUNK_SIZES}")
    batch, tokens, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    state = _initial_state(state, v, key_dim)
    out = torch.empty(batch, tokens, value_heads, value_dim, device=v.device, dtype=v.dtype)
    new_state = _state_out(new_state, state)
    if tokens == 0:
        if new_state is not state:
            new_state.copy_(state)
        return out, new_state
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    scale = key_dim**-0.5 if scale is None else scale
    chunks = triton.cdiv(tokens, chunk_size)
    inverse = torch.empty(batch * value_heads, chunks, chunk_size, chunk_size, device=v.device, dtype=torch.float32)
    block_k = max(16, triton.next_power_of_2(key_dim))
    if block_values is None:
        block_values = scan_block_values(batch * value_heads, value_dim, v.device)
    block_v = max(16, min(block_values, triton.next_power_of_2(value_dim)))
    precision = _dot_precision(v.dtype)
    g_strides, beta_strides = _strides(g, (0, 1, 2)), _strides(beta, (0, 1, 2))
    launch_options = {"num_warps": num_warps} | ({} if num_stages is None else {"num_stages": num_stages})
    with _device_scope(v):
        _chunk_inverse_kernel[(chunks, batch * value_heads)](
            k, g, beta, inverse, tokens, key_heads, value_heads, chunks,
            *_strides(k, (0, 1, 2)), *g_strides, *beta_strides,
            KEY_DIM=key_dim, CHUNK=chunk_size, BLOCK_K=block_k, DOT_PRECISION=precision,
        )
        _chunk_scan_kernel[(batch * value_heads, triton.cdiv(value_dim, block_v))](
            q, k, v, g, beta, inverse, state, out, new_state,
            tokens, scale, key_heads, value_heads, chunks,
            *_strides(q, (0, 1, 2)), *_strides(k, (0, 1, 2)), *_strides(v, (0, 1, 2)), *g_strides, *beta_strides,
            KEY_DIM=key_dim, VALUE_DIM=value_dim, CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v,
            DOT_PRECISION=precision, SPLIT_BF16=v.dtype == torch.bfloat16, INTERPRETED=_interpreted(),
            **launch_options,
        )
    return out, new_state


# -- Gated DeltaNet, one token at a time along a chain or a tree ----------------------------------------


@triton.jit
def _load_token(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, parents_ptr, i, present,
    stride_qt, stride_kt, stride_vt, stride_gt, stride_betat, key_dims, key_ok, value_dims, value_ok,
    TREE: tl.constexpr,
):
    """Token i's inputs (q, k, v as fp32 vectors; decay exp(g); beta; parent), zeros unless `present`.
    The pointers are already offset to the program's sequence and heads."""
    q = tl.load(q_ptr + i * stride_qt + key_dims, mask=key_ok & present, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + i * stride_kt + key_dims, mask=key_ok & present, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + i * stride_vt + value_dims, mask=value_ok & present, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + i * stride_gt, mask=present, other=0.0).to(tl.float32))
    beta = tl.load(beta_ptr + i * stride_betat, mask=present, other=0.0).to(tl.float32)
    if TREE:
        parent = tl.load(parents_ptr + i, mask=present, other=0).to(tl.int32)
    else:
        parent = tl.zeros([], tl.int32) + i - 1  # a tensor either way: the loop carries it
    return q, k, v, decay, beta, parent


@triton.jit
def _walk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, parents_ptr, out_ptr, states_out_ptr,
    tokens, scale, key_heads, value_heads,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_gb, stride_gt, stride_gh, stride_betab, stride_betat, stride_betah,
    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    TREE: tl.constexpr,
):
    """The recurrence token by token for one (sequence, value head) and BLOCK_V of its value dims.

    TREE: token i steps from the state after `parents[i]` (-1: the initial state) and every token's state
    is written to `states_out` `[T, H_v, D_k, D_v]`; otherwise each token steps from the previous one
    and only the final state is written (`states_out` `[B, H_v, D_k, D_v]`).
    """
    sequence_head = tl.program_id(0)
    batch = sequence_head // value_heads
    head = sequence_head % value_heads
    key_head = head % key_heads
    key_dims = tl.arange(0, BLOCK_K)
    value_dims = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_ok = key_dims < KEY_DIM
    value_ok = value_dims < VALUE_DIM
    slice_in_head = key_dims[:, None] * VALUE_DIM + value_dims[None, :]
    tile_ok = key_ok[:, None] & value_ok[None, :]
    head_state_size = KEY_DIM * VALUE_DIM
    initial = state_ptr + sequence_head.to(tl.int64) * head_state_size + slice_in_head
    state = tl.load(initial, mask=tile_ok, other=0.0)

    q_base = q_ptr + batch * stride_qb + key_head * stride_qh
    k_base = k_ptr + batch * stride_kb + key_head * stride_kh
    v_base = v_ptr + batch * stride_vb + head * stride_vh
    g_base = g_ptr + batch * stride_gb + head * stride_gh
    beta_base = beta_ptr + batch * stride_betab + head * stride_betah
    q, k, v, decay, beta, parent = _load_token(
        q_base, k_base, v_base, g_base, beta_base, parents_ptr, 0, tokens > 0,
        stride_qt, stride_kt, stride_vt, stride_gt, stride_betat, key_dims, key_ok, value_dims, value_ok, TREE)
    # A while loop: Triton 3.6's interpreter cannot take an argument as a range() bound (numpy >= 2.4).
    # Each step loads the next token's inputs before its own dependent chain (manual pipelining), so
    # a step costs the two reductions, not a memory round trip.
    i = 0
    while i < tokens:
        next_q, next_k, next_v, next_decay, next_beta, next_parent = _load_token(
            q_base, k_base, v_base, g_base, beta_base, parents_ptr, i + 1, i + 1 < tokens,
            stride_qt, stride_kt, stride_vt, stride_gt, stride_betat, key_dims, key_ok, value_dims, value_ok, TREE)
        if TREE:  # noqa: SIM102 -- a compile-time branch around a run-time one: Triton cannot `and` them
            if parent != i - 1:  # the registers hold token i-1's state: fetch the parent's
                parent_state = states_out_ptr + (parent.to(tl.int64) * value_heads + head) * head_state_size
                state = tl.load(tl.where(parent < 0, initial, parent_state + slice_in_head), mask=tile_ok, other=0.0)

        state = state * decay
        update = (v - tl.sum(state * k[:, None], axis=0)) * beta  # beta * (v - S^T k)
        state += k[:, None] * update[None, :]
        out = tl.sum(state * (q * scale)[:, None], axis=0)  # S^T q
        position = (batch * tokens + i).to(tl.int64)
        tl.store(out_ptr + (position * value_heads + head) * VALUE_DIM + value_dims,
                 out.to(out_ptr.dtype.element_ty), mask=value_ok)
        if TREE:
            node_state = states_out_ptr + (i * value_heads + head).to(tl.int64) * head_state_size + slice_in_head
            tl.store(node_state, state, mask=tile_ok)
            # A later node may reload this state; other threads of the program wrote parts of it.
            tl.debug_barrier()
        q, k, v, decay, beta, parent = next_q, next_k, next_v, next_decay, next_beta, next_parent
        i += 1

    if not TREE:
        tl.debug_barrier()  # as the chunk scan: the new state may overwrite the old
        tl.store(states_out_ptr + sequence_head.to(tl.int64) * head_state_size + slice_in_head, state, mask=tile_ok)


def _walk(q, k, v, g, beta, state, parents, scale, states_out, block_values, num_warps):
    batch, tokens, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    out = torch.empty(batch, tokens, value_heads, value_dim, device=v.device, dtype=v.dtype)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    block_v = max(16, min(block_values, triton.next_power_of_2(value_dim)))
    with _device_scope(v):
        _walk_kernel[(batch * value_heads, triton.cdiv(value_dim, block_v))](
            q, k, v, g, beta, state, state if parents is None else parents, out, states_out,
            tokens, key_dim**-0.5 if scale is None else scale, key_heads, value_heads,
            *_strides(q, (0, 1, 2)), *_strides(k, (0, 1, 2)), *_strides(v, (0, 1, 2)),
            *_strides(g, (0, 1, 2)), *_strides(beta, (0, 1, 2)),
            KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_K=max(16, triton.next_power_of_2(key_dim)),
            BLOCK_V=block_v, TREE=parents is not None, num_warps=num_warps,
        )
    return out


def gated_delta_rule_sequential(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None, scale: float | None = None, *, block_values: int = WALK_BLOCK_VALUES,
    num_warps: int = WALK_WARPS, new_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """the qwen35 family's `gated_delta_rule_recurrent` reference (`lucebox_qwen35.ops`) (any T) as one kernel walking the tokens in order: the
    simple form of `gated_delta_rule_chunked`, same arguments less `chunk_size`. Slower for long T
    (every token is a dependent step); kept as a fallback and as a second oracle. `new_state`: as
    `gated_delta_rule_chunked`'s."""
    _check_delta_shapes("gated_delta_rule_sequential", q, k, v, g, beta)
    state = _initial_state(state, v, k.shape[3])
    new_state = _state_out(new_state, state)
    out = _walk(q, k, v, g, beta, state, None, scale, new_state, block_values, num_warps)
    return out, new_state


def gated_delta_rule_tree(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, parents: torch.Tensor, scale: float | None = None, *,
    block_values: int = WALK_BLOCK_VALUES, num_warps: int = WALK_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """the qwen35 family's `gated_delta_rule_tree` reference (`lucebox_qwen35.ops`): q, k `[1, N, H_k, D_k]`, v `[1, N, H_v, D_v]`, g, beta
    `[1, N, H_v]`, state `[1, H_v, D_k, D_v]` fp32 (not modified), parents `[N]` long on the device
    (`parents[i] < i`, -1 for a root) -> (o `[1, N, H_v, D_v]` in v's dtype, the fp32 state after every
    node `[N, H_v, D_k, D_v]`). One launch; `parents` is never read on the host."""
    _check_delta_shapes("gated_delta_rule_tree", q, k, v, g, beta)
    nodes = k.shape[1]
    if k.shape[0] != 1 or parents.shape != (nodes,) or parents.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"gated_delta_rule_tree: batch 1 and parents [N] integer, got q {tuple(q.shape)}, "
                         f"parents {tuple(parents.shape)} {parents.dtype}")
    state = _initial_state(state, v, k.shape[3])
    node_states = torch.empty(nodes, *state.shape[1:], device=v.device, dtype=torch.float32)
    out = _walk(q, k, v, g, beta, state, parents.contiguous(), scale, node_states, block_values, num_warps)
    return out, node_states


# -- causal conv1d: prefill and tree -------------------------------------------------------------------


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, weight_ptr, state_ptr, y_ptr, new_state_ptr, tokens, channels,
    stride_xb, stride_xt, stride_wc, stride_wk, stride_sb, stride_sk,
    KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr,
):
    """y[t] = sum_j weight[:, j] * window[t + j] over the window cat(state, x), then SiLU if SILU; the
    programs of the first token block also write the new state, the window's last KERNEL-1 rows. y and the
    new state are contiguous [B, T, C] and [B, K-1, C]; the new state may be the state itself: only the
    first token block's programs read state rows (BLOCK_T >= KERNEL-1), each its own channels, and each
    writes those channels after its reads."""
    batch = tl.program_id(0)
    times = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < channels
    time_ok = times < tokens
    x_base = x_ptr + batch.to(tl.int64) * stride_xb
    state_base = state_ptr + batch.to(tl.int64) * stride_sb
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        source = times + (j - (KERNEL - 1))  # row of x; negative: row KERNEL-1+source of the state
        in_x = time_ok & (source >= 0)
        in_state = time_ok & (source < 0)
        from_x = tl.load(x_base + source.to(tl.int64)[:, None] * stride_xt + cols[None, :],
                         mask=in_x[:, None] & col_ok[None, :], other=0.0)
        from_state = tl.load(state_base + (KERNEL - 1 + source)[:, None] * stride_sk + cols[None, :],
                             mask=in_state[:, None] & col_ok[None, :], other=0.0)
        # The reference casts the state to x's dtype first.
        row = from_x.to(tl.float32) + from_state.to(x_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(weight_ptr + cols * stride_wc + j * stride_wk, mask=col_ok, other=0.0).to(tl.float32)
        acc += row * weight[None, :]
    if SILU:  # as the tree and step kernels: rounded to the activation dtype, then SiLU
        acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        acc = acc * tl.sigmoid(acc)
    y_rows = (batch * tokens + times).to(tl.int64) * channels
    tl.store(y_ptr + y_rows[:, None] + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=time_ok[:, None] & col_ok[None, :])

    if tl.program_id(1) == 0:
        kept = tl.arange(0, BLOCK_K)  # new state row r is window row tokens + r
        kept_ok = kept < KERNEL - 1
        kept_source = tokens + kept - (KERNEL - 1)
        kept_x = tl.load(x_base + kept_source.to(tl.int64)[:, None] * stride_xt + cols[None, :],
                         mask=(kept_ok & (kept_source >= 0))[:, None] & col_ok[None, :], other=0.0)
        kept_state = tl.load(state_base + (KERNEL - 1 + kept_source)[:, None] * stride_sk + cols[None, :],
                             mask=(kept_ok & (kept_source < 0))[:, None] & col_ok[None, :], other=0.0)
        rows = kept_x + kept_state.to(x_ptr.dtype.element_ty)
        # Written in place, the state's rows move between threads: every read of the old rows lands first.
        tl.debug_barrier()
        new_state_rows = (batch * (KERNEL - 1) + kept).to(tl.int64) * channels
        tl.store(new_state_ptr + new_state_rows[:, None] + cols[None, :], rows,
                 mask=kept_ok[:, None] & col_ok[None, :])


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, *, activation: str | None = None,
    new_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """the qwen35 family's `causal_conv1d` reference (`lucebox_qwen35.ops`): x `[B, T, C]`, weight `[C, K]`, state `[B, K-1, C]` -> (y `[B, T, C]`,
    new state `[B, K-1, C]`), both in x's dtype (fp32 accumulation). `activation="silu"`: SiLU on y in the
    same kernel (the family's `causal_conv1d_silu_`). `new_state`: where to write the new state (x's dtype,
    contiguous), `state` itself to update it in place; by default a new tensor."""
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', not {activation!r}")
    batch, tokens, channels = x.shape
    kernel = weight.shape[1]
    if (weight.shape[0] != channels or state.shape != (batch, kernel - 1, channels) or kernel < 2
            or kernel - 1 > CONV_BLOCK_TOKENS):
        raise ValueError(f"causal_conv1d shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"state {tuple(state.shape)}")
    if new_state is None:
        new_state = torch.empty(batch, kernel - 1, channels, device=x.device, dtype=x.dtype)
    elif new_state.shape != state.shape or new_state.dtype != x.dtype or not new_state.is_contiguous():
        raise ValueError(f"new_state must be a contiguous {x.dtype} tensor of shape {tuple(state.shape)}")
    x, state = _last_dim_contiguous(x), _last_dim_contiguous(state)
    y = torch.empty(batch, tokens, channels, device=x.device, dtype=x.dtype)
    grid = (batch, max(1, triton.cdiv(tokens, CONV_BLOCK_TOKENS)), triton.cdiv(channels, CONV_BLOCK_CHANNELS))
    with _device_scope(x):
        _causal_conv1d_kernel[grid](
            x, weight, state, y, new_state, tokens, channels,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), state.stride(0), state.stride(1),
            KERNEL=kernel, BLOCK_T=CONV_BLOCK_TOKENS, BLOCK_C=CONV_BLOCK_CHANNELS,
            BLOCK_K=triton.next_power_of_2(kernel - 1), SILU=activation == "silu",
        )
    return y, new_state


@triton.jit
def _causal_conv1d_tree_kernel(
    x_ptr, weight_ptr, state_ptr, parents_ptr, y_ptr, node_states_ptr, channels,
    stride_xt, stride_wc, stride_wk, stride_sk,
    KERNEL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr,
):
    """Node i's window, newest first: x[i], x[parent(i)], ... up its ancestry, then the committed state
    rows K-2, K-3, ...; y[i] = sum_j weight[:, j] * window[j] (oldest first), and the node's conv state
    is the window's last K-1 rows. y `[N, C]` and node states `[N, K-1, C]` are contiguous.

    The window is assembled as the one-token step kernel holds it (a [BLOCK_K, BLOCK_C] tile) and reduced
    and activated with the same operations, so a node's output equals, bit for bit, the decode step's for
    the same token after its path."""
    node_index = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < channels
    taps = tl.arange(0, BLOCK_K)
    window = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
    node = node_index.to(tl.int64)  # the next ancestor to read; -1 once past the root
    state_row = KERNEL - 2  # the next committed row to read once the ancestry is used up
    states_base = node_states_ptr + node_index.to(tl.int64) * (KERNEL - 1) * channels
    for newest_first in tl.static_range(KERNEL):
        j = KERNEL - 1 - newest_first  # position in the window, oldest first
        in_tree = node >= 0
        from_x = tl.load(x_ptr + tl.maximum(node, 0) * stride_xt + cols, mask=col_ok & in_tree, other=0.0)
        from_state = tl.load(state_ptr + state_row * stride_sk + cols, mask=col_ok & (node < 0), other=0.0)
        row = tl.where(in_tree, from_x, from_state.to(x_ptr.dtype.element_ty))
        window = tl.where(taps[:, None] == j, row.to(tl.float32)[None, :], window)
        if j >= 1:
            tl.store(states_base + (j - 1) * channels + cols, row, mask=col_ok)
        parent = tl.load(parents_ptr + tl.maximum(node, 0), mask=in_tree, other=-1)
        state_row = tl.where(in_tree, state_row, state_row - 1)
        node = tl.where(in_tree, parent, node)
    weight = tl.load(weight_ptr + cols[None, :] * stride_wc + taps[:, None] * stride_wk,
                     mask=(taps[:, None] < KERNEL) & col_ok[None, :], other=0.0).to(tl.float32)
    y = tl.sum(window * weight, axis=0)
    if SILU:  # as triton_ops' step kernel: rounded to the activation dtype, then SiLU
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + node_index.to(tl.int64) * channels + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


def causal_conv1d_tree(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor, *,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal convolution over the nodes of a candidate tree (the qwen35 family's `causal_conv1d_tree` reference (`lucebox_qwen35.ops`)):
    x `[1, N, C]`, weight `[C, K]`, state `[1, K-1, C]` (the committed inputs), parents `[N]` long on the
    device -> (y `[1, N, C]`, each node's conv state `[N, K-1, C]`), in x's dtype. One launch.
    `activation="silu"`: SiLU applied in the kernel, as the decode step's `conv_silu_update_` does."""
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', not {activation!r}")
    _, nodes, channels = x.shape
    kernel = weight.shape[1]
    if (x.shape[0] != 1 or weight.shape[0] != channels or state.shape != (1, kernel - 1, channels)
            or parents.shape != (nodes,) or kernel < 2):
        raise ValueError(f"causal_conv1d_tree shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"state {tuple(state.shape)}, parents {tuple(parents.shape)}")
    x, state = _last_dim_contiguous(x), _last_dim_contiguous(state)
    y = torch.empty(1, nodes, channels, device=x.device, dtype=x.dtype)
    node_states = torch.empty(nodes, kernel - 1, channels, device=x.device, dtype=x.dtype)
    with _device_scope(x):
        _causal_conv1d_tree_kernel[(nodes, triton.cdiv(channels, CONV_BLOCK_CHANNELS))](
            x, weight, state, parents.contiguous(), y, node_states, channels,
            x.stride(1), weight.stride(0), weight.stride(1), state.stride(1),
            KERNEL=kernel, BLOCK_K=triton.next_power_of_2(kernel), BLOCK_C=CONV_BLOCK_CHANNELS,
            SILU=activation == "silu",
        )
    return y, node_states


# -- GPU check and timing: python -m lucebox_cuda.triton_gdn -----------------------------------------


def _delta_inputs(tokens: int, dtype: torch.dtype, device: torch.device, key_heads: int = 16,
                  value_heads: int = 48, dim: int = 128) -> tuple[torch.Tensor, ...]:
    """27B-shaped Gated DeltaNet inputs with the model's ranges: unit q, k; g <= 0; beta in (0, 1)."""
    unit = torch.nn.functional.normalize
    q = unit(torch.randn(1, tokens, key_heads, dim, device=device), dim=-1).to(dtype)
    k = unit(torch.randn(1, tokens, key_heads, dim, device=device), dim=-1).to(dtype)
    v = torch.randn(1, tokens, value_heads, dim, device=device).to(dtype)
    g = -torch.rand(1, tokens, value_heads, device=device) * 0.5
    beta = torch.rand(1, tokens, value_heads, device=device).to(dtype)
    state = torch.randn(1, value_heads, dim, dim, device=device) * 0.1
    return q, k, v, g, beta, state


def _tree_parents(nodes: int, device: torch.device) -> torch.Tensor:
    """A bushy tree: a chain for the first half, then nodes branching off random earlier nodes."""
    generator = torch.Generator().manual_seed(nodes)
    parents = [-1] + [i - 1 if i <= nodes // 2 else int(torch.randint(0, i, (1,), generator=generator)) for i in
                      range(1, nodes)]
    return torch.tensor(parents, device=device)


def main() -> int:
    """Check every kernel against the references on the GPU at 27B shapes and time both; print a table.

    The reference runs in fp32 on the same (rounded) inputs. Returns 1, naming the kernel, if a relative
    error exceeds its dtype's bound. Also times the chunk-scan launch options, to pick the defaults.
    """
    from lucebox_core.ops import with_family_ops
    from lucebox_core.torch_backend import TorchBackend

    if not torch.cuda.is_available():
        print("no CUDA device: run the CPU tests (tests/test_triton_gdn.py) instead")
        return 1
    device = torch.device("cuda")
    torch.manual_seed(0)
    bounds = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
    oracle = with_family_ops(TorchBackend(device, torch.float32, weight_cache_bytes=0))
    failures: list[str] = []

    def check(label: str, dtype: torch.dtype, kernel: Callable, reference: Callable, args: tuple,
              tokens: int | None = None) -> None:
        upcast = tuple(t.float() if t.is_floating_point() else t for t in args)
        expected = reference(*upcast)
        result = kernel(*args)
        error = max(_relative_error(a, b) for a, b in zip(result, expected))
        triton_ms = _median_ms(functools.partial(kernel, *args))
        torch_ms = _median_ms(functools.partial(reference, *args), repeats=3)
        rate = f"{tokens / triton_ms * 1e3:>12,.0f}" if tokens else ""
        print(f"{label:<44} {str(dtype).removeprefix('torch.'):<9} {error:>9.2e} {triton_ms:>10.4f} "
              f"{torch_ms:>9.3f} {rate}")
        if not error <= bounds[dtype]:
            failures.append(f"{label} {dtype}: relative error {error:.2e} > {bounds[dtype]:.0e}")

    print(f"{torch.cuda.get_device_name(device)}, Triton {triton.__version__}, torch {torch.__version__}")
    print(f"{'op (27B shapes)':<44} {'dtype':<9} {'rel err':>9} {'triton ms':>10} {'torch ms':>9} {'tok/s/layer':>12}")
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (512, 4096):
            args = _delta_inputs(tokens, dtype, device)
            check(f"gated_delta_rule_chunked T={tokens}", dtype, gated_delta_rule_chunked,
                  oracle.gated_delta_rule_chunked, args, tokens)
            if tokens == 512:
                check(f"gated_delta_rule_sequential T={tokens}", dtype, gated_delta_rule_sequential,
                      oracle.gated_delta_rule_chunked, args, tokens)
        for nodes in (1, 8, 23, 64):
            args = (*_delta_inputs(nodes, dtype, device), _tree_parents(nodes, device))
            check(f"gated_delta_rule_tree N={nodes}", dtype, gated_delta_rule_tree, oracle.gated_delta_rule_tree,
                  args)
        x = torch.randn(1, 4096, 10240, device=device).to(dtype)
        conv_args = (x, torch.randn(10240, 4, device=device).to(dtype), torch.randn(1, 3, 10240, device=device))
        check("causal_conv1d T=4096 C=10240 K=4", dtype, causal_conv1d, oracle.causal_conv1d, conv_args, 4096)
        tree_args = (x[:, :23], *conv_args[1:], _tree_parents(23, device))
        check("causal_conv1d_tree N=23", dtype, causal_conv1d_tree, oracle.causal_conv1d_tree, tree_args)

    def sweep(label: str, kernel: Callable, args: tuple, options: list[dict]) -> None:
        """Time `kernel` under each launch option: the data for the defaults."""
        print(label)
        for option in options:
            try:
                milliseconds = f"{_median_ms(functools.partial(kernel, *args, **option), repeats=10):.4f}"
            except triton.runtime.errors.OutOfResources as error:  # say so and keep going
                milliseconds = f"{error!r:.80}"
            print(f"  {option}: {milliseconds}")

    chunk_args = _delta_inputs(4096, torch.bfloat16, device)
    default_block = scan_block_values(48, 128, device)
    sweep(f"chunk-scan launch options, bf16, T=4096, ms per call (default block_values {default_block}, "
          f"{SCAN_WARPS} warps):", gated_delta_rule_chunked, chunk_args,
          # 64 value dims, or 8 warps, overran memory on the H200 (illegal address, run 2): not offered.
          [{"block_values": 16}, {"block_values": 32}])
    tree_args = (*_delta_inputs(23, torch.bfloat16, device), _tree_parents(23, device))
    sweep(f"tree launch options, bf16, N=23, ms per call (default block_values {WALK_BLOCK_VALUES}, "
          f"{WALK_WARPS} warps):", gated_delta_rule_tree, tree_args,
          [{"num_warps": 1}, {"num_warps": 2}, {"num_warps": 4}, {"block_values": 32, "num_warps": 4}])
    for failure in failures:
        print("FAIL", failure)
    print("all kernels within bounds" if not failures else f"{len(failures)} kernel checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
