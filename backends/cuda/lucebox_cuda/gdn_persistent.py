"""A decode step's Gated DeltaNet mixer (Qwen3.5's linear-attention layers) as one persistent launch.

`gated_delta_net_decode_` (the qwen35 family's op: one token through a `GatedDeltaNet` from its normed input to
its output, the conv and recurrent states updated in place) is six kernels on this backend: the qkv | z and b | a
products, the convolution with SiLU, the delta step, the gated norm and the output product. Qwen3.5-0.8B runs 18
such layers a token, each kernel a few microseconds that pays a launch, a ramp and a drain. Here they are three
phases of `kernels/gdn_persistent.cu` with two grid-wide barriers (the barrier, counter and grid sizing of
`ffn_persistent`): issue #17's megakernel, its second piece.

Off by default until measured on a GPU: `LUCEBOX_PERSISTENT_GDN=1` turns it on for one token at a time (the decode
step); a verify pass and a prefill keep the unfused kernels. The products are the `mma` kernel's arithmetic and
the rest rounds where the Triton kernels round, with their operations, but the taps, the L2 norms' and the gated
norm's sums of squares and the key-dim sums of the delta step add in another order: near-tie equal to the unfused
step, not bit-equal (a switch for plain decoding's measurements, as the other persistent kernels).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lucebox_core.static_step import decode_only_kernels

from . import catalogue, ffn_persistent
from .nvrtc import Float, Int, Pointer

ENV_SWITCH = "LUCEBOX_PERSISTENT_GDN"
TILE = 16
HEAD_DIM = 128  # the kernel's d_k = d_v
CHUNK = 32  # value dims a phase-2 unit steps
TAPS = 4
ACTIVATIONS, NORM_WEIGHTS = ffn_persistent.ACTIVATIONS, ffn_persistent.NORM_WEIGHTS


def enabled() -> bool:
    """Whether `LUCEBOX_PERSISTENT_GDN` asks for the persistent mixer (read at each call, for an A/B)."""
    return os.environ.get(ENV_SWITCH, "0") == "1"


def _rows(mixer: Any) -> dict[str, tuple[Any, int]]:
    """The four input products as (GGUF weight, first row in it): the fused weights where the backend fused them
    (`in_proj_qkvz`, `in_proj_ba`), else the separate ones."""
    conv_dim = mixer.conv1d.shape[0]
    if mixer.in_proj_qkvz is not None:
        qkv, z = (mixer.in_proj_qkvz, 0), (mixer.in_proj_qkvz, conv_dim)
    else:
        qkv, z = (mixer.in_proj_qkv, 0), (mixer.in_proj_z, 0)
    if mixer.in_proj_ba is not None:
        b, a = (mixer.in_proj_ba, 0), (mixer.in_proj_ba, mixer.num_v_heads)
    else:
        b, a = (mixer.in_proj_b, 0), (mixer.in_proj_a, 0)
    return {"qkv": qkv, "z": z, "b": b, "a": a, "out": (mixer.out_proj, 0)}


def formats(mixer: Any, hidden: int) -> tuple[str, str] | None:
    """(the qkv rows' format, every other product's) where the kernel takes the weights, else None: the qkv rows
    may be of their own format (Q4_K_M files give every layer's `attn_qkv` Q6_K on some layers), z, b, a and the
    output product share one (a fused weight holds one format)."""
    rows = _rows(mixer)
    qkv = ffn_persistent.mma_format(rows["qkv"][0], hidden)
    rest = {ffn_persistent.mma_format(rows[part][0], hidden) for part in ("z", "b", "a")}
    rest.add(ffn_persistent.mma_format(mixer.out_proj, mixer.num_v_heads * mixer.head_v_dim))
    if qkv is None or len(rest) != 1 or None in rest:
        return None
    return qkv, rest.pop()


def refusal(x: torch.Tensor, mixer: Any, state: Any) -> str | None:
    """Why the kernel cannot take this mixer and token, wherever they are (None: it can)."""
    hidden = x.shape[-1]
    if x.numel() != hidden:
        return f"{x.numel() // max(hidden, 1)} tokens (one at a time)"
    if x.dtype not in ACTIVATIONS:
        return f"activations {x.dtype} (bf16 or f16)"
    if mixer.head_k_dim != HEAD_DIM or mixer.head_v_dim != HEAD_DIM:
        return f"head dims {mixer.head_k_dim} / {mixer.head_v_dim} (the kernel's {HEAD_DIM})"
    key_heads, value_heads = mixer.num_k_heads, mixer.num_v_heads
    if key_heads < 1 or value_heads % TILE or value_heads % key_heads:
        return f"{value_heads} value heads over {key_heads} key heads (a multiple of {TILE} and of the key heads)"
    channels = (2 * key_heads + value_heads) * HEAD_DIM
    value_channels = value_heads * HEAD_DIM
    room = catalogue.GDN_PERSISTENT_STAGE_VALUES
    if hidden % 256 or hidden > room or value_channels > room:
        return f"hidden {hidden} / value channels {value_channels} (whole 256-value blocks, at most {room})"
    conv1d = mixer.conv1d
    if tuple(conv1d.shape) != (channels, TAPS) or conv1d.dtype != x.dtype or not conv1d.is_contiguous():
        return f"conv1d {tuple(mixer.conv1d.shape)} {mixer.conv1d.dtype} (contiguous [{channels}, {TAPS}] of {x.dtype})"
    conv = state.conv
    if tuple(conv.shape) != (1, TAPS - 1, channels) or conv.dtype != x.dtype or not conv.is_contiguous():
        return f"conv state {tuple(state.conv.shape)} {state.conv.dtype}"
    recurrent = (1, value_heads, HEAD_DIM, HEAD_DIM)
    if (tuple(state.recurrent.shape) != recurrent or state.recurrent.dtype != torch.float32
            or not state.recurrent.is_contiguous()):
        return f"recurrent state {tuple(state.recurrent.shape)} {state.recurrent.dtype} (contiguous fp32 {recurrent})"
    for name in ("ssm_a", "dt_bias"):
        tensor = getattr(mixer, name)
        if tensor.dtype != torch.float32 or tensor.numel() != value_heads or not tensor.is_contiguous():
            return f"{name} {tensor.dtype} {tuple(tensor.shape)} (fp32, one a value head)"
    norm = mixer.norm
    if norm.dtype not in (torch.float32, x.dtype) or norm.numel() != HEAD_DIM or not norm.is_contiguous():
        return f"norm weight {mixer.norm.dtype} {tuple(mixer.norm.shape)} (fp32 or the activations' type)"
    if formats(mixer, hidden) is None:
        return "input or output products not of tensor-core K-quant formats (z, b, a and out of one)"
    # Each product's rows where the kernel reads them (a fused weight holds its parts' rows one after another).
    rows = _rows(mixer)
    wanted = {"qkv": channels, "z": value_channels, "b": value_heads, "a": value_heads, "out": hidden}
    for part, (weight, first) in rows.items():
        if weight.shape[0] < first + wanted[part]:
            return f"{part} rows {weight.shape[0] - first} from row {first} of {weight.name!r} (wants {wanted[part]})"
    if mixer.out_proj.shape[0] != hidden:
        return f"out rows {mixer.out_proj.shape[0]} (the hidden size {hidden})"
    return None


def residual_refusal(x: torch.Tensor, residual: torch.Tensor, input_norm: torch.Tensor, mixer: Any) -> str | None:
    """Why the kernel cannot take the layer's input add + norm with the mixer (None: it can): the first phase's
    (`ffn_persistent.token_refusal`), and an input norm weight of the gated norm's type (one template type)."""
    reason = ffn_persistent.token_refusal(x, residual, input_norm)
    if reason is None and input_norm.dtype != mixer.norm.dtype:
        return f"input norm {input_norm.dtype} beside the gated norm's {mixer.norm.dtype} (one type)"
    return reason


def takes(ops: Any, x: torch.Tensor, mixer: Any, state: Any, residual: torch.Tensor | None = None,
          input_norm: torch.Tensor | None = None) -> bool:
    """Whether the persistent kernel runs this call: switched on, inside a decode step that may take decode-only
    kernels (`static_step.decode_only_kernels`: not a verify pass, not a sequence with a drafter), a CUDA build of
    torch, operands it takes (`refusal`, and `residual_refusal` with a residual) on the backend's CUDA device,
    the barrier's counter made (never inside a graph capture)."""
    if not enabled() or not decode_only_kernels() or getattr(torch.version, "hip", None):
        return False
    ops = getattr(ops, "backend", ops)  # a family op gets the family's view: the counter is the backend's
    if refusal(x, mixer, state) is not None:
        return False
    if residual is not None and residual_refusal(x, residual, input_norm, mixer) is not None:
        return False
    tensors = (x, mixer.conv1d, mixer.ssm_a, mixer.dt_bias, mixer.norm, state.conv, state.recurrent,
               *((residual, input_norm) if residual is not None else ()))
    if x.device.type != "cuda" or any(t.device != ops.device for t in tensors):
        return False
    return ffn_persistent.counter(ops, make=not torch.cuda.is_current_stream_capturing()) is not None


def run(ops: Any, x: torch.Tensor, mixer: Any, state: Any, *, residual: torch.Tensor | None = None,
        input_norm: torch.Tensor | None = None, input_eps: float = 0.0,
        trace: dict[str, torch.Tensor] | None = None) -> Any:
    """The persistent mixer for a call `takes` accepted, the states updated in place: the output `[1, 1, hidden]`
    of the normed input `x`; with a `residual`, `(the output, residual + x)` of `rms_norm(residual + x) *
    input_norm` (the layer's input add + norm in the same launch). `trace` (a check's): filled with the launch's
    products (qkv | z | b | a rows) and core (the delta step's readout, before the gated norm)."""
    ops = getattr(ops, "backend", ops)  # a family op gets the family's view: the counter is the backend's
    hidden = x.shape[-1]
    qkv_format, rest_format = formats(mixer, hidden)
    program, name = catalogue.gdn_persistent(qkv_format, rest_format, ACTIVATIONS[x.dtype],
                                             NORM_WEIGHTS[mixer.norm.dtype])
    key_heads, value_heads = mixer.num_k_heads, mixer.num_v_heads
    channels = (2 * key_heads + value_heads) * HEAD_DIM
    value_channels = value_heads * HEAD_DIM
    tiles = max((channels + value_channels + 2 * value_heads) // TILE, value_heads * HEAD_DIM // CHUNK, hidden // TILE)
    grid = ffn_persistent.grid_size(ops, program, name, tiles, threads=catalogue.GDN_PERSISTENT_THREADS)
    x = x.contiguous()
    products = torch.empty(channels + value_channels + 2 * value_heads, dtype=x.dtype, device=ops.device)
    core = torch.empty(value_channels, dtype=x.dtype, device=ops.device)
    out = torch.empty_like(x)
    summed = None
    if residual is not None:
        residual = residual.contiguous()
        summed = torch.empty_like(residual)
    rows = _rows(mixer)
    ops._launch((program, name), grid, catalogue.GDN_PERSISTENT_THREADS, Pointer(x.data_ptr()),
                Pointer(residual.data_ptr() if residual is not None else 0),
                Pointer(input_norm.data_ptr() if residual is not None else 0),
                Pointer(summed.data_ptr() if summed is not None else 0),
                *(ffn_persistent.row_pointer(ops, *rows[part]) for part in ("qkv", "z", "b", "a", "out")),
                Pointer(mixer.conv1d.data_ptr()), Pointer(mixer.ssm_a.data_ptr()), Pointer(mixer.dt_bias.data_ptr()),
                Pointer(mixer.norm.data_ptr()), Pointer(state.conv.data_ptr()), Pointer(state.recurrent.data_ptr()),
                Pointer(products.data_ptr()), Pointer(core.data_ptr()), Pointer(out.data_ptr()),
                Pointer(ffn_persistent.counter(ops, make=False).data_ptr()), Int(hidden), Int(key_heads),
                Int(value_heads), Float(mixer.eps), Float(input_eps))
    if trace is not None:
        trace.update(products=products, core=core)
    return out if summed is None else (out, summed)
