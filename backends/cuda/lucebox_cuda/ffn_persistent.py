"""A decode step's dense SwiGLU MLP, with the residual add and norm before it, as one persistent launch.

`add_rms_norm_swiglu` (the core's generic op: `(down(silu(g) * u), residual + x)` for `g | u` the fused gate and
up rows of `rms_norm(residual + x)`) is four kernels on this backend: add + norm, the gate | up product, the
SwiGLU and the down product, each a few microseconds that pay a launch, a ramp and a drain. A small model's step
is made of such kernels (Qwen3.5-0.8B: ~11 a layer, launch-bound at ~1.6 ms a token on the H200). Here they are
two phases of `kernels/ffn_persistent.cu` with one grid-wide barrier between them: the first piece of issue
#17's megakernel, and a measurement of what a barrier costs against a launch.

Off by default until measured on a GPU: `LUCEBOX_PERSISTENT_FFN=1` turns it on for one token at a time (the
decode step); a verify pass and a prefill keep the four kernels. Its products are the `mma` kernel's arithmetic
and its norm and SwiGLU round with the Triton kernels' operations, but the norm adds its squares in another
order, so with it on a decode step may differ from a verify node in a last bit (near-tie equal, not bit-equal).
That is why it is a switch for plain decoding's measurements, not yet for a speculative run.

The grid must be resident all at once (the barrier waits for every block): the SM count times the blocks an SM
holds of the kernel (the driver's occupancy), capped at `LUCEBOX_PERSISTENT_FFN_BLOCKS` a SM (default 2, below
the kernel's 4) for a margin. A barrier that still waits ~30 s traps: an error, not a hung GPU. The barrier's
counter (`uint32`, one a device) is zeroed once outside any graph capture and needs no reset after (see the
kernel's comment); the launches that use it run on one stream, one after another (each waits for the kernel ahead
before it lets the next start: PDL's contract, `pdl.py`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lucebox_core.quants import QuantTensor
from lucebox_core.static_step import decode_only_kernels

from . import catalogue, tiled_weights
from .nvrtc import Float, Int, Pointer, ensure_context

ENV_SWITCH = "LUCEBOX_PERSISTENT_FFN"
BLOCKS_ENV = "LUCEBOX_PERSISTENT_FFN_BLOCKS"
# 1 (16-row tiles) or 2 (32-row tiles, the same bits): for the probe's A/B of session 26's reading that a block's
# tiles, one after another with nothing in flight between them, are what makes the kernel slow.
ROW_TILES_ENV = "LUCEBOX_PERSISTENT_FFN_ROW_TILES"
DEFAULT_BLOCKS_PER_SM = 2
TILE = 16  # output rows a block computes at a time (the tensor-core body's M)
ACTIVATIONS = {torch.bfloat16: "bf16", torch.float16: "f16"}
NORM_WEIGHTS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def enabled() -> bool:
    """Whether `LUCEBOX_PERSISTENT_FFN` asks for the persistent block (read at each call, for an A/B)."""
    return os.environ.get(ENV_SWITCH, "0") == "1"


def mma_format(weight: Any, cols: int, rows: int | None = None) -> str | None:
    """The tensor-core format name of a 2-D GGUF weight with `cols` columns (and `rows` rows, where given), or None:
    what every persistent kernel's products read. Weights the backend holds tiled are refused: these kernels read
    GGUF's rows (on any device: where bulk copies hold more formats tiled too)."""
    if not isinstance(weight, QuantTensor) or len(weight.shape) != 2 or weight.shape[1] != cols:
        return None
    if tiled_weights.tiles_weight(weight, bulk=True):
        return None
    if rows is not None and weight.shape[0] != rows:
        return None
    name = catalogue.WEIGHT_FORMATS.get(weight.ggml_type)
    return name if name in catalogue.MMA_FORMATS else None


