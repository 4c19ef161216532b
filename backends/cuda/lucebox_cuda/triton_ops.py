"""Triton kernels for the small non-matmul ops of the decode step, with thin torch-facing wrappers.

Each wrapper takes the tensors of the reference op of the same name (the qwen35 family's, `lucebox_qwen35.ops`)
and gives the same result; the kernels accumulate in fp32 whatever the activation dtype. No host value
depends on device data, so every wrapper can be recorded in a CUDA graph.

- `_load_kv_rows`: rows of one KV head as values or Q8_0 / Q4_0 / TQ3_0 blocks decoded in registers (the
  attention kernels of `triton_attention`, decode step and tree verification alike, read the cache through
  it; TQ3_0 in its rotated domain, which the wrappers account for).
- `gated_delta_rule_step`: one token of the Gated DeltaNet recurrence, one program per (sequence, value
  head, slice of value dims); the fp32 state slice stays in registers between the decay, the delta
  update and the readout.
- `causal_conv1d_step`: one token of the depthwise causal convolution, optionally followed by SiLU.

The wrappers run under `TRITON_INTERPRET=1` on CPU tensors too (that is how CI tests them).
`python -m lucebox_cuda.triton_ops` checks and times every kernel against the torch reference on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .pdl import triton_options
from .timing import median_ms as _median_ms
from .timing import relative_error as _relative_error

# Value dims one Gated DeltaNet program owns: a [128, 32] fp32 state slice is 32 registers a thread with
# 4 warps, and 27B's 48 value heads of 128 dims make 192 programs.
DELTA_BLOCK_VALUES = 32
# Channels one convolution program owns.
CONV_BLOCK_CHANNELS = 256

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _device_scope(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device's current stream: make that the tensor's device."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with stride 1 and every other dim with the tensor's own strides."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def device_offset(causal_offset: int | torch.Tensor | None, q: torch.Tensor) -> bool:
    """Whether `causal_offset` is read on the device (a `[1]` integer tensor on q's device; never compared on
    the host, where a graph's replay would not see it change); a host value must be >= 0."""
    if isinstance(causal_offset, torch.Tensor):
        if causal_offset.numel() != 1 or causal_offset.device != q.device or causal_offset.is_floating_point():
            raise ValueError(f"a device causal_offset must be one integer on {q.device}, not {causal_offset!r}")
        return True
    if causal_offset is not None and causal_offset < 0:
        raise ValueError(f"causal_offset must be >= 0, not {causal_offset}")
    return False


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 products in full precision (Triton's default for fp32 is TF32); half types are exact anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


# -- decode attention ----------------------------------------------------------------------------------


# What `_load_kv_rows` reads, by KV cache type (a constexpr of the attention kernels): values, or the blocks of
# `lucebox_core.kv_quant` decoded in registers.
KV_FORMATS = {None: 0, "q8_0": 1, "q4_0": 2, "tq3_0": 3}


@triton.jit
def grid_dependency():
    """A kernel launched with PDL (`lucebox_cuda.pdl`, its `PDL` constexpr): wait until the kernel ahead has
    finished and its writes are visible, then let the next kernel launch early. First in the kernel, under
    `if PDL:` (the interpreter has no inline PTX; a plain launch compiles it out)."""
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def _load_kv_rows(base, offsets, row_ok, dims, dim_ok, stride_n, FORMAT: tl.constexpr):
    """Rows `offsets` of one KV head as fp32 `[BLOCK_N, BLOCK_D]`: plain values, or blocks decoded in registers
    (`KV_FORMATS`; `base` and `stride_n` in bytes then)."""
    return _load_kv_row_ptrs(base + offsets * stride_n, row_ok, dims, dim_ok, FORMAT)


@triton.jit
def _block_scale(rows, block_start, mask):
    """The fp16 at the start of each value's block (a Q8_0/Q4_0 scale, a TQ3_0 norm) as fp32."""
    low = tl.load(rows + block_start[None, :], mask=mask, other=0).to(tl.uint16)
    high = tl.load(rows + (block_start + 1)[None, :], mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_kv_row_ptrs(rows, row_ok, dims, dim_ok, FORMAT: tl.constexpr):
    """`_load_kv_rows` from a pointer per row (`rows` `[BLOCK_N]`): rows gathered from two tensors of one
    storage format."""
    mask = row_ok[:, None] & dim_ok[None, :]
    within = dims % 32  # a value's place in its block of 32
    if FORMAT == 1:  # Q8_0: fp16 scale, 32 int8
        block_start = (dims // 32) * 34
        rows = rows[:, None]
        quants = tl.load(rows + (block_start + 2 + within)[None, :], mask=mask, other=0)
        values = quants.to(tl.int8, bitcast=True).to(tl.float32) * _block_scale(rows, block_start, mask)
    elif FORMAT == 2:  # Q4_0: fp16 scale, byte j = value j (low nibble) and value j + 16 (high nibble)
        block_start = (dims // 32) * 18
        rows = rows[:, None]
        packed = tl.load(rows + (block_start + 2 + within % 16)[None, :], mask=mask, other=0)
        nibble = (packed >> ((within // 16) * 4)[None, :].to(tl.uint8)) & 15
        values = (nibble.to(tl.float32) - 8.0) * _block_scale(rows, block_start, mask)
    elif FORMAT == 3:  # TQ3_0: fp16 norm, 2-bit lows 4 a byte, high bits 8 a byte; values in the rotated domain
        block_start = (dims // 32) * 14
        rows = rows[:, None]
        low = tl.load(rows + (block_start + 2 + within // 4)[None, :], mask=mask, other=0)
        low = (low >> ((within % 4) * 2)[None, :].to(tl.uint8)) & 3
        high = tl.load(rows + (block_start + 10 + within // 8)[None, :], mask=mask, other=0)
        high = (high >> (within % 8)[None, :].to(tl.uint8)) & 1
        index = (low | (high << 2)).to(tl.int32)
        # The Lloyd-Max levels (kv_quant.TQ3_0_LEVELS): index 4 + k is +level k, 3 - k is -level k.
        positive = index >= 4
        level_index = tl.where(positive, index - 4, 3 - index)
        level = tl.where(level_index == 0, 0.021460,
                         tl.where(level_index == 1, 0.065717, tl.where(level_index == 2, 0.117832, 0.190685)))
        values = tl.where(positive, level, -level) * _block_scale(rows, block_start, mask)
    else:
        values = tl.load(rows[:, None] + dims[None, :], mask=mask, other=0.0)
    return values  # one return: compiled Triton wants a single return type per specialisation


# -- Gated DeltaNet recurrent step ---------------------------------------------------------------------


@triton.jit
def _gated_delta_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, new_state_ptr, out_ptr,
    scale, key_heads, value_heads,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_gb, stride_gh, stride_betab, stride_betah,
    KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One token for one (sequence, value head) and BLOCK_V of its value dims: the state's columns are
    independent in the delta rule, so a column slice is a whole problem."""
    sequence_head = tl.program_id(0)
    batch = sequence_head // value_heads
    head = sequence_head % value_heads
    key_head = head % key_heads  # tiled heads: the GGUF order (see the reference `gated_delta_rule_recurrent`)
    key_dims = tl.arange(0, BLOCK_K)
    value_dims = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_ok = key_dims < KEY_DIM
    value_ok = value_dims < VALUE_DIM

    q = tl.load(q_ptr + batch * stride_qb + key_head * stride_qh + key_dims, mask=key_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + batch * stride_kb + key_head * stride_kh + key_dims, mask=key_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + batch * stride_vb + head * stride_vh + value_dims, mask=value_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + batch * stride_gb + head * stride_gh).to(tl.float32))
    beta = tl.load(beta_ptr + batch * stride_betab + head * stride_betah).to(tl.float32)

    # The state is [B, H_v, D_k, D_v], contiguous, fp32.
    tile = (sequence_head * KEY_DIM + key_dims[:, None]) * VALUE_DIM + value_dims[None, :]
    tile_ok = key_ok[:, None] & value_ok[None, :]
    state = tl.load(state_ptr + tile, mask=tile_ok, other=0.0) * decay
    update = (v - tl.sum(state * k[:, None], axis=0)) * beta  # beta * (v - S^T k)
    state += k[:, None] * update[None, :]
    out = tl.sum(state * (q * scale)[:, None], axis=0)  # S^T q
    tl.store(new_state_ptr + tile, state, mask=tile_ok)
    tl.store(out_ptr + sequence_head * VALUE_DIM + value_dims, out.to(out_ptr.dtype.element_ty), mask=value_ok)


def gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None, scale: float | None = None, *, new_state: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """the qwen35 family's `gated_delta_rule_recurrent` reference (`lucebox_qwen35.ops`) for one token: q, k `[B, 1, H_k, D_k]`, v `[B, 1, H_v, D_v]`,
    g, beta `[B, 1, H_v]`, state `[B, H_v, D_k, D_v]` fp32 (None: zeros) -> (o `[B, 1, H_v, D_v]` in v's
    dtype, the new fp32 state).

    `new_state`: where to write the new state (contiguous fp32); pass `state` itself to update it in
    place (each program reads its slice before writing it). By default a new tensor, leaving `state` as it
    was, as the op contract asks. `out`: a contiguous `[B, 1, H_v, D_v]` tensor of v's dtype to write o into.
    """
    batch, tokens, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if tokens != 1 or q.shape != k.shape or v.shape[:2] != (batch, 1) or value_heads % key_heads:
        raise ValueError(f"gated_delta_rule_step shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if state is None:
        state = torch.zeros(batch, value_heads, key_dim, value_dim, device=v.device, dtype=torch.float32)
    state = state.float().contiguous()
    if new_state is None:
        new_state = torch.empty_like(state)
    elif new_state.shape != state.shape or new_state.dtype != torch.float32 or not new_state.is_contiguous():
        raise ValueError(f"new_state must be a contiguous float32 tensor of shape {tuple(state.shape)}")
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    if out is None:
        out = torch.empty(batch, 1, value_heads, value_dim, device=v.device, dtype=v.dtype)
    elif out.shape != (batch, 1, value_heads, value_dim) or out.dtype != v.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {v.dtype} tensor of shape {(batch, 1, value_heads, value_dim)}")
    scale = key_dim**-0.5 if scale is None else scale
    block_values = min(DELTA_BLOCK_VALUES, triton.next_power_of_2(value_dim))
    grid = (batch * value_heads, math.ceil(value_dim / block_values))
    with _device_scope(v):
        _gated_delta_step_kernel[grid](
            q, k, v, g, beta, state, new_state, out,
            scale, key_heads, value_heads,
            q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
            g.stride(0), g.stride(2), beta.stride(0), beta.stride(2),
            KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_values,
        )
    return out, new_state


# -- causal conv1d step --------------------------------------------------------------------------------


@triton.jit
def _causal_conv1d_step_kernel(
    x_ptr, weight_ptr, state_ptr, y_ptr, new_state_ptr, channels,
    stride_xb, stride_wc, stride_wk, stride_sb, stride_sk, stride_nb, stride_nk, stride_yb,
    KERNEL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """y[c] = sum_j weight[c, j] * window[j, c] over the window (state rows, then x); the new state is
    the window's last KERNEL-1 rows."""
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    batch = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < channels
    taps = tl.arange(0, BLOCK_K)
    from_state = (taps[:, None] < KERNEL - 1) & col_ok[None, :]
    window = tl.load(state_ptr + batch * stride_sb + taps[:, None] * stride_sk + cols[None, :],
                     mask=from_state, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + batch * stride_xb + cols, mask=col_ok, other=0.0)
    window = tl.where(taps[:, None] == KERNEL - 1, x.to(tl.float32)[None, :], window)
    weight = tl.load(weight_ptr + cols[None, :] * stride_wc + taps[:, None] * stride_wk,
                     mask=(taps[:, None] < KERNEL) & col_ok[None, :], other=0.0).to(tl.float32)
    y = tl.sum(window * weight, axis=0)
    if SILU:
        # Rounded to the activation dtype first, as the reference (convolution, then SiLU) and the prefill
        # and tree-verify paths do: decode and verify must see the same GDN input bits.
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + batch * stride_yb + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)
    # Updating the state in place moves rows between threads: every read above must land first.
    tl.debug_barrier()
    shifted = (taps[:, None] >= 1) & (taps[:, None] < KERNEL) & col_ok[None, :]
    tl.store(new_state_ptr + batch * stride_nb + (taps[:, None] - 1) * stride_nk + cols[None, :],
             window.to(new_state_ptr.dtype.element_ty), mask=shifted)


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, *, activation: str | None = None,
    new_state: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """the qwen35 family's `causal_conv1d_step` reference (`lucebox_qwen35.ops`): x `[B, C]`, weight `[C, K]`, state `[B, K-1, C]` -> (y `[B, C]`,
    new state `[B, K-1, C]`), both in x's dtype.

    `activation="silu"` applies SiLU to y in the same kernel (the reference op applies none; the model
    applies it next). `new_state`: where to write the new state (x's dtype, last dim contiguous); pass
    `state` itself to shift it in place. By default a new tensor, leaving `state` as it was. `out`: a
    `[B, C]` tensor of x's dtype (last dim contiguous) to write y into.
    """
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', not {activation!r}")
    batch, channels = x.shape
    kernel = weight.shape[1]
    if weight.shape[0] != channels or state.shape != (batch, kernel - 1, channels):
        raise ValueError(f"causal_conv1d_step shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"state {tuple(state.shape)}")
    x, state = _last_dim_contiguous(x), _last_dim_contiguous(state)
    if new_state is None:
        new_state = torch.empty(batch, kernel - 1, channels, device=x.device, dtype=x.dtype)
    elif new_state.shape != state.shape or new_state.dtype != x.dtype or new_state.stride(-1) != 1:
        raise ValueError(f"new_state must be a {x.dtype} tensor of shape {tuple(state.shape)}, last dim contiguous")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {x.dtype} tensor of shape {tuple(x.shape)}, last dim contiguous")
    grid = (batch, math.ceil(channels / CONV_BLOCK_CHANNELS))
    with _device_scope(x):
        _causal_conv1d_step_kernel[grid](
            x, weight, state, out, new_state, channels,
            x.stride(0), weight.stride(0), weight.stride(1), state.stride(0), state.stride(1),
            new_state.stride(0), new_state.stride(1), out.stride(0),
            KERNEL=kernel, BLOCK_K=triton.next_power_of_2(kernel), BLOCK_C=CONV_BLOCK_CHANNELS,
            SILU=activation == "silu", **triton_options(x),
        )
    return out, new_state


# -- KV rows stored at device-held positions ---------------------------------------------------------------


@triton.jit
def _write_kv_rows_kernel(
    k_ptr, v_ptr, keys_ptr, values_ptr, positions_ptr, ring, kv_heads,
    stride_kn, stride_kh, stride_vn, stride_vh,
    K_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, RING: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One (row, KV head): its K and V rows copied into the cache buffers (`[slots, heads, dim]`, contiguous) at
    the slot of the row's position (the position itself, or in a ring of `ring` slots position % ring)."""
    if PDL:  # programmatic dependent launch: the kernel ahead's writes first (lucebox_cuda.pdl)
        grid_dependency()
    row = tl.program_id(0)
    head = tl.program_id(1)
    position = tl.load(positions_ptr + row)
    slot = position % ring if RING else position
    destination = slot * kv_heads + head
    k_dims = tl.arange(0, BLOCK_K)
    k = tl.load(k_ptr + row * stride_kn + head * stride_kh + k_dims, mask=k_dims < K_DIM)
    tl.store(keys_ptr + destination * K_DIM + k_dims, k.to(keys_ptr.dtype.element_ty), mask=k_dims < K_DIM)
    v_dims = tl.arange(0, BLOCK_V)
    v = tl.load(v_ptr + row * stride_vn + head * stride_vh + v_dims, mask=v_dims < V_DIM)
    tl.store(values_ptr + destination * V_DIM + v_dims, v.to(values_ptr.dtype.element_ty), mask=v_dims < V_DIM)


def write_kv_rows(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, ring: int, k: torch.Tensor,
                  v: torch.Tensor) -> None:
    """The core's `write_kv_rows` (`TorchBackend.write_kv_rows`) in one launch, where the reference takes two
    index copies and, for a ring, the slots' modulo: `k` `[N, heads, k_dim]` and `v` into the contiguous plain
    buffers `keys` `[slots, heads, k_dim]` and `values` at the slots of `positions` `[N]` (device integers)."""
    rows, heads = k.shape[:2]
    if (keys.dim() != 3 or values.dim() != 3 or k.dim() != 3 or v.shape[:2] != (rows, heads)
            or keys.shape[1:] != k.shape[1:] or values.shape[1:] != v.shape[1:] or keys.shape[0] != values.shape[0]):
        raise ValueError(f"write_kv_rows shapes: keys {tuple(keys.shape)}, values {tuple(values.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("write_kv_rows needs contiguous cache buffers")
    positions = positions.reshape(-1)
    if positions.numel() != rows:
        raise ValueError(f"{positions.numel()} positions for {rows} rows")
    if rows == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    with _device_scope(k):
        _write_kv_rows_kernel[(rows, heads)](
            k, v, keys, values, positions, max(ring, 1), heads, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            K_DIM=k.shape[2], V_DIM=v.shape[2], BLOCK_K=triton.next_power_of_2(k.shape[2]),
            BLOCK_V=triton.next_power_of_2(v.shape[2]), RING=ring > 0, **triton_options(k),
        )


# -- GPU check and timing: python -m lucebox_cuda.triton_ops -----------------------------------------


def _decode_cases(dtype: torch.dtype, device: torch.device) -> list[tuple[str, Callable, str, tuple, dict]]:
    """(label, kernel wrapper, reference op name, arguments, keyword arguments) at the 27B decode shapes:
    Gated DeltaNet 16 key / 48 value heads of 128 dims, conv 10240 channels with kernel 4."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(dtype)

    # (The decode step's attention, a one-node tree kernel, is checked with the others in triton_attention.)
    cases = []
    unit = torch.nn.functional.normalize
    delta_args = (unit(randn(1, 1, 16, 128).float(), dim=-1).to(dtype),
                  unit(randn(1, 1, 16, 128).float(), dim=-1).to(dtype),
                  randn(1, 1, 48, 128), -2 * torch.rand(1, 1, 48, device=device),
                  torch.rand(1, 1, 48, device=device).to(dtype), torch.randn(1, 48, 128, 128, device=device))
    cases.append(("gated_delta_rule_step 16/48 heads 128x128", gated_delta_rule_step, "gated_delta_rule_recurrent",
                  delta_args, {}))
    conv_args = (randn(1, 10240), randn(10240, 4), randn(1, 3, 10240))
    cases.append(("causal_conv1d_step 10240 channels, kernel 4", causal_conv1d_step, "causal_conv1d_step",
                  conv_args, {}))
    return cases


def main() -> int:
    """Check every kernel against the references on the GPU at the 27B shapes and time both; print a table.

    Results are poisoned with NaN before the checked run and compared with the reference op run in fp32 on
    the same (rounded) inputs. Returns 1, naming the kernel, if a relative error exceeds its dtype's bound.
    """
    from lucebox_core.ops import with_family_ops
    from lucebox_core.torch_backend import TorchBackend

    if not torch.cuda.is_available():
        print("no CUDA device: run the CPU tests (tests/test_cuda_triton.py) instead")
        return 1
    device = torch.device("cuda")
    torch.manual_seed(0)
    bounds = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
    oracle = with_family_ops(TorchBackend(device, torch.float32, weight_cache_bytes=0))
    failures = []
    print(f"{torch.cuda.get_device_name(device)}, Triton {triton.__version__}, torch {torch.__version__}")
    print(f"{'op':<44} {'dtype':<9} {'rel err':>9} {'triton ms':>10} {'torch ms':>9}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        reference = with_family_ops(TorchBackend(device, dtype, weight_cache_bytes=0))
        for label, kernel, op, args, kwargs in _decode_cases(dtype, device):
            upcast = tuple(t.float() if t.is_floating_point() else t for t in args)
            expected = getattr(oracle, op)(*upcast, **kwargs)
            expected = expected if isinstance(expected, tuple) else (expected,)
            poisoned = {"out": torch.full_like(expected[0], float("nan"), dtype=dtype)}
            if len(expected) == 2:  # (output, state): the state keeps its dtype (fp32 for Gated DeltaNet)
                poisoned["new_state"] = torch.full_like(expected[1], float("nan"), dtype=args[-1].dtype)
            result = kernel(*args, **kwargs, **poisoned)
            result = result if isinstance(result, tuple) else (result,)
            error = max(_relative_error(a, b) for a, b in zip(result, expected))
            triton_ms = _median_ms(functools.partial(kernel, *args, **kwargs, **poisoned))
            torch_ms = _median_ms(functools.partial(getattr(reference, op), *args, **kwargs))
            dtype_name = str(dtype).removeprefix("torch.")
            print(f"{label:<44} {dtype_name:<9} {error:>9.2e} {triton_ms:>10.4f} {torch_ms:>9.4f}")
            if not error <= bounds[dtype]:
                failures.append(f"{label} {dtype}: relative error {error:.2e} > {bounds[dtype]:.0e}")
    for failure in failures:
        print("FAIL", failure)
    print("all kernels within bounds" if not failures else f"{len(failures)} kernel checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
