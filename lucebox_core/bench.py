"""`lucebox bench`: prompt and decode speed measured the way llama-bench measures them, with the bandwidth
decode achieved.

As llama-bench does: prompt processing (`ppN`) is one prefill of N random tokens; decode (`tgN`, at a
context depth) feeds N tokens one at a time, each a fresh random id, and the host waits for the device
after every token, so the per-step host work is inside the clock. Every timed row has an untimed run at its
own shape first (kernels compile and tune, graphs are recorded for the KV windows the run crosses), the
device is synchronised before a clock starts and before it stops, and the figure is the median of `-r`
repetitions; each pp/tg row also keeps every repetition's rate and their standard deviation (llama-bench's
`± stddev`), so a row's noise is on record beside it. The clocks wait for the model's own device, through
its backend.

Decode at batch 1 reads every weight once per token (the embedding table only one row), so bytes read per
token / seconds per token is the bandwidth achieved; compare it with the device's copy bandwidth.

With a drafter (`-md`) there are three more kinds of row: the speculative decode speed (greedy, after a
32-token random prompt; with `--force-accept K` the first K drafts of every step are replaced by the
target's own continuation, and the row says FORCED: never an acceptance rate), the cost of one draft step,
and the cost of one verify pass per node count.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import attrs
import torch

from .engine import Engine, GenerationRequest
from .sampling import SamplingParams

DECODE_WARMUP_STEPS = 2  # positions the decode rows need past depth + n_gen (the cli allocates them)
SPEC_PROMPT_TOKENS = 32


def decode_bytes_per_token(gguf_file: Any) -> int:
    """Weight bytes one decode step reads: all tensors, less the embedding table when the head is separate,
    and of a mixture of experts' stacked expert tensors (GGUF's `*_exps`) only the share one token routes to
    (`expert_used_count` of `expert_count` experts, each a distinct slice): a token reads its k experts' rows,
    never the other experts', so counting the whole stack would report several times the memory's bandwidth."""
    experts, used = gguf_file.arch_get("expert_count", int, 0), gguf_file.arch_get("expert_used_count", int, 0)
    total = 0
    for name, info in gguf_file.tensors.items():
        routed = experts > 0 and 0 < used <= experts and "_exps." in name
        total += info.n_bytes * used // experts if routed else info.n_bytes
    if "output.weight" in gguf_file.tensors and "token_embd.weight" in gguf_file.tensors:
        total -= gguf_file.tensors["token_embd.weight"].n_bytes
    return total


def _random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _timed(tokens: int, seconds: list[float]) -> dict:
    """A pp/tg row's timing fields from its repetitions' seconds: the median (the figure), every repetition's
    rate and their sample standard deviation (0 for one repetition)."""
    median = statistics.median(seconds)
    rates = [tokens / s for s in seconds]
    spread = statistics.stdev(rates) if len(rates) > 1 else 0.0
    return {"seconds": median, "tokens_per_s": tokens / median, "tokens_per_s_samples": rates,
            "tokens_per_s_stddev": spread}


def run_bench(assembled: Any, *, prompts: list[int], n_gen: int, depths: list[int], reps: int,
              force_accept: float | None = None) -> list[dict]:
    """The rows of `lucebox bench` for an `assembly.AssembledEngine` (its context must hold the longest test
    plus `DECODE_WARMUP_STEPS`)."""
    loaded, assembled_engine = assembled.loaded, assembled.engine
    model, backend = loaded.model, assembled_engine.backend
    # The plain rows run without the drafter: a speculative sequence also captures the drafter's features.
    plain = Engine(model, loaded.tokenizer, ctx_size=assembled_engine.ctx_size,
                   prefill_chunk=assembled_engine.prefill_chunk, backend=backend)
    vocab = model.vocab_size
    rows: list[dict] = []

    def time_prefill(n: int, seed: int) -> float:
        sequence = plain.new_sequence()
        ids = _random_ids(n, vocab, seed)
        backend.synchronize()
        start = time.perf_counter()
        plain.prefill(sequence, ids)
        backend.synchronize()
        seconds = time.perf_counter() - start
        plain.release(sequence)
        return seconds

    def time_decode(depth: int, seed: int) -> float:
        sequence = plain.new_sequence()  # a released one: its recorded decode steps are replayed
        if depth:
            plain.prefill(sequence, _random_ids(depth, vocab, seed))
        ids = _random_ids(DECODE_WARMUP_STEPS + n_gen, vocab, seed + 1)
        for token in ids[:DECODE_WARMUP_STEPS]:
            model.forward(sequence.state, torch.tensor([token]))
        backend.synchronize()
        start = time.perf_counter()
        for token in ids[DECODE_WARMUP_STEPS:]:
            model.forward(sequence.state, torch.tensor([token]))
            backend.synchronize()  # llama-bench waits for every token
        seconds = time.perf_counter() - start
        plain.release(sequence)
        return seconds

    for n in [p for p in prompts if p > 0]:
        # Warm-up at the measured length (as llama-bench's warm-up run): the first pass of a new prompt
        # length compiles and tunes kernels for its shapes, which a shorter warm-up leaves to the timed runs.
        time_prefill(n, reps)
        rows.append({"test": f"pp{n}", "tokens": n, **_timed(n, [time_prefill(n, rep) for rep in range(reps)])})
    if n_gen > 0:
        bytes_per_token = decode_bytes_per_token(loaded.gguf)
        for depth in depths:
            time_decode(depth, 1000 + depth)  # warm-up at this depth: records every KV window the test crosses
            timed = _timed(n_gen, [time_decode(depth, rep) for rep in range(reps)])
            rows.append(
                {
                    "test": f"tg{n_gen}" + (f" @ d{depth}" if depth else ""),
                    "tokens": n_gen,
                    "depth": depth,
                    **timed,
                    "weight_bytes_per_token": bytes_per_token,
                    "achieved_GB_per_s": bytes_per_token * timed["tokens_per_s"] / 1e9,
                }
            )
    if assembled_engine.speculative is not None and n_gen > 0:
        rows.extend(_speculative_rows(plain, assembled_engine, n_gen=n_gen, reps=reps, force_accept=force_accept))
    return rows


def _speculative_rows(plain: Engine, engine: Engine, *, n_gen: int, reps: int,
                      force_accept: float | None) -> list[dict]:
    """Speculative decode speed, draft cost and verify cost (see the module docstring)."""
    model, backend, speculative = engine.model, engine.backend, engine.speculative
    greedy = SamplingParams(temperature=0)
    rows: list[dict] = []
    label = f"{speculative.spec_type}" + (f" budget {speculative.budget}" if speculative.budget is not None else "")

    def run(seed: int) -> Any:
        request = GenerationRequest(prompt_ids=_random_ids(SPEC_PROMPT_TOKENS, model.vocab_size, seed),
                                    max_tokens=n_gen, sampling=greedy, ignore_eos=True)
        if force_accept is not None:
            # The plain greedy continuation, one block past the end so the last step is forced like the others.
            reference = plain.generate(attrs.evolve(request, max_tokens=n_gen + speculative.block_size)).token_ids
            request = attrs.evolve(request, force_accept=force_accept, force_reference=reference)
        return engine.generate(request)  # its sequence is released after, and reused by the next run

    # The untimed run at this row's shapes: the draft and verify passes are recorded for the windows and
    # node counts the timed runs meet (otherwise the first repetition records them inside its clock).
    run(99)
    results = [run(100 + rep) for rep in range(reps)]
    rate = statistics.median(r.timings.decode_tokens_per_s for r in results)
    lengths = [n for r in results for n in r.timings.accepted_lengths]
    forced = f" FORCED accept {force_accept:g}" if force_accept is not None else ""
    row = {"test": f"tg{n_gen} spec {label}{forced}", "tokens": n_gen, "tokens_per_s": rate,
           "seconds": n_gen / rate if rate else float("inf"),
           "mean_accepted_length": sum(lengths) / max(1, len(lengths)), "forced_accept": force_accept,
           # Each timed run's rate: one slow run (a probe, a recording) moves the median of two by half its loss.
           "runs_tokens_per_s": [r.timings.decode_tokens_per_s for r in results]}
    if speculative.governor is not None:
        # What the governor decided: tokens decoded plainly because drafting measured slower.
        row["governed_plain_tokens"] = sum(r.timings.governed_plain_tokens for r in results)
        row["speculation"] = speculative.governor.describe()
    rows.append(row)

    # The same requests through the plain engine (sampling, the engine's loop): what speculation must beat.
    def run_plain(seed: int) -> Any:
        return plain.generate(GenerationRequest(prompt_ids=_random_ids(SPEC_PROMPT_TOKENS, model.vocab_size, seed),
                                                max_tokens=n_gen, sampling=greedy, ignore_eos=True))

    run_plain(99)
    plain_rates = [run_plain(100 + rep).timings.decode_tokens_per_s for rep in range(reps)]
    plain_rate = statistics.median(plain_rates)
    rows.append({"test": f"tg{n_gen} plain engine", "tokens": n_gen, "tokens_per_s": plain_rate,
                 "seconds": n_gen / plain_rate if plain_rate else float("inf"),
                 "speculative_over_plain": rate / plain_rate if plain_rate else None, "runs_tokens_per_s": plain_rates})

    # Per-step costs on a sequence holding a 32-token prompt, each after a warm-up call at its shape.
    sequence = engine.new_sequence()
    engine.prefill(sequence, _random_ids(SPEC_PROMPT_TOKENS, model.vocab_size, 7))
    state, root, block = sequence.state, 1000, speculative.block_size
    tokens = [*sequence.tokens, root]

    def per_call(call: Any) -> float:
        call()  # warm-up at this shape
        backend.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            call()
        backend.synchronize()
        return (time.perf_counter() - start) / reps

    draft_seconds = per_call(lambda: speculative.drafter.draft(model, state, sequence.draft, tokens, block))
    rows.append({"test": f"draft step (block {block})", "tokens": block - 1, "seconds": draft_seconds,
                 "tokens_per_s": (block - 1) / draft_seconds})
    for nodes in sorted({1, block, speculative.max_nodes}):  # one node, a block, the verifier's largest pass
        parents = list(range(-1, nodes - 1))
        seconds = per_call(lambda: model.verify(state, [root] * nodes, parents))
        rows.append({"test": f"verify {nodes} nodes", "tokens": nodes, "seconds": seconds,
                     "tokens_per_s": nodes / seconds})
    return rows


def format_bench(loaded: Any, rows: list[dict]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{loaded.path.name} ({loaded.family.name}, backend {loaded.backend_name})")
    for column in ("test", "tok/s (median ± sd)", "seconds", "GB/s (weights)", "accepted len"):
        table.add_column(column, justify="right")
    for row in rows:
        gbps = f"{row['achieved_GB_per_s']:.2f}" if "achieved_GB_per_s" in row else ""
        accepted = f"{row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else ""
        rate = f"{row['tokens_per_s']:.2f}"
        if "tokens_per_s_stddev" in row:
            rate += f" ± {row['tokens_per_s_stddev']:.2f}"
        table.add_row(row["test"], rate, f"{row['seconds']:.3f}", gbps, accepted)
    console = Console(width=100, record=True)
    with console.capture() as capture:
        console.print(table)
    return capture.get()
