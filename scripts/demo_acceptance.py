"""Real acceptance of the demo pair (issue #22, item 3): greedy decoding of held-out stdlib functions, plain and
speculative, with the trained drafter and with a random one.

    python3 scripts/demo_acceptance.py --target T.gguf --draft D.gguf --out acceptance.json            # CPU
    python3 scripts/demo_acceptance.py --target T.gguf --draft D.gguf --device cuda --out acc-h200.json

Prompts: held-out functions (the target's `lucebox.train.heldout_files`, found in this machine's stdlib), each
cut after its signature and docstring, as a user would write them before asking for the body. Every prompt is
generated greedily (`-n` tokens, stopping at an end-of-generation token) through Lucebox's engine, as `lucebox
generate` runs it: plain; `chain`; `ddtree` with budget 22; `ddtree` with `--tree-budget auto`; each
speculative mode with the trained drafter and with a random drafter of Lucebox's `full` draft shape for this
target (`lucebox synth --arch qwen35-dflash-draft --target T`), unless `--random-draft` names one.

Per mode: the mean accepted length (tokens per verify step: accepted drafts + the bonus, pooled over prompts),
decode tok/s (pooled: all tokens over all decode seconds), the speed-up over plain, and for each prompt whether
the output equals plain greedy (with the first position where it differs). Each engine generates once before
it is timed (a GPU records its graphs then).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_corpus  # noqa: E402

MODES = ("plain", "chain", "ddtree", "ddtree-auto")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def heldout_files(gguf_file: Any) -> list[str]:
    files = gguf_file.get("lucebox.train.heldout_files", list, default=None)
    if not files:
        raise SystemExit(f"error: {gguf_file.path} has no lucebox.train.heldout_files: not a demo target "
                         "written by scripts/train_demo.py")
    return [str(f) for f in files]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def random_drafter_file(target: Path, folder: Path) -> Path:
    from lucebox_qwen35 import draft_synth

    return draft_synth.write(folder / "random-dflash-draft.gguf", size="full", type="q8_0", seed=0, target=target)


def run_mode(engine: Any, requests: list, plain: list | None) -> dict:
    from lucebox_core.engine import GenerationRequest

    import attrs

    engine.generate(attrs.evolve(requests[0], max_tokens=8))  # warm-up: on a GPU, the graphs are recorded here
    per_prompt = []
    tokens = seconds = 0.0
    lengths: list[int] = []
    for i, request in enumerate(requests):
        assert isinstance(request, GenerationRequest)
        result = engine.generate(request)
        ids = list(result.token_ids)
        tokens += result.timings.decode_tokens
        seconds += result.timings.decode_seconds
        lengths += list(result.timings.accepted_lengths)
        row = {"tokens": len(ids), "decode_tok_s": result.timings.decode_tokens_per_s,
               "mean_accepted_length": result.timings.mean_accepted_length, "token_ids": ids}
        if plain is not None:
            row["equals_plain"] = ids == plain[i]["token_ids"]
            row["first_difference"] = first_difference(ids, plain[i]["token_ids"])
        per_prompt.append(row)
    summary = {"decode_tok_s": tokens / seconds if seconds else 0.0, "decode_tokens": int(tokens),
               "decode_seconds": seconds, "verify_steps": len(lengths),
               "mean_accepted_length": sum(lengths) / len(lengths) if lengths else None, "prompts": per_prompt}
    if plain is not None:
        summary["all_equal_plain"] = all(r["equals_plain"] for r in per_prompt)
    return summary


def run(args: argparse.Namespace, scratch: contextlib.ExitStack) -> dict:
    from lucebox_core.assembly import load_drafter
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.loading import load_model
    from lucebox_core.sampling import SamplingParams
    from lucebox_core.speculative import SpeculativeDecoder

    loaded = load_model(args.target, backend=args.backend, device=args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    files = args.files or heldout_files(loaded.gguf)
    root = demo_corpus.stdlib_root()
    prompts = demo_corpus.function_prompts(root, files, args.prompts)
    present = sum((root / f).is_file() for f in files)
    log(f"{len(prompts)} prompts from {present} of the {len(files)} held-out files found under {root}")
    if not prompts:
        raise SystemExit("error: no held-out function found on this machine")
    greedy = SamplingParams(temperature=0)
    requests = [GenerationRequest(prompt_ids=tokenizer.encode(p.prompt, add_bos=False), max_tokens=args.n_predict,
                                  sampling=greedy) for p in prompts]
    ctx = max(len(r.prompt_ids) for r in requests) + args.n_predict + 128
    drafters = {"trained": load_drafter(str(args.draft), model, loaded.backend)}
    if not args.skip_random:
        if args.random_draft:
            path = Path(args.random_draft)
        else:  # kept for the run: the loaded drafter maps the file
            path = random_drafter_file(Path(args.target), Path(scratch.enter_context(tempfile.TemporaryDirectory())))
        drafters["random"] = load_drafter(str(path), model, loaded.backend)

    results: dict[str, Any] = {
        "target": str(args.target), "draft": str(args.draft), "backend": loaded.backend_name,
        "device": str(model.ops.device), "activations": str(model.ops.dtype).removeprefix("torch."),
        "n_predict": args.n_predict, "python": platform.python_version(),
        "prompts": [{"file": p.file, "function": p.name, "line": p.line, "prompt_tokens": len(r.prompt_ids)}
                    for p, r in zip(prompts, requests)],
        "modes": {},
    }
    start = time.perf_counter()
    plain = run_mode(Engine(model, tokenizer, ctx_size=ctx), requests, None)
    results["modes"]["plain"] = plain
    log(f"plain: {plain['decode_tok_s']:.1f} tok/s ({time.perf_counter() - start:.0f} s)")
    for drafter_name, drafter in drafters.items():
        for mode in args.modes:
            if mode == "plain":
                continue
            spec_type, budget = ("chain", 22) if mode == "chain" else ("ddtree", "auto" if mode == "ddtree-auto" else 22)
            decoder = SpeculativeDecoder(model, drafter, spec_type, budget=budget)
            summary = run_mode(Engine(model, tokenizer, ctx_size=ctx, speculative=decoder), requests, plain["prompts"])
            summary["speedup"] = summary["decode_tok_s"] / plain["decode_tok_s"] if plain["decode_tok_s"] else None
            results["modes"][f"{mode} ({drafter_name} drafter)"] = summary
            log(f"{mode} ({drafter_name} drafter): mean accepted length {summary['mean_accepted_length']:.2f}, "
                f"{summary['decode_tok_s']:.1f} tok/s ({summary['speedup']:.2f}x), "
                f"output = plain greedy: {summary['all_equal_plain']}")
    return results


def markdown(results: dict) -> str:
    lines = [f"Greedy, {len(results['prompts'])} held-out stdlib functions (signature + docstring), "
             f"-n {results['n_predict']}, {results['backend']} on {results['device']} ({results['activations']})", "",
             "| mode | mean accepted length | decode tok/s | speed-up | output = plain |",
             "| --- | ---: | ---: | ---: | --- |"]
    for name, m in results["modes"].items():
        accepted = "-" if m["mean_accepted_length"] is None else f"{m['mean_accepted_length']:.2f}"
        speedup = "1.00x" if name == "plain" else f"{m['speedup']:.2f}x"
        equal = "-" if name == "plain" else ("yes" if m["all_equal_plain"] else "NO")
        lines.append(f"| {name} | {accepted} | {m['decode_tok_s']:.1f} | {speedup} | {equal} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, type=Path)
    p.add_argument("--draft", required=True, type=Path)
    p.add_argument("--random-draft", help="a random drafter to compare with (default: one synthesized for the target)")
    p.add_argument("--skip-random", action="store_true", help="measure the trained drafter only")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--files", type=lambda s: [f for f in s.split(",") if f],
                   help="stdlib files (relative paths) to take functions from instead of the held-out ones")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(MODES))
    p.add_argument("--backend")
    p.add_argument("--device")
    p.add_argument("--out", type=Path, help="write the results as JSON here (and a .md table beside)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = set(args.modes) - set(MODES)
    if unknown:
        raise SystemExit(f"error: unknown --modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    with contextlib.ExitStack() as scratch:
        results = run(args, scratch)
    table = markdown(results)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
