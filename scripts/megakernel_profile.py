"""Where a megakernel step's time goes, phase by phase (issue #17, item 4).

Loads a Qwen3.5 GGUF with `LUCEBOX_MEGAKERNEL=1` (so every layer's weights stay in GGUF's rows), decodes a few
tokens through the recorded step (the megakernel inside its graph), then records the megakernel alone in a graph
with a timeline and replays it (as the step does; an eager launch is timed beside): block 0's SM clock at the start, after every grid barrier and at the end
(`grid_barrier_mark`). Each interval is one phase as block 0 saw it, its barrier's wait included: from one
barrier's release to the next's. The phases are named by the bodies' order (a Gated DeltaNet layer's three, an
attention layer's four, each MLP's two, the final norm) and summed over the layers; the clock is turned into
microseconds by the launch's wall time (CUDA events around the same launches).

    python3 scripts/megakernel_profile.py model.gguf [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

PHASES = {"linear": ("gdn.products", "gdn.delta", "gdn.out"), "attention": (
    "attention.products", "attention.spans", "attention.merge", "attention.out")}
MLP_PHASES = ("mlp.gate_up", "mlp.down")


def phase_names(model) -> list[str]:
    """The intervals' names in launch order: each layer's mixer phases, then its MLP's, then the final norm."""
    names = []
    for layer in model.layers:
        names += PHASES["linear" if layer.linear_attn is not None else "attention"]
        names += MLP_PHASES
    return names + ["final_norm"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=20, help="timed launches (after 3 untimed ones)")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    os.environ["LUCEBOX_MEGAKERNEL"] = "1"

    from lucebox_core.ggufio import GGUFFile
    from lucebox_core.static_step import kv_window, running_static_step, window_limit
    from lucebox_cuda import megakernel
    from lucebox_cuda.backend import CudaBackend
    from lucebox_qwen35 import loader

    model = loader.load(GGUFFile(args.model), CudaBackend(dtype=torch.bfloat16))
    ops = model.ops
    state = model.new_state(4096)
    logits = model.forward(state, torch.arange(16, device="cuda"))[-1:]
    for _ in range(8):  # the recorded step, with the megakernel in it (its table, counter and program made)
        logits = model.decode_step(state, logits.argmax(-1).reshape(1))
    torch.cuda.synchronize()
    token = logits.argmax(-1).reshape(1)
    x = model.embed(token).reshape(1, 1, -1)
    position = torch.tensor([state.length], dtype=torch.int64, device="cuda")
    window = kv_window(state.length + 1, window_limit(state.kv), model.decode_min_window)
    names = phase_names(model)
    timeline = torch.zeros(len(names) + 2, dtype=torch.int64, device="cuda")

    def _timed(launch, phases):
        """One launch's marks (block 0's clocks) and wall time in microseconds (CUDA events)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        torch.cuda.synchronize()
        clocks = timeline.tolist()
        assert clocks[0] == phases + 1, f"{clocks[0]} marks, {phases + 1} expected"
        return clocks, start.elapsed_time(end) * 1000.0

    with running_static_step(decode_only=True):
        assert megakernel.takes(ops, model, state, x, position, window), "the megakernel refuses this model"
        launch = lambda: megakernel.run(ops, model, state, x, position, window, timeline=timeline)  # noqa: E731
        launch()
        graph = torch.cuda.CUDAGraph()  # as the decode step runs it: replayed (an eager launch reads slower)
        with torch.cuda.graph(graph):
            launch()
    eager_us = statistics.median(_timed(launch, len(names))[1] for _ in range(5))
    intervals, walls = [], []
    for step in range(3 + args.steps):  # each replay steps the states on (their values do not change the time)
        clocks, wall = _timed(graph.replay, len(names))
        if step >= 3:
            intervals.append([b - a for a, b in zip(clocks[1:-1], clocks[2:])])
            walls.append((wall, clocks[-1] - clocks[1]))
    # Clock cycles to microseconds: the launches' wall time over their clock span (the launch's own ramp included).
    us_per_cycle = statistics.median(wall / cycles for wall, cycles in walls)
    median = [statistics.median(column) * us_per_cycle for column in zip(*intervals)]
    totals: dict[str, list[float]] = {}
    for name, us in zip(names, median):
        totals.setdefault(name, []).append(us)
    step_us = statistics.median(wall for wall, _ in walls)
    print(f"megakernel step {step_us:.1f} us wall replayed ({1e6 / step_us:.0f} steps/s without the head; eager "
          f"{eager_us:.1f} us), {len(names) - 1} barriers, {sum(median):.1f} us in phases")
    print(f"{'phase':<20}{'count':>6}{'total us':>10}{'mean us':>9}{'share':>7}")
    rows = []
    for name, values in sorted(totals.items(), key=lambda item: -sum(item[1])):
        total = sum(values)
        rows.append({"phase": name, "count": len(values), "total_us": round(total, 1),
                     "mean_us": round(total / len(values), 2)})
        print(f"{name:<20}{len(values):>6}{total:>10.1f}{total / len(values):>9.2f}{total / sum(median):>7.1%}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"step_us": step_us, "eager_us": eager_us, "phases": rows, "intervals_us": median, "names": names}, out, indent=1)


if __name__ == "__main__":
    main()
