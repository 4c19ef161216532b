"""Time the one-launch MoE router (`lucebox_cuda.triton_router.route`) per launch shape, on the GPU.

The decode step's shapes of Laguna-XS.2 (sigmoid router with a selection bias, 256 experts, top-8, hidden
2048) and Qwen3.5-35B-A3B (softmax router, the shared expert's gate riding as one more row), an fp32 router
as GGUF files keep it, bf16 activations, random inputs. Each variant is warmed up, then REPEAT launches are
recorded in one CUDA graph and the graph replayed (the launches back to back, as in a graphed decode step);
the figure is the median per launch over replays. Every variant's choice is checked against the default's.
A launch shape is warps a program (`LUCEBOX_ROUTER_WARPS`) and router rows a program
(`LUCEBOX_ROUTER_EXPERTS_PER_PROGRAM`); the last line names the fastest for Laguna as environment settings.

    python3 scripts/router_probe.py [--warps 1 2 4 8] [--experts 2 4 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from lucebox_cuda import triton_router

HIDDEN, EXPERTS, TOP_K, REPEAT, REPLAYS = 2048, 256, 8, 50, 20


def inputs(seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "x": torch.randn(1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16),
        "proj": torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5,
        "bias": torch.randn(EXPERTS, generator=gen, device="cuda") * 0.05,
        "gate": torch.randn(1, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5,
    }


def call(family: str, data: dict):
    if family == "laguna":
        return triton_router.route(data["x"], data["proj"], TOP_K, selection_bias=data["bias"], scale=2.5)
    return triton_router.route(data["x"], data["proj"], TOP_K, shared_gate=data["gate"])


def time_variant(family: str, data: dict) -> float:
    """Microseconds a launch: REPEAT launches in one graph, the median replay over REPLAYS."""
    for _ in range(3):
        call(family, data)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            call(family, data)
    return replay_us(graph, REPEAT, REPLAYS)


def replay_us(graph: torch.cuda.CUDAGraph, repeat: int, replays: int) -> float:
    """Median microseconds a call over `replays` replays of `graph` (`repeat` calls each), after one replay
    (scripts/persistent_probe.py times its kernels with it too)."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / repeat)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8], help="router rows a program")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for family in ("laguna", "qwen35moe"):
        data = inputs(7)
        for name in (triton_router.WARPS_ENV, triton_router.EXPERTS_ENV):
            os.environ.pop(name, None)
        reference = [t.clone() for t in call(family, data)]
        for warps in args.warps:
            for experts in args.experts:
                os.environ[triton_router.WARPS_ENV] = str(warps)
                os.environ[triton_router.EXPERTS_ENV] = str(experts)
                got = call(family, data)
                same = all(torch.equal(a, b) for a, b in zip(got, reference))
                micros = time_variant(family, data)
                rows.append({"family": family, "warps": warps, "experts_per_program": experts,
                             "us_per_launch": micros, "same_as_default": same})
                print(f"router {family} warps {warps} rows {experts}: {micros:.2f} us a launch, "
                      f"same as default: {same}")
        for name in (triton_router.WARPS_ENV, triton_router.EXPERTS_ENV):
            os.environ.pop(name, None)
    best = min((row for row in rows if row["family"] == "laguna" and row["same_as_default"]),
               key=lambda row: row["us_per_launch"])
    print(f"best: {triton_router.WARPS_ENV}={best['warps']},{triton_router.EXPERTS_ENV}={best['experts_per_program']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
