"""Issue #17's megakernel: a Qwen3.5 decode step's whole decoder stack as one persistent launch.

`decode_layers_` (the qwen35 family's op: every layer of a static decode step, from the token's embedding to the
final-normed hidden state) is ~11 kernels a layer on this backend, ~270 a token on the 0.8B, each paying a launch,
a ramp and a drain around a few microseconds of bytes. Here it is `kernels/qwen35_megakernel.cu`: the persistent
pieces' bodies (`gdn_persistent`, `attention_persistent`, `ffn_persistent`) one after another in one launch, with a
grid barrier between them. The output head and the draw stay the step's own kernels.

Off by default until it is measured faster than the recorded step it replaces: `LUCEBOX_MEGAKERNEL=1` turns it on
for the decode steps of a sequence with no drafter (`static_step.decode_only_kernels`); its norms add in the
block's order, so its tokens are near-tie equal to the recorded step's, not bit-equal, and a verify pass never
runs it. It takes a model only where every layer is one the pieces take (`refusal` says why not), on one device.
With it on, every weight but the head's stays in GGUF's rows (`tiled_weights.tiles_weight`).

The per-layer operands (weights, norms, states, caches) go to the kernel as a table of u64 slots a layer
(`FIELDS`), made outside any graph capture (at the static step's warm-up) and kept while its sequence lives: a
recorded step holds its address. Each layer's weight formats pick one of the bodies compiled into this model's
program (`catalogue.qwen35_megakernel`: a Q4_K_M file mixes Q4_K and Q6_K layers).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from lucebox_core.static_step import decode_only_kernels

from . import attention_persistent, catalogue, ffn_persistent, gdn_persistent
from .nvrtc import Float, Int, Pointer

ENV_SWITCH = "LUCEBOX_MEGAKERNEL"
BLOCKS_ENV = "LUCEBOX_MEGAKERNEL_BLOCKS"  # blocks an SM runs at most (default 2; the barrier is cheaper at 1)
DEFAULT_BLOCKS_PER_SM = 2
# A layer's row of the table, in the kernel's `MegaField` order: a Gated DeltaNet layer's operands, or an attention
# layer's in the same slots (w0-w3: q, k, v, o; p0, p1: q_norm, k_norm; s0, s1: the key and value caches).
FIELDS = ("kind", "mixer_variant", "ffn_variant", "input_norm", "post_norm", "gate_up", "down",
          "w0", "w1", "w2", "w3", "w4", "p0", "p1", "p2", "p3", "s0", "s1",
          # What the L2 prefetch a layer ahead asks for (`mega_prefetch_layer`): (address, bytes) of w0-w4's rows in
          # use, gate | up, down and the recurrent state.
          *(f"prefetch{i}_{part}" for i in range(8) for part in ("address", "bytes")))
# Layers whose weights ask for L2 ahead of their turn (0, the default: none). Measured in session 35 (0.8B tg128),
# one layer ahead was slower, 572.6 against 595.1 tok/s on an H100 and 526.7 against 609.1 on an H200: the phases
# wait on their own chains of loads and reductions, not on DRAM (`docs/results/2026-12-06-session35.md`).
PREFETCH_ENV = "LUCEBOX_MEGAKERNEL_PREFETCH"
LINEAR, ATTENTION = 0, 1


def enabled() -> bool:
    """Whether `LUCEBOX_MEGAKERNEL` asks for the megakernel (read at each call, for an A/B)."""
    return os.environ.get(ENV_SWITCH, "0") == "1"


def blocks_per_sm() -> int:
    asked = os.environ.get(BLOCKS_ENV, str(DEFAULT_BLOCKS_PER_SM)).strip()
    if not asked.isdigit() or int(asked) < 1:
        raise ValueError(f"{BLOCKS_ENV} must be a whole number of blocks of at least 1, not {asked!r}")
    return int(asked)


def _gate_up(layer: Any) -> Any:
    mlp = layer.mlp
    return getattr(mlp, "gate_up_proj", None) if getattr(mlp, "swiglu", False) else None


def _uniform(values: list[Any], what: str) -> str | None:
    return None if len(set(values)) <= 1 else f"{what} differ between layers ({sorted(set(map(str, values)))})"


def refusal(model: Any, state: Any, x: torch.Tensor, position: torch.Tensor, window: int) -> str | None:
    """Why the megakernel cannot run this model's step (None: it can): a model on one device whose every layer is a
    fused SwiGLU MLP after a Gated DeltaNet or gated attention mixer that the persistent pieces take, of one
    activation and one norm-weight type, and shapes alike across layers (one kernel argument each)."""
    if getattr(model, "split_steps", False):
        return "a model split over devices"
    room = catalogue.MEGAKERNEL_STAGE_VALUES
    norms, inters, linear_shapes, attention_shapes, eps = [model.norm.dtype], [], [], [], []
    for layer in model.layers:
        where = f"layer {layer.index}"
        gate_up = _gate_up(layer)
        if gate_up is None:
            return f"{where}: an MLP that is not a fused SwiGLU"
        reason = ffn_persistent.refusal(x, x, layer.post_attention_layernorm, gate_up, layer.mlp.down_proj)
        if reason is not None:
            return f"{where}'s MLP: {reason}"
        inters.append(gate_up.shape[0] // 2)
        norms += [layer.input_layernorm.dtype, layer.post_attention_layernorm.dtype]
        mixer, attention = layer.linear_attn, layer.self_attn
        if mixer is not None:
            reason = (gdn_persistent.refusal(x, mixer, state.linear[layer.index])
                      or gdn_persistent.residual_refusal(x, x, layer.input_layernorm, mixer))
            linear_shapes.append((mixer.num_k_heads, mixer.num_v_heads))
            norms.append(mixer.norm.dtype)
            eps.append(mixer.eps)
        else:
            reason = (attention_persistent.refusal(x, attention, state.kv, position, window)
                      or attention_persistent.residual_refusal(x, x, layer.input_layernorm, attention))
            attention_shapes.append((attention.num_heads, attention.num_kv_heads, attention.rope_dim,
                                     float(attention.rope_theta), attention.eps))
            norms.append(attention.q_norm.dtype)
        if reason is not None:
            return f"{where}'s mixer: {reason}"
    if max(inters, default=0) > room:
        return f"intermediate size {max(inters)} (at most {room})"
    return (_uniform(norms, "norm weight types") or _uniform(inters, "intermediate sizes")
            or _uniform(linear_shapes, "linear-attention heads") or _uniform(attention_shapes, "attention shapes")
            or _uniform(eps, "gated norm epsilons"))


def takes(ops: Any, model: Any, state: Any, x: torch.Tensor, position: torch.Tensor, window: int) -> bool:
    """Whether the megakernel runs this step: switched on, inside a decode step that may take decode-only kernels,
    a CUDA build of torch, a model it takes (`refusal`) on the backend's device, and its table, counter and
    inverse frequencies made (never inside a graph capture: the warm-up makes them)."""
    if not enabled() or not decode_only_kernels() or getattr(torch.version, "hip", None):
        return False
    ops = getattr(ops, "backend", ops)  # a family op gets the family's view: the counter is the backend's
    if x.device.type != "cuda" or x.device != ops.device or position.device != ops.device:
        return False
    if refusal(model, state, x, position, window) is not None:
        return False
    if any(ops.holds_tiled(weight) for layer in model.layers for weight in _layer_weights(layer)):
        return False  # tiled at their first use, before the switch was on: the recorded step's kernels run them
    make = not torch.cuda.is_current_stream_capturing()
    attention = next((layer.self_attn for layer in model.layers if layer.self_attn is not None), None)
    if attention is not None and attention_persistent._inv_freq(ops, attention.rope_dim, attention.rope_theta,
                                                                make=make) is None:
        return False
    return (ffn_persistent.counter(ops, make=make) is not None
            and _table(ops, model, state, x, make=make) is not None)


def _layer_weights(layer: Any) -> list[Any]:
    """The GGUF weights a layer's bodies read as rows (the fused ones where the backend fused them)."""
    rows = (gdn_persistent._rows(layer.linear_attn) if layer.linear_attn is not None
            else attention_persistent._rows(layer.self_attn))
    return [_gate_up(layer), layer.mlp.down_proj, *(weight for weight, _ in rows.values())]


