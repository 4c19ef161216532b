"""Where a plain decode step's host time goes: the engine's tokens per second beside the recorded step's
replay alone, then the same generation under cProfile (the host functions by own time, per token).

A decode step replays its recorded graph in a few milliseconds; the engine around it (sampling, feeding
ahead, reading the token back, detokenizing) must hand the GPU the next step before the one queued runs out,
or the GPU idles. The gap between `engine_ms` and `replay_ms` is that idle time.

    python scripts/decode_overhead.py -m laguna-xs2-q4_k_m.gguf -n 128
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

from lucebox_core.assembly import EngineOptions, build_engine
from lucebox_core.engine import GenerationRequest
from lucebox_core.sampling import SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top", type=int, default=25, help="host functions listed")
    p.add_argument("--json")
    args = p.parse_args(argv)
    assembled = build_engine(EngineOptions(model=args.model, ctx_size=4096, no_draft=True))
    engine, model = assembled.engine, assembled.loaded.model
    sync = engine.backend.synchronize if engine.backend is not None else (lambda: None)
    prompt = list(range(100, 164))
    params = SamplingParams(temperature=args.temperature, top_k=40, top_p=0.95, seed=1)
    request = GenerationRequest(prompt_ids=prompt, max_tokens=args.n_gen, sampling=params, ignore_eos=True)

    def run() -> float:
        sync()
        start = time.perf_counter()
        result = engine.generate(request)
        sync()
        assert len(result.token_ids) == args.n_gen
        return (time.perf_counter() - start) * 1000 / args.n_gen

    run()  # warm-up: recordings made
    engine_ms = min(run() for _ in range(3))
    # The recorded step alone: replays of the sequence's decode step back to back.
    recordings = [r for seq in engine._idle if seq.state.decode is not None for r in seq.state.decode.recordings()]
    replay_ms = None
    if recordings:
        graph = recordings[-1]
        graph.replay()
        sync()
        start = time.perf_counter()
        for _ in range(50):
            graph.replay()
        sync()
        replay_ms = (time.perf_counter() - start) * 1000 / 50
    profiler = cProfile.Profile()
    profiler.enable()
    profiled_ms = run()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(args.top)
    row = {"model": args.model, "temperature": args.temperature, "engine_ms": round(engine_ms, 3),
           "engine_tok_s": round(1000 / engine_ms, 1), "replay_ms": None if replay_ms is None else round(replay_ms, 3),
           "profiled_ms": round(profiled_ms, 3)}
    print(json.dumps(row))
    print(text.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
