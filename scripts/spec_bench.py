"""Speculative decoding benchmark on synthetic files (issue #6): verify cost, draft cost, forced end-to-end speed.

    python3 scripts/spec_bench.py --size 27b --out DIR               # on the GPU (synthesizes what is missing)
    python3 scripts/spec_bench.py --size tiny --device cpu --out DIR # dry run of the logic on a CPU
    python3 scripts/spec_bench.py table DIR/spec_bench.json [--llama LLAMA_BENCH.json ...] [--md OUT.md]

A synthetic target (`lucebox_qwen35.synth`, Q4_K_M by default) and a synthetic DFlash drafter for it
(`lucebox synth --arch qwen35-dflash-draft --target FILE`). Random weights accept nothing, so:

(a) verify cost: one target pass over a candidate set of N nodes, for N in `--sizes`, after a
    `--prefill`-token prompt, for two shapes: a chain (parents -1, 0, 1, ...) and the DDTree the verifier
    would build from the drafter's real logits with budget N - 1. `model.verify` is timed, and
    `model.verify_static` too when the model has one (same arguments assumed).
(b) draft cost: one `drafter.draft` of a block, and the host work of building the DDTree from it.
(c) end to end, tg`--n-gen` after a `--prompt`-token random prompt, greedy, through the engine: plain
    decode; each spec type (chain, ddtree with `--budget`) unforced (random weights: about 1 token per
    step) and with `force_accept` K for K in `--force` (the first K drafts of every step are replaced by
    the target's own greedy continuation, so the real verifier accepts them). A forced figure is a
    benchmark of the verifier, never an acceptance rate: the tables say FORCED.

The forcing reference: by default (`--reference spec`) the output of one pass that forces every draft with
plain greedy's tokens. Speculative output is the target's greedy choice at every position whatever the
drafts, so that pass yields the verify path's own greedy continuation, and forcing then holds even where
the verify kernels (many rows) and the decode step (one row) round a near-tie differently; the pass
reports where the two parted. `--reference plain` uses plain greedy decoding directly, as `lucebox bench
--force-accept` does; where it differs from the verify path the forced acceptance collapses after that
point, which the tables show (requested vs measured tokens per verify).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import environment, llama_row, log, random_ids

VERIFY_SIZES = (1, 2, 4, 8, 16, 23, 32, 48, 64)
FORCED = (4.0, 8.3, 12.0)
SPEC_TYPES = ("chain", "ddtree")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], reps: int) -> list[float]:
    """Wall seconds of each of `reps` calls after one warm-up call, the device drained around each."""
    fn()
    samples = []
    for _ in range(reps):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        samples.append(time.perf_counter() - start)
    return samples


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# -- files -------------------------------------------------------------------------------------------------


def ensure_files(args: argparse.Namespace) -> tuple[Path, Path]:
    """The target and drafter GGUFs: given, or synthesized into --workdir (reused when already there)."""
    from lucebox_qwen35 import draft_synth, synth

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    target = Path(args.target) if args.target else workdir / f"qwen35-{args.size}-{args.type}.gguf"
    if not target.exists():
        start = time.perf_counter()
        synth.write(target, size=args.size, type=args.type, seed=0)
        log(f"wrote {target} in {time.perf_counter() - start:.1f} s (RANDOM WEIGHTS)")
    drafter_size = args.drafter_size or ("tiny" if args.size == "tiny" else "full")
    drafter = (Path(args.drafter) if args.drafter
               else workdir / f"qwen35-{args.size}-dflash-draft-{drafter_size}-{args.type}.gguf")
    if not drafter.exists():
        start = time.perf_counter()
        draft_synth.write(drafter, size=drafter_size, type=args.type, seed=1, target=target)
        log(f"wrote {drafter} in {time.perf_counter() - start:.1f} s (RANDOM WEIGHTS)")
    return target, drafter


# -- the measurements ---------------------------------------------------------------------------------------


class Results:
    """What the run measured so far; written out after every section (a run killed at its limit keeps it)."""

    def __init__(self, out: Path | None, header: dict) -> None:
        self.out = out
        self.data: dict[str, Any] = {"header": header, "setup": {}, "verify": [], "draft": {}, "e2e": [],
                                 "reference_passes": []}

    def save(self) -> None:
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "spec_bench.json").write_text(json.dumps(self.data, indent=1, default=str))
            (self.out / "spec_bench.md").write_text(markdown(self.data))


def engine_verify_path(model: Any) -> str:
    """Which of `verify_functions` the engine's speculative step takes (the model's defaults)."""
    parameters = inspect.signature(model.verify).parameters
    if "static" not in parameters:
        return "verify"
    return "static+graph" if getattr(model, "decode_graphs", False) else "dynamic"


def verify_functions(model: Any) -> dict[str, Callable]:
    """Every verify path the model offers, by name: with `static`/`graphs` switches (qwen35), the dynamic
    pass, the static-shape pass run eagerly, and (on a GPU) the static pass replayed as a CUDA graph; a
    model-level `verify_static`, if one appears, too. The engine uses the model's default."""
    parameters = inspect.signature(model.verify).parameters
    if "static" not in parameters:
        functions = {"verify": model.verify}
    else:
        functions = {"dynamic": functools.partial(model.verify, static=False)}
        if "graphs" in parameters:
            functions["static"] = functools.partial(model.verify, static=True, graphs=False)
            if getattr(model, "decode_graphs", False):
                functions["static+graph"] = functools.partial(model.verify, static=True, graphs=True)
        else:
            functions["static"] = functools.partial(model.verify, static=True)
    if callable(getattr(model, "verify_static", None)):
        functions["verify_static"] = model.verify_static
    return functions


