"""KVFlash on a device (issue #15): paged chunks' bytes through the side stream, and per-token decode times at
a depth several times the pool beside the full cache at a depth of one pool.

1. Round trip: a `qk` KVFlash cache with the model's attention layers, KV types and device is fed random rows
   (passes of random sizes, a random query after each, so chunks leave and come back every `tau` tokens,
   with rollbacks between, as speculative verification does), then every resident chunk's pool rows and every
   paged chunk's host record are compared, byte for byte, with the rows as stored when written.
2. Decode: one prefill of random ids to `--depth-pools` x `--pool` under KVFlash (lru; `--policies`), and
   to `--pool` under the full cache; then `-n` tokens fed one at a time (after a warm-up), the host waiting for the device
   after each; the per-token ms (median, p90, max) of each, and for `qk` / `drafter` the reselections in the
   timed tokens and their mean host ms (`qk` chooses on the device: one small copy a reselection; `drafter`
   adds its scorer's pass, `--scorer` or a synthetic Qwen3-0.6B).

Prints a JSON summary (also written to `--json`); exits 1 if any byte differs.

    python scripts/kvflash_gpu_check.py --device cuda:0 --pool 4096 --depth-pools 8       # a synthetic 0.8B
    python scripts/kvflash_gpu_check.py -m tiny.gguf --device cpu --pool 256 --depth-pools 3 -n 8
    python scripts/kvflash_gpu_check.py --device cuda:0 --pool 4096 --depth-pools 32 --policies lru,qk,drafter
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import attrs
import torch

from lucebox_core.assembly import EngineOptions, build_engine
from lucebox_core.bench import DECODE_WARMUP_STEPS
from lucebox_core.engine import Engine
from lucebox_core.kvflash import CHUNK, KVFlashCache, KVFlashPolicy
from lucebox_core.kvflash_policy import DrafterScorer
from lucebox_core.plugins import registry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF file (default: a synthetic qwen35 written to a temporary folder)")
    p.add_argument("--synth-size", default="0.8b", help="size of the synthetic qwen35 (default 0.8b)")
    p.add_argument("--synth-type", default="q8_0", help="weight type of the synthetic qwen35 (default q8_0)")
    p.add_argument("--device", help="torch device, e.g. cuda:0 or cpu")
    p.add_argument("--backend", help="kernel backend (default: the best available)")
    p.add_argument("--pool", type=int, default=4096, help="KVFlash pool in tokens (default 4096)")
    p.add_argument("--depth-pools", type=int, default=8, help="KVFlash decode depth in pools (default 8)")
    p.add_argument("--policies", default="lru",
                   help="KVFlash policies of the decode rows (default lru; e.g. lru,qk,drafter)")
    p.add_argument("--scorer", help="the drafter policy's scorer GGUF (default: a synthetic qwen3 0.6b, q8_0)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="tokens timed per row (default 128)")
    p.add_argument("--round-trip-steps", type=int, default=400, help="passes fed to the round-trip cache (default 400)")
    p.add_argument("-ctk", "--cache-type-k", help="KV cache type of K")
    p.add_argument("-ctv", "--cache-type-v", help="KV cache type of V")
    p.add_argument("--json", metavar="OUT", help="also write the summary to OUT")
    return p.parse_args(argv)


def round_trip(model, pool: int, steps: int, seed: int = 0) -> dict:
    """Feed a qk cache random rows and compare every chunk it holds (pool or host) with the rows written."""
    context = 8 * pool
    model.kv_policy = attrs.evolve(registry().kv_policy("kvflash"), factory=KVFlashPolicy(pool, "qk", tau=16))
    cache = model.new_state(context).kv
    if not isinstance(cache, KVFlashCache):
        raise SystemExit(f"the round trip needs one device's KVFlash cache, got {type(cache).__name__}")
    gen = torch.Generator().manual_seed(seed)
    device, dtype = cache.device, cache.dtype
    stored = {layer: (torch.zeros(context, *cache._keys[layer].shape[1:], dtype=cache._keys[layer].dtype,
                                  device=device),
                      torch.zeros(context, *cache._values[layer].shape[1:], dtype=cache._values[layer].dtype,
                                  device=device)) for layer in cache.shapes}
    for step in range(steps):
        length = cache.length
        if step % 5 == 4 and length:  # a verify's rejected nodes: back by up to a chunk
            cache.rollback(max(0, length - int(torch.randint(1, CHUNK, (1,), generator=gen))))
            continue
        longest = min(cache.max_pass, 4 * CHUNK)  # decode tokens, verify blocks and prefill passes
        tokens = min(int(torch.randint(1, longest + 1, (1,), generator=gen)) if step % 2 else 1, context - length)
        if not tokens:
            break
        cache.ensure_room(tokens)
        for layer, shape in cache.shapes.items():
            k = torch.randn(tokens, shape.kv_heads, shape.k_head_dim, generator=gen).to(device, dtype)
            v = torch.randn(tokens, shape.kv_heads, shape.v_head_dim, generator=gen).to(device, dtype)
            stored[layer][0][length:length + tokens] = cache._k_codec.encode(k)
            stored[layer][1][length:length + tokens] = cache._v_codec.encode(v)
            cache.append(layer, k, v)
            heads = shape.kv_heads * 2
            cache.observe_query(layer, torch.randn(1, heads, shape.k_head_dim, generator=gen).to(device, dtype))
    cache.ensure_room(0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mismatches, chunks = [], 0
    held = cache.resident_positions()
    index = torch.tensor(held, device=device)
    for layer in cache.shapes:
        keys, values = cache.gather(layer, cache.pool_tokens)
        for role, pool_rows, truth in (("k", keys, stored[layer][0]), ("v", values, stored[layer][1])):
            bad = (pool_rows[:len(held)] != truth[index]).flatten(1).any(1).nonzero().flatten().tolist()
            mismatches += [f"layer {layer} {role} position {held[i]} (pool)" for i in bad[:4]]
    for chunk in list(cache._host):
        rows = cache.host_rows(chunk)
        chunks += 1
        span = slice(chunk * CHUNK, (chunk + 1) * CHUNK)
        for layer in cache.shapes:
            for role, truth in (("k", stored[layer][0]), ("v", stored[layer][1])):
                if not torch.equal(rows[f"{layer}.{role}"], truth[span].cpu()):
                    mismatches.append(f"layer {layer} {role} chunk {chunk} (host)")
    info = cache.info()
    return {"chunks": chunks + -(-len(held) // CHUNK), "host_chunks": chunks, "mismatches": len(mismatches),
            "first_mismatches": mismatches[:8], "pages_out": info["pages_out"], "pages_in": info["pages_in"],
            "side_stream": cache._copier.side is not None, "copies": cache._copier.copies,
            "arena_slabs": len(cache._arena.slabs), "k_type": cache.k_type, "v_type": cache.v_type}


def decode_row(model, engine, tokenizer, label: str, policy, factory, depth: int, n_gen: int, sync) -> dict:
    model.kv_policy = policy
    chunk = engine.prefill_chunk if factory is None else min(engine.prefill_chunk, factory.max_pass(engine.ctx_size))
    runner = Engine(model, tokenizer, ctx_size=engine.ctx_size, prefill_chunk=chunk, backend=engine.backend)
    ids = torch.randint(0, model.vocab_size, (depth + DECODE_WARMUP_STEPS + 2 * n_gen,),
                        generator=torch.Generator().manual_seed(depth)).tolist()
    sequence = runner.new_sequence()
    start = time.perf_counter()
    runner.prefill(sequence, ids[:depth])
    sync()
    prefill_s = time.perf_counter() - start
    feed = iter(ids[depth:])

    def step() -> None:  # fed past the engine: the tokens recorded as it would (the drafter policy reads them)
        token = next(feed)
        model.forward(sequence.state, torch.tensor([token]))
        sequence.tokens.append(token)

    for _ in range(DECODE_WARMUP_STEPS + n_gen):  # warm-up at this depth (graphs recorded, a boundary crossed)
        step()
    sync()
    token_ms = []
    before_info = dict(sequence.state.kv.info()) if factory is not None else {}
    for _ in range(n_gen):
        before = time.perf_counter()
        step()
        sync()
        token_ms.append((time.perf_counter() - before) * 1e3)
    row = {"kv": label, "depth": depth, "prefill_s": round(prefill_s, 2),
           "token_ms_median": round(statistics.median(token_ms), 4),
           "token_ms_p90": round(sorted(token_ms)[int(0.9 * (len(token_ms) - 1))], 4),
           "token_ms_max": round(max(token_ms), 4), "tokens_per_s": round(1e3 * n_gen / sum(token_ms), 2)}
    if factory is not None:
        info = sequence.state.kv.info()
        row.update({key: info[key] for key in ("pool_tokens", "resident_chunks", "host_chunks", "pages_out",
                                               "pages_in", "host_bytes", "host_reserved_bytes")})
        reselections = info["reselections"] - before_info["reselections"]
        seconds = info["reselect_seconds"] - before_info["reselect_seconds"]
        row.update({"reselections_timed": reselections,
                    "reselect_ms_mean": round(1e3 * seconds / reselections, 3) if reselections else None})
        if "scorer_rescores" in info:
            row.update({key: info[key] for key in ("scorer_rescores", "scorer_mean_seconds", "scorer_last_seconds",
                                                   "scorer_last_tokens", "scorer_load_seconds")})
    runner.release(sequence)
    return row


def drafter_scorer(args: argparse.Namespace) -> DrafterScorer:
    """The drafter policy's scorer: `--scorer`, else a synthetic Qwen3-0.6B (q8_0) written to a temporary folder."""
    from lucebox_core.assembly import SCORER_ALPHA
    from lucebox_core.block_sparse import BlockSparseConfig
    from lucebox_core.loading import load_model

    path = args.scorer
    if path is None:
        from lucebox_qwen35 import synth

        path = str(synth.write_qwen3(f"{tempfile.mkdtemp(prefix='kvflash-scorer-')}/qwen3.gguf", size="0.6b",
                                     type="q8_0", seed=2))
    return DrafterScorer(path, lambda file: load_model(file, backend=args.backend, device=args.device),
                         sparse=BlockSparseConfig(alpha=SCORER_ALPHA))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_path = args.model
    if model_path is None:
        from lucebox_qwen35 import synth

        model_path = str(synth.write(f"{tempfile.mkdtemp(prefix='kvflash-check-')}/qwen35.gguf",
                                     size=args.synth_size, type=args.synth_type, seed=1))
    depth = args.depth_pools * args.pool
    context = depth + DECODE_WARMUP_STEPS + 2 * args.n_gen + 1
    assembled = build_engine(EngineOptions(model=model_path, ctx_size=max(context, 8 * args.pool),
                                           backend=args.backend, device=args.device,
                                           cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v))
    model, engine = assembled.loaded.model, assembled.engine
    full_policy = model.kv_policy
    summary = {"model": model_path, "device": str(model.ops.device), "pool": args.pool, "n_gen": args.n_gen,
               "round_trip": round_trip(model, args.pool, args.round_trip_steps)}
    sync = engine.backend.synchronize
    tokenizer = assembled.loaded.tokenizer
    summary["decode"] = [decode_row(model, engine, tokenizer, "full", full_policy, None, args.pool, args.n_gen, sync)]
    for name in [p.strip() for p in args.policies.split(",") if p.strip()]:
        factory = KVFlashPolicy(args.pool, name, scorer=drafter_scorer(args) if name == "drafter" else None)
        flash_policy = attrs.evolve(registry().kv_policy("kvflash"), factory=factory)
        summary["decode"].append(decode_row(model, engine, tokenizer, f"kvflash {name}", flash_policy, factory,
                                            depth, args.n_gen, sync))
    model.kv_policy = full_policy
    full_ms = summary["decode"][0]["token_ms_median"]
    # Full at one pool deep over KVFlash at several: 1.0 when paging costs nothing a token (target >= 0.95).
    summary["full_over_kvflash_median"] = {row["kv"]: round(full_ms / row["token_ms_median"], 4)
                                           for row in summary["decode"][1:]}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text)
    return 1 if summary["round_trip"]["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
