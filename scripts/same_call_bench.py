"""One version of Lucebox timed the same way as another, for a before/after comparison in one device call.

Run it once per version, each with that version's packages first on PYTHONPATH (`--label` names it):

    PYTHONPATH=/tmp/old python3 scripts/same_call_bench.py MODEL DRAFT --label before --out before.json
    PYTHONPATH=/tmp/new python3 scripts/same_call_bench.py MODEL DRAFT --label after --out after.json
    python3 scripts/same_call_bench.py table before.json after.json

It uses only calls both versions have (`load_model`, `Engine`, `model.forward`, the drafter and
`SpeculativeDecoder`), and measures as llama-bench does, identically for both: `ppN` one prefill of N random
tokens after a warm-up at N; `tgN` N one-token forwards of fresh random ids, the host waiting for each;
the speculative row greedy after a 32-token prompt with `--force-accept` (FORCED: never an acceptance rate),
after an untimed run at its own shapes, its output checked against the plain greedy reference.
Medians of `--reps`. Synchronises the model's device with torch directly (the old version has no backend
device services).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

SPEC_PROMPT = 32


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_speculative(model: Any, draft: str, budget: int) -> Any:
    from lucebox_core.speculative import SpeculativeDecoder

    try:  # this version's one assembly point (drafter chosen by the draft file's architecture)
        from lucebox_core.assembly import load_drafter

        return SpeculativeDecoder(model, load_drafter(draft, model), "ddtree", budget=budget)
    except ImportError:  # the version before it
        from lucebox_core.plugins import registry

        drafter = registry().named("lucebox_drafters", "dflash", "drafter").create(draft, model)
        return SpeculativeDecoder(model, drafter, spec_type="ddtree", budget=budget)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import attrs

    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.loading import load_model
    from lucebox_core.sampling import SamplingParams

    start = time.perf_counter()
    loaded = load_model(args.model)
    model = loaded.model
    rows: list[dict[str, Any]] = []
    ctx = max(max(args.prompts) + 1, args.n_gen + 8, SPEC_PROMPT + args.spec_n + 80)
    plain = Engine(model, loaded.tokenizer, ctx_size=ctx)
    vocab = model.vocab_size
    print(f"[{args.label}] loaded {Path(args.model).name} in {time.perf_counter() - start:.1f} s", flush=True)

    for n in args.prompts:
        samples = []
        for rep in range(args.reps + 1):  # the first at this length is the warm-up
            sequence = plain.new_sequence()
            ids = random_ids(n, vocab, rep)
            sync()
            t0 = time.perf_counter()
            plain.prefill(sequence, ids)
            sync()
            samples.append(time.perf_counter() - t0)
            plain.release(sequence)
        seconds = statistics.median(samples[1:])
        rows.append({"test": f"pp{n}", "tokens_per_s": n / seconds, "samples_s": samples[1:]})
        print(f"[{args.label}] pp{n}: {n / seconds:.1f} tok/s", flush=True)
        # How long the host takes to queue one prefill pass (a pass whose GPU work is shorter than this is
        # host-bound): the forward call alone, before the device is waited for.
        issue = []
        for rep in range(args.reps + 1):
            sequence = plain.new_sequence()
            ids = torch.tensor(random_ids(n, vocab, 50 + rep))
            sync()
            t0 = time.perf_counter()
            model.forward(sequence.state, ids, last_only=True)
            issue.append(time.perf_counter() - t0)
            sync()
            plain.release(sequence)
        host_ms = statistics.median(issue[1:]) * 1e3
        rows.append({"test": f"pp{n} host issue (ms, lower is better)", "tokens_per_s": host_ms, "samples_s": issue[1:]})
        print(f"[{args.label}] pp{n} host issue: {host_ms:.2f} ms", flush=True)

    samples = []
    for rep in range(args.reps + 1):  # the first is the warm-up: records the windows the run crosses
        sequence = plain.new_sequence()
        ids = random_ids(args.n_gen + 2, vocab, 1000 + rep)
        for token in ids[:2]:
            model.forward(sequence.state, torch.tensor([token]))
        sync()
        t0 = time.perf_counter()
        for token in ids[2:]:
            model.forward(sequence.state, torch.tensor([token]))
            sync()
        samples.append(time.perf_counter() - t0)
        plain.release(sequence)
    seconds = statistics.median(samples[1:])
    rows.append({"test": f"tg{args.n_gen}", "tokens_per_s": args.n_gen / seconds, "samples_s": samples[1:]})
    print(f"[{args.label}] tg{args.n_gen}: {args.n_gen / seconds:.1f} tok/s", flush=True)

    if args.draft and not args.skip_spec:
        speculative = make_speculative(model, args.draft, args.budget)
        engine = Engine(model, loaded.tokenizer, ctx_size=ctx, speculative=speculative)
        greedy = SamplingParams(temperature=0)
        rates, lengths, exact = [], [], []
        for rep in range(args.reps + 1):  # the first is the untimed run at this row's shapes
            request = GenerationRequest(prompt_ids=random_ids(SPEC_PROMPT, vocab, 100 + rep), max_tokens=args.spec_n,
                                        sampling=greedy, ignore_eos=True)
            reference = plain.generate(attrs.evolve(request, max_tokens=args.spec_n + speculative.block_size)).token_ids
            result = engine.generate(attrs.evolve(request, force_accept=args.force, force_reference=reference))
            exact.append(result.token_ids == reference[: args.spec_n])
            if rep:
                rates.append(result.timings.decode_tokens_per_s)
                lengths += result.timings.accepted_lengths
        rows.append({"test": f"tg{args.spec_n} spec ddtree budget {args.budget} FORCED accept {args.force:g}",
                     "tokens_per_s": statistics.median(rates), "samples_tok_s": rates,
                     "mean_accepted_length": sum(lengths) / max(1, len(lengths)), "equals_plain_greedy": all(exact)})
        print(f"[{args.label}] spec FORCED {args.force:g}: {statistics.median(rates):.1f} tok/s, "
              f"{sum(lengths) / max(1, len(lengths)):.2f} per verify, equals plain greedy: {all(exact)}", flush=True)
    return {"label": args.label, "model": Path(args.model).name, "backend": loaded.backend_name,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": rows}


def table(paths: list[str]) -> str:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    tests = [row["test"] for row in runs[0]["rows"]]
    lines = ["| test | " + " | ".join(r["label"] for r in runs) + " | ratio |", "| --- |" + " ---: |" * (len(runs) + 1)]
    for test in tests:
        rates = [next((row["tokens_per_s"] for row in r["rows"] if row["test"] == test), float("nan")) for r in runs]
        cells = " | ".join(f"{rate:,.1f}" for rate in rates)
        lines.append(f"| {test} | {cells} | {rates[-1] / rates[0]:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "table":
        print(table(argv[1:]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("draft", nargs="?", help="DFlash draft GGUF (the speculative row)")
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--prompts", type=lambda t: [int(x) for x in t.split(",")], default=[512, 4096])
    parser.add_argument("--n-gen", type=int, default=128)
    parser.add_argument("--spec-n", type=int, default=256)
    parser.add_argument("--force", type=float, default=8.3)
    parser.add_argument("--budget", type=int, default=22)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-spec", action="store_true", help="no speculative row (the prefill and decode rows only)")
    args = parser.parse_args(argv)
    result = measure(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
