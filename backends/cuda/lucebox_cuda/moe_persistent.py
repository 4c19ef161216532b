"""A decode step's MoE block, with the residual add and norm before it, as one persistent launch.

`add_rms_norm_moe` (the core's generic op: `(block(rms_norm(residual + x)), residual + x)` for a family's MoE
block that says what it is, `block.routing()`: `lucebox_core.moe_routing.MoERouting`) is six kernels a layer on
this backend for one token: add + norm, the router (product and choice), the gate | up pair products, the SwiGLU,
the down products, their combine. Laguna-XS.2's decode step is launch-bound (issue #14: 39 MoE layers, ~14
kernels each, ~9 us of fixed cost a kernel against ~4 us of bytes). Here the six are three phases of
`kernels/moe_persistent.cu` with two grid-wide barriers (the barrier and grid sizing of `ffn_persistent`).

Off by default until measured on a GPU: `LUCEBOX_PERSISTENT_MOE=1` turns it on for one token at a time (the decode
step); a verify pass, a prefill and Spark's paged stacks keep the unfused kernels. Its expert products are the
pair kernels' arithmetic and its SwiGLU, norm, choice and combine round with the Triton kernels' operations, but
the router's logits, the norm's sum of squares and the choice's renormalising sums add in another order: a
weight or a normed value may differ in a last bit, and a near tie between two experts go the other way. Near-tie
equal to the unfused step, not bit-equal (a switch for plain decoding's measurements, not yet for a speculative
run).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lucebox_core.moe_routing import SIGMOID, MoERouting
from lucebox_core.quants import QuantTensor
from lucebox_core.static_step import decode_only_kernels

from . import catalogue, ffn_persistent, tiled_weights
from .nvrtc import Float, Int, Int64, Pointer

ENV_SWITCH = "LUCEBOX_PERSISTENT_MOE"
TILE = 16
ACTIVATIONS, NORM_WEIGHTS = ffn_persistent.ACTIVATIONS, ffn_persistent.NORM_WEIGHTS
BLOCKS_PER_SM = 3  # Laguna-XS.2's and the 35B-A3B's 288 gate | up units a layer in one round on 132 SMs


def enabled() -> bool:
    """Whether `LUCEBOX_PERSISTENT_MOE` asks for the persistent block (read at each call, for an A/B)."""
    return os.environ.get(ENV_SWITCH, "0") == "1"


def _float_rows(weight: Any, rows: int, cols: int) -> bool:
    """Whether `weight` is an fp32 matrix `[rows, cols]` (a torch tensor, 16-byte aligned for the kernel's vector
    loads, or a GGUF F32 tensor's bytes, which the backend uploads aligned)."""
    if isinstance(weight, QuantTensor):
        return weight.ggml_type.name == "F32" and tuple(weight.shape) == (rows, cols)
    return (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and tuple(weight.shape) == (rows, cols)
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0)


def _format(weight: Any, shape: tuple[int, ...]) -> str | None:
    # A shared expert the backend holds tiled is refused: the kernel reads GGUF's rows.
    if not isinstance(weight, QuantTensor) or tuple(weight.shape) != shape or tiled_weights.tiles_weight(weight):
        return None
    name = catalogue.WEIGHT_FORMATS.get(weight.ggml_type)
    return name if name in catalogue.MMA_FORMATS else None


def refusal(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, routing: MoERouting | None) -> str | None:
    """Why the kernel cannot take these operands, wherever they are (None: it can): one token of 16-bit
    activations, an fp32 norm weight, a block that says what it is with an fp32 router of at most 512 experts and
    top-k 16, K-quant stacks of matching shapes in whole blocks (the shared expert's of the experts' formats), and
    rows the kernel's staging holds."""
    hidden = x.shape[-1]
    reason = ffn_persistent.token_refusal(x, residual, weight)
    if reason is not None:
        return reason
    if routing is None:
        return "the block gives no routing (Spark's paged stacks, or no fused shared gate | up rows)"
    experts = routing.router.shape[0] if len(getattr(routing.router, "shape", ())) == 2 else 0
    most = catalogue.MOE_PERSISTENT_MAX_EXPERTS
    if not 0 < experts <= most or not _float_rows(routing.router, experts, hidden):
        return f"router {tuple(getattr(routing.router, 'shape', ()))} (fp32, at most {most} experts)"
    if not 0 < routing.top_k <= min(experts, catalogue.MOE_PERSISTENT_MAX_TOP_K):
        return f"top-k {routing.top_k}"
    if routing.choice == SIGMOID:
        bias = routing.selection_bias
        if not isinstance(bias, torch.Tensor) or bias.numel() != experts:
            return "a sigmoid router without a selection bias of one value an expert"
        if routing.shared_gate is not None:
            return "a sigmoid router with a gated shared expert (the kernel adds the shared expert ungated)"
    elif not _float_rows(routing.shared_gate, 1, hidden):
        return "a softmax router without an fp32 shared-expert gate row"
    elif routing.selection_bias is not None or routing.scale != 1.0:
        return "a softmax router with a selection bias or a scale (the kernel has neither)"
    gate_shape = tuple(getattr(routing.gate_exps, "shape", ()))
    if len(gate_shape) != 3 or gate_shape[0] != experts or gate_shape[2] != hidden:
        return f"expert stacks {gate_shape}"
    inter = gate_shape[1]
    if hidden % 256 or inter % 256:
        return f"hidden {hidden} / intermediate {inter} (whole 256-value blocks)"
    room = catalogue.MOE_PERSISTENT_STAGE_VALUES
    if hidden > room or (routing.top_k + 1) * inter > room:
        return f"hidden {hidden} / {routing.top_k + 1} x intermediate {inter} (at most {room} values)"
    gate_format = _format(routing.gate_exps, gate_shape)
    down_format = _format(routing.down_exps, (experts, hidden, inter))
    if gate_format is None or down_format is None or _format(routing.up_exps, gate_shape) != gate_format:
        return "expert stacks not of tensor-core K-quant formats, or gate and up apart"
    if routing.up_exps.ggml_type != routing.gate_exps.ggml_type:
        return "gate and up stacks of different formats"
    if (_format(routing.shared_gate_up, (2 * inter, hidden)) != gate_format
            or routing.shared_gate_up.ggml_type != routing.gate_exps.ggml_type
            or _format(routing.shared_down, (hidden, inter)) != down_format
            or routing.shared_down.ggml_type != routing.down_exps.ggml_type):
        return "a shared expert not of the experts' formats and shapes"
    return None


def takes(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, block: Any) -> bool:
    """Whether the persistent kernel runs this call: switched on, inside a decode step that may take decode-only
    kernels (`static_step.decode_only_kernels`: not a verify pass, not a sequence with a drafter), a CUDA build of
    torch, the block's routing taken (`refusal`) on the backend's CUDA device, the float tensors there, the
    barrier's counter made (never inside a graph capture)."""
    if not enabled() or not decode_only_kernels() or getattr(torch.version, "hip", None):
        return False
    routing = block.routing()
    if refusal(x, residual, weight, routing) is not None:
        return False
    if x.device.type != "cuda" or x.device != ops.device or residual.device != ops.device or weight.device != ops.device:
        return False
    for tensor in (routing.router, routing.selection_bias, routing.shared_gate):
        if isinstance(tensor, torch.Tensor) and tensor.device != ops.device:
            return False
    return ffn_persistent.counter(ops, make=not torch.cuda.is_current_stream_capturing()) is not None


def _device_floats(ops: Any, weight: Any) -> torch.Tensor:
    """An fp32 matrix on the device: a torch tensor as it is, a GGUF F32 tensor's bytes uploaded once and viewed."""
    if isinstance(weight, QuantTensor):
        return ops.device_weight(weight).data.view(torch.float32)
    return weight


def run(ops: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, block: Any, *,
        trace: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The persistent block for a call `takes` accepted: `(the block's output, residual + x)`, both of residual's
    shape. `trace` (a check's): filled with the launch's logits, expert ids and weights, and SwiGLU rows."""
    routing = block.routing()
    hidden = x.shape[-1]
    experts, inter, _ = routing.gate_exps.shape
    top_k, sigmoid = routing.top_k, routing.choice == SIGMOID
    program, name = catalogue.moe_persistent(catalogue.WEIGHT_FORMATS[routing.gate_exps.ggml_type],
                                             catalogue.WEIGHT_FORMATS[routing.down_exps.ggml_type],
                                             ACTIVATIONS[x.dtype], NORM_WEIGHTS[weight.dtype], sigmoid=sigmoid)
    pairs = top_k + 1
    tiles = max(pairs * inter // TILE, hidden // TILE, -(-experts // 4))
    grid = ffn_persistent.grid_size(ops, program, name, tiles, BLOCKS_PER_SM, catalogue.MOE_PERSISTENT_THREADS)
    x, residual = x.contiguous(), residual.contiguous()
    device, dtype = ops.device, x.dtype
    summed, out = torch.empty_like(residual), torch.empty_like(residual)
    logits = torch.empty(experts, dtype=torch.float32, device=device)
    gate_logit = torch.empty(1, dtype=dtype, device=device)
    products = torch.empty(pairs * 2 * inter, dtype=dtype, device=device)
    act = torch.empty(pairs * inter, dtype=dtype, device=device)
    down_rows = torch.empty(pairs * hidden, dtype=dtype, device=device)
    ids = torch.empty(top_k, dtype=torch.long, device=device)
    weights = torch.empty(top_k, dtype=torch.float32, device=device)
    router = _device_floats(ops, routing.router)
    bias = routing.selection_bias.to(device=device, dtype=torch.float32).contiguous() if sigmoid else None
    shared_row = None if sigmoid else _device_floats(ops, routing.shared_gate)
    stacks = [ops.device_weight(w).data for w in (routing.gate_exps, routing.up_exps, routing.down_exps)]
    shared_gate_up = ops.device_weight(routing.shared_gate_up).data
    shared_up_offset = shared_gate_up.numel() // 2  # the up rows after the gate rows, whole GGUF rows each half
    barrier = ffn_persistent.counter(ops, make=False)
    ops._launch((program, name), grid, catalogue.MOE_PERSISTENT_THREADS,
                Pointer(x.data_ptr()), Pointer(residual.data_ptr()), Pointer(weight.data_ptr()), Float(eps),
                Pointer(router.data_ptr()), Pointer(bias.data_ptr() if bias is not None else 0),
                Pointer(shared_row.data_ptr() if shared_row is not None else 0), Float(routing.scale),
                *(Pointer(stack.data_ptr()) for stack in stacks),
                Int64(stacks[0].numel() // experts), Int64(stacks[2].numel() // experts),
                Pointer(shared_gate_up.data_ptr()), Pointer(shared_gate_up.data_ptr() + shared_up_offset),
                Pointer(ops.device_weight(routing.shared_down).data.data_ptr()),
                Pointer(summed.data_ptr()), Pointer(out.data_ptr()), Pointer(logits.data_ptr()),
                Pointer(gate_logit.data_ptr()), Pointer(products.data_ptr()), Pointer(act.data_ptr()),
                Pointer(down_rows.data_ptr()), Pointer(ids.data_ptr()), Pointer(weights.data_ptr()),
                Pointer(barrier.data_ptr()), Int(hidden), Int(inter), Int(experts), Int(top_k))
    if trace is not None:
        trace.update(logits=logits, gate_logit=gate_logit, ids=ids, weights=weights, act=act.view(pairs, inter))
    return out, summed
