"""KVFlash's choice of resident chunks (`--kvflash-policy`): the names, the chunk scores and the top set.

Both scoring policies rank the *materialized* chunks (every complete chunk before the tail, resident or paged
out) and keep the best that fit; the cache (`kvflash.KVFlashCache`) protects the sink and trailing chunks and
does the paging. What each policy scores with:

- `qk`: the target's own last query of each attention layer against each chunk's pooled (mean) key, a query
  head against its KV head, summed over heads and layers. The pooled keys live in one device tensor per
  layer (`PooledKeys`), written once when a chunk closes (its 64 rows are final), so a reselection is a few
  device ops over every chunk, a `torch.topk`, and one small device -> host copy of the chosen ids: no wait
  per chunk and no host loop over the paged-out chunks (it took up to 210 ms a reselection at 128K when it
  sorted every host chunk on the host).
- `drafter`: PFlash's scorer model (a small qwen3 such as Qwen3-0.6B) reads the sequence's tokens; the
  attention of its last queries over them (`prefill_compression.tail_scores`) is each token's importance, and
  a chunk's score the mean over its 64 positions (`prefill_compression.chunk_means`). The scorer has its own
  vocabulary: the target's tokens are turned into text and re-tokenized, and each target token takes the
  importance of the scorer token holding its first byte (`DrafterScorer.token_importance`); when the two
  vocabularies are the same the ids go through as they are. The model is loaded on the first reselection
  and kept. Rescoring a long history costs seconds on a GPU, so it runs every `max(tau, history / 45)`
  tokens (`reselect_interval`, as Lucebox's C++ KVFlash: about 15% of decode at most); between rescorings a
  chunk that must leave is chosen from the last scores, chunks scored never yet ranking above every scored
  one (the newest kept).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from .errors import LuceboxError

POLICIES = ("lru", "qk", "drafter")
SCORING = ("qk", "drafter")  # the policies that rank chunks by a score (and recall paged-out ones)
DRAFTER_HISTORY_SHARE = 45  # drafter: rescore every max(tau, history / 45) tokens
# A chunk the drafter has not scored yet ranks above every scored one (scores are attention probabilities,
# at most 1), the older lower: a key of UNSCORED + chunk / chunks.
UNSCORED = 2.0


def check_policy(name: str) -> str:
    """A `--kvflash-policy` name, or a LuceboxError saying what there is."""
    name = str(name).strip().lower()
    if name not in POLICIES:
        raise LuceboxError(f"--kvflash-policy: unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return name


def reselect_interval(policy: str, tau: int, length: int) -> int:
    """Tokens between reselections: `tau` for `qk` (a rescoring is cheap), `max(tau, length / 45)` for the
    drafter (its pass over the history grows with it)."""
    if policy == "drafter":
        return max(tau, length // DRAFTER_HISTORY_SHARE)
    return tau


def top_chunks(scores: torch.Tensor, count: int, excluded: Sequence[int] = ()) -> list[int]:
    """The `count` chunks of highest score (`scores` `[chunks]`, on any device), never one of `excluded`:
    chosen on the scores' device and brought to the host in one copy."""
    count = min(count, scores.shape[0] - len(set(excluded)))
    if count <= 0:
        return []
    if excluded:
        scores = scores.clone()
        scores[torch.tensor(sorted(set(excluded)), dtype=torch.long, device=scores.device)] = float("-inf")
    return torch.topk(scores, count, sorted=False).indices.tolist()


class PooledKeys:
    """`qk`'s pooled keys: per layer `[context chunks, H, Dk]` (float32, on the cache's device), the mean key
    of every closed chunk below `closed`; rows of a chunk rolled back into are written again when it closes."""

    def __init__(self) -> None:
        self.means: dict[int, torch.Tensor] = {}
        self.closed = 0  # chunks 0 .. closed - 1 hold their final mean

    def store(self, layer: int, chunks: int, heads: int, dim: int, device: torch.device) -> torch.Tensor:
        table = self.means.get(layer)
        if table is None:
            table = self.means[layer] = torch.zeros(chunks, heads, dim, dtype=torch.float32, device=device)
        return table

    def rollback(self, chunks: int) -> None:
        self.closed = min(self.closed, chunks)

    def scores(self, queries: dict[int, torch.Tensor], chunks: torch.Tensor | int) -> torch.Tensor:
        """Each chunk's score (`chunks`: the first N, or an index tensor): the last query of every layer against
        the chunk's mean key, a query head against its KV head, summed over heads and layers."""
        total = None
        for layer, query in queries.items():
            table = self.means[layer]
            keys = table[:chunks] if isinstance(chunks, int) else table.index_select(0, chunks)
            grouped = query.float().reshape(keys.shape[1], -1, query.shape[-1])  # [H, Hq / H, D]
            layer_scores = torch.einsum("chd,hgd->c", keys, grouped)
            total = layer_scores if total is None else total + layer_scores
        return total


@attrs.define
class ScorerCost:
    """What the drafter's rescoring has cost, for /props and /metrics."""

    rescores: int = 0
    seconds: float = 0.0  # all rescorings together (the scorer's pass, the mapping, the chunk means)
    last_seconds: float = 0.0
    last_tokens: int = 0  # the history the last rescoring read
    load_seconds: float = 0.0  # the scorer's one load