def tree_shapes(root: int, draft_logits: Any, size: int, vocab: int) -> dict[str, tuple[list[int], list[int]]]:
    """A chain of `size` nodes and the DDTree of `size` nodes built from the drafter's logits."""
    from lucebox_core.speculative import trees

    chain_tokens = [root, *random_ids(size - 1, vocab, size)] if size > 1 else [root]
    shapes = {"chain": (chain_tokens, list(range(-1, size - 1)))}
    log_probs, ids = trees.top_k_log_probs(draft_logits, trees.DEFAULT_TOP_K)
    tree = trees.ddtree(root, log_probs, ids, size - 1)
    shapes["tree"] = (list(tree.tokens), list(tree.parents))
    return shapes


def tree_depth(parents: Sequence[int]) -> int:
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return max(depths)


def measure_verify_and_draft(loaded: Any, drafter: Any, results: Results, args: argparse.Namespace) -> None:
    """(a) and (b), on one sequence holding a `--prefill`-token prompt, features captured for the drafter."""
    from lucebox_core.engine import Engine
    from lucebox_core.speculative import SpeculativeDecoder, trees

    model = loaded.model
    decoder = SpeculativeDecoder(model, drafter, spec_type="ddtree", budget=args.budget)
    engine = Engine(model, loaded.tokenizer, ctx_size=args.prefill + max(args.sizes) + 8, speculative=decoder)
    sequence = engine.new_sequence()
    start = time.perf_counter()
    engine.prefill(sequence, random_ids(args.prefill, model.vocab_size, 11))
    log(f"prefill {args.prefill} tokens (first use: weight upload, compiles) {time.perf_counter() - start:.1f} s")
    state, root, block = sequence.state, random_ids(1, model.vocab_size, 12)[0], decoder.block_size
    draft_logits = drafter.draft(model, state, sequence.draft, [*sequence.tokens, root], block)  # also projects the prompt's features

    if "draft" not in args.skip:
        draft = timed(lambda: drafter.draft(model, state, sequence.draft, [*sequence.tokens, root], block), args.reps)

        def build_tree() -> None:
            log_probs, ids = trees.top_k_log_probs(draft_logits, trees.DEFAULT_TOP_K)
            trees.ddtree(root, log_probs, ids, args.budget)

        build = timed(build_tree, args.reps)
        results.data["draft"] = {"block": block, "draft_s": statistics.median(draft), "draft_samples_s": draft,
                                 "tree_build_s": statistics.median(build), "budget": args.budget}
        log(f"draft step (block {block}): {1e3 * statistics.median(draft):.2f} ms; ddtree build (budget "
            f"{args.budget}): {1e3 * statistics.median(build):.3f} ms")
        results.save()

    if "verify" in args.skip:
        return
    functions = verify_functions(model)
    log(f"verify functions: {', '.join(functions)}")
    for size in args.sizes:
        for shape, (tokens, parents) in tree_shapes(root, draft_logits, size, model.vocab_size).items():
            for name, verify in functions.items():
                row: dict[str, Any] = {"function": name, "shape": shape, "nodes": len(tokens),
                                       "depth": tree_depth(parents), "prefill": args.prefill}
                try:
                    samples = timed(lambda f=verify, t=tokens, p=parents: f(state, t, p), args.reps)
                except Exception as exc:  # a verify_static with other arguments, or a failure to report
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    log(f"  {name} {shape} {len(tokens)} nodes raised {row['error']}")
                else:
                    row.update({"seconds": statistics.median(samples), "samples_s": samples})
                    log(f"  {name} {shape:5s} {len(tokens):3d} nodes (depth {row['depth']:2d}): "
                        f"{1e3 * row['seconds']:.2f} ms")
                results.data["verify"].append(row)
        results.save()
    assert state.length == args.prefill, "verify must not commit anything"


