"""CUDA graphs for the decode step: record a static-shape step once, replay it for every token.

A decode step driven from Python launches hundreds of kernels, and each launch costs microseconds of host
time: on a small model that, not the GPU, sets the speed. A step whose shapes and buffer addresses never
change (its inputs read from fixed device tensors, its state updated in place, its output left in a
buffer of its own) can be recorded with `torch.cuda.graph` and replayed with one launch.

The one shape that must grow with the sequence is the window of the KV cache that attention reads.
`kv_window` rounds the length up to one of a few sizes per octave (so at most a quarter of the window is
masked-off padding), and `StepGraphs` keeps one recording per window size.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

ENV_SWITCH = "LUCEBOX_CUDA_GRAPHS"  # "0" turns graph replay off (eager decode, for debugging and profiling)
MIN_WINDOW = 256
WINDOWS_PER_OCTAVE = 4


def graphs_enabled(device: str | torch.device) -> bool:
    """Whether decode steps on `device` should be replayed as CUDA graphs: on CUDA, unless switched off."""
    return torch.device(device).type == "cuda" and os.environ.get(ENV_SWITCH, "1") != "0"


def kv_window(length: int, max_context: int, minimum: int = MIN_WINDOW) -> int:
    """The KV window a step over `length` positions attends to: `length` rounded up to `minimum`, or above
    it to a multiple of a quarter of its octave's lower bound (257 -> 320, 8193 -> 10240), capped at
    `max_context`."""
    if length <= minimum:
        size = minimum
    else:
        step = 1 << max(0, (length - 1).bit_length() - 1 - (WINDOWS_PER_OCTAVE.bit_length() - 1))
        size = -(-length // step) * step
    return min(size, max_context)


class StepGraphs:
    """Recordings of one step function, one per key (the KV window), for one sequence's buffers.

    `pool`: a graph memory pool (`torch.cuda.graph_pool_handle()`) for this sequence's recordings, so their
    intermediates live in one place; safe because replays never overlap (one stream) and each recording's
    output buffer stays referenced here. Do not share it across sequences, whose graphs die separately.
    """

    def __init__(self, device: str | torch.device, pool: Any = None, label: str = "decode step") -> None:
        self.device = torch.device(device)
        self.pool = pool
        self.label = label
        self._recorded: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.failure: str | None = None  # why recording failed; the caller then steps eagerly

    def __len__(self) -> int:
        return len(self._recorded)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._recorded

    def run(self, key: Hashable, step: Callable[[], Any]) -> Any:
        """Run `step` for `key` and return its output (buffers that the next replay overwrites; any
        structure of tensors).

        The first time, `step` runs eagerly on a side stream (the warm-up: kernels compile, weights upload,
        library handles are made; its result is the real result) and is then recorded, which runs nothing.
        Every later time the recording is replayed. `step` must read host values only to choose shapes that
        `key` determines, and update its state in place.
        """
        entry = self._recorded.get(key)
        if entry is not None:
            graph, out = entry
            graph.replay()
            return out
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                out = step()
        finally:  # also after a failure: work queued on the side stream must come before what follows
            current.wait_stream(side)
        if self.failure is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    recorded = step()
            except Exception as exc:  # recording runs nothing, so the state is as the warm-up left it
                self.failure = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"CUDA graph capture of the {self.label} failed, running it eagerly: {self.failure}",
                              RuntimeWarning, stacklevel=2)
            else:
                self._recorded[key] = (graph, recorded)
        return out