class DrafterScorer:
    """The drafter policy's scorer: PFlash's scorer model from `path`, loaded on first use by `load(path)`
    (-> a `LoadedModel`-like object with `model` and `tokenizer`), shared by every sequence of a server."""

    def __init__(self, path: str, load: Callable[[str], Any], *, lookahead: int | None = None,
                 sparse: Any = None) -> None:
        from .prefill_compression import CompressionConfig

        self.path, self._load = path, load
        settings = CompressionConfig()
        self.lookahead = settings.lookahead if lookahead is None else lookahead
        self.pool = settings.pool
        self.sparse = sparse
        self.cost = ScorerCost()
        self.model: Any = None
        self.tokenizer: Any = None
        self._lock = threading.Lock()
        self._same_vocab: dict[int, bool] = {}  # id(target tokenizer) -> whether its ids are the scorer's

    @property
    def loaded(self) -> bool:
        return self.model is not None

    def _ensure_loaded(self) -> None:
        if self.model is not None:
            return
        start = time.perf_counter()
        loaded = self._load(self.path)
        if not hasattr(loaded.model, "tail_attention"):
            raise LuceboxError(f"--kvflash-scorer {self.path}: a {getattr(loaded.family, 'name', '?')} model "
                               f"cannot score tokens (needs tail_attention, e.g. the qwen3 family)")
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.cost.load_seconds = time.perf_counter() - start

    def chunk_scores(self, token_ids: Sequence[int], target_tokenizer: Any, chunk: int) -> torch.Tensor:
        """Each complete or partial `chunk`-token chunk's mean importance over `token_ids` (the target's),
        `[ceil(len / chunk)]` float32 on the scorer's device."""
        from .prefill_compression import chunk_means

        with self._lock:
            start = time.perf_counter()
            self._ensure_loaded()
            importance = self.token_importance(token_ids, target_tokenizer)
            scores = chunk_means(importance, chunk)
            seconds = time.perf_counter() - start
            self.cost.rescores += 1
            self.cost.seconds += seconds
            self.cost.last_seconds, self.cost.last_tokens = seconds, len(token_ids)
            return scores

    def token_importance(self, token_ids: Sequence[int], target_tokenizer: Any) -> torch.Tensor:
        """Importance `[len(token_ids)]` of each target token: the scorer's tail attention over the same
        text (`tail_scores`), through the scorer's own tokens when the vocabularies differ."""
        from .prefill_compression import tail_scores

        ids = list(token_ids)
        if self._shares_vocabulary(target_tokenizer):
            scorer_ids, first_byte_owner = ids, None
        else:
            scorer_ids, first_byte_owner = self._retokenize(ids, target_tokenizer)
        lookahead = min(self.lookahead, len(scorer_ids))
        queries, keys = self.model.tail_attention(torch.tensor(scorer_ids, dtype=torch.long), lookahead,
                                                  sparse=self.sparse)
        scores = tail_scores(queries, keys, self.pool).float()
        if first_byte_owner is None:
            return scores
        return scores.index_select(0, first_byte_owner.to(scores.device))

    def _shares_vocabulary(self, target_tokenizer: Any) -> bool:
        key = id(target_tokenizer)
        same = self._same_vocab.get(key)
        if same is None:
            theirs, ours = target_tokenizer, self.tokenizer
            same = (theirs.vocab_size == ours.vocab_size
                    and all(theirs.id_to_token(i) == ours.id_to_token(i) for i in range(ours.vocab_size)))
            self._same_vocab[key] = same
        return same

    def _retokenize(self, ids: list[int], target_tokenizer: Any) -> tuple[list[int], torch.Tensor]:
        """The scorer's ids for the target's text, and for each target token the index of the scorer token
        holding its first byte (a token of no bytes takes the one holding the byte after it)."""
        pieces = [target_tokenizer.token_bytes(i) for i in ids]
        text = b"".join(pieces).decode("utf-8", "replace")
        scorer_ids = self.tokenizer.encode(text, add_bos=False) or [self.tokenizer.eos_id or 0]
        target_starts = torch.tensor([0] + [len(p) for p in pieces[:-1]], dtype=torch.long).cumsum(0)
        scorer_ends = torch.tensor([len(self.tokenizer.token_bytes(i)) for i in scorer_ids], dtype=torch.long).cumsum(0)
        if int(scorer_ends[-1]) != sum(len(p) for p in pieces):  # bytes replaced (a split character): by share
            target_starts = target_starts * int(scorer_ends[-1]) // max(1, sum(len(p) for p in pieces))
        owner = torch.searchsorted(scorer_ends, target_starts, right=True).clamp_(max=len(scorer_ids) - 1)
        return scorer_ids, owner

    def describe(self) -> dict[str, Any]:
        return {"scorer": self.path, "scorer_loaded": self.loaded, "scorer_load_seconds": self.cost.load_seconds,
                "scorer_rescores": self.cost.rescores, "scorer_seconds": self.cost.seconds,
                "scorer_last_seconds": self.cost.last_seconds, "scorer_last_tokens": self.cost.last_tokens,
                "scorer_mean_seconds": self.cost.seconds / self.cost.rescores if self.cost.rescores else 0.0}
