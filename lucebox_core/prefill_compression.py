"""PFlash's scoring and selection: which 32-token chunks of a long prompt a target is handed.

A small scorer model (Qwen3-0.6B in Lucebox) reads the whole prompt; the attention of its last
`lookahead` (8) tokens says which earlier tokens matter to the question. This module is the arithmetic
after the scorer's forward, independent of any model or device:

- `tail_scores(queries, keys)`: per layer `softmax(Q_tail K^T / sqrt(d))` under the causal mask, GQA-broadcast;
  the max over heads, a running max over layers, the mean over the tail queries, then a centred average
  pool of width 13 (edges averaged over the positions that exist);
- `keep_ratio_for(n, config)`: the fraction of chunks kept, fixed or piecewise-linear in the token count;
- `anchor_chunks(ids, config)`: every 4-gram of the query (the last 96 tokens) found 1 to `anchor_max_hits`
  times earlier marks the chunk of each hit (and `anchor_radius` chunks either side) as forced: a needle's
  neighbourhood survives when the question repeats its key;
- `select_spans(scores, config, ...)`: `n_keep = max(1, floor(n_chunks * ratio))` chunks: the first 8 and last
  24 (scaled down in proportion when they would take more than `n_keep - 1`), the anchors, then the best by
  mean score; kept chunks in their original order, adjacent ones merged into spans. Chunks overlapping a
  `protected` span are kept whole, beyond the budget: the structure-aware rule (system prompt, tool
  definitions, tool calls and results, the last user message are never compressed) is expressed as
  protected spans by the caller, which knows the chat's structure.

Lucebox leaves two numbers of the anchor rule unstated; here `anchor_max_hits` is 4 and `anchor_radius` 1.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import attrs
import torch

from .errors import LuceboxError


@attrs.frozen(kw_only=True)
class CompressionConfig:
    keep_ratio: float = 0.05  # --prefill-keep-ratio: a fraction of chunks
    curve: tuple[tuple[int, float], ...] = ()  # --prefill-curve T:R ...: ratio against prompt tokens
    chunk: int = 32
    head_chunks: int = 8
    tail_chunks: int = 24
    lookahead: int = 8  # tail queries scored
    pool: int = 13  # centred average pool width (odd)
    anchor_query_tokens: int = 96
    anchor_ngram: int = 4
    anchor_max_hits: int = 4
    anchor_radius: int = 1  # chunks either side of a hit's chunk

    def __attrs_post_init__(self) -> None:
        if not 0 < self.keep_ratio <= 1:
            raise LuceboxError(f"--prefill-keep-ratio must be in (0, 1], got {self.keep_ratio}")
        if self.chunk < 1 or self.pool < 1 or self.pool % 2 == 0:
            raise LuceboxError(f"chunk ({self.chunk}) must be positive and the pool width ({self.pool}) odd")
        tokens = [t for t, _ in self.curve]
        if tokens != sorted(set(tokens)) or any(not 0 < r <= 1 for _, r in self.curve):
            raise LuceboxError(f"--prefill-curve needs increasing token counts and ratios in (0, 1], got {self.curve}")


def parse_curve(points: Sequence[str]) -> tuple[tuple[int, float], ...]:
    """`["32768:0.1", "131072:0.02"]` -> ((32768, 0.1), (131072, 0.02)); a LuceboxError naming the bad point."""
    curve = []
    for point in points:
        tokens, _, ratio = point.partition(":")
        try:
            curve.append((int(tokens), float(ratio)))
        except ValueError:
            raise LuceboxError(f"--prefill-curve: {point!r} is not TOKENS:RATIO (e.g. 32768:0.1)") from None
    return tuple(curve)


def keep_ratio_for(n_tokens: int, config: CompressionConfig) -> float:
    """The keep ratio for a prompt of `n_tokens`: the curve's, linear between its points and flat past its
    ends, or the fixed one."""
    if not config.curve:
        return config.keep_ratio
    points = config.curve
    if n_tokens <= points[0][0]:
        return points[0][1]
    for (t0, r0), (t1, r1) in zip(points, points[1:]):
        if n_tokens <= t1:
            return r0 + (r1 - r0) * (n_tokens - t0) / (t1 - t0)
    return points[-1][1]


def tail_scores(queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor], pool: int = 13) -> torch.Tensor:
    """Token importance `[S]` from each scored layer's tail queries `[H, T, d]` (positions S-T .. S-1) and
    keys `[H_kv, S, d]` (see the module's docstring)."""
    if not queries or len(queries) != len(keys):
        raise LuceboxError(f"tail_scores needs one key tensor per query tensor, got {len(queries)} and {len(keys)}")
    running = None
    for q, k in zip(queries, keys):
        heads, tail, dim = q.shape
        kv_heads, length, _ = k.shape
        if heads % kv_heads or k.shape[2] != dim or tail > length:
            raise LuceboxError(f"tail queries {tuple(q.shape)} do not fit keys {tuple(k.shape)}")
        k = k.float().repeat_interleave(heads // kv_heads, dim=0)
        logits = torch.einsum("htd,hsd->hts", q.float(), k) / math.sqrt(dim)
        # The causal rule on the keys' device (a scorer on the GPU hands GPU tensors).
        query_positions = torch.arange(length - tail, length, device=k.device).unsqueeze(1)
        logits = logits.masked_fill(torch.arange(length, device=k.device).unsqueeze(0) > query_positions,
                                    float("-inf"))
        layer = torch.softmax(logits, dim=-1).amax(dim=0)  # [T, S]: the max over heads
        running = layer if running is None else torch.maximum(running, layer)
    scores = running.mean(dim=0)
    return torch.nn.functional.avg_pool1d(scores[None, None], pool, stride=1, padding=pool // 2,
                                          count_include_pad=False)[0, 0]


def chunk_means(scores: torch.Tensor, chunk: int) -> torch.Tensor:
    """The mean of `scores` `[S]` over each `chunk` positions (the last chunk over those it has), `[ceil(S /
    chunk)]` float32 on the scores' device, in one pass (not a device sync per chunk). PFlash ranks its
    32-token chunks by it; KVFlash's drafter policy its 64-token ones."""
    length = int(scores.shape[0])
    n_chunks = -(-length // chunk)
    padded = torch.nn.functional.pad(scores.detach().float(), (0, n_chunks * chunk - length))
    counts = torch.full((n_chunks,), float(chunk), device=padded.device)
    counts[-1] = length - (n_chunks - 1) * chunk
    return padded.view(n_chunks, chunk).sum(dim=1) / counts


def anchor_chunks(token_ids: Sequence[int], config: CompressionConfig) -> set[int]:
    """Chunks holding an earlier occurrence of a query n-gram seen 1 to `anchor_max_hits` times (± radius)."""
    n, ids = config.anchor_ngram, list(token_ids)
    query_start = max(0, len(ids) - config.anchor_query_tokens)
    seen: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for start in range(0, query_start - n + 1):
        seen[tuple(ids[start : start + n])].append(start)
    n_chunks = -(-len(ids) // config.chunk)
    forced: set[int] = set()
    for start in range(query_start, len(ids) - n + 1):
        hits = seen.get(tuple(ids[start : start + n]), [])
        if 1 <= len(hits) <= config.anchor_max_hits:
            for hit in hits:
                centre = hit // config.chunk
                forced.update(range(max(0, centre - config.anchor_radius),
                                    min(n_chunks, centre + config.anchor_radius + 1)))
    return forced


def select_spans(scores: torch.Tensor, config: CompressionConfig, *, token_ids: Sequence[int] | None = None,
                 protected: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """Token spans `[start, end)` to keep, in order (see the module's docstring). `scores` `[S]` from
    `tail_scores`; `token_ids` (the scorer's) turn on the anchor rule; `protected`: spans kept whole."""
    length = int(scores.shape[0])
    n_chunks = -(-length // config.chunk)
    n_keep = max(1, math.floor(n_chunks * keep_ratio_for(length, config)))
    head, tail = config.head_chunks, config.tail_chunks
    if head + tail > n_keep - 1:  # scaled down in proportion
        room = max(0, n_keep - 1)
        head = head * room // (head + tail) if head + tail else 0
        tail = room - head
    kept = set(range(min(head, n_chunks))) | set(range(max(0, n_chunks - tail), n_chunks))
    if token_ids is not None:
        kept |= anchor_chunks(token_ids, config)
    chunk_scores = chunk_means(scores, config.chunk).cpu().tolist()  # brought to the host once
    for c in sorted(range(n_chunks), key=lambda c: (-chunk_scores[c], c)):
        if len(kept) >= n_keep:
            break
        kept.add(c)
    for start, end in protected:
        kept.update(range(max(0, start // config.chunk), min(n_chunks, -(-end // config.chunk))))
    spans: list[tuple[int, int]] = []
    for c in sorted(kept):
        start, end = c * config.chunk, min(length, (c + 1) * config.chunk)
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans
