"""Check the multi-device code path on a GPU machine (issue #19): greedy tokens of one model run
(a) on one device, (b) with its layers split into two and three parts (`--target-devices DEV,DEV`: on a
one-GPU machine every part on the same GPU: the path two GPUs take, a graph recorded per part and the hidden
state handed over between the replays), (c) speculatively, split too, with the drafter on `--draft-device`
(the GPU, then the CPU),
and, where the machine has two GPUs, (d) split over cuda:0,cuda:1; every run must give run (a)'s tokens
exactly. Prints tok/s per run, how each run's decode step ran (`step`: "graph", "graph per part", ...), the
split's cost per token against run (a) (`split_cost`: the hand-over and a replay per part instead of one),
and one JSON line; exit 1 on a mismatch, or when a split on a GPU did not record a graph per part.

    python3 scripts/multi_device_check.py                      # synthetic 0.8B-sized qwen35 (q8_0), drafter
    python3 scripts/multi_device_check.py --size tiny --tokens 32
    python3 scripts/multi_device_check.py -m MODEL.gguf -md DRAFT.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import attrs


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def synthetic_pair(folder: Path, size: str, type: str) -> tuple[str, str]:
    from lucebox_qwen35 import draft_synth, synth

    target = synth.write(folder / f"qwen35-{size}-{type}.gguf", size=size, type=type, seed=7)
    draft = draft_synth.write(folder / "draft.gguf", size="tiny", type="f16" if type != "f32" else "f32", seed=8,
                              target=target)
    return str(target), str(draft)


def run(label: str, model: str, prompt: list[int], tokens: int, repeats: int = 3, **flags) -> dict:
    import torch

    from lucebox_core.assembly import EngineOptions, build_engine
    from lucebox_core.engine import GenerationRequest
    from lucebox_core.sampling import SamplingParams

    assembled = build_engine(EngineOptions(model=model, ctx_size=max(1024, len(prompt) + tokens + 64), **flags))
    request = GenerationRequest(prompt_ids=prompt, max_tokens=tokens, ignore_eos=True,
                                sampling=SamplingParams(temperature=0))
    assembled.engine.generate(attrs.evolve(request, max_tokens=4))  # warm-up: kernels compile, graphs record
    times, result = [], None
    for _ in range(repeats):  # the best of a few runs: the first of them still records the later windows
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        again = assembled.engine.generate(request)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if result is not None and again.token_ids != result.token_ids:
            raise SystemExit(f"{label}: a repeat gave other tokens than the first run")
        result = again
    seconds = min(times)
    model_ = assembled.loaded.model
    device_map = getattr(model_, "device_map", None)
    from lucebox_core.split_step import SplitStaticStep, step_mode

    row = {
        "run": label, "flags": flags, "tokens": result.token_ids, "seconds": round(seconds, 3),
        "tok_s": round(len(result.token_ids) / seconds, 1),
        "ms_per_token": round(1000 * seconds / max(1, len(result.token_ids)), 3),
        "decode_graphs": bool(getattr(model_, "decode_graphs", False)), "step": step_mode(model_),
        "device_map": device_map.describe() if device_map is not None else None,
    }
    # What the sequence's steps really recorded (a part whose recording failed runs eagerly from then on):
    # plain decoding's decode step, speculative decoding's verify pass.
    for name in ("decode", "verify"):
        steps = [getattr(seq.state, name, None) for seq in assembled.engine._idle]
        step = next((s for s in steps if s is not None), None)
        if step is None:
            continue
        split = isinstance(step, SplitStaticStep)
        row[f"{name}_recordings"] = [len(part) for part in step.steps] if split else [len(step)]
        if split:
            row[f"{name}_graphed_parts"] = step.graphed_parts
    recordings = row.get("decode_recordings") or row.get("verify_recordings")
    parts = "" if device_map is None else device_map.describe()["parts"]
    log(f"{label:<38} {row['tok_s']:>8} tok/s  {row['ms_per_token']:>7} ms/token  step={row['step']}  "
        f"recordings={recordings}  {parts}")
    del assembled
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", help="target GGUF (default: a synthetic qwen35 of --size)")
    parser.add_argument("-md", "--model-draft", help="drafter GGUF (default: a synthetic one for the target)")
    parser.add_argument("--size", default="0.8b", help="synthetic target size: tiny or 0.8b (default)")
    parser.add_argument("--type", default="q8_0", help="synthetic target type (default q8_0)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per run (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration, the best kept (3)")
    parser.add_argument("--device", default=None, help="the GPU (default cuda:0, else cpu)")
    parser.add_argument("--no-cpu-draft", action="store_true", help="skip the run with the drafter on the CPU")
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    folder = Path(tempfile.mkdtemp(prefix="lucebox-multi-device-"))
    if args.model is None:
        log(f"writing a synthetic {args.size} {args.type} qwen35 and a drafter in {folder} (RANDOM WEIGHTS)")
        model, draft = synthetic_pair(folder, args.size, args.type)
    else:
        model, draft = args.model, args.model_draft
    prompt = [(i * 7919) % 5000 + 100 for i in range(48)]

    runs = [("a: one device", {"target_device": device}),
            ("b: split in two parts on one device", {"target_devices": f"{device},{device}",
                                                      "target_layer_split": "0.5,0.5"}),
            ("b: split in three parts on one device", {"target_devices": f"{device},{device},{device}"})]
    if draft is not None:
        runs += [("c: drafter, one device", {"target_device": device, "model_draft": draft}),
                 ("c: drafter on --draft-device, split", {"target_devices": f"{device},{device}",
                                                          "model_draft": draft, "draft_device": device}),
                 # Three parts: the first part's taps for the drafter pass the middle one to reach the head's.
                 ("c: drafter, split in three parts", {"target_devices": f"{device},{device},{device}",
                                                       "model_draft": draft})]
        if device != "cpu" and not args.no_cpu_draft:
            runs.append(("c: drafter on --draft-device cpu", {"target_device": device, "model_draft": draft,
                                                               "draft_device": "cpu"}))
    if torch.cuda.device_count() >= 2:
        runs.append(("d: split over cuda:0,cuda:1", {"target_devices": "cuda:0,cuda:1",
                                                     "target_layer_split": "0.5,0.5"}))
    rows = [run(label, model, prompt, args.tokens, max(1, args.repeats), **flags) for label, flags in runs]
    reference = rows[0]["tokens"]
    mismatches = [row["run"] for row in rows if row["tokens"] != reference]
    for row in rows:
        row["identical"] = row["tokens"] == reference
        del row["tokens"]
    # The split's price per token against the one-device run: the hand-over copies and a replay per part.
    split_cost = {row["run"]: {"ms_per_token": round(row["ms_per_token"] - rows[0]["ms_per_token"], 3),
                               "tok_s_ratio": round(row["tok_s"] / rows[0]["tok_s"], 3)}
                  for row in rows[1:] if "model_draft" not in row["flags"] and row["device_map"] is not None}
    # On a GPU a split must record a graph per part (the path of two GPUs), not fall back to eager steps.
    ungraphed = [row["run"] for row in rows if device != "cpu" and row["device_map"] is not None and not all(
        row.get("verify_graphed_parts" if "model_draft" in row["flags"] else "decode_graphed_parts") or [False])]
    print(json.dumps({"model": model, "device": device, "tokens": args.tokens, "runs": rows,
                      "split_cost": split_cost, "identical": not mismatches, "ungraphed_splits": ungraphed}))
    if mismatches:
        log(f"MISMATCH: {', '.join(mismatches)} differ from the one-device run")
    if ungraphed:
        log(f"NOT GRAPHED PER PART: {', '.join(ungraphed)}")
    if mismatches or ungraphed:
        return 1
    log(f"all {len(rows)} runs gave the one-device run's {len(reference)} tokens; split cost {split_cost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
