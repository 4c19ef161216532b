"""Where the host time of a decode step and of a short prefill piece goes, on a GPU.

A decode step replays its recorded graph in a few milliseconds; the engine around it (sampling, feeding
ahead, reading the token back, detokenizing) must hand the GPU the next step before the one queued runs out,
or the GPU idles. This prints the engine's milliseconds per token beside a bare replay of the recorded step,
the operations that made the host wait for the device (`torch.cuda.set_sync_debug_mode`), the GPU's busy
time against the wall clock with the kernels launched outside the graph (`torch.profiler`), and the host
functions by own time (cProfile). With `--pieces`, the same for eager forward calls of those many tokens
after a prompt of `--depth` tokens (the pieces a second turn restored from the prefix cache prefills).

    python scripts/decode_overhead.py -m laguna-xs2-q4_k_m.gguf -n 128
    python scripts/decode_overhead.py -m qwen35-27b-q4_k_m.gguf -n 64 --pieces 3,256 --depth 8192
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import time
import traceback
import warnings

import torch

from lucebox_core.assembly import EngineOptions, build_engine
from lucebox_core.engine import GenerationRequest
from lucebox_core.sampling import SamplingParams


def host_waits(run) -> list[tuple[str, int]]:
    """The places (innermost project frame) whose operations made the host wait for the device in `run()`."""
    places: collections.Counter = collections.Counter()

    def note(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "lucebox" in f.filename or "scripts" in f.filename]
        where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else filename
        places[f"{where}: {str(message)[:80]}"] += 1

    previous = warnings.showwarning
    warnings.showwarning = note
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = previous
    return places.most_common(12)


def gpu_profile(run, label: str) -> dict:
    """GPU busy time of `run()` against its wall time, and the kernels it launched outside CUDA graphs."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels) / 1e6  # µs -> s (overlaps counted twice: an upper bound)
    names = collections.Counter()
    times = collections.Counter()
    for e in kernels:
        names[e.name[:70]] += 1
        times[e.name[:70]] += e.device_time
    top = [(name, names[name], round(times[name] / 1e3, 3)) for name, _ in times.most_common(15)]
    return {"label": label, "wall_ms": round(wall * 1e3, 3), "gpu_busy_ms": round(busy * 1e3, 3),
            "kernel_events": len(kernels), "top_kernels_ms": top}


def cprofile(run, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def bench_loop(model, sync, top: int) -> dict:
    """`lucebox bench`'s tg row waits for every token (as llama-bench does), so the host's work between two
    steps adds to the step: ms per token of the bench's loop (forward + wait), of the decode step + wait, of a
    bare replay + wait, and of bare replays back to back; GPU time per token; cProfile of the bench's loop."""
    state = model.new_state(1024)
    model.forward(state, torch.arange(100, 116))
    tokens = iter(range(200, 10**6))

    def per_token(run, steps: int = 64) -> float:
        run()
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            run()
        return round((time.perf_counter() - start) * 1000 / steps, 3)

    row = {"forward_wait_ms": per_token(lambda: (model.forward(state, torch.tensor([next(tokens)])), sync())),
           "decode_step_wait_ms": per_token(lambda: (model.decode_step(state, next(tokens)), sync()))}
    graph = state.decode.recordings()[-1]
    row["replay_wait_ms"] = per_token(lambda: (graph.replay(), sync()))
    row["replay_ms"] = per_token(graph.replay)
    sync()
    row["gpu"] = gpu_profile(lambda: [(model.forward(state, torch.tensor([next(tokens)])), sync()) for _ in range(16)],
                             "bench loop, 16 tokens")
    print("bench loop", json.dumps(row, indent=1), flush=True)
    print(cprofile(lambda: [(model.forward(state, torch.tensor([next(tokens)])), sync()) for _ in range(64)], top),
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--pieces", default="", help="token counts of eager forward calls to profile, e.g. 3,256")
    p.add_argument("--depth", type=int, default=8192, help="tokens prefilled before the pieces")
    p.add_argument("--top", type=int, default=20, help="host functions listed")
    p.add_argument("--bench-loop", action="store_true",
                   help="also `lucebox bench`'s tg loop (a forward per token, a wait per token) taken apart")
    p.add_argument("--json")
    args = p.parse_args(argv)
    pieces = [int(n) for n in args.pieces.split(",") if n]
    assembled = build_engine(EngineOptions(model=args.model, ctx_size=args.depth + sum(pieces) * 4 + 512,
                                           no_draft=True))
    engine, model = assembled.engine, assembled.loaded.model
    sync = engine.backend.synchronize
    params = SamplingParams(temperature=args.temperature, top_k=40, top_p=0.95, seed=1)
    request = GenerationRequest(prompt_ids=list(range(100, 164)), max_tokens=args.n_gen, sampling=params,
                                ignore_eos=True)

    def generate() -> float:
        sync()
        start = time.perf_counter()
        assert len(engine.generate(request).token_ids) == args.n_gen
        sync()
        return (time.perf_counter() - start) * 1000 / args.n_gen

    generate()  # warm-up: the recordings are made
    report: dict = {"model": args.model, "temperature": args.temperature}
    report["engine_ms"] = round(min(generate() for _ in range(3)), 3)
    recordings = [r for seq in engine._idle if seq.state.decode is not None for r in seq.state.decode.recordings()]
    if recordings:
        graph = recordings[-1]
        graph.replay()
        sync()
        start = time.perf_counter()
        for _ in range(50):
            graph.replay()
        sync()
        report["replay_ms"] = round((time.perf_counter() - start) * 1000 / 50, 3)
    print(json.dumps(report), flush=True)
    report["decode_host_waits"] = host_waits(generate)
    print("decode: host waits", json.dumps(report["decode_host_waits"], indent=1), flush=True)
    report["decode_gpu"] = gpu_profile(generate, f"generate {args.n_gen} tokens")
    print("decode: GPU", json.dumps(report["decode_gpu"], indent=1), flush=True)
    print(cprofile(generate, args.top), flush=True)

    if args.bench_loop:
        report["bench_loop"] = bench_loop(model, sync, args.top)

    if pieces:
        state = model.new_state(args.depth + sum(pieces) * 4 + 512)
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(10, 1000, (args.depth,), generator=generator)
        for start in range(0, args.depth, 4096):
            model.forward(state, prompt[start : start + 4096], last_only=True)
        sync()
        for n in pieces:
            ids = torch.randint(10, 1000, (n,), generator=generator)
            call = lambda ids=ids: (model.forward(state, ids, last_only=True), sync())  # noqa: E731
            call()  # warm-up at this shape
            start = time.perf_counter()
            call()
            row = {"tokens": n, "depth": int(state.length), "forward_ms": round((time.perf_counter() - start) * 1e3, 2)}
            row["host_waits"] = host_waits(call)
            row["gpu"] = gpu_profile(call, f"forward {n} tokens")
            print("piece", json.dumps(row, indent=1), flush=True)
            print(cprofile(call, args.top), flush=True)
            report.setdefault("pieces", []).append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
