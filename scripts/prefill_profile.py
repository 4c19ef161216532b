"""Where a prefill's time goes: wall time against the GPU's busy time, kernels by time, host ops by time.

    python3 scripts/prefill_profile.py MODEL.gguf [--tokens 512] [--chunk N] [--reps 3] [--json OUT.json]
        [--python] [--stacks]

A prefill that is slower than its kernels add up to is bound by the host (launches, Python, syncs between
chunks); one whose kernels fill the wall time is bound by what those kernels do. The report separates the
two: `wall_ms` (median over `--reps`, each after a warm-up at the same size), `gpu_busy_ms` (the kernels'
time in one profiled prefill) and the host ops that launched them, by self CPU time. Issue #17 reads the
0.8B's pp512 as "per-chunk overheads"; this is the measurement behind that reading.

`--python` adds one more prefill under cProfile: the Python functions that hold the host (what a host-bound
prefill spends its time on). `--stacks` records the profiled prefill's call stacks and names the project's
lines that launched the torch ops with the most device time (which copies and elementwise ops to fuse).
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


def _python_profile(run: Any, top: int) -> list[dict[str, Any]]:
    """The functions of one call of `run` by their own time (cProfile), with their cumulative time and calls."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, tottime, cumtime, callers)}
    by_own = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    # The project's own functions by cumulative time: which layer of the model's code the host time sits under.
    ours = [item for item in stats.items() if "lucebox" in item[0][0] or "plugins/" in item[0][0]]
    by_cum = [item for item in sorted(ours, key=lambda item: -item[1][3]) if item not in by_own][:top]
    return [{"function": f"{Path(file).name}:{line}:{name}", "self_ms": tottime * 1e3, "cum_ms": cumtime * 1e3,
             "calls": calls} for (file, line, name), (_, calls, tottime, cumtime, _) in by_own + by_cum]


def _op_stacks(events: Any, top: int) -> list[dict[str, Any]]:
    """Torch ops (not kernels) by the project's call site and their device time (CPU time on a CPU run, which
    has none): the lines to fuse away first. Products (`mm`) are left out: their call sites are known."""
    rows = []
    for event in events:
        spent_us = _device_us(event) or event.cpu_time_total
        if not event.key.startswith("aten::") or spent_us <= 0 or event.key in {"aten::mm", "aten::linear",
                                                                                  "aten::matmul"}:
            continue
        frames = [f for f in (event.stack or []) if "lucebox" in f][:3]
        if frames:
            rows.append({"op": event.key, "ms": spent_us / 1e3, "count": event.count, "where": frames})
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def profile_prefill(path: str, tokens: int, chunk: int | None, reps: int, top: int, python: bool = False,
                    stacks: bool = False) -> dict[str, Any]:
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
    # Kineto keeps the Python stacks of ops only with the verbose config (an empty `stack` otherwise).
    verbose = {"experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)} if stacks else {}
    with torch_profile(activities=activities, with_stack=stacks, **verbose) as prof:
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
    if stacks:
        summary["op_stacks"] = _op_stacks(prof.key_averages(group_by_stack_n=8), top)
    if python:
        summary["python"] = _python_profile(lambda: time_prefill(engine, random_ids(tokens, vocab, 4321)), top)
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
    if "op_stacks" in summary:
        lines.append("  torch ops by call site (device time; CPU time where no GPU ran):")
        for row in summary["op_stacks"]:
            lines.append(f"    {row['ms']:8.3f} ms x{row['count']:5d}  {row['op']}")
            lines += [f"        {frame[:110]}" for frame in row["where"]]
    if "python" in summary:
        lines.append("  one more prefill under cProfile: functions by own time, then the project's by cumulative:")
        lines += [f"    {f['self_ms']:8.3f} ms (cum {f['cum_ms']:8.3f}) x{f['calls']:6d}  {f['function'][:90]}"
                  for f in summary["python"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, help="prefill chunk (default: the model's)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25, help="rows of each table")
    parser.add_argument("--json", help="write the summary here too")
    parser.add_argument("--python", action="store_true", help="one more prefill under cProfile: the host's functions")
    parser.add_argument("--stacks", action="store_true", help="the project's call sites of the device-heavy ops")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.reps < 1:
        parser.error("--tokens and --reps must be positive")
    start = time.perf_counter()
    summary = profile_prefill(args.model, args.tokens, args.chunk, args.reps, args.top, args.python, args.stacks)
    summary["script_s"] = time.perf_counter() - start
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