def forced_lengths(k: float, n_gen: int) -> list[int]:
    """Tokens each verify step yields when forcing `k` holds: the forced drafts plus the bonus, per step,
    until `n_gen` tokens are out. The first token comes from the prompt's logits, before any verify; the
    engine records a step's whole block even where it stops inside it."""
    from lucebox_core.speculative import forced_accept_counts

    lengths: list[int] = []
    for count in forced_accept_counts(k):
        if 1 + sum(lengths) >= n_gen:
            return lengths
        lengths.append(count + 1)
    return lengths


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure_end_to_end(loaded: Any, drafter: Any, results: Results, args: argparse.Namespace) -> None:
    """(c): plain decode, then per spec type unforced and each forced K, through `Engine.generate`."""
    import attrs

    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams
    from lucebox_core.speculative import SpeculativeDecoder

    model = loaded.model
    greedy = SamplingParams(temperature=0)
    block = drafter.block_size
    ctx = args.prompt + args.n_gen + 2 * block + 8
    prompts = [random_ids(args.prompt, model.vocab_size, 100 + rep) for rep in range(args.e2e_reps)]
    # One block past the end, so the last step can be forced like the others.
    requests = [GenerationRequest(prompt_ids=p, max_tokens=args.n_gen + block, sampling=greedy, ignore_eos=True)
                for p in prompts]

    plain_engine = Engine(model, loaded.tokenizer, ctx_size=ctx)
    plain_engine.generate(attrs.evolve(requests[0], max_tokens=4))  # warm-up (records the decode graphs)
    plain = [plain_engine.generate(request) for request in requests]
    plain_rates = [p.timings.decode_tokens_per_s for p in plain]
    results.data["e2e"].append({"decoder": "plain", "tok_s": statistics.median(plain_rates), "samples": plain_rates,
                                "tokens": args.n_gen + block})
    log(f"plain decode: {statistics.median(plain_rates):.1f} tok/s")
    results.save()

    for spec_type in args.spec_types:
        decoder = SpeculativeDecoder(model, drafter, spec_type=spec_type, budget=args.budget)
        engine = Engine(model, loaded.tokenizer, ctx_size=ctx, speculative=decoder)
        nodes = block if spec_type == "chain" else args.budget + 1
        label = spec_type + (f" budget {args.budget}" if spec_type == "ddtree" else "")
        engine.generate(attrs.evolve(requests[0], max_tokens=2))  # warm-up: two verify steps
        references = [list(p.token_ids) for p in plain]

        def summary(runs: list) -> tuple[list[float], float]:
            lengths = [x for r in runs for x in r.timings.accepted_lengths]
            return [r.timings.decode_tokens_per_s for r in runs], sum(lengths) / max(1, len(lengths))

        if args.reference == "spec":
            # One pass forcing every draft with plain greedy's tokens: its output is the verify path's own greedy
            # continuation (speculative output is the target's greedy whatever the drafts), the reference that
            # forcing can then hold to. Where it differs from plain greedy, the two paths part at a near-tie.
            passes = [engine.generate(attrs.evolve(request, force_accept=block - 1, force_reference=reference))
                      for request, reference in zip(requests, references)]
            _, per_verify = summary(passes)
            diverged = [first_difference(r.token_ids, ref) for r, ref in zip(passes, references)]
            results.data["reference_passes"].append({"spec_type": spec_type, "force_accept": block - 1,
                                                     "tokens_per_verify": per_verify,
                                                     "lengths": [list(r.timings.accepted_lengths) for r in passes],
                                                     "plain_greedy_first_difference": diverged})
            log(f"{label} reference pass: {per_verify:.2f} tokens per verify; verify-path greedy parts from plain "
                f"greedy at {diverged} (None: never)")
            references = [list(r.token_ids) for r in passes]
        if args.unforced:
            unforced = [engine.generate(request) for request in requests]
            rates, per_verify = summary(unforced)
            diverged = [first_difference(u.token_ids, p.token_ids) for u, p in zip(unforced, plain)]
            results.data["e2e"].append({
                "decoder": label, "spec_type": spec_type, "nodes": nodes, "force_accept": None,
                "tok_s": statistics.median(rates), "samples": rates, "tokens": args.n_gen + block,
                "tokens_per_verify": per_verify, "plain_greedy_first_difference": diverged,
            })
            log(f"{label} unforced: {statistics.median(rates):.1f} tok/s, {per_verify:.2f} tokens per verify; "
                f"first difference from plain greedy {diverged}")
        results.save()
        for k in args.force:
            runs = [engine.generate(attrs.evolve(request, max_tokens=args.n_gen, force_accept=k,
                                                 force_reference=reference))
                    for request, reference in zip(requests, references)]
            rates, per_verify = summary(runs)
            lengths = [x for r in runs for x in r.timings.accepted_lengths]
            expected = forced_lengths(k, args.n_gen)
            row = {
                "decoder": label, "spec_type": spec_type, "nodes": nodes, "force_accept": k,
                "reference": args.reference, "tok_s": statistics.median(rates), "samples": rates,
                "tokens": args.n_gen, "tokens_per_verify": per_verify, "verify_steps": len(lengths) / len(runs),
                "forcing_held": all(list(r.timings.accepted_lengths) == expected for r in runs),
                "matches_reference": [r.token_ids == ref[: args.n_gen] for r, ref in zip(runs, references)],
            }
            results.data["e2e"].append(row)
            log(f"{label} FORCED {k:g}: {row['tok_s']:.1f} tok/s, {per_verify:.2f} tokens per verify "
                f"({'held' if row['forcing_held'] else 'FORCING DID NOT HOLD'}), output = reference "
                f"{row['matches_reference']}")
            results.save()


