"""`lucebox bench`: prompt and decode speed like llama-bench, with the bandwidth decode achieved.

Decode at batch 1 reads every weight once per token (the embedding table only one row), so bytes read
per token / seconds per token is the bandwidth achieved; compare it with the device's copy bandwidth.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .engine import Engine


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


def run_bench(loaded: Any, *, prompts: list[int], n_gen: int, depths: list[int], reps: int, ctx_size: int) -> list[dict]:
    model = loaded.model
    engine = Engine(model, loaded.tokenizer, ctx_size=ctx_size)
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
        _sync(None)
        start = time.perf_counter()
        for _ in range(steps):
            model.forward(sequence.state, token)
        _sync(None)
        return time.perf_counter() - start

    for n in [p for p in prompts if p > 0]:
        time_prefill(min(n, 16), 0)  # warm-up
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
    return rows


def format_bench(loaded: Any, rows: list[dict]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{loaded.path.name} ({loaded.family.name}, backend {loaded.backend_name})")
    for column in ("test", "tok/s", "seconds", "GB/s (weights)"):
        table.add_column(column, justify="right")
    for row in rows:
        gbps = f"{row['achieved_GB_per_s']:.2f}" if "achieved_GB_per_s" in row else ""
        table.add_row(row["test"], f"{row['tokens_per_s']:.2f}", f"{row['seconds']:.3f}", gbps)
    console = Console(width=100, record=True)
    with console.capture() as capture:
        console.print(table)
    return capture.get()
