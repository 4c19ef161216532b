"""Where a prefill's time goes: wall time against the GPU's busy time, kernels by time, host ops by time.

    python3 scripts/prefill_profile.py MODEL.gguf [--tokens 512] [--chunk N] [--reps 3] [--json OUT.json]

A prefill that is slower than its kernels add up to is bound by the host (launches, Python, syncs between
chunks); one whose kernels fill the wall time is bound by what those kernels do. The report separates the
two: `wall_ms` (median over `--reps`, each after a warm-up at the same size), `gpu_busy_ms` (the kernels'
time in one profiled prefill) and the host ops that launched them, by self CPU time. Issue #17 reads the
0.8B's pp512 as "per-chunk overheads"; this is the measurement behind that reading.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import random_ids, time_prefill  # noqa: E402  (one way to time a prefill)


def _device_us(event: Any) -> float:
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0) or 0.0


def _self_device_us(event: Any) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0.0


def _merged_busy_us(prof: Any) -> float:
    """The union of the kernels' intervals: time the GPU ran anything (overlapping streams count once)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")
                   and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def profile_prefill(path: str, tokens: int, chunk: int | None, reps: int, top: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from lucebox_core.engine import Engine
    from lucebox_core.loading import load_model

    loaded = load_model(path)
    model = loaded.model
    engine = Engine(model, loaded.tokenizer, ctx_size=tokens + 1, prefill_chunk=chunk)
    vocab = model.vocab_size
    time_prefill(engine, random_ids(tokens, vocab, 99))  # weights upload, kernels compile: untimed
    time_prefill(engine, random_ids(tokens, vocab, 98))  # and a warm-up at this size
    walls = [time_prefill(engine, random_ids(tokens, vocab, rep)) for rep in range(reps)]
    activities = [ProfilerActivity.CPU]
    if model.ops.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        profiled_wall = time_prefill(engine, random_ids(tokens, vocab, 1234))
    events = prof.key_averages()
    kernels = sorted(((e.key, _self_device_us(e), e.count) for e in events if _self_device_us(e) > 0),
                     key=lambda k: -k[1])
    host_ops = sorted(((e.key, e.self_cpu_time_total, e.count) for e in events if e.self_cpu_time_total > 0),
                      key=lambda k: -k[1])
    launches = sum(e.count for e in events if e.key in {"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                         "cuLaunchKernelEx", "cudaGraphLaunch"})
    syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key in {"cudaMemcpyAsync", "cudaMemcpy"})
    wall_ms = statistics.median(walls) * 1e3
    busy_ms = _merged_busy_us(prof) / 1e3 if len(activities) > 1 else 0.0
    summary = {
        "model": Path(path).name, "backend": loaded.backend_name, "tokens": tokens,
        "prefill_chunk": engine.prefill_chunk, "wall_ms": wall_ms, "walls_ms": [w * 1e3 for w in walls],
        "tok_s": tokens / (wall_ms / 1e3), "profiled_wall_ms": profiled_wall * 1e3,
        "gpu_busy_ms": busy_ms, "kernel_ms_sum": sum(k[1] for k in kernels) / 1e3,
        "launches": launches, "syncs_and_copies": syncs,
        "kernels": [{"name": n[:100], "ms": us / 1e3, "count": c} for n, us, c in kernels[:top]],
        "host_ops": [{"name": n[:100], "self_cpu_ms": us / 1e3, "count": c} for n, us, c in host_ops[:top]],
    }
    return summary


def report(summary: dict[str, Any]) -> str:
    lines = [f"prefill {summary['model']} ({summary['backend']}): {summary['tokens']} tokens in chunks of "
             f"{summary['prefill_chunk']}: wall {summary['wall_ms']:.2f} ms ({summary['tok_s']:,.0f} tok/s); "
             f"profiled {summary['profiled_wall_ms']:.2f} ms, GPU busy {summary['gpu_busy_ms']:.2f} ms "
             f"({summary['gpu_busy_ms'] / max(summary['profiled_wall_ms'], 1e-9):.0%}), "
             f"{summary['launches']} launches, {summary['syncs_and_copies']} syncs/copies"]
    total = max(summary["kernel_ms_sum"], 1e-9)
    lines.append("  kernels (self device time):")
    lines += [f"    {k['ms']:8.3f} ms {k['ms'] / total:6.1%} x{k['count']:5d}  {k['name'][:90]}"
              for k in summary["kernels"]]
    lines.append("  host ops (self CPU time):")
    lines += [f"    {h['self_cpu_ms']:8.3f} ms x{h['count']:6d}  {h['name'][:90]}" for h in summary["host_ops"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, help="prefill chunk (default: the model's)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25, help="rows of each table")
    parser.add_argument("--json", help="write the summary here too")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.reps < 1:
        parser.error("--tokens and --reps must be positive")
    start = time.perf_counter()
    summary = profile_prefill(args.model, args.tokens, args.chunk, args.reps, args.top)
    summary["script_s"] = time.perf_counter() - start
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
