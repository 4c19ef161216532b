"""Second-turn time to first token with and without the prefix cache (RAM and disk).

A conversation of `--context` tokens (messages of `--turn-tokens` random ids, each ended by the model's
end-of-turn id) is the first turn's prompt; the second turn adds a `--answer-tokens` answer and a
`--new-tokens` user message. Three ways to answer the second turn, each timed from the request to its first
token (prefill, or restore + the suffix's prefill, then the first token sampled and copied to the host):

- `cold`: no cache, the whole prompt prefilled;
- `ram`: the first turn's snapshot restored from RAM;
- `disk`: restored from its file under a `--kv-cache-dir` (a fresh cache object, nothing in RAM; the file is
  likely in the OS page cache, which the row says).

Every mode has an untimed run first; the figure is the median of `--reps`. Random weights: timing only.

    python scripts/bench_prefix_cache.py -m qwen35-27b-q4_k_m.gguf --context 32768 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lucebox_core.assembly import EngineOptions, build_engine
from lucebox_core.engine import Engine
from lucebox_core.prefix_cache import PrefixCache, PrefixCacheConfig, turn_boundaries


def conversation(vocab: int, end_of_turn: int, context: int, turn_tokens: int, answer_tokens: int,
                 new_tokens: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """The first turn's prompt (`context` tokens, ending in an open 3-token header) and the second's."""
    generator = torch.Generator().manual_seed(seed)

    def message(n: int) -> list[int]:
        ids = torch.randint(10, vocab, (n,), generator=generator).tolist()
        return [i if i != end_of_turn else i - 1 for i in ids] + [end_of_turn]

    history: list[int] = []
    while len(history) < context - 3 - turn_tokens:
        history += message(turn_tokens - 1)
    history += message(context - 3 - len(history) - 1)
    header = message(3)[:3]
    first = history + header
    second = history + header + message(answer_tokens - 1) + message(new_tokens - 1) + header
    return first, second


def time_to_first_token(engine: Engine, prompt: list[int]) -> float:
    """Seconds from the request to the first token on the host."""
    sequence = engine.new_sequence()
    engine.backend.synchronize()
    start = time.perf_counter()
    engine.prefill(sequence, prompt)
    int(sequence.pending_logits.argmax())  # on the host: the device has finished
    seconds = time.perf_counter() - start
    engine.release(sequence)
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF file (default: the default model)")
    p.add_argument("--context", type=int, default=32768, help="tokens of the first turn's prompt (default 32768)")
    p.add_argument("--turn-tokens", type=int, default=2048, help="tokens a message (default 2048)")
    p.add_argument("--answer-tokens", type=int, default=256, help="the first turn's answer (default 256)")
    p.add_argument("--new-tokens", type=int, default=256, help="the second turn's new message (default 256)")
    p.add_argument("-ctk", "--cache-type-k")
    p.add_argument("-ctv", "--cache-type-v")
    p.add_argument("--backend")
    p.add_argument("--device")
    p.add_argument("-ub", "--ubatch-size", type=int)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kv-cache-dir", help="folder for the disk tier (default: a temporary one)")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)

    first_len = args.context
    options = EngineOptions(model=args.model, backend=args.backend, device=args.device,
                            ctx_size=first_len + args.answer_tokens + args.new_tokens + 16,
                            prefill_chunk=args.ubatch_size, cache_type_k=args.cache_type_k,
                            cache_type_v=args.cache_type_v, no_draft=True)
    assembled = build_engine(options)
    loaded, base = assembled.loaded, assembled.engine
    model, tokenizer = loaded.model, loaded.tokenizer
    end_of_turn = min(base.eog_ids)
    first, second = conversation(model.vocab_size, end_of_turn, first_len, args.turn_tokens, args.answer_tokens,
                                 args.new_tokens)
    boundary = max(b for b in turn_boundaries(second, base.eog_ids) if b <= len(first))
    folder = Path(args.kv_cache_dir or tempfile.mkdtemp(prefix="lucebox-kv-bench-"))

    def engine_with(cache: PrefixCache | None) -> Engine:
        return Engine(model, tokenizer, ctx_size=base.ctx_size, prefill_chunk=base.prefill_chunk,
                      backend=base.backend, prefix_cache=cache)

    # The first turn, once, through a cache that writes its snapshot to RAM and disk.
    seed = PrefixCache(PrefixCacheConfig(slots=1, min_tokens=1, directory=str(folder)), "bench")
    warm_engine = engine_with(seed)
    start = time.perf_counter()
    sequence = warm_engine.new_sequence()
    warm_engine.prefill(sequence, first)
    base.backend.synchronize()
    first_turn_s = time.perf_counter() - start
    seed.flush()
    [snapshot] = list(seed._ram.values())
    print(f"first turn: {len(first)} tokens in {first_turn_s:.2f} s; snapshot at {snapshot.length} tokens, "
          f"{snapshot.nbytes / 2**20:.1f} MiB", file=sys.stderr)
    warm_engine.release(sequence)

    never = len(second) + 1  # min_tokens: the timed runs take no new snapshot

    def ram_cache() -> PrefixCache:
        cache = PrefixCache(PrefixCacheConfig(slots=1, min_tokens=never), "bench")
        cache.store(snapshot.tokens, snapshot.tensors)
        return cache

    def disk_cache() -> PrefixCache:
        return PrefixCache(PrefixCacheConfig(slots=0, min_tokens=never, directory=str(folder)), "bench")

    rows = []
    engines = {}
    for mode, make in (("cold", lambda: None), ("ram", ram_cache), ("disk", disk_cache)):
        times, restored = [], 0
        # One engine a mode, as a server keeps its slots: the sequence a request ran in is recycled with its
        # recorded decode steps (which the answer's header, stepped, replays); each run gets a fresh cache.
        engine = engines[mode] = engine_with(None)
        for rep in range(args.reps + 1):  # the first run is the warm-up at this shape
            cache = make()
            engine.prefix_cache = cache
            seconds = time_to_first_token(engine, second)
            restored = cache.stats.tokens_reused if cache is not None else 0
            if cache is not None:
                cache.close()
            if rep:
                times.append(seconds)
        row = {"test": "ttft_second_turn", "mode": mode, "prompt_tokens": len(second), "restored_tokens": restored,
               "prefilled_tokens": len(second) - restored, "seconds": round(statistics.median(times), 4),
               "reps": args.reps, "each_s": [round(t, 4) for t in times],
               "snapshot_bytes": snapshot.nbytes if mode != "cold" else None,
               "expected_restore": boundary, "backend": loaded.backend_name,
               "kv": f"{model.cache_type_k}/{model.cache_type_v}",
               "note": "file in the OS page cache" if mode == "disk" else None}
        rows.append(row)
        print(json.dumps(row))
    engines["ram"].prefix_cache = ram_cache()
    rows.append(breakdown(engines["ram"], second))
    print(json.dumps(rows[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def breakdown(engine: Engine, prompt: list[int]) -> dict:
    """One more RAM-restored second turn with each piece of it timed apart (a device sync around each): the
    lookup and restore, every prefill forward call (its tokens), and the rest (sampling the first token)."""
    model, sync = engine.model, engine.backend.synchronize
    parts: list[tuple[str, int, float]] = []

    def timed(name: str, call):
        def run(*args, **kwargs):
            sync()
            start = time.perf_counter()
            result = call(*args, **kwargs)
            sync()
            tokens = int(args[1].numel()) if name == "forward" else 0
            parts.append((name, tokens, time.perf_counter() - start))
            return result
        return run

    model.forward, model.restore_state = timed("forward", model.forward), timed("restore", model.restore_state)
    try:
        total = time_to_first_token(engine, prompt)
    finally:
        del model.forward, model.restore_state  # the instance attributes: the class's methods again
    forwards = [(tokens, round(s, 4)) for name, tokens, s in parts if name == "forward"]
    restore = sum(s for name, _, s in parts if name == "restore")
    return {"test": "ttft_breakdown", "mode": "ram", "seconds": round(total, 4), "restore_s": round(restore, 4),
            "forward_calls": forwards, "forward_s": round(sum(s for _, s in forwards), 4),
            "rest_s": round(total - restore - sum(s for _, s in forwards), 4)}


if __name__ == "__main__":
    raise SystemExit(main())
