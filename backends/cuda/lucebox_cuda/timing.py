"""Timing GPU work with CUDA events, for the GPU-machine check scripts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def event_times_ms(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Milliseconds of each of `repeats` calls of `fn`, measured by CUDA events on the current stream."""
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times
