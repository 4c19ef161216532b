"""PFlash's timing (issue #16, item 7): time to first token of a long prompt with and without speculative
prefill, and the scorer's prefill with block-sparse against dense attention.

For each length L (tokens of the target's tokenizer), the prompt is Python standard-library source cut to L
target tokens, and three things are timed, each after an untimed run at its own shape, the median of
`--reps`:

- `dense`: the target's own prefill of all L tokens, to the first token on the host (our TTFT without PFlash);
- `pflash`: the whole PFlash path to the first token: the scorer tokenizes the text, scores it (block-sparse
  attention, `--alpha`), the kept chunks (`--keep`) become text, the target tokenizes and prefills them; the
  row splits the time into scorer and target parts;
- `scorer-sparse` / `scorer-dense`: the scorer's pass alone (`tail_attention`) over the same tokens with
  block-sparse and with dense attention.

Random weights make the selection meaningless (what is kept says nothing of quality): timing only. The
mechanics (what is kept, forced, anchored, protected) are proven by the CPU tests.

    python scripts/bench_pflash.py --target qwen35-27b-q4_k_m.gguf --scorer qwen3-0.6b.gguf \
        --lengths 32768,65536,131072 --json pflash.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from lucebox_core.assembly import EngineOptions, build_engine
from lucebox_core.block_sparse import BlockSparseConfig
from lucebox_core.chat_compression import Piece
from lucebox_core.loading import load_model
from lucebox_core.pflash import PFlashCompressor
from lucebox_core.prefill_compression import CompressionConfig

QUESTION = "\n\nQuestion: which function above parses the header, and what does it return?\n"


def stdlib_text(tokenizer, tokens: int) -> str:
    """Standard-library source cut to `tokens` tokens of `tokenizer` (files in a fixed order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, have = [], 0
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(f"# file: {path.relative_to(root)}\n{text}")
        have += len(text) // 3  # a cheap lower bound of the tokens (code runs ~3-4 characters a token)
        if have > tokens * 1.3:
            ids = tokenizer.encode("".join(parts), add_bos=False)
            if len(ids) >= tokens:
                return tokenizer.decode(ids[:tokens])
    raise SystemExit(f"the standard library under {root} has fewer than {tokens} tokens")


def timed(function, sync, reps: int) -> tuple[float, object]:
    function()  # the untimed run at this shape
    times, result = [], None
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        result = function()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def profile_chunks(model, function, sync) -> dict:
    """Where a long dense prefill's time goes: `function` run once more with every prefill chunk timed
    (synchronised: a chunk of thousands of tokens costs far more than the wait), then each chunk's seconds
    fitted as a * tokens + b * tokens * (its mean position): the first term is what does not grow with
    the context (the weights' matmuls, DeltaNet), the second the attention over the cache."""
    chunks: list[tuple[int, int, float]] = []
    forward = model.forward

    def timed_forward(state, token_ids, *rest, **options):
        sync()
        start, position = time.perf_counter(), int(state.length)
        logits = forward(state, token_ids, *rest, **options)
        sync()
        chunks.append((position, len(token_ids), time.perf_counter() - start))
        return logits

    model.forward = timed_forward
    try:
        function()
    finally:
        del model.forward  # the class's method again
    n = torch.tensor([c[1] for c in chunks], dtype=torch.float64)
    mean_position = torch.tensor([c[0] + c[1] / 2 for c in chunks], dtype=torch.float64)
    seconds = torch.tensor([c[2] for c in chunks], dtype=torch.float64)
    design = torch.stack([n, n * mean_position], dim=1)
    a, b = torch.linalg.lstsq(design, seconds[:, None]).solution[:, 0].tolist()
    return {"profile_chunks": len(chunks), "profile_total_s": round(float(seconds.sum()), 3),
            "first_chunk_s": round(chunks[0][2], 3), "last_chunk_s": round(chunks[-1][2], 3),
            "context_independent_s": round(a * float(n.sum()), 3),
            "attention_s": round(b * float((n * mean_position).sum()), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target GGUF")
    p.add_argument("--scorer", required=True, help="the scorer GGUF (a qwen3 model such as Qwen3-0.6B)")
    p.add_argument("--lengths", default="32768,65536,131072", help="prompt lengths in target tokens")
    p.add_argument("--keep", type=float, default=0.05, help="keep ratio (default 0.05)")
    p.add_argument("--alpha", type=float, default=0.85, help="block-sparse alpha (default 0.85)")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--skip-dense", action="store_true", help="leave out the target's dense prefill rows")
    p.add_argument("--skip-scorer-dense", action="store_true", help="leave out the scorer's dense-attention rows")
    p.add_argument("--backend")
    p.add_argument("--device")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]

    options = EngineOptions(model=args.target, backend=args.backend, device=args.device,
                            ctx_size=max(lengths) + 64, no_draft=True)
    assembled = build_engine(options)
    engine, target = assembled.engine, assembled.loaded
    sync = engine.backend.synchronize
    scorer = load_model(args.scorer, backend=args.backend, device=args.device)
    sparse = BlockSparseConfig(alpha=args.alpha)
    compressor = PFlashCompressor(scorer.model, scorer.tokenizer, CompressionConfig(keep_ratio=args.keep),
                                  sparse=sparse)
    print(f"target {Path(args.target).name} ({target.backend_name}), scorer {Path(args.scorer).name}, "
          f"keep {args.keep}, alpha {args.alpha}", file=sys.stderr)

    def first_token(ids: list[int]) -> int:
        sequence = engine.new_sequence()
        engine.prefill(sequence, ids)
        token = int(sequence.pending_logits.argmax())  # on the host: the device has finished
        engine.release(sequence)
        return token

    rows = []

    def row(**fields) -> None:
        rows.append(fields)
        print(json.dumps(fields), file=sys.stderr)

    for length in lengths:
        text = stdlib_text(target.tokenizer, length - len(target.tokenizer.encode(QUESTION, add_bos=False)))
        prompt_ids = target.tokenizer.encode(text + QUESTION, add_bos=False)
        scorer_ids = torch.tensor(scorer.tokenizer.encode(text + QUESTION, add_bos=False), dtype=torch.long)
        if not args.skip_dense:
            seconds, _ = timed(lambda: first_token(prompt_ids), sync, args.reps)
            row(test="ttft", mode="dense", prompt_tokens=len(prompt_ids), seconds=round(seconds, 3),
                prefill_tokens_per_s=round(len(prompt_ids) / seconds, 1),
                **profile_chunks(target.model, lambda: first_token(prompt_ids), sync))
        parts: dict[str, float] = {}

        def pflash() -> int:
            start = time.perf_counter()
            kept_text, question = compressor.compress([Piece(text, protected=False), Piece(QUESTION, protected=True)])
            kept_ids = target.tokenizer.encode(kept_text + question, add_bos=False)
            sync()
            middle = time.perf_counter()
            token = first_token(kept_ids)
            parts.update(scorer_s=middle - start, target_s=time.perf_counter() - middle, kept_tokens=len(kept_ids))
            return token

        seconds, _ = timed(pflash, sync, args.reps)
        row(test="ttft", mode="pflash", prompt_tokens=len(prompt_ids), scorer_tokens=int(scorer_ids.numel()),
            kept_tokens=parts["kept_tokens"], seconds=round(seconds, 3), scorer_s=round(parts["scorer_s"], 3),
            target_prefill_s=round(parts["target_s"], 3), keep=args.keep, alpha=args.alpha)
        for mode in ("sparse", "dense"):
            if mode == "dense" and args.skip_scorer_dense:
                continue
            config = sparse if mode == "sparse" else None
            seconds, _ = timed(lambda: scorer.model.tail_attention(scorer_ids, 8, sparse=config), sync, args.reps)
            row(test="scorer", mode=mode, tokens=int(scorer_ids.numel()), seconds=round(seconds, 3),
                tokens_per_s=round(scorer_ids.numel() / seconds, 1))
        if torch.cuda.is_available():
            row(test="memory", length=length, max_allocated_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "target": args.target, "scorer": args.scorer}, indent=1))
    print("| test | mode | tokens | seconds | detail |\n| --- | --- | ---: | ---: | --- |")
    for r in rows:
        if r["test"] == "memory":
            continue
        detail = (f"scorer {r['scorer_s']} s + target {r['target_prefill_s']} s over {r['kept_tokens']} kept"
                  if r["mode"] == "pflash" else f"{r.get('prefill_tokens_per_s') or r.get('tokens_per_s')} tok/s")
        print(f"| {r['test']} | {r['mode']} | {r.get('prompt_tokens') or r.get('tokens')} | {r['seconds']} | {detail} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
