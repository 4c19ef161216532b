"""Helpers of `bench_vs_llamacpp.sh`: the side-by-side table, and a profile of one decode step.

    python3 scripts/bench_vs_llamacpp.py table --llama L1.json [L2.json ...] --lucebox B1.json [...] --label 27b
    python3 scripts/bench_vs_llamacpp.py profile MODEL.gguf [--ctx 4096] [--out DIR]

`table` reads llama-bench's `-o json` output and `lucebox bench --json` output for one model and prints a
markdown table: both engines' tok/s per test, the ratio, and for decode the weight bandwidth each achieved
(weight bytes per token from the GGUF, the same file for both). `profile` times one decode step of
Lucebox three ways (eager, graph replay through `decode_step`, bare replay) and sums GPU kernel time by
kernel over replays, to say where a step's time goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _llama_key(row: dict) -> str:
    depth = int(row.get("n_depth", 0) or 0)
    if int(row.get("n_gen", 0)) > 0:
        return f"tg{row['n_gen']}" + (f" @ d{depth}" if depth else "")
    return f"pp{row['n_prompt']}" + (f" @ d{depth}" if depth else "")


def _load_rows(paths: list[str]) -> list[dict]:
    rows: list[dict] = []
    for path in paths:
        text = Path(path).read_text().strip()
        if not text:
            continue
        # llama-bench prints one JSON array; tolerate log lines before it, and skip a failed run's output.
        try:
            rows.extend(json.loads(text[text.index("[") :]))
        except ValueError:
            print(f"(skipped {path}: not a JSON list)", file=sys.stderr)
    return rows


def table(args: argparse.Namespace) -> int:
    llama = {_llama_key(row): row for row in _load_rows(args.llama)}
    ours = {row["test"]: row for row in _load_rows(args.lucebox)}
    bytes_per_token = next((row["weight_bytes_per_token"] for row in ours.values() if "weight_bytes_per_token" in row), None)
    print(f"\n### {args.label}\n")
    print("| test | llama.cpp tok/s | Lucebox tok/s | Lucebox / llama.cpp | llama.cpp GB/s | Lucebox GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for test in sorted(set(llama) | set(ours), key=lambda t: (t.startswith("tg"), len(t), t)):
        theirs = llama.get(test, {}).get("avg_ts")
        mine = ours.get(test, {}).get("tokens_per_s")
        ratio = f"{mine / theirs:.2f}x" if theirs and mine else "–"
        gbps = lambda rate: f"{bytes_per_token * rate / 1e9:,.0f}" if rate and bytes_per_token and test.startswith("tg") else ""
        print(f"| {test} | {f'{theirs:,.1f}' if theirs else '–'} | {f'{mine:,.1f}' if mine else '–'} | {ratio} "
              f"| {gbps(theirs)} | {gbps(mine)} |")
    return 0


def profile(args: argparse.Namespace) -> int:
    import torch

    from lucebox_core.bench import decode_bytes_per_token
    from lucebox_core.loading import load_model

    loaded = load_model(args.model)
    model = loaded.model
    print(f"profile {Path(args.model).name}: backend {loaded.backend_name}, {model.ops!r}")
    state = model.new_state(args.ctx)
    model.forward(state, torch.randint(0, model.vocab_size, (16,)))
    token = 1000

    def per_step(run, steps: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    eager = per_step(lambda: model.decode_step(state, token, graphs=False), 8)
    model.decode_step(state, token, graphs=True)  # records the window's graph
    graphed = statistics.median(per_step(lambda: model.decode_step(state, token, graphs=True), 32) for _ in range(3))
    graph = next(iter(state.decode.graphs._recorded.values()))[0]
    bare = statistics.median(per_step(graph.replay, 32) for _ in range(3))
    weight_bytes = decode_bytes_per_token(loaded.gguf)
    summary = {
        "model": Path(args.model).name, "eager_ms": eager * 1e3, "graph_step_ms": graphed * 1e3,
        "bare_replay_ms": bare * 1e3, "graph_tok_s": 1 / graphed, "weight_GB_per_s": weight_bytes / graphed / 1e9,
        "weight_bytes_per_token": weight_bytes,
    }
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    replays = 10
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us:
            kernels.append((event.key, device_us / replays, event.count / replays))
    kernels.sort(key=lambda k: -k[1])
    total = sum(k[1] for k in kernels)
    summary["kernel_us_per_step"] = total
    summary["kernels"] = [{"name": name[:90], "us_per_step": us, "launches_per_step": n} for name, us, n in kernels[:25]]
    print(f"eager {eager * 1e3:.2f} ms | graph step {graphed * 1e3:.3f} ms ({1 / graphed:.1f} tok/s, "
          f"{weight_bytes / graphed / 1e9:.0f} GB/s weights) | bare replay {bare * 1e3:.3f} ms | "
          f"GPU kernel time {total / 1e3:.3f} ms/step in {sum(k[2] for k in kernels):.0f} launches")
    for name, us, n in kernels[:12]:
        print(f"  {us:9.1f} us {us / total:6.1%} x{n:5.0f}  {name[:80]}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"profile_{Path(args.model).stem}.json").write_text(json.dumps(summary, indent=1))
    return 0


def synth_file(args: argparse.Namespace) -> int:
    from lucebox_qwen35 import synth

    synth.write(args.path, size=args.size, type=args.type)
    return 0


def bench(args: argparse.Namespace) -> int:
    """`lucebox bench --json` without the CLI (whose server import needs packages the GPU image lacks)."""
    from lucebox_core.bench import run_bench
    from lucebox_core.loading import load_model

    loaded = load_model(args.model)
    ctx = max(4096, max(args.p) + 1, max(args.d) + args.n + 1)
    rows = run_bench(loaded, prompts=args.p, n_gen=args.n, depths=args.d, reps=args.r, ctx_size=ctx)
    print(json.dumps(rows))
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("table")
    p.add_argument("--llama", nargs="*", default=[])
    p.add_argument("--lucebox", nargs="*", default=[])
    p.add_argument("--label", default="")
    p.set_defaults(run=table)
    p = sub.add_parser("profile")
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--out")
    p.set_defaults(run=profile)
    p = sub.add_parser("synth")
    p.add_argument("size")
    p.add_argument("type")
    p.add_argument("path")
    p.set_defaults(run=synth_file)
    p = sub.add_parser("bench")
    p.add_argument("model")
    p.add_argument("-p", type=_ints, default=[512])
    p.add_argument("-n", type=int, default=128)
    p.add_argument("-d", type=_ints, default=[0])
    p.add_argument("-r", type=int, default=3)
    p.set_defaults(run=bench)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
