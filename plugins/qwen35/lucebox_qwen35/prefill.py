"""Qwen3.5/3.6's recorded prefill piece: a piece of a prompt as a step of fixed shapes, replayed as a graph.

An eager prefill piece of the 0.8B launches ~600 ops, 25-30 ms of host time around ~5 ms of kernels (H100,
session 30), so the host, not the GPU, sets its speed. `static_step.run_prefill_piece` pads the piece to a bucket
length and records the step below once per (bucket, KV window); it reads the start position and the real token
count from device buffers, so every later piece of that bucket replays the recording.

What the padding (tokens `count .. bucket-1`, after the real ones) must not touch:

- the Gated DeltaNet's recurrent state: a padding token gets beta = 0 (it writes nothing) and g = 0 (it decays
  nothing), so the chunked scan ends in the state the real tokens leave;
- its convolution state: the scan's kernel keeps the piece's last K-1 inputs, padding included, so the state is
  then set to the last K-1 real inputs (a piece shorter than K-1 keeps the eager forward);
- the attention layers: the padding's K/V rows are written past the committed length, where no real query looks
  (the causal rule) and the next piece writes over them;
- the drafter's feature ring: a padding token's slot keeps what it holds;
- the logits: those of token `count - 1`, gathered on the device.

Every real token's arithmetic is row-wise or causal, so it sees only real tokens; the products run over `bucket`
rows (cuBLAS may then round differently than over `count`): what a piece runs on depends on its length alone, so a
prompt prefilled cold and one restored from the prefix cache still give the same bits.
"""

from __future__ import annotations

from typing import Any

import torch

from lucebox_core.kv import write_rows
from lucebox_core.static_step import StaticInputs, prefill_bucket, recorded_prefill_fits, run_prefill_piece


def takes(model: Any, state: Any, tokens: int) -> bool:
    """Whether `model` may run a piece of `tokens` after `state` as a recorded piece: besides the core's
    conditions (`recorded_prefill_fits`), a dense model on one device (a MoE block's routing and Spark's paging
    decide on the host), a drafter's feature ring (if any) of at least the padded piece's rows (its slots then
    differ within a piece), and a KV cache of plain rows at slot = position (the attention reads the window it
    writes; a quantized, ring or KVFlash cache keeps the eager forward)."""
    if model.device_map is not None:
        return False
    if state.features is not None and state.features.shape[0] < prefill_bucket(tokens):
        return False
    if not all(getattr(type(layer.mlp), "swiglu", False) for layer in model.layers):
        return False
    # The convolution state is taken from the piece's last K-1 real inputs: the piece must hold that many.
    if any(layer.linear_attn.conv1d.shape[1] - 1 > tokens for layer in model.layers if layer.linear_attn is not None):
        return False
    kv = state.kv
    if getattr(kv, "attention_position", None) is not None or getattr(kv, "observe_query", None) is not None:
        return False
    lend = getattr(kv, "plain_rows", None)
    for layer in model.layers:
        if layer.self_attn is not None:
            rows = None if lend is None else lend(layer.index)
            if rows is None or rows[2] != 0:
                return False
    return recorded_prefill_fits(model, state, tokens)


def prefill_piece(model: Any, state: Any, token_ids: torch.Tensor) -> torch.Tensor:
    """A piece `[T]` through the recorded step: the last token's logits `[1, vocab]`, the state advanced (and the
    drafter's features of its positions in the ring)."""
    # A recording writes into the feature ring it was made with: a new ring needs recordings of its own.
    ring = None if state.features is None else state.features.data_ptr()
    return run_prefill_piece(model, state, token_ids, lambda s, inputs, window: _step(model, s, inputs, window),
                             key=ring)


def _step(model: Any, state: Any, inputs: StaticInputs, window: int) -> torch.Tensor:
    """The piece as a function of its fixed inputs and `window` alone (what a graph records)."""
    ops = model.ops
    bucket = inputs.embedded.shape[1]
    offsets = torch.arange(bucket, device=inputs.start.device)
    positions = inputs.start + offsets
    real = (offsets < inputs.count)[None, :, None]  # [1, bucket, 1]: the tokens that are not padding

    def mix(layer: Any, x: torch.Tensor) -> torch.Tensor:
        if layer.linear_attn is not None:
            return layer.linear_attn(x, state.linear[layer.index], count=inputs.count)
        return _gated_attention(layer.self_attn, x, positions, inputs.start, state.kv, window)

    taps: list[torch.Tensor] = []
    tapped = state.capture_layers if state.features is not None else ()
    hidden, pending = model._run_part_layers(model.layers, inputs.embedded, None, mix,
                                             lambda layer, output: taps.append(output[0]), tapped)
    if state.features is not None:
        _ring_features(model, state, taps, positions, real[0])
    last = inputs.count - 1
    hidden = model._final_norm(hidden.index_select(1, last), pending.index_select(1, last))
    return ops.linear(hidden, model.lm_head)[0]


def _ring_features(model: Any, state: Any, taps: list[torch.Tensor], positions: torch.Tensor,
                   real: torch.Tensor) -> None:
    """The drafter's features of the real tokens into the ring at slot position % capacity; a padding token's
    slot (that of a position a ring's length earlier, which the drafter may still read) keeps what it holds."""
    ring = state.features
    slots = positions % ring.shape[0]
    rows = model._concat_taps(state, taps).to(ring.dtype)
    ring.index_copy_(0, slots, torch.where(real, rows, ring.index_select(0, slots)))


def _gated_attention(attention: Any, x: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, kv: Any,
                     window: int) -> torch.Tensor:
    """`GatedAttention.__call__` at device positions: the piece's K/V written at `positions`, then causal
    attention over the cache's first `window` rows from the device offset `start`."""
    ops = attention.ops
    query, gate, key, value = attention._project(x, positions)
    write_rows(kv, ops, attention.layer_index, positions, key[0], value[0])
    keys, values = kv.gather(attention.layer_index, window)
    out = ops.attention(query, keys[None].to(query.dtype), values[None].to(query.dtype),
                        scale=attention.head_dim**-0.5, causal_offset=start)
    return attention._output(out, gate)