def _variants(model: Any, hidden: int) -> tuple[list[tuple], list[tuple], list[tuple], list[tuple[int, int, int]]]:
    """The distinct (formats) of the Gated DeltaNet mixers, the attentions and the MLPs, in order of first use, and
    each layer's (kind, mixer variant, MLP variant)."""
    lists: dict[str, list[tuple]] = {"gdn": [], "attention": [], "ffn": []}

    def variant(kind: str, formats: tuple) -> int:
        if formats not in lists[kind]:
            lists[kind].append(formats)
        return lists[kind].index(formats)

    rows = []
    for layer in model.layers:
        gate_up, down = _gate_up(layer), layer.mlp.down_proj
        inter = gate_up.shape[0] // 2
        ffn = variant("ffn", (ffn_persistent.mma_format(gate_up, hidden), ffn_persistent.mma_format(down, inter)))
        if layer.linear_attn is not None:
            rows.append((LINEAR, variant("gdn", gdn_persistent.formats(layer.linear_attn, hidden)), ffn))
        else:
            rows.append((ATTENTION, variant("attention", attention_persistent.formats(layer.self_attn, hidden)), ffn))
    return lists["gdn"], lists["attention"], lists["ffn"], rows


def prefetch_ahead() -> int:
    asked = os.environ.get(PREFETCH_ENV, "0").strip()
    if not asked.isdigit():
        raise ValueError(f"{PREFETCH_ENV} must be a whole number of layers (0: no prefetch), not {asked!r}")
    return int(asked)


