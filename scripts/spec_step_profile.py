"""Where one speculative step's time goes: draft, candidate tree, verify pass, walk, commit, and the rest.

    python3 scripts/spec_step_profile.py TARGET.gguf DRAFT.gguf [--force-accept 8.3] [-n 256] [--json OUT.json]

Greedy generation after a 32-token random prompt through the engine (`Engine.generate`, what `lucebox bench`
times), with `--force-accept K` as bench takes it (the plain greedy continuation as the forcing reference).
One untimed run records every shape; then one run with the step's parts wrapped in timers that wait for the
device before and after each part (so each part's time is its own, GPU work included; "draft sync", the drafter's
projection of the newly accepted tokens' features, is timed inside "draft"), and one plain timed run without them.
Then `--draft-kernels` more calls of the last step's draft (its context already synced), timed and profiled: the
draft's kernels by kind. The waits add a little to the wrapped run; the unwrapped run's time per step minus the
parts' sum is the engine's remaining host work (emitting tokens, stops, bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from typing import Any

import attrs


def _timed(totals: dict[str, float], counts: dict[str, int], name: str, function: Any, synchronize: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        synchronize()
        start = time.perf_counter()
        result = function(*args, **kwargs)
        synchronize()
        totals[name] += time.perf_counter() - start
        counts[name] += 1
        return result

    return wrapper


NESTED = "draft sync"  # timed inside "draft", so not added to the parts' sum


def _draft_kernels(drafter: Any, call_args: tuple, call_kwargs: dict, calls: int, synchronize: Any) -> dict:
    """The last step's draft call made again `calls` times (its context already synced, so the block's forward and
    the output layer alone), timed, then under torch.profiler: its kernels' time by kind (`verify_profile.KINDS`)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from verify_profile import kernel_kind

    draft = type(drafter).draft.__get__(drafter)  # the method itself, not this script's timers
    draft(*call_args, **call_kwargs)
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        draft(*call_args, **call_kwargs)
    synchronize()
    wall = (time.perf_counter() - start) / calls
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            draft(*call_args, **call_kwargs)
        synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_kind: collections.Counter = collections.Counter()
    by_name: collections.Counter = collections.Counter()
    for event in kernels:
        by_kind[kernel_kind(event.name)] += event.device_time / 1e3 / calls
        by_name[event.name[:90]] += event.device_time / 1e3 / calls
    return {"calls": calls, "wall_ms": round(wall * 1e3, 3), "kernel_ms": round(sum(by_kind.values()), 3),
            "launches_a_call": round(len(kernels) / calls, 1),
            "by_kind_ms": {kind: round(ms, 3) for kind, ms in by_kind.most_common()},
            "top_kernels_ms": [(name, round(ms, 3)) for name, ms in by_name.most_common(12)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--force-accept", type=float, default=None)
    parser.add_argument("-n", "--n-gen", type=int, default=256)
    parser.add_argument("--spec-type", default="ddtree")
    parser.add_argument("--tree-budget", default="22")
    parser.add_argument("--draft-kernels", type=int, default=8,
                        help="draft calls replayed under torch.profiler after the runs (0: none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from lucebox_core.assembly import EngineOptions, build_engine
    from lucebox_core.bench import SPEC_PROMPT_TOKENS, _random_ids
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams

    budget = args.tree_budget if args.tree_budget == "auto" else int(args.tree_budget)
    assembled = build_engine(EngineOptions(model=args.target, model_draft=args.draft, spec_type=args.spec_type,
                                           tree_budget=budget, ctx_size=SPEC_PROMPT_TOKENS + args.n_gen + 256))
    engine, speculative = assembled.engine, assembled.speculative
    model, backend = engine.model, engine.backend
    plain = Engine(model, assembled.loaded.tokenizer, ctx_size=engine.ctx_size, backend=backend)

    def request(seed: int) -> GenerationRequest:
        prompt = _random_ids(SPEC_PROMPT_TOKENS, model.vocab_size, seed)
        base = GenerationRequest(prompt_ids=prompt, max_tokens=args.n_gen, sampling=SamplingParams(temperature=0),
                                 ignore_eos=True)
        if args.force_accept is None:
            return base
        reference = plain.generate(attrs.evolve(base, max_tokens=args.n_gen + speculative.block_size)).token_ids
        return attrs.evolve(base, force_accept=args.force_accept, force_reference=reference)

    engine.generate(request(99))  # records every shape
    timed_request = request(100)
    backend.synchronize()
    start = time.perf_counter()
    unwrapped = engine.generate(timed_request)
    backend.synchronize()
    unwrapped_seconds = time.perf_counter() - start
    steps = len(unwrapped.timings.accepted_lengths)

    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    sync = backend.synchronize
    drafter, verifier = speculative.drafter, speculative.verifier
    originals = {"draft": (drafter, "draft"), "candidates": (verifier, "candidates"), "verify": (model, "verify"),
                 "walk": (verifier, "walk"), "commit": (model, "commit"),
                 NESTED: (drafter, "sync")}  # inside "draft": the features of the accepted tokens projected
    for name, (owner, attribute) in originals.items():
        setattr(owner, attribute, _timed(totals, counts, name, getattr(owner, attribute), sync))
    last_draft: list[tuple] = []
    timed_draft = drafter.draft

    def keep_arguments(*call_args: Any, **call_kwargs: Any) -> Any:
        last_draft[:] = [(call_args, call_kwargs)]
        return timed_draft(*call_args, **call_kwargs)

    drafter.draft = keep_arguments
    try:
        sync()
        start = time.perf_counter()
        wrapped = engine.generate(timed_request)
        sync()
        wrapped_seconds = time.perf_counter() - start
    finally:
        for owner, attribute in originals.values():
            vars(owner).pop(attribute, None)  # the class's method again
    if wrapped.token_ids != unwrapped.token_ids:
        print("warning: the wrapped run generated other tokens", file=sys.stderr)

    per_step = {name: 1e3 * seconds / max(1, counts[name]) for name, seconds in totals.items()}
    parts = sum(ms for name, ms in per_step.items() if name != NESTED)
    draft_kernels = None
    if args.draft_kernels > 0 and last_draft:
        call_args, call_kwargs = last_draft[0]
        draft_kernels = _draft_kernels(drafter, call_args, call_kwargs, args.draft_kernels, sync)
    result = {
        "target": args.target, "draft": args.draft, "force_accept": args.force_accept, "n_gen": args.n_gen,
        "steps": steps, "mean_accepted_length": args.n_gen / max(1, steps),
        "tokens_per_s": args.n_gen / unwrapped_seconds, "ms_per_step": 1e3 * unwrapped_seconds / max(1, steps),
        "wrapped_ms_per_step": 1e3 * wrapped_seconds / max(1, len(wrapped.timings.accepted_lengths)),
        "parts_ms_per_step": per_step,
        "rest_ms_per_step": 1e3 * unwrapped_seconds / max(1, steps) - parts,
        "draft_kernels": draft_kernels,
    }
    print(f"{steps} steps, {result['mean_accepted_length']:.2f} tokens a step, {result['tokens_per_s']:.1f} tok/s, "
          f"{result['ms_per_step']:.2f} ms a step (wrapped: {result['wrapped_ms_per_step']:.2f})")
    for name, ms in per_step.items():
        print(f"  {name:<11} {ms:8.3f} ms")
    print(f"  {'rest':<11} {result['rest_ms_per_step']:8.3f} ms (engine host work, unwrapped run)")
    if draft_kernels:
        print(f"  a draft call again ({args.draft_kernels} calls, the context already synced): "
              f"{draft_kernels['wall_ms']:.3f} ms, kernels {draft_kernels['kernel_ms']:.3f} ms in "
              f"{draft_kernels['launches_a_call']:.0f} launches")
        for kind, ms in draft_kernels["by_kind_ms"].items():
            print(f"    {kind:<24} {ms:8.3f} ms")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
