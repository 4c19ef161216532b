"""Recorded prefill pieces on a GPU: the same logits and state as eager pieces, and what a piece costs each way.

    python3 scripts/recorded_prefill_check.py MODEL.gguf [--pieces 512,300,512,37] [--timed 512,300,128,64]
        [--reps 5] [--json FILE]

Correctness: the pieces run one after another on two states of one model, eagerly (`model.recorded_prefill`
off) and recorded (each piece's first run: the warm-up of its recording), then again on the emptied recorded
state (replays); each piece's last logits are compared with the eager ones (largest difference relative to the
logits' spread, the argmax), then the Gated DeltaNet states and the KV rows. Timing: a prefill of each `--timed`
length from an empty state, synchronised, after a warm-up at its own length (which records), eager against
recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _timed(model: Any, state: Any, ids: torch.Tensor, recorded: bool, reps: int) -> list[float]:
    model.recorded_prefill = recorded
    synchronize = model.ops.synchronize
    seconds = []
    for rep in range(reps + 1):  # the first: the warm-up at this length (compiles, records)
        model.reset_state(state)
        synchronize()
        start = time.perf_counter()
        model.forward(state, ids, last_only=True)
        synchronize()
        if rep:
            seconds.append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--pieces", default="512,300,512,37")
    parser.add_argument("--timed", default="512,300,128,64")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--without-graphs", action="store_true",
                        help="take the recorded path where graphs are off too (the CPU): its step then runs eagerly")
    parser.add_argument("--eager-step", action="store_true",
                        help="run the recorded path's padded step without recording it (graphs off, also on a GPU): "
                             "tells what the recording changes from what the padded step computes")
    args = parser.parse_args(argv)

    from lucebox_core.loading import load_model

    model = load_model(args.model).model
    if args.eager_step and hasattr(model, "recorded_prefill"):
        model.decode_graphs = False  # the states made below run their pieces' steps eagerly
    if (args.without_graphs or args.eager_step) and hasattr(model, "recorded_prefill"):
        model.recorded_prefill = True
    if not getattr(model, "recorded_prefill", False):
        print(f"{type(model).__name__} offers no recorded prefill here")
        return 2
    pieces = [int(p) for p in args.pieces.split(",")]
    ids = torch.randint(0, model.vocab_size, (sum(pieces) + 1,), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.ops.device)
    report: dict[str, Any] = {"model": Path(args.model).name, "pieces": [], "timing": []}
    eager_state, recorded_state = model.new_state(args.ctx), model.new_state(args.ctx)
    begin, eager_logits = 0, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for piece in pieces:  # each piece's first run at its (bucket, window): the warm-up, then the recording
            chunk = ids[begin:begin + piece]
            model.recorded_prefill = False
            eager = model.forward(eager_state, chunk, last_only=True)
            eager_logits.append(eager.clone())
            model.recorded_prefill = True
            recorded = model.forward(recorded_state, chunk, last_only=True)
            row = {"piece": piece, "start": begin, "relative_max_diff": _relative(recorded, eager),
                   "argmax_equal": bool(recorded.argmax() == eager.argmax())}
            print("piece", row)
            report["pieces"].append(row)
            begin += piece
        # The same pieces again on the emptied state: every one a replay of its recording.
        model.reset_state(recorded_state)
        begin = 0
        for piece, eager in zip(pieces, eager_logits):
            replayed = model.forward(recorded_state, ids[begin:begin + piece], last_only=True)
            row = {"piece": piece, "start": begin, "replay": True, "relative_max_diff": _relative(replayed, eager),
                   "argmax_equal": bool(replayed.argmax() == eager.argmax())}
            print("replayed piece", row)
            report["pieces"].append(row)
            begin += piece
    report["warnings"] = [str(w.message) for w in caught]
    report["failure"] = recorded_state.prefill.failure if recorded_state.prefill is not None else "never ran"
    report["recordings"] = len(recorded_state.prefill or ())
    recurrent = max(_relative(recorded_state.linear[i].recurrent, s.recurrent) for i, s in eager_state.linear.items())
    conv = max(_relative(recorded_state.linear[i].conv, s.conv) for i, s in eager_state.linear.items())
    kv = max(_relative(mine, theirs) for layer in model.layers if layer.self_attn is not None
             for mine, theirs in zip(recorded_state.kv.read(layer.index), eager_state.kv.read(layer.index)))
    report["state_relative_max_diff"] = {"recurrent": recurrent, "conv": conv, "kv": kv}
    print("state", report["state_relative_max_diff"], "recordings", report["recordings"], "failure", report["failure"])
    for warning in report["warnings"]:
        print("warning:", warning)

    state = model.new_state(args.ctx)
    for tokens in (int(t) for t in args.timed.split(",")):
        piece = ids[:tokens]
        for recorded in (False, True):
            seconds = _timed(model, state, piece, recorded, args.reps)
            median = statistics.median(seconds)
            row = {"tokens": tokens, "recorded": recorded, "median_ms": median * 1e3,
                   "tokens_per_s": tokens / median, "runs_ms": [s * 1e3 for s in seconds]}
            print(f"pp{tokens} {'recorded' if recorded else 'eager'}: {median * 1e3:.2f} ms, "
                  f"{tokens / median:,.0f} tok/s")
            report["timing"].append(row)
    model.recorded_prefill = True
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    bad = [r for r in report["pieces"] if r["relative_max_diff"] > 2e-2 or not r["argmax_equal"]]
    return 1 if bad or report["failure"] is not None else 0


if __name__ == "__main__":
    sys.exit(main())