def _rows_bytes(ops: Any, weight: Any, first: int, count: int) -> tuple[int, int]:
    """(address, bytes) of `count` rows of a GGUF weight from row `first`."""
    data = ops.device_weight(weight).data
    row_bytes = data.numel() // weight.shape[0]
    return data.data_ptr() + first * row_bytes, count * row_bytes


def _layer_row(ops: Any, layer: Any, state: Any, kind: int, mixer_variant: int, ffn_variant: int) -> list[int]:
    """A layer's table row (`FIELDS`): addresses, variants and the prefetch's ranges."""
    address = {"kind": kind, "mixer_variant": mixer_variant, "ffn_variant": ffn_variant,
               "input_norm": layer.input_layernorm.data_ptr(), "post_norm": layer.post_attention_layernorm.data_ptr(),
               "gate_up": ops.device_weight(_gate_up(layer)).data.data_ptr(),
               "down": ops.device_weight(layer.mlp.down_proj).data.data_ptr()}
    gate_up, down = _gate_up(layer), layer.mlp.down_proj
    ranges = [_rows_bytes(ops, gate_up, 0, gate_up.shape[0]), _rows_bytes(ops, down, 0, down.shape[0])]
    if kind == LINEAR:
        mixer, mixer_state = layer.linear_attn, state.linear[layer.index]
        rows = gdn_persistent._rows(mixer)
        heads, channels = mixer.num_v_heads, mixer.conv1d.shape[0]
        wanted = {"qkv": channels, "z": heads * gdn_persistent.HEAD_DIM, "b": heads, "a": heads,
                  "out": mixer.out_proj.shape[0]}
        for slot, part in zip(("w0", "w1", "w2", "w3", "w4"), ("qkv", "z", "b", "a", "out")):
            address[slot] = ffn_persistent.row_pointer(ops, *rows[part]).value or 0
            ranges.append(_rows_bytes(ops, *rows[part], wanted[part]))
        for slot, tensor in zip(("p0", "p1", "p2", "p3", "s0", "s1"), (
                mixer.conv1d, mixer.ssm_a, mixer.dt_bias, mixer.norm, mixer_state.conv, mixer_state.recurrent)):
            address[slot] = tensor.data_ptr()
        recurrent = mixer_state.recurrent
        ranges.append((recurrent.data_ptr(), recurrent.numel() * recurrent.element_size()))
    else:
        attention = layer.self_attn
        rows = attention_persistent._rows(attention)
        q_dim, heads, kv_heads = attention_persistent.HEAD_DIM, attention.num_heads, attention.num_kv_heads
        wanted = {"q": 2 * heads * q_dim, "k": kv_heads * q_dim, "v": kv_heads * q_dim, "o": attention.o_proj.shape[0]}
        for slot, part in zip(("w0", "w1", "w2", "w3"), ("q", "k", "v", "o")):
            address[slot] = ffn_persistent.row_pointer(ops, *rows[part]).value or 0
            ranges.append(_rows_bytes(ops, *rows[part], wanted[part]))
        keys, values, _ = state.kv.plain_rows(attention.layer_index)
        for slot, tensor in zip(("p0", "p1", "s0", "s1"), (attention.q_norm, attention.k_norm, keys, values)):
            address[slot] = tensor.data_ptr()
    for i, (start, size) in enumerate(ranges):
        address[f"prefetch{i}_address"], address[f"prefetch{i}_bytes"] = start, size
    return [int(address.get(field, 0)) for field in FIELDS]


def _table(ops: Any, model: Any, state: Any, x: torch.Tensor, *, make: bool) -> torch.Tensor | None:
    """The sequence's table on the device, made with `make` (never during a graph capture), else None until made.
    Kept on the backend while `state` lives (a recorded step reads it at every replay), keyed on the state and on
    every address in it (a cache that grew, a weight uploaded again: a new table)."""
    *_, variants = _variants(model, x.shape[-1])
    values = tuple(value for layer, row in zip(model.layers, variants)
                   for value in _layer_row(ops, layer, state, *row))
    tables = ops.__dict__.setdefault("_megakernel_tables", {})
    key = (id(state), values)
    if key not in tables and make:
        tables[key] = torch.tensor(values, dtype=torch.int64).to(ops.device)
        weakref.finalize(state, tables.pop, key, None)
    return tables.get(key)


