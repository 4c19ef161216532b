"""Timing GPU work with CUDA events, for the GPU-machine check scripts."""

from __future__ import annotations

import statistics
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


def median_ms(fn: Callable[[], Any], repeats: int = 20) -> float:
    """Median of CUDA-event timings of `fn` on the current stream, after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    return statistics.median(event_times_ms(fn, repeats))


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    """`|result - reference| / |reference|` in float64; inf if the result holds a NaN or an inf."""
    result, reference = result.double(), reference.double()
    if not torch.isfinite(result).all():
        return float("inf")
    return ((result - reference).norm() / reference.norm().clamp_min(1e-30)).item()