def row_pointer(ops: Any, weight: QuantTensor, first_row: int) -> Pointer:
    """The device address of `weight`'s row `first_row` (rows of one GGUF type are whole blocks: equal bytes), for a
    kernel that reads one part of a fused weight."""
    data = ops.device_weight(weight).data
    return Pointer(data.data_ptr() + first_row * (data.numel() // weight.shape[0]))


def token_refusal(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why a persistent kernel's first phase (add + norm, `grid_barrier.cuh`) cannot take these (None: it can): one
    token of 16-bit activations, a residual like it, a norm weight of fp32 or the activations' type."""
    hidden = x.shape[-1]
    if x.numel() != hidden:
        return f"{x.numel() // max(hidden, 1)} tokens (one at a time)"
    if x.dtype not in ACTIVATIONS or residual.dtype != x.dtype or residual.shape != x.shape:
        return f"activations {x.dtype} / residual {residual.dtype} {tuple(residual.shape)}"
    if weight.dtype not in (torch.float32, x.dtype) or weight.numel() != hidden or not weight.is_contiguous():
        return f"norm weight {weight.dtype} {tuple(weight.shape)} (fp32 or the activations' type)"
    return None


def refusal(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, gate_up: Any, down: Any) -> str | None:
    """Why the kernel cannot take these operands, wherever they are (None: it can): one token of 16-bit activations,
    K-quant weights of matching shapes in whole blocks and row tiles, sizes its staging holds, a norm weight it
    reads."""
    hidden = x.shape[-1]
    reason = token_refusal(x, residual, weight)
    if reason is not None:
        return reason
    if not isinstance(gate_up, QuantTensor) or len(gate_up.shape) != 2 or gate_up.shape[0] % (2 * TILE):
        return f"gate | up rows {tuple(getattr(gate_up, 'shape', ()))} (GGUF, an even count of {TILE}-row tiles)"
    inter = gate_up.shape[0] // 2
    if max(hidden, inter) > catalogue.FFN_PERSISTENT_MAX_VALUES:
        return f"hidden {hidden} / intermediate {inter} (at most {catalogue.FFN_PERSISTENT_MAX_VALUES})"
    if hidden % 256 or inter % 256:
        return f"hidden {hidden} / intermediate {inter} (whole 256-value blocks)"
    if mma_format(gate_up, hidden, 2 * inter) is None or mma_format(down, inter, hidden) is None:
        return "weights not of a tensor-core K-quant format, or of other shapes"
    return None


def takes(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, gate_up: Any,
          down: Any) -> bool:
    """Whether the persistent kernel runs this call: switched on, inside a decode step that may take decode-only
    kernels (`static_step.decode_only_kernels`: not a verify pass, not a sequence with a drafter), a CUDA build of
    torch, operands it takes (`refusal`) on the backend's CUDA device, and the barrier's counter already made
    (never inside a graph capture: its zeroing must not be a recorded node that a replay has not run yet)."""
    if not enabled() or not decode_only_kernels() or getattr(torch.version, "hip", None):
        return False
    if refusal(x, residual, weight, gate_up, down) is not None:
        return False
    if x.device.type != "cuda" or x.device != ops.device or weight.device != ops.device:
        return False
    return counter(ops, make=not torch.cuda.is_current_stream_capturing()) is not None


def counter(ops: Any, *, make: bool) -> torch.Tensor | None:
    """The device's barrier counter (one for every persistent kernel of the backend: `moe_persistent` too), made
    with `make` (never during a graph capture), else None until made."""
    made = ops.__dict__.get("_grid_barrier")
    if made is None and make:
        made = ops.__dict__["_grid_barrier"] = torch.zeros(1, dtype=torch.int32, device=ops.device)
    return made


def blocks_per_sm(default: int = DEFAULT_BLOCKS_PER_SM) -> int:
    """Blocks an SM runs at most (`LUCEBOX_PERSISTENT_FFN_BLOCKS`, else `default`: 2 for the MLP, 3 for the MoE
    block, whose 288 units a layer would leave a tail at 264 blocks): below the 4 the kernels' registers allow, so
    that the grid stays resident even where the shared-memory split or another stream's kernel leaves an SM short
    of one block (the barrier waits for every block)."""
    asked = os.environ.get(BLOCKS_ENV, str(default)).strip()
    if not asked.isdigit() or int(asked) < 1:
        raise ValueError(f"{BLOCKS_ENV} must be a whole number of blocks of at least 1, not {asked!r}")
    return int(asked)


def row_tiles() -> int:
    """16-row tiles a block computes at a time (`LUCEBOX_PERSISTENT_FFN_ROW_TILES`: 1, the default, or 2)."""
    asked = os.environ.get(ROW_TILES_ENV, "1").strip()
    if asked not in ("1", "2"):
        raise ValueError(f"{ROW_TILES_ENV} must be 1 or 2, not {asked!r}")
    return int(asked)


def grid_size(ops: Any, program: Any, name: str, tiles: int, per_sm: int = DEFAULT_BLOCKS_PER_SM,
              threads: int = catalogue.FFN_PERSISTENT_THREADS) -> int:
    """Blocks for a launch over `tiles` row tiles (the larger phase's): the SM count times the blocks an SM holds
    of the kernel (the driver's occupancy, with the shared-memory split preferred at its largest so that the
    query and the launch agree), capped by `blocks_per_sm`."""
    resident = ops.__dict__.setdefault("_ffn_resident", {})
    if name not in resident:
        from cuda.bindings import driver

        function = ops.kernel(program, name)
        with torch.cuda.device(ops.device):  # the driver calls act on the current context: this device's
            ensure_context(ops.device.index)
            carveout = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            (result,) = driver.cuFuncSetAttribute(function, carveout, 100)
            if int(result) != 0:
                raise RuntimeError(f"{name}: cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT): {result}")
            result, per_sm_held = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, 0)
        if int(result) != 0 or int(per_sm_held) < 1:
            raise RuntimeError(f"{name} cannot be resident on {ops.device} "
                               f"(cuOccupancyMaxActiveBlocksPerMultiprocessor: {result}, {per_sm_held} blocks an SM)")
        resident[name] = torch.cuda.get_device_properties(ops.device).multi_processor_count * int(per_sm_held)
    sms = torch.cuda.get_device_properties(ops.device).multi_processor_count
    return max(1, min(tiles, resident[name], sms * blocks_per_sm(per_sm)))


def run(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gate_up: QuantTensor,
        down: QuantTensor, *, trace: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The persistent block for a call `takes` accepted: `(mlp output, residual + x)`, both of residual's shape.
    `trace` (a check's): filled with the launch's gate | up products and SwiGLU row, phase 1's outputs."""
    hidden = x.shape[-1]
    inter = gate_up.shape[0] // 2
    activation = ACTIVATIONS[x.dtype]
    tiles = row_tiles()  # hidden and inter are whole 256-value blocks (`refusal`): whole 32-row tiles too
    program, name = catalogue.ffn_persistent(mma_format(gate_up, hidden, 2 * inter), mma_format(down, inter, hidden),
                                             activation, NORM_WEIGHTS[weight.dtype], tiles)
    # 32-row tiles take ~200-255 registers (2 blocks an SM): one a SM by default, for the barrier's margin.
    grid = grid_size(ops, program, name, max(inter, hidden) // (TILE * tiles), per_sm=DEFAULT_BLOCKS_PER_SM // tiles)
    x, residual = x.contiguous(), residual.contiguous()
    summed = torch.empty_like(residual)
    out = torch.empty_like(residual)
    products = torch.empty(2 * inter, dtype=x.dtype, device=ops.device)
    act = torch.empty(inter, dtype=x.dtype, device=ops.device)
    barrier = counter(ops, make=False)
    ops._launch((program, name), grid, catalogue.FFN_PERSISTENT_THREADS,
                Pointer(ops.device_weight(gate_up).data.data_ptr()), Pointer(ops.device_weight(down).data.data_ptr()),
                Pointer(x.data_ptr()), Pointer(residual.data_ptr()), Pointer(weight.data_ptr()),
                Pointer(summed.data_ptr()), Pointer(products.data_ptr()), Pointer(act.data_ptr()),
                Pointer(out.data_ptr()), Pointer(barrier.data_ptr()), Int(hidden), Int(inter), Float(eps))
    if trace is not None:
        trace.update(products=products, act=act)
    return out, summed
