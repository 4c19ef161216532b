"""Where a verify pass's GPU time goes, by kind of kernel, against the pass's node count.

    python3 scripts/verify_profile.py MODEL.gguf [--nodes 1,16,23] [--depth 512] [--reps 20] [--json OUT.json]

A prompt of `--depth` random tokens is prefilled; then for each node count a verify pass over a chain of that
many nodes (the shape `VerifyCostCurve` times) and, for the largest count, over a tree of the same size (node i's
parent (i - 1) // 2: several branches a level) and over a tree shaped as a chain-seeded DDTree's (a spine of two
thirds of the nodes, then siblings of spine nodes: where few nodes are branched from). Each pass runs once untimed (on a GPU:
records its graph), then `--reps` times timed (the device waited for after each), then `--reps` times under
`torch.profiler`, whose kernels are summed by kind: the weights' products by GGUF format, attention, the Gated
DeltaNet's recurrence and convolution, norms, and the rest. The products' rate is the weights' bytes over their
kernel time (each weight is read once a pass). A pass's `kernel_ms` against its `wall_ms` is what launches, host
work and gaps add.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time

import torch

# (kind, pattern on the kernel's name): the first that matches names the kind.
KINDS: tuple[tuple[str, str], ...] = (
    ("products q4_k", r"(matvec|pipe|mma).*q4_k"),
    ("products q5_k", r"(matvec|pipe|mma).*q5_k"),
    ("products q6_k", r"(matvec|pipe|mma).*q6_k"),
    ("products q8_0", r"(matvec|pipe|mma).*q8_0"),
    ("products other", r"matvec|gemm|gemv|cutlass|sm90_xmma|nvjet"),
    ("attention", r"attention|attn|softmax|flash"),
    ("gated delta recurrence", r"delta|gdn|recurr"),
    ("convolution", r"conv"),
    ("norms", r"norm"),
    ("gates and activations", r"gate|silu|swiglu|sigmoid|act"),
    ("copies and fills", r"copy|fill|memcpy|memset|elementwise|index|cat|scatter|gather"),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def tree_parents(nodes: int, shape: str) -> list[int]:
    if shape == "chain":
        return list(range(-1, nodes - 1))
    if shape == "ddtree":  # a chain-seeded DDTree's shape: a spine of two thirds, then siblings off the spine
        spine = max(2, 2 * nodes // 3) if nodes > 2 else nodes
        return list(range(-1, spine - 1)) + [(i - spine) % (spine - 1) for i in range(spine, nodes)]
    return [-1] + [(i - 1) // 2 for i in range(1, nodes)]


def profile_pass(model, state, nodes: int, shape: str, reps: int, synchronize, weight_bytes: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    parents = tree_parents(nodes, shape)
    tokens = torch.randint(0, model.vocab_size, (nodes,), generator=torch.Generator().manual_seed(nodes)).tolist()
    model.verify(state, tokens, parents)  # records the pass (graphs) and compiles its kernels
    model.verify(state, tokens, parents)
    synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        model.verify(state, tokens, parents)
        synchronize()
    wall = (time.perf_counter() - start) / reps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            model.verify(state, tokens, parents)
            synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_kind: collections.Counter = collections.Counter()
    by_name: collections.Counter = collections.Counter()
    launches: collections.Counter = collections.Counter()
    for event in kernels:
        by_kind[kernel_kind(event.name)] += event.device_time / 1e3 / reps  # µs -> ms a pass
        by_name[event.name[:90]] += event.device_time / 1e3 / reps
        launches[event.name[:90]] += 1
    products = sum(ms for kind, ms in by_kind.items() if kind.startswith("products"))
    return {
        "nodes": nodes, "shape": shape, "wall_ms": round(wall * 1e3, 3),
        "kernel_ms": round(sum(by_kind.values()), 3), "launches_a_pass": round(len(kernels) / reps, 1),
        "by_kind_ms": {kind: round(ms, 3) for kind, ms in by_kind.most_common()},
        "products_gb_per_s": round(weight_bytes / (products * 1e-3) / 1e9, 1) if products else None,
        "top_kernels_ms": [(name, round(ms, 3), launches[name] // reps) for name, ms in by_name.most_common(12)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--nodes", default="1,16,23", help="node counts, comma-separated")
    parser.add_argument("--depth", type=int, default=512, help="tokens prefilled before the passes")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",") if n]
    if not counts or min(counts) < 1:
        parser.error("--nodes takes positive node counts, e.g. 1,16,23")

    from lucebox_core.assembly import EngineOptions, build_engine

    assembled = build_engine(EngineOptions(model=args.model, ctx_size=args.depth + 2 * max(counts) + 64))
    engine = assembled.engine
    model, backend = engine.model, engine.backend
    synchronize = backend.synchronize
    state = model.new_state(args.depth + 2 * max(counts) + 64)
    prompt = torch.randint(0, model.vocab_size, (args.depth,), generator=torch.Generator().manual_seed(0))
    model.forward(state, prompt)
    synchronize()
    # The CUDA backend's, once the prompt's forward has uploaded every weight (they go up at first use: before it, 0).
    weight_bytes = int(getattr(assembled.loaded.backend, "device_weight_bytes", 0))

    rows = [profile_pass(model, state, n, "chain", args.reps, synchronize, weight_bytes) for n in counts]
    if max(counts) > 2:
        for shape in ("tree", "ddtree"):
            rows.append(profile_pass(model, state, max(counts), shape, args.reps, synchronize, weight_bytes))
    one = next((r for r in rows if r["nodes"] == 1), None)
    for row in rows:
        ratio = f" ({row['wall_ms'] / one['wall_ms']:.2f}x one node)" if one else ""
        print(f"{row['nodes']:>3} nodes, {row['shape']}: {row['wall_ms']:.3f} ms a pass{ratio}, kernels "
              f"{row['kernel_ms']:.3f} ms in {row['launches_a_pass']:.0f} launches, products at "
              f"{row['products_gb_per_s']} GB/s")
        for kind, ms in row["by_kind_ms"].items():
            base = one["by_kind_ms"].get(kind) if one else None
            grown = f" ({ms / base:.2f}x)" if base else ""
            print(f"      {kind:<24} {ms:8.3f} ms{grown}")
        for name, ms, launches in row["top_kernels_ms"]:
            print(f"        {ms:8.3f} ms  x{launches:<4} {name}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model, "depth": args.depth, "weight_bytes": weight_bytes, "passes": rows},
                      handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
