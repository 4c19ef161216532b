"""Decode speed at a context depth: the `full` KV policy against KVFlash pools (`--kvflash N`, lru and qk).

For each depth and KV policy, one prefill of D random tokens, then `lucebox bench`'s decode measure on that
sequence: N + 2 tokens fed untimed (the warm-up at this shape: graphs recorded for the windows the run
crosses), then `--reps` runs of N tokens fed one at a time, the host waiting for the device after each, the
median reported (`tgN @ dD`; each run starts N tokens deeper than the last, which at these depths changes
nothing measurable). One prefill a row, not one a repetition: at 128K the 27B's prefill is half a minute. On
one loaded model (the policy is swapped between rows). A KVFlash row also says how many
64-token chunks went to host memory and came back during its runs. Random ids: timing only.

    python scripts/bench_kvflash.py -m qwen35-27b-q4_k_m.gguf --depths 8192,32768 --pool 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import attrs
import torch

from lucebox_core.assembly import EngineOptions, build_engine
from lucebox_core.bench import DECODE_WARMUP_STEPS, decode_bytes_per_token
from lucebox_core.engine import Engine
from lucebox_core.kvflash import KVFlashPolicy
from lucebox_core.plugins import registry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="GGUF file")
    p.add_argument("--depths", default="8192,32768", help="comma-separated context depths (default 8192,32768)")
    p.add_argument("--pool", default="4096", help="KVFlash pool in tokens (default 4096)")
    p.add_argument("--policies", default="lru,qk", help="KVFlash policies to time (default lru,qk)")
    p.add_argument("--full-depths", help="depths of the full-cache rows (default: --depths); e.g. 0 for the "
                   "depth-0 reference only, when a 128K full row was measured before")
    p.add_argument("-n", "--n-gen", type=int, default=64, help="tokens decoded per run (default 64)")
    p.add_argument("-r", "--reps", type=int, default=3, help="repetitions, the median reported (default 3)")
    p.add_argument("--backend", help="kernel backend (default: the best available)")
    p.add_argument("--device", help="torch device, e.g. cuda:0")
    p.add_argument("-ctk", "--cache-type-k", help="KV cache type of K")
    p.add_argument("-ctv", "--cache-type-v", help="KV cache type of V")
    p.add_argument("--json", metavar="OUT", help="also write the rows to OUT as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    full_depths = depths if args.full_depths is None else [int(d) for d in args.full_depths.split(",") if d.strip()]
    context = max(depths) + args.n_gen * (args.reps + 1) + DECODE_WARMUP_STEPS + 1
    assembled = build_engine(EngineOptions(model=args.model, ctx_size=context, backend=args.backend,
                                           device=args.device, cache_type_k=args.cache_type_k,
                                           cache_type_v=args.cache_type_v))
    model, engine = assembled.loaded.model, assembled.engine
    full_policy, full_chunk = model.kv_policy, engine.prefill_chunk
    configs = [("full", full_policy, None)]
    for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
        factory = KVFlashPolicy(args.pool, name)
        configs.append((f"kvflash {name} pool {args.pool}", attrs.evolve(registry().kv_policy("kvflash"),
                                                                          factory=factory), factory))
    rows = []
    bytes_per_token = decode_bytes_per_token(assembled.loaded.gguf)
    sync = engine.backend.synchronize
    for label, policy, factory in configs:
        # New sequences take the model's policy, prefilling in passes the pool can take.
        model.kv_policy = policy
        chunk = full_chunk if factory is None else min(full_chunk, factory.max_pass(engine.ctx_size))
        runner = Engine(model, assembled.loaded.tokenizer, ctx_size=engine.ctx_size, prefill_chunk=chunk,
                        backend=engine.backend)
        for depth in (full_depths if factory is None else depths):
            generator = torch.Generator().manual_seed(depth)
            ids = torch.randint(0, model.vocab_size, (depth + DECODE_WARMUP_STEPS + args.n_gen * (args.reps + 1),),
                                generator=generator).tolist()
            sequence = runner.new_sequence()
            start = time.perf_counter()
            if depth:
                runner.prefill(sequence, ids[:depth])
            sync()
            prefill_s = time.perf_counter() - start
            feed = iter(ids[depth:])
            for _ in range(DECODE_WARMUP_STEPS + args.n_gen):  # the warm-up at this depth
                model.forward(sequence.state, torch.tensor([next(feed)]))
            sync()
            times, token_ms = [], []
            for _ in range(args.reps):
                start = time.perf_counter()
                for _ in range(args.n_gen):
                    before = time.perf_counter()
                    model.forward(sequence.state, torch.tensor([next(feed)]))
                    sync()  # as llama-bench: the host waits for every token
                    token_ms.append((time.perf_counter() - before) * 1e3)
                times.append(time.perf_counter() - start)
            runner.release(sequence)
            rate = args.n_gen / statistics.median(times)
            row = {"kv": label, "test": f"tg{args.n_gen}" + (f" @ d{depth}" if depth else ""), "depth": depth,
                   "tokens_per_s": rate, "prefill_s": round(prefill_s, 2),
                   "achieved_GB_per_s": bytes_per_token * rate / 1e9,
                   # Where a slow row loses its time: every token a little (host planning), or a few tokens
                   # a lot (the pool's relayout at a chunk boundary, page copies).
                   "token_ms_median": round(statistics.median(token_ms), 3), "token_ms_max": round(max(token_ms), 3),
                   "token_ms_p90": round(sorted(token_ms)[int(0.9 * (len(token_ms) - 1))], 3)}
            if factory is not None:
                traffic = factory.describe()
                row.update({key: traffic[key] for key in ("pool_tokens", "pages_out", "pages_in", "bytes_out",
                                                          "bytes_in")})
            rows.append(row)
            print(f"{label:>28}  {row['test']:>16}  {rate:9.2f} tok/s  (prefill {prefill_s:.1f} s)"
                  + f"  token ms median {row['token_ms_median']} p90 {row['token_ms_p90']} max {row['token_ms_max']}"
                  + (f"  pages out {row['pages_out']} in {row['pages_in']}" if factory is not None else ""),
                  flush=True)
    model.kv_policy = full_policy
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": args.model, "depths": depths, "pool": args.pool, "n_gen": args.n_gen,
                       "reps": args.reps, "rows": rows}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