def run(args: argparse.Namespace) -> int:
    from lucebox_core.assembly import load_drafter
    from lucebox_core.loading import load_model

    results = Results(Path(args.out) if args.out else None, environment(part="spec", measure_copy=False))
    target, drafter_path = ensure_files(args)
    start = time.perf_counter()
    loaded = load_model(target, backend=args.backend, device=args.device)
    drafter = load_drafter(str(drafter_path), loaded.model, loaded.backend)  # chosen by the file's architecture
    results.data["setup"] = {
        "target": target.name, "drafter": drafter_path.name, "backend": loaded.backend_name,
        "ops": repr(loaded.model.ops), "activations": str(loaded.model.ops.dtype).removeprefix("torch."),
        "drafter_config": repr(drafter), "block": drafter.block_size, "budget": args.budget,
        "prefill": args.prefill, "prompt": args.prompt, "n_gen": args.n_gen, "reps": args.reps,
        "e2e_reps": args.e2e_reps, "reference": args.reference, "unforced": args.unforced,
        "engine_verify": engine_verify_path(loaded.model),
    }
    log(f"loaded {target.name} ({loaded.backend_name}) and {drafter!r} in {time.perf_counter() - start:.1f} s")
    results.save()
    if not {"verify", "draft"} <= set(args.skip):
        measure_verify_and_draft(loaded, drafter, results, args)
    if "e2e" not in args.skip:
        measure_end_to_end(loaded, drafter, results, args)
    results.save()
    if args.out:
        print((Path(args.out) / "spec_bench.md").read_text())
    return 0


# -- the report ---------------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return f"{1e3 * seconds:.2f}" if seconds is not None else "–"