def run(ops: Any, model: Any, state: Any, x: torch.Tensor, position: torch.Tensor, window: int, *,
        timeline: torch.Tensor | None = None) -> torch.Tensor:
    """The megakernel for a step `takes` accepted, the states and caches updated in place: the final-normed hidden
    state `[1, 1, hidden]` of the embedding `x`. `timeline` (a probe's: int64, a slot per barrier and two more):
    block 0's SM clock at the start, after each barrier and at the end, from slot 1 (slot 0: their count)."""
    ops = getattr(ops, "backend", ops)
    hidden = x.shape[-1]
    gdn, attentions, ffn, _ = _variants(model, hidden)
    layers = model.layers
    mixer = next((layer.linear_attn for layer in layers if layer.linear_attn is not None), None)
    attention = next((layer.self_attn for layer in layers if layer.self_attn is not None), None)
    activation = ffn_persistent.ACTIVATIONS[x.dtype]
    heads, kv_heads = (attention.num_heads, attention.num_kv_heads) if attention is not None else (1, 1)
    program, name = catalogue.qwen35_megakernel(gdn, attentions, ffn, activation,
                                                ffn_persistent.NORM_WEIGHTS[model.norm.dtype], heads // kv_heads)
    inter = _gate_up(layers[0]).shape[0] // 2
    key_heads, value_heads = (mixer.num_k_heads, mixer.num_v_heads) if mixer is not None else (1, 16)
    channels = (2 * key_heads + value_heads) * gdn_persistent.HEAD_DIM
    value_channels = value_heads * gdn_persistent.HEAD_DIM
    q_dim = attention_persistent.HEAD_DIM
    q_rows, kv_rows = 2 * heads * q_dim, kv_heads * q_dim
    tiles = max((channels + value_channels + 2 * value_heads) // 16, inter // 16, (q_rows + 2 * kv_rows) // 16)
    grid = ffn_persistent.grid_size(ops, program, name, tiles, per_sm=blocks_per_sm(),
                                    threads=catalogue.MEGAKERNEL_THREADS)
    span, spans = attention_persistent.partition(window, kv_heads, grid)
    units = heads * spans * attention_persistent.WARPS
    empty = lambda *shape, dtype=x.dtype: torch.empty(*shape, dtype=dtype, device=ops.device)  # noqa: E731
    sums, mixer_out, mlp_out, normed = empty(2 * hidden), empty(hidden), empty(hidden), empty(1, 1, hidden)
    products = empty(max(channels + value_channels + 2 * value_heads, q_rows + 2 * kv_rows))
    mlp_products, act, core = empty(2 * inter), empty(inter), empty(max(value_channels, heads * q_dim))
    partial_max, partial_sum = empty(units, dtype=torch.float32), empty(units, dtype=torch.float32)
    partial_acc = empty(units, q_dim, dtype=torch.float32)
    zeros = torch.zeros(hidden, dtype=x.dtype, device=ops.device)
    inv_freq = (attention_persistent._inv_freq(ops, attention.rope_dim, attention.rope_theta, make=False)
                if attention is not None else zeros)
    table = _table(ops, model, state, x, make=False)
    x = x.contiguous()
    ops._launch((program, name), grid, catalogue.MEGAKERNEL_THREADS, Pointer(table.data_ptr()), Int(len(layers)),
                Pointer(x.data_ptr()), Pointer(zeros.data_ptr()), Pointer(model.norm.data_ptr()),
                Pointer(normed.data_ptr()),
                *(Pointer(t.data_ptr()) for t in (sums, mixer_out, mlp_out, products, mlp_products, core, act,
                                                   partial_max, partial_sum, partial_acc, inv_freq, position)),
                Pointer(ffn_persistent.counter(ops, make=False).data_ptr()), Int(hidden), Int(inter), Int(key_heads),
                Int(value_heads), Int(kv_heads), Int(attention.rope_dim if attention is not None else 2), Int(span),
                Int(spans), Float(attention_persistent.HEAD_DIM ** -0.5),
                Float(mixer.eps if mixer is not None else 0.0), Float(attention.eps if attention is not None else 0.0),
                Float(model.config.eps), Pointer(timeline.data_ptr() if timeline is not None else 0),
                Int(prefetch_ahead()))
    return normed
