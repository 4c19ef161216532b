"""`lucebox bench`: prompt and decode speed like llama-bench, with the bandwidth decode achieved.

Decode at batch 1 reads every weight once per token (the embedding table only one row), so bytes read
per token / seconds per token is the bandwidth achieved; compare it with the device's copy bandwidth.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import attrs
import torch

from .engine import Engine

DECODE_WARMUP_STEPS = 2


def decode_bytes_per_token(gguf_file: Any) -> int:
    """Weight bytes one decode step reads: all tensors, less the embedding table when the head is separate."""
    total = sum(info.n_bytes for info in gguf_file.tensors.values())
    if "output.weight" in gguf_file.tensors and "token_embd.weight" in gguf_file.tensors:
        total -= gguf_file.tensors["token_embd.weight"].n_bytes
    return total


def _random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _sync(device: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_bench(loaded: Any, *, prompts: list[int], n_gen: int, depths: list[int], reps: int, ctx_size: int,
              speculative: Any = None, force_accept: float | None = None,
              prefill_chunk: int | None = None) -> list[dict]:
    model = loaded.model
    # Room for the decode warm-up steps past depth + n_gen.
    engine = Engine(model, loaded.tokenizer, ctx_size=ctx_size + DECODE_WARMUP_STEPS, prefill_chunk=prefill_chunk)
    vocab = model.vocab_size
    rows: list[dict] = []

    def time_prefill(n: int, seed: int) -> float:
        sequence = engine.new_sequence()
        ids = _random_ids(n, vocab, seed).tolist()
        _sync(None)
        start = time.perf_counter()
        engine.prefill(sequence, ids)
        _sync(None)
        return time.perf_counter() - start

    def time_decode(depth: int, seed: int, steps: int = n_gen) -> float:
        sequence = engine.new_sequence()
        if depth:
            engine.prefill(sequence, _random_ids(depth, vocab, seed).tolist())
        token = torch.tensor([int(_random_ids(1, vocab, seed + 1))])
        # Two untimed steps: the first records the decode step's CUDA graph for this KV window (graphs.py),
        # the second replays it once, as llama-bench's own warm-up run does.
        for _ in range(DECODE_WARMUP_STEPS):
            model.forward(sequence.state, token)
        _sync(None)
        start = time.perf_counter()
        for _ in range(steps):
            model.forward(sequence.state, token)
        _sync(None)
        return time.perf_counter() - start

    for n in [p for p in prompts if p > 0]:
        # Warm-up at the measured length (as llama-bench's warm-up run): the first pass of a new prompt
        # length compiles and tunes kernels for its shapes, which a shorter warm-up leaves to the timed runs.
        time_prefill(n, reps)
        seconds = statistics.median(time_prefill(n, rep) for rep in range(reps))
        rows.append({"test": f"pp{n}", "tokens": n, "seconds": seconds, "tokens_per_s": n / seconds})
    if n_gen > 0:
        bytes_per_token = decode_bytes_per_token(loaded.gguf)
        time_decode(0, 0, steps=min(n_gen, 4))  # warm-up
        for depth in depths:
            seconds = statistics.median(time_decode(depth, rep) for rep in range(reps))
            rate = n_gen / seconds
            rows.append(
                {
                    "test": f"tg{n_gen}" + (f" @ d{depth}" if depth else ""),
                    "tokens": n_gen,
                    "depth": depth,
                    "seconds": seconds,
                    "tokens_per_s": rate,
                    "weight_bytes_per_token": bytes_per_token,
                    "achieved_GB_per_s": bytes_per_token * rate / 1e9,
                }
            )
    if speculative is not None and n_gen > 0:
        rows.extend(_speculative_rows(loaded, speculative, n_gen=n_gen, reps=reps, ctx_size=ctx_size,
                                      force_accept=force_accept))
    return rows


def _speculative_rows(loaded: Any, speculative: Any, *, n_gen: int, reps: int, ctx_size: int,
                      force_accept: float | None) -> list[dict]:
    """Speculative decode speed (greedy, after a 32-token random prompt), draft cost and verify cost."""
    from .engine import GenerationRequest
    from .sampling import SamplingParams

    model = loaded.model
    plain = Engine(model, loaded.tokenizer, ctx_size=ctx_size)
    engine = Engine(model, loaded.tokenizer, ctx_size=ctx_size, speculative=speculative)
    greedy = SamplingParams(temperature=0)
    rows: list[dict] = []
    label = f"{speculative.spec_type}" + (f" budget {speculative.budget}" if speculative.spec_type == "ddtree" else "")
    rates, lengths = [], []
    for rep in range(reps):
        request = GenerationRequest(prompt_ids=_random_ids(32, model.vocab_size, 100 + rep).tolist(), max_tokens=n_gen,
                                    sampling=greedy, ignore_eos=True)
        if force_accept is not None:
            # One block past the end, so the last step is forced like the others.
            reference = plain.generate(attrs.evolve(request, max_tokens=n_gen + speculative.block_size)).token_ids
            request = attrs.evolve(request, force_accept=force_accept, force_reference=reference)
        result = engine.generate(request)
        rates.append(result.timings.decode_tokens_per_s)
        lengths.extend(result.timings.accepted_lengths)
    forced = f" FORCED accept {force_accept:g}" if force_accept is not None else ""
    rows.append({"test": f"tg{n_gen} spec {label}{forced}", "tokens": n_gen, "tokens_per_s": statistics.median(rates),
                 "seconds": n_gen / statistics.median(rates), "mean_accepted_length": sum(lengths) / max(1, len(lengths)),
                 "forced_accept": force_accept})

    # Per-step costs on a sequence holding a 32-token prompt.
    sequence = engine.new_sequence()
    engine.prefill(sequence, _random_ids(32, model.vocab_size, 7).tolist())
    state, root = sequence.state, 1000
    drafter = speculative.drafter
    drafter.draft(model, state, sequence.draft, root, speculative.block_size)  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        drafter.draft(model, state, sequence.draft, root, speculative.block_size)
    _sync(None)
    draft_seconds = (time.perf_counter() - start) / reps
    rows.append({"test": f"draft step (block {speculative.block_size})", "tokens": speculative.block_size - 1,
                 "seconds": draft_seconds, "tokens_per_s": (speculative.block_size - 1) / draft_seconds})
    budget = speculative.budget if isinstance(speculative.budget, int) else 22
    for nodes in sorted({1, speculative.block_size, budget + 1}):
        parents = list(range(-1, nodes - 1))
        model.verify(state, [root] * nodes, parents)  # warm-up
        start = time.perf_counter()
        for _ in range(reps):
            model.verify(state, [root] * nodes, parents)
        _sync(None)
        seconds = (time.perf_counter() - start) / reps
        rows.append({"test": f"verify {nodes} nodes", "tokens": nodes, "seconds": seconds, "tokens_per_s": nodes / seconds})
    return rows


def format_bench(loaded: Any, rows: list[dict]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{loaded.path.name} ({loaded.family.name}, backend {loaded.backend_name})")
    for column in ("test", "tok/s", "seconds", "GB/s (weights)", "accepted len"):
        table.add_column(column, justify="right")
    for row in rows:
        gbps = f"{row['achieved_GB_per_s']:.2f}" if "achieved_GB_per_s" in row else ""
        accepted = f"{row['mean_accepted_length']:.2f}" if "mean_accepted_length" in row else ""
        table.add_row(row["test"], f"{row['tokens_per_s']:.2f}", f"{row['seconds']:.3f}", gbps, accepted)
    console = Console(width=100, record=True)
    with console.capture() as capture:
        console.print(table)
    return capture.get()