def _verify_seconds(data: dict, shape: str, nodes: int, function: str = "verify") -> float | None:
    """Measured verify time at `nodes` (linear between measured sizes)."""
    points = sorted((r["nodes"], r["seconds"]) for r in data["verify"]
                    if r["shape"] == shape and r["function"] == function and "seconds" in r)
    for (n0, t0), (n1, t1) in itertools.pairwise(points):
        if n0 <= nodes <= n1:
            return t0 if n1 == n0 else t0 + (t1 - t0) * (nodes - n0) / (n1 - n0)
    exact = [t for n, t in points if n == nodes]
    return exact[0] if exact else None


def markdown(data: dict) -> str:
    header, setup = data["header"], data.get("setup", {})
    lines = ["## Speculative decoding, synthetic files (random weights: nothing is accepted unless FORCED)", "",
             f"- {header.get('date_utc')}, {header.get('gpu')} (driver {header.get('driver')}), torch "
             f"{header.get('torch')} / CUDA {header.get('cuda')}, Lucebox `{header.get('commit')}`",
             f"- target `{setup.get('target')}`, drafter `{setup.get('drafter')}` (block {setup.get('block')}); "
             f"backend {setup.get('backend')}, {setup.get('activations')} activations; the engine verifies "
             f"through `{setup.get('engine_verify')}`",
             "- A FORCED figure benchmarks the verifier with the drafts replaced by the target's own greedy tokens;"
             " it is never an acceptance rate.", ""]
    order = ("verify", "dynamic", "static", "static+graph", "verify_static")
    functions = sorted({r["function"] for r in data["verify"]}, key=lambda f: (order.index(f) if f in order else 9, f))
    if data["verify"]:
        lines += [f"### (a) Verify cost per step against candidate count (after a {setup.get('prefill')}-token "
                  "prefill; ms, median)", ""]
        columns = [f"{shape} {function}" for function in functions for shape in ("chain", "tree")]
        lines += ["| nodes | " + " | ".join(f"{c} ms" for c in columns) + " | tree depth | tree ms per node |",
                  "| ---: | " + " | ".join("---:" for _ in columns) + " | ---: | ---: |"]
        for nodes in sorted({r["nodes"] for r in data["verify"]}):
            cells, depth, per_node = [], "–", "–"
            for function in functions:
                for shape in ("chain", "tree"):
                    row = next((r for r in data["verify"] if (r["nodes"], r["shape"], r["function"]) ==
                                (nodes, shape, function)), None)
                    cells.append("error" if row and "error" in row else _ms(row.get("seconds") if row else None))
                    if row and shape == "tree" and function == functions[0]:
                        depth = str(row["depth"])
                        per_node = _ms(row["seconds"] / nodes) if "seconds" in row else "–"
            lines.append(f"| {nodes} | " + " | ".join(cells) + f" | {depth} | {per_node} |")
        lines.append("")
    draft = data.get("draft") or {}
    if draft:
        lines += ["### (b) Draft cost per step", "", "| draft of one block (ms) | DDTree build on the host (ms) |",
                  "| ---: | ---: |", f"| {_ms(draft['draft_s'])} (block {draft['block']}) | "
                  f"{_ms(draft['tree_build_s'])} (budget {draft['budget']}) |", ""]
    if data["e2e"]:
        plain = next((r for r in data["e2e"] if r["decoder"] == "plain"), None)
        lines += [f"### (c) End to end: tg{setup.get('n_gen')} after a {setup.get('prompt')}-token prompt, greedy "
                  f"(forcing reference: {setup.get('reference')})", "",
                  "| decoder | drafts forced per step | tokens per verify (measured) | tok/s | vs plain | "
                  "predicted from (a)+(b) | output = reference |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for row in data["e2e"]:
            ratio = f"{row['tok_s'] / plain['tok_s']:.2f}x" if plain and plain["tok_s"] else "–"
            if row["decoder"] in ("plain", "llama.cpp"):
                lines.append(f"| {row['decoder']} decode | – | 1 | {row['tok_s']:,.1f} | {ratio} | | |")
                continue
            forced = row.get("force_accept")
            per_verify = row.get("tokens_per_verify", 0.0)
            predicted = "–"
            verify_s = _verify_seconds(data, "chain" if row["spec_type"] == "chain" else "tree", row["nodes"],
                                       setup.get("engine_verify", functions[0] if functions else "verify"))
            if verify_s is not None and draft:
                predicted = f"{per_verify / (verify_s + draft['draft_s']):,.1f}"
            held = "" if forced is None or row.get("forcing_held") else " (forcing did NOT hold)"
            matches = row.get("matches_reference")
            lines.append(
                f"| {row['decoder']} | {'FORCED ' + format(forced, 'g') if forced is not None else 'unforced'} "
                f"| {per_verify:.2f}{held} | {row['tok_s']:,.1f} | {ratio} | {predicted} | "
                f"{'–' if matches is None else ('yes' if all(matches) else 'NO ' + str(matches))} |")
        lines.append("")
        for reference in data.get("reference_passes", []):
            parted = reference["plain_greedy_first_difference"]
            lines.append(f"- Reference pass, {reference['spec_type']} (every draft forced to plain greedy's token): "
                         f"{reference['tokens_per_verify']:.2f} tokens per verify; the verify path's greedy "
                         + ("equals plain greedy." if all(d is None for d in parted) else
                            f"parts from plain greedy at token {parted} (a near-tie rounded differently)."))
        lines.append("")
    return "\n".join(lines)


def cmd_table(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="spec_bench.py table")
    parser.add_argument("result")
    parser.add_argument("--llama", nargs="*", default=[], help="llama-bench -o json files: their plain tg rows")
    parser.add_argument("--md")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.result).read_text())
    target = Path(data.get("setup", {}).get("target", "")).stem
    for path in args.llama:
        if not Path(path).is_file():
            log(f"(no {path}: no llama.cpp row)")
            continue
        text = Path(path).read_text().strip()
        try:
            records = json.loads(text[text.index("["):]) if text else []
        except ValueError:
            log(f"(skipped {path}: not llama-bench JSON)")
            continue
        for record in records:
            row = llama_row(record)
            if row["model"] == target and row["n_gen"] and not row["n_depth"]:
                data["e2e"].insert(1, {"decoder": "llama.cpp", "tok_s": row["tokens_per_s"], "test": row["test"],
                                       "build_commit": row["build_commit"]})
    text = markdown(data)
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="27b", help="target size: tiny, 0.8b, 27b")
    parser.add_argument("--type", default="q4_k_m", help="GGUF type of target and drafter")
    parser.add_argument("--target", help="target GGUF (default: synthesized into --workdir)")
    parser.add_argument("--drafter", help="drafter GGUF (default: synthesized into --workdir)")
    parser.add_argument("--drafter-size", choices=("tiny", "full"), help="default: tiny for a tiny target, else full")
    parser.add_argument("--workdir", default="/tmp/w")
    parser.add_argument("--backend", help="kernel backend (default: cuda when a GPU is present)")
    parser.add_argument("--device", help="torch device, e.g. cpu")
    parser.add_argument("--prefill", type=int, default=1024, help="prompt before (a) and (b)")
    parser.add_argument("--sizes", type=_ints, default=list(VERIFY_SIZES), help="candidate counts for (a)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions for (a) and (b)")
    parser.add_argument("--budget", type=int, default=22, help="DDTree node budget")
    parser.add_argument("--spec-types", type=lambda t: t.split(","), default=list(SPEC_TYPES))
    parser.add_argument("--force", type=_floats, default=list(FORCED), help="forced accepted drafts per step")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens before (c)")
    parser.add_argument("-n", "--n-gen", type=int, default=128, help="tokens generated in (c)")
    parser.add_argument("--e2e-reps", type=int, default=2, help="prompts (repetitions) in (c)")
    parser.add_argument("--reference", choices=("spec", "plain"), default="spec",
                        help="forcing reference: the verify path's own greedy tokens (spec) or plain decoding's")
    parser.add_argument("--unforced", action="store_true",
                        help="also time each spec type unforced (random weights: ~1 token per verify; slow)")
    parser.add_argument("--skip", type=lambda t: t.split(","), default=[], help="comma list of: verify, draft, e2e")
    parser.add_argument("--out", help="folder for spec_bench.json and spec_bench.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"]:
        return cmd_table(argv[1:])
    args = build_parser().parse_args(argv)
    if args.backend is None and args.device is None:
        import torch

        args.backend = "cuda" if torch.cuda.is_available() else None
    if max(args.force, default=0) >= 16:
        raise SystemExit("--force values must stay below the drafter's block (16 positions: at most 15 drafts)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
