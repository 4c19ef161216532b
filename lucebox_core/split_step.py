"""Static steps of a model split into parts (issue #19): one recording per part, each on its part's device.

A graph records the work of one device's stream, so a step over layers on two GPUs cannot be one graph. A
`SplitStaticStep` holds one `StaticStep` per part, each on its part's backend (its own input buffers, its own
graph memory pool on that device, its recordings made with that device current), and runs a step as the
parts in turn: part 0 is replayed, what it hands over (the residual stream, the pending MLP output, the
drafter's taps) is copied into part 1's static input buffers (a device-to-device copy, a peer copy between
GPUs where they allow it, ordered after part 0's stream), part 1 is replayed, and so on. The copies run
between replays, outside any recording. A part on a device without graphs (the CPU) runs eagerly; so does
every part with graphs off. Parts on one device go through the very same path (two recordings, a copy
between them), which is how a one-GPU machine tests it and times what the split costs.

    step = SplitStaticStep(part_backends, "decode step")
    inputs = [step.inputs(part, position=length) for part in range(step.parts)]
    results = step.run(window, lambda part, i: part_step(part, i), inputs)

`part_step(part, inputs)` returns `(handed, result)`: `handed` a dict of tensors the next part reads by those
names from its inputs, `result` whatever that part gives the caller (the last part: the logits). What a part
hands over reaches every later part (a drafter's tap from part 0 is read by the last part), each copy made
from the part that produced it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from .kv import window_limit
from .static_step import StaticInputs, StaticStep, kv_window


def step_mode(model: Any) -> str:
    """How `model`'s decode step runs, for /props and the log: the model's own answer (`step_mode()`, which a
    family that splits gives), else "graph" or "eager" as its static steps are recorded or not."""
    if hasattr(model, "step_mode"):
        return model.step_mode()
    return "graph" if getattr(model, "decode_graphs", False) else "eager"


class SplitStaticStep:
    """One step function's recordings for a model split into parts: a `StaticStep` per part (see the module
    docstring). `graphs`: as `StaticStep`'s, for every part (default: where each part's backend records).
    `failed_parts`: a set the step adds a part's index to when that part's recording fails."""

    def __init__(self, backends: Sequence[Any], label: str, *, graphs: bool | None = None,
                 failed_parts: set[int] | None = None):
        self.label = label
        self.failed_parts = failed_parts  # the owner's record of parts whose recording failed (for /props)
        self.steps = [StaticStep(backend, f"{label} (part {part})", graphs=graphs)
                      for part, backend in enumerate(backends)]

    @property
    def parts(self) -> int:
        return len(self.steps)

    def __len__(self) -> int:
        """Recordings held by the first part (every part records the same keys)."""
        return len(self.steps[0])

    @property
    def graphed_parts(self) -> list[bool]:
        """Which parts record and replay graphs (the others run eagerly)."""
        return [step.graphs and step.failure is None for step in self.steps]

    @property
    def failure(self) -> str | None:
        """The first part's recording failure, if any (what `StaticStep.failure` tells a caller)."""
        return next((step.failure for step in self.steps if step.failure is not None), None)

    def recordings(self) -> list[Any]:
        return [graph for step in self.steps for graph in step.recordings()]

    def inputs(self, part: int, **values: int | float | torch.Tensor) -> StaticInputs:
        """Fill part `part`'s static buffers (on its device) for one call."""
        return self.steps[part].inputs(**values)

    def run(self, key: Hashable, part_step: Callable[[int, StaticInputs], tuple[dict[str, torch.Tensor], Any]],
            inputs: Sequence[StaticInputs], *, graphs: bool | None = None, decode_only: bool = False) -> list[Any]:
        """Each part's `part_step`, recorded for `key` the first time and replayed after, with the hand-over
        copied into the next part's buffers between them; returns each part's result (in the recordings'
        buffers, overwritten by the next replay, as `StaticStep.run` without `clone`; `decode_only` as there)."""
        handed: dict[str, torch.Tensor] = {}  # name -> the producing part's output
        results = []
        for part, step in enumerate(self.steps):
            part_inputs = inputs[part]
            for name, value in handed.items():
                part_inputs.set(name, value)  # the hand-over: into this part's static buffer, on its device
            out, result = step.run(key, lambda step_inputs, part=part: part_step(part, step_inputs), part_inputs,
                                   graphs=graphs, decode_only=decode_only)
            if step.failure is not None and self.failed_parts is not None:
                self.failed_parts.add(part)
            handed.update(out)
            results.append(result)
        return results


def run_split_decode_step(model: Any, state: Any, token: Any,
                          part_step: Callable[[Any, int, StaticInputs, int], tuple[dict[str, torch.Tensor], Any]], *,
                          graphs: bool | None = None, sampler: Any = None) -> Any:
    """`static_step.run_decode_step` for a model split into parts: one token at position `state.length`
    through each part's static step in turn (`part_step(state, part, inputs, window)`, see
    `SplitStaticStep`); the last part's result is the logits `[1, vocab]`. The model gives `part_ops` (a
    backend per part), `embed(ids)`, `decode_graphs` and `decode_min_window`; the state as
    `run_decode_step`'s. Every part holds the position in a buffer of its own, on its device; the token and
    its embedding are the first part's. A `sampler` (see `run_decode_step`) draws after the last part, on
    its device but outside the parts' recordings: `(logits, token)` comes back."""
    first = model.part_ops[0]
    length = state.length
    state.kv.ensure_room(1)
    if state.decode is None:
        state.decode = SplitStaticStep(model.part_ops, "decode step", graphs=None if model.decode_graphs else False,
                                       failed_parts=getattr(model, "failed_parts", None))
    if isinstance(token, torch.Tensor) and token.device != torch.device(first.device):
        token = int(token.reshape(-1)[0])
    inputs = [state.decode.inputs(0, token=token.reshape(1) if isinstance(token, torch.Tensor) else int(token),
                                  position=length)]
    inputs += [state.decode.inputs(part, position=length) for part in range(1, state.decode.parts)]
    inputs[0].set("embedded", model.embed(inputs[0].token).reshape(1, 1, -1))
    window = kv_window(length + 1, window_limit(state.kv), model.decode_min_window)
    key = window if state.features is None else (window, state.features.data_ptr())
    results = state.decode.run(key, lambda part, step_inputs: part_step(state, part, step_inputs, window), inputs,
                               graphs=graphs, decode_only=state.features is None)
    logits = results[-1].clone()
    state.kv.commit(length + 1)
    state.length = length + 1
    state.captured = {}
    if sampler is not None:
        token = sampler(logits[-1])
        sampler.drawn()
        return logits, token
    return logits
