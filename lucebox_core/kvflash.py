"""KVFlash: bounded KV residency (`--kvflash N|auto`, the `kvflash` KV policy).

Each attention layer keeps its K and V in a *pool* of N slots (N a multiple of 64) instead of one row per
position. Logical positions are mapped to slots a 64-token chunk at a time through a chunk table; chunks
that do not fit are copied, as stored (raw rows of the storage type: f16, Q8_0 blocks...), to host memory
(pinned where the device is not the CPU) and copied back when the policy wants them again. The first chunk
(the attention sink) and the trailing chunks are never paged out.

Why the attention kernels need no change: RoPE is applied before K is cached, so attention over a set of
rows does not depend on their order, only on which rows are in it. The pool is kept *compact*: the resident
chunks fill pool chunks `0 .. U-1`, every one but the last ones fully written, and the chunks of the
positions a pass writes (the partial tail and any new chunk) are always the top ones, in logical order and
contiguous. So the rows a query at position p may see are exactly the slots `0 .. slot(p)`: the
"slot <= position" mask every decode / tree attention op already applies becomes the exact validity mask
when the family hands it `slot(p)` (`attention_position`) instead of p. With a pool at least as large as
the context every chunk sits at its own index, slot = position, and everything is bit-identical to `full`.

Paging happens on the host between passes (`ensure_room`, called before every forward, decode step and
verify pass; `append` and `read` plan too when called without one), never inside a recorded step: `write`,
`gather`, `move` and `attention_position` read only the device position -> slot table, which a relayout
updates in place, so replayed graphs follow it. A plan that moves nothing (a decode token inside its chunk, the common
case) is O(1): it looks up the tail's chunks, never iterating the host chunks or the resident table (the
highest resident chunk, whether the pool is compact and a bound on the highest host chunk are kept for that).
Paged-out chunks live in records of a host arena allocated many at a time and reused (`kvflash_host`), and
the copies each way run on a side stream, ordered against the compute stream by events.

Policies (which non-protected chunk leaves when the pool is full, and which come back):
- `lru`: the chunk least recently written or recalled leaves; nothing is recalled (a StreamingLLM-like sink
  plus recent window, with the middle kept while there is room);
- `qk`: every `tau` tokens, inside a chunk or at its boundary, (and whenever a chunk must leave) each chunk
  is scored by the target's own current query (`observe_query`, the last token's query of each attention
  layer) against the chunk's mean key, summed over heads and layers; the lowest-scoring resident chunks leave
  and host chunks scoring above the weakest resident one come back. A swap keeps the resident count, so the
  partial tail stays contiguous on top (it moves only if recalls outnumber evictions, which a relayout does).
- `drafter`: the same choice by PFlash's scorer model reading the sequence's tokens (which the engine binds,
  `bind_tokens`), every `max(tau, history / 45)` tokens.
How the scores are made and the top set chosen (on the device, one small copy to the host): `kvflash_policy`.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from .errors import LuceboxError
from .kvflash_host import HostChunkArena, PageCopier
from .kvflash_policy import (POLICIES, SCORING, UNSCORED, DrafterScorer, PooledKeys, check_policy,  # noqa: F401
                             reselect_interval, top_chunks)
from .kv import K_FLAG, V_FLAG, KV_CACHE_TYPES, KVLayerShape, _Codec, check_kv_pair, head_dim_multiple, kv_cache_type

CHUNK = 64  # positions per chunk: the unit of mapping and paging
AUTO_POOL = 4096  # `--kvflash auto`: this many tokens, or the context if smaller
SINK_CHUNKS = 1  # the first chunk: attention sinks, never paged out
TRAILING_CHUNKS = 1  # complete chunks just before the tail, kept resident with it
MIN_POOL_CHUNKS = SINK_CHUNKS + TRAILING_CHUNKS + 2  # room for the sink, the trailing chunk and a pass


def pool_tokens(value: str | int, max_context: int | None = None) -> int:
    """The pool size `--kvflash` asks for: `auto` (4096, or the context if smaller) or a token count, rounded
    up to whole chunks; a LuceboxError naming the flag for anything else."""
    text = str(value).strip().lower()
    if text == "auto":
        tokens = AUTO_POOL if max_context is None else min(AUTO_POOL, max_context)
    else:
        try:
            tokens = int(text)
        except ValueError:
            raise LuceboxError(f"--kvflash: expected a pool size in tokens or 'auto', got {value!r}") from None
    if max_context is not None and tokens >= max_context:  # the whole context fits: slot = position
        tokens = max_context
    elif tokens < MIN_POOL_CHUNKS * CHUNK:
        raise LuceboxError(f"--kvflash {value}: the pool must hold at least {MIN_POOL_CHUNKS * CHUNK} tokens "
                           f"({MIN_POOL_CHUNKS} chunks of {CHUNK}: the sink, the trailing chunk and a pass)")
    return -(-tokens // CHUNK) * CHUNK


@attrs.define
class PageTraffic:
    """What a cache has paged, for /props and /metrics."""

    pages_out: int = 0  # chunks copied to host memory
    pages_in: int = 0  # chunks copied back into the pool
    bytes_out: int = 0
    bytes_in: int = 0
    reselections: int = 0  # qk / drafter: times they chose which chunks stay (due, or a chunk had to leave)
    reselect_seconds: float = 0.0  # ... host time they took (the drafter's scorer pass included)


class KVFlashCache:
    """One sequence's attention K/V in a bounded pool of `pool` slots per layer (see the module doc).

    The constructor takes what every KV policy's factory takes, plus `pool` (tokens; default 4096, capped
    at the context), `policy` (`lru`, `qk` or `drafter`), `tau` (tokens between reselections; the drafter's
    interval grows with the history) and, for `drafter`, `scorer` (a `kvflash_policy.DrafterScorer`)."""

    def __init__(
        self,
        layers: Mapping[int, KVLayerShape],
        max_context: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        k_type: str | torch.dtype | None = None,
        v_type: str | torch.dtype | None = None,
        pool: int | str = AUTO_POOL,
        policy: str = "lru",
        tau: int = 64,
        traffic: PageTraffic | None = None,
        scorer: DrafterScorer | None = None,
    ) -> None:
        """`traffic`: where the page counts go (a policy shares one among its sequences; default this cache's)."""
        if max_context <= 0:
            raise LuceboxError(f"the context size must be positive, got {max_context}")
        if tau < 1:
            raise LuceboxError(f"--kvflash-tau must be at least 1, got {tau}")
        self.max_context = max_context
        self.dtype = dtype
        self.device = torch.device(device)
        self.shapes = dict(layers)
        self.policy = check_policy(policy)
        self.tau = int(tau)
        if self.policy == "drafter" and scorer is None:
            raise LuceboxError("--kvflash-policy drafter needs a scorer model (--kvflash-scorer FILE)")
        self.scorer = scorer
        for layer, s in self.shapes.items():
            if s.window:
                raise LuceboxError(f"the kvflash KV policy pools global-attention layers only; layer {layer} is a "
                                   f"sliding-window layer (window {s.window}): use --kv-policy full")
        self.k_type = kv_cache_type(dtype if k_type is None else k_type, K_FLAG)
        self.v_type = kv_cache_type(dtype if v_type is None else v_type, V_FLAG)
        check_kv_pair(self.k_type, self.v_type, tuple(KV_CACHE_TYPES))
        self._k_codec, self._v_codec = _Codec(self.k_type, dtype), _Codec(self.v_type, dtype)
        for layer, s in self.shapes.items():
            for codec, role, dim, flag in ((self._k_codec, "K", s.k_head_dim, K_FLAG),
                                           (self._v_codec, "V", s.v_head_dim, V_FLAG)):
                if dim % head_dim_multiple(codec.cache_type):
                    raise LuceboxError(f"{flag} {codec.cache_type}: layer {layer}'s {role} head dim {dim} is not a "
                                       f"multiple of {head_dim_multiple(codec.cache_type)}; choose another type")
        context_chunks = -(-max_context // CHUNK)
        self.pool_chunks = pool_tokens(pool, max_context) // CHUNK
        self.pool_tokens = self.pool_chunks * CHUNK
        self._keys = {layer: torch.zeros(self.pool_tokens, s.kv_heads, *self._k_codec.stored_shape(s.k_head_dim),
                                         dtype=self._k_codec.storage_dtype, device=self.device)
                      for layer, s in self.shapes.items()}
        self._values = {layer: torch.zeros(self.pool_tokens, s.kv_heads, *self._v_codec.stored_shape(s.v_head_dim),
                                           dtype=self._v_codec.storage_dtype, device=self.device)
                        for layer, s in self.shapes.items()}
        self._lengths = {layer: 0 for layer in self.shapes}
        # Logical chunk -> pool chunk, on the host (`_where`) and on the device as position -> slot (what recorded
        # steps read: one gather a lookup, where `table[p // 64] * 64 + p % 64` was five small kernels, twice a
        # layer and token).
        self._context_chunks = context_chunks
        self._offsets = torch.arange(CHUNK, device=self.device)
        table = torch.arange(context_chunks, device=self.device).clamp_(max=self.pool_chunks - 1)
        self._slot_of = (table[:, None] * CHUNK + self._offsets).reshape(-1)
        self._where: dict[int, int] = {}  # resident logical chunk -> pool chunk
        # What keeps a plan O(1) when nothing moves (the decode step's case), rather than a scan of the tables:
        self._top = -1  # the highest resident chunk
        self._compact = True  # the resident chunks fill pool chunks 0 .. len(_where) - 1
        self._host: dict[int, int] = {}  # paged-out chunk -> its record in the arena ("<layer>.k|v" rows as stored)
        self._host_top = -1  # at least the highest paged-out chunk (a rollback scans `_host` only below it)
        self._arena = HostChunkArena(
            {f"{layer}.{role}": ((CHUNK, *buffer.shape[1:]), buffer.dtype)
             for layer in self.shapes for role, buffer in (("k", self._keys[layer]), ("v", self._values[layer]))},
            pin=self.device.type != "cpu")  # pinned host memory makes the copies asynchronous
        self._copier = PageCopier(self.device)
        # `qk`: every closed chunk's mean key on the device; `drafter`: every chunk's last score (unscored ones
        # above any scored, the newest highest) and where its tokens come from (`bind_tokens`).
        self._pooled = PooledKeys()
        newer = torch.arange(context_chunks, dtype=torch.float32, device=self.device) / context_chunks
        self._unscored = UNSCORED + newer
        self._drafter_scores = self._unscored.clone() if self.policy == "drafter" else None
        self._drafter_scored = 0  # chunks below this hold a score of the drafter's
        self._token_source: Callable[[], Sequence[int]] | None = None
        self._target_tokenizer: Any = None
        self._used: dict[int, int] = {}  # chunk -> tick it was last written or recalled (lru)
        self._tick = 0
        self._scored_at = 0  # the length at the last qk reselection
        self.traffic = traffic if traffic is not None else PageTraffic()
        # The last query of each layer (`observe_query`), for `qk`: a device buffer written in place.
        self._queries: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"KVFlashCache({len(self.shapes)} layers, {self.length}/{self.max_context} positions, pool "
                f"{self.pool_tokens}, {len(self._where)} resident / {len(self._host)} host chunks, {self.policy})")

    # -- sizes ---------------------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return max(self._lengths.values(), default=0)

    @property
    def nbytes(self) -> int:
        """Device bytes: the pools, whatever the context holds."""
        return sum(t.numel() * t.element_size() for t in (*self._keys.values(), *self._values.values()))

    @property
    def host_bytes(self) -> int:
        """The paged-out chunks' bytes (the arena's slabs may hold more: `host_reserved_bytes` in `info`)."""
        return len(self._host) * self._arena.chunk_bytes

    @property
    def bytes_per_token(self) -> int:
        """Device bytes one more position takes: none, the pool is allocated whole."""
        return 0

    @property
    def max_window(self) -> int:
        """The most rows a static step's window holds: the pool (`kv.window_limit`)."""
        return min(self.pool_tokens, self.max_context)

    @property
    def max_pass(self) -> int:
        """The most positions one pass may add: its chunks, the sink and the trailing chunk must fit."""
        if self.pool_tokens >= self.max_context:
            return self.max_context
        return (self.pool_chunks - SINK_CHUNKS - TRAILING_CHUNKS - 1) * CHUNK

    def info(self) -> dict[str, int | str]:
        """Residency and page traffic (shared with the policy's other sequences when it made this one), and the
        drafter's scorer cost."""
        return {"pool_tokens": self.pool_tokens, "policy": self.policy, "tau": self.tau,
                "resident_chunks": len(self._where), "host_chunks": len(self._host),
                **attrs.asdict(self.traffic), "device_bytes": self.nbytes, "host_bytes": self.host_bytes,
                "host_reserved_bytes": self._arena.capacity_bytes,
                **(self.scorer.describe() if self.scorer is not None else {})}

    def bind_tokens(self, source: Callable[[], Sequence[int]], tokenizer: Any) -> None:
        """Where the drafter policy reads the sequence's tokens (`source()`: at least the `length` the cache
        holds, in the target's vocabulary) and the target's tokenizer (to hand the scorer the same text)."""
        self._token_source, self._target_tokenizer = source, tokenizer

    # -- planning (host side, between passes) -------------------------------------------------------------

    def ensure_room(self, new_tokens: int) -> None:
        """Map positions `length .. length + new_tokens - 1` to the top of the pool, paging chunks out (and,
        for `qk`, back in) as the policy says; a LuceboxError, before anything moves, if they cannot fit."""
        length = self.length
        if length + new_tokens > self.max_context:
            raise LuceboxError(
                f"context overflow: the sequence holds {length} tokens and {new_tokens} more do not fit "
                f"in the context size {self.max_context}; raise -c/--ctx-size or shorten the conversation"
            )
        self._plan(length, new_tokens)

    def _plan(self, length: int, new_tokens: int) -> None:
        first = length // CHUNK
        last = (length + new_tokens - 1) // CHUNK if new_tokens else first - (length % CHUNK == 0)
        tail = list(range(first, last + 1))  # the chunks this pass writes into, in order
        if last >= self.pool_chunks and len(tail) > self.pool_chunks - SINK_CHUNKS - TRAILING_CHUNKS:
            raise LuceboxError(
                f"kvflash: a pass of {new_tokens} tokens does not fit a pool of {self.pool_tokens} (the sink and "
                f"trailing chunks stay resident); feed at most {self.max_pass} tokens a pass (-ub/--ubatch-size)"
            )
        # Chunks past the tail hold only rolled-back rows: dropped, never paged (scans only after a rollback).
        if self._top > last:
            self._drop_resident_after(last)
        if self._host_top * CHUNK >= length:
            for chunk in [c for c in self._host if c * CHUNK >= length]:
                self._drop_host(chunk)
            self._host_top = max(self._host, default=-1)
        if self.policy == "qk" and first > self._pooled.closed:  # a chunk closed: pool its keys (before it may leave)
            self._close_chunks(first)
        # `qk` and `drafter` reselect every interval, chunk boundary or not: a swap keeps the resident count, so
        # the tail stays contiguous at the top and only the swapped chunks' slots change.
        reselect = (self.policy in SCORING and bool(self._host)
                    and length - self._scored_at >= reselect_interval(self.policy, self.tau, length))
        if self._tail_in_place(tail) and not reselect:
            return
        old = sorted(c for c in self._where if c < first)
        room = self.pool_chunks - len(tail)
        protected = set(range(SINK_CHUNKS)) | set(range(first - TRAILING_CHUNKS, first))
        recalls: list[int] = []
        if self.policy in SCORING and (self._host or len(old) > room):
            old, recalls = self._select_scored(old, room, protected, length)
        else:
            while len(old) > room:
                victims = [c for c in old if c not in protected] or [c for c in old if c >= SINK_CHUNKS]
                old.remove(min(victims, key=lambda c: (self._used.get(c, 0), c)))
        self._relayout(old + recalls, tail)

    def _drop_resident_after(self, last: int) -> None:
        """Forget the resident chunks past `last` (rolled back); the pool stays compact if they were its top."""
        dropped = sorted(self._where.pop(c) for c in [c for c in self._where if c > last])
        if dropped != list(range(len(self._where), len(self._where) + len(dropped))):
            self._compact = False
        self._top = max(self._where, default=-1)

    def _tail_in_place(self, tail: list[int]) -> bool:
        """Whether the tail's chunks are (or can be, with no data moved) the top of the pool, in order: the
        resident rows below the tail fill every pool chunk below it (the mask is "slot <= p"). In O(len(tail)):
        over a compact pool that holds nothing past the tail, that is the resident chunks from the tail's first
        one up (`first .. _top`) sitting at the top slots in order."""
        if not self._compact:
            return False  # a rollback far back: relayout
        if not tail:
            return True
        first, used = tail[0], len(self._where)
        if first in self._where:
            start = used - (self._top - first + 1)
            if any(self._where.get(first + i) != start + i for i in range(self._top - first + 1)):
                return False
        elif self._top >= first:
            return False
        else:
            start = used
        if start + len(tail) > self.pool_chunks or any(c in self._host for c in tail):
            return False
        for i, chunk in enumerate(tail):
            if chunk not in self._where:
                self._where[chunk] = start + i
                torch.add(self._offsets, (start + i) * CHUNK, out=self._slot_of[chunk * CHUNK:(chunk + 1) * CHUNK])
                self._touch(chunk)
        self._top = max(self._top, tail[-1])
        return True

    def _touch(self, chunk: int) -> None:
        self._tick += 1
        self._used[chunk] = self._tick

    def _select_scored(self, old: list[int], room: int, protected: set[int],
                       length: int) -> tuple[list[int], list[int]]:
        """`qk` / `drafter`: which old chunks stay and which host chunks come back. When a reselection is due,
        the best `room` of every materialized chunk (resident or paged out; the protected ones kept if resident,
        never recalled); in between, only what must leave leaves, by the last scores. Chosen on the device
        (`top_chunks`): the host sees the chosen ids only, never a loop over the host chunks."""
        first = length // CHUNK
        due = length - self._scored_at >= reselect_interval(self.policy, self.tau, length)
        if not due and len(old) <= room:
            return old, []
        started = time.perf_counter()
        keep = [c for c in old if c in protected]
        count = room - len(keep)
        scores = self._all_scores(first, length) if due else None
        if scores is not None:
            self._scored_at = length
            chosen = top_chunks(scores, count, [c for c in protected if c < first])
        else:  # between reselections (or nothing to score with yet): the resident candidates only
            candidates = [c for c in old if c not in protected]
            scores = self._scores_of(candidates)
            if scores is None:  # no query seen, no tokens bound: the most recently used stay
                chosen = sorted(candidates, key=lambda c: -self._used.get(c, 0))[:max(0, count)]
            else:
                chosen = [candidates[i] for i in top_chunks(scores, count)]
        self.traffic.reselections += 1
        self.traffic.reselect_seconds += time.perf_counter() - started
        kept = sorted(keep + [c for c in chosen if c in self._where])
        return kept, sorted(c for c in chosen if c in self._host)

    def _all_scores(self, first: int, length: int) -> torch.Tensor | None:
        """Every materialized chunk's score `[first]` on the device (qk: the pooled keys against the last
        queries; drafter: the scorer's pass over the tokens, which also updates the last scores), or None
        when there is nothing to score with."""
        if self.policy == "qk":
            return self._pooled.scores(self._queries, first) if self._queries else None
        ids = self._token_source() if self._token_source is not None else ()
        if len(ids) < length or not length:
            return None
        scores = self.scorer.chunk_scores(ids[:length], self._target_tokenizer, CHUNK)[:first].to(self.device)
        self._drafter_scores[:first] = scores
        self._drafter_scored = first
        return scores

    def _scores_of(self, chunks: list[int]) -> torch.Tensor | None:
        """The scores of resident `chunks` (qk: against the last queries; drafter: the last rescoring's,
        chunks it has not seen yet above all)."""
        index = torch.tensor(chunks, dtype=torch.long, device=self.device)
        if self.policy == "drafter":
            return self._drafter_scores.index_select(0, index) if self._token_source is not None else None
        return self._pooled.scores(self._queries, index) if self._queries else None

    def _close_chunks(self, first: int) -> None:
        """Pool the keys of chunks `closed .. first - 1` (complete: their rows are final until a rollback
        reaches them): resident ones in one gather a layer, a paged-out one (only after a rollback) from its
        host record."""
        chunks = list(range(self._pooled.closed, first))
        if not chunks:
            return
        resident = [c for c in chunks if c in self._where]
        paged = [c for c in chunks if c not in self._where]
        rows = self._rows([self._where[c] for c in resident]) if resident else None
        for layer, shape in self.shapes.items():
            buffer = self._keys[layer]
            table = self._pooled.store(layer, self._context_chunks, shape.kv_heads, shape.k_head_dim, self.device)
            if resident:
                keys = self._k_codec.decode(buffer.index_select(0, rows)).float()
                means = keys.unflatten(0, (len(resident), CHUNK)).mean(1)
                table.index_copy_(0, torch.tensor(resident, dtype=torch.long, device=self.device), means)
            for chunk in paged:
                held = self.host_rows(chunk)[f"{layer}.k"].to(self.device)
                table[chunk] = self._k_codec.decode(held).float().mean(0)
        self._pooled.closed = first

    def observe_query(self, layer: int, query: torch.Tensor) -> None:
        """Keep the last token's query `[..., T, Hq, D]` of `layer` for `qk` scoring (in place: a recorded
        step may call it)."""
        if self.policy != "qk":
            return
        last = query.reshape(-1, *query.shape[-2:])[-1]
        held = self._queries.get(layer)
        if held is None or held.shape != last.shape:
            self._queries[layer] = last.detach().clone()
        else:
            held.copy_(last)

    def _relayout(self, old: list[int], tail: list[int]) -> None:
        """Make the pool hold `old` (sorted; resident or on the host) in its first chunks, then `tail` in
        order: evicted chunks copied out first, moves within the pool all read before any write, recalled
        chunks copied in last."""
        keep = set(old) | set(tail)
        self._page_out(sorted(c for c in self._where if c not in keep))
        base = len(old)
        target: dict[int, int] = {c: base + i for i, c in enumerate(tail)}
        taken = {self._where[c] for c in old if c in self._where}
        holes = iter([j for j in range(base) if j not in taken])
        for chunk in old:
            where = self._where.get(chunk)
            target[chunk] = where if where is not None and where < base else next(holes)
        moves = [(self._where[c], target[c]) for c in target if c in self._where and self._where[c] != target[c]]
        if moves:
            source = self._rows([s for s, _ in moves])
            destination = self._rows([d for _, d in moves])
            for buffer in (*self._keys.values(), *self._values.values()):
                buffer.index_copy_(0, destination, buffer.index_select(0, source))
        self._where = {c: target[c] for c in target if c in self._where}
        self._page_in([(c, target[c]) for c in (*old, *tail) if c in self._host])
        for chunk in tail:
            if chunk not in self._where:
                self._where[chunk] = target[chunk]
                self._touch(chunk)
        self._compact, self._top = True, max(self._where, default=-1)
        chunks = list(self._where)
        self._slot_of.index_copy_(0, self._rows(chunks), self._rows([self._where[c] for c in chunks]))

    def _rows(self, pool_chunks: list[int]) -> torch.Tensor:
        starts = torch.tensor(pool_chunks, dtype=torch.long, device=self.device)[:, None] * CHUNK
        return (starts + torch.arange(CHUNK, device=self.device)).reshape(-1)

    def _page_out(self, chunks: list[int]) -> None:
        """Copy `chunks` to host records (on the side stream where there is one) and forget their slots."""
        pairs = []
        for chunk in chunks:
            rows = slice(self._where[chunk] * CHUNK, (self._where[chunk] + 1) * CHUNK)
            record = self._arena.take()
            host = self._arena.views(record)
            for layer in self.shapes:
                for role, buffer in (("k", self._keys[layer]), ("v", self._values[layer])):
                    pairs.append((host[f"{layer}.{role}"], buffer[rows]))
            self._host[chunk] = record
            self._host_top = max(self._host_top, chunk)
            del self._where[chunk]
            self.traffic.pages_out += 1
            self.traffic.bytes_out += self._arena.chunk_bytes
        self._copier.copy_out(pairs)

    def _page_in(self, recalls: list[tuple[int, int]]) -> None:
        """Copy each `(chunk, pool chunk)` back from its host record (its record is free again once the copy
        is issued: every later copy into it is ordered after this one)."""
        pairs = []
        for chunk, pool_chunk in recalls:
            rows = slice(pool_chunk * CHUNK, (pool_chunk + 1) * CHUNK)
            host = self._arena.views(self._host[chunk])
            for layer in self.shapes:
                for role, buffer in (("k", self._keys[layer]), ("v", self._values[layer])):
                    pairs.append((buffer[rows], host[f"{layer}.{role}"]))
            self.traffic.bytes_in += self._arena.chunk_bytes
            self.traffic.pages_in += 1
        self._copier.copy_in(pairs)
        for chunk, pool_chunk in recalls:
            self._drop_host(chunk)
            self._where[chunk] = pool_chunk
            self._touch(chunk)

    def _drop_host(self, chunk: int) -> None:
        record = self._host.pop(chunk, None)
        if record is not None:
            self._arena.release(record)

    def host_rows(self, chunk: int) -> dict[str, torch.Tensor]:
        """A paged-out chunk's host rows, `"<layer>.k|v"` -> rows as stored, once their copy has landed (views
        into the arena: valid until the chunk is recalled or dropped)."""
        self._copier.synchronize()
        return self._arena.views(self._host[chunk])

    def _valid_rows(self, length: int) -> int:
        """Pool rows a query at position `length` sees (all resident rows of positions below it): the slot
        `length` maps to, once the tail is in place."""
        first, within = divmod(length, CHUNK)
        slot = self._where.get(first)
        if self._compact and slot is not None and self._top == first and slot == len(self._where) - 1:
            return slot * CHUNK + within  # the common case, in O(1): every other resident chunk is below
        if self._compact and slot is None and self._top < first:
            return len(self._where) * CHUNK + within
        below = sum(1 for c in self._where if c < first)
        return below * CHUNK + within

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        return self._slot_of[positions]

    def attention_position(self, position: torch.Tensor) -> torch.Tensor:
        """The slot a query at device `position` writes to: the decode / tree attention ops mask the window
        at it ("slot <= position"), which over the compact pool is exactly the resident rows it may see."""
        return self._slots(position)

    def resident_positions(self) -> list[int]:
        """The logical positions held in the pool, in slot order (for tests and tools)."""
        length = self.length
        by_slot = sorted(self._where.items(), key=lambda item: item[1])
        return [p for c, _ in by_slot for p in range(c * CHUNK, min((c + 1) * CHUNK, length))]

    # -- the eager path -----------------------------------------------------------------------------------

    def _settle(self, start: int, tokens: int) -> None:
        """Plan from an eager call that came without `ensure_room` (the first layer of a pass)."""
        if all(held == start for held in self._lengths.values()):
            self._plan(start, tokens)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k` / `v` `[T, heads, dim]` at the positions after what `layer` holds; return the resident
        rows and the new ones, decoded, in slot order: query i of the pass sees the first
        `len - T + i + 1` of them (the family's causal offset is `len - T`)."""
        if layer not in self.shapes:
            raise KeyError(f"layer {layer} has no KV cache (cached layers: {sorted(self.shapes)})")
        start, tokens = self._lengths[layer], k.shape[0]
        if start + tokens > self.max_context:
            raise LuceboxError(
                f"context overflow: layer {layer} holds {start} tokens and {tokens} more do not fit in the "
                f"context size {self.max_context}; raise -c/--ctx-size or shorten the conversation"
            )
        shape = self.shapes[layer]
        expected_k, expected_v = (tokens, shape.kv_heads, shape.k_head_dim), (tokens, shape.kv_heads, shape.v_head_dim)
        if tuple(k.shape) != expected_k or tuple(v.shape) != expected_v:
            raise ValueError(
                f"layer {layer}: K {tuple(k.shape)} / V {tuple(v.shape)} do not match {expected_k} / {expected_v}")
        self._settle(start, tokens)
        first = self._valid_rows(start) if start else 0
        end = first + tokens  # the tail is contiguous at the top of the pool
        self._keys[layer][first:end] = self._k_codec.encode(k)
        self._values[layer][first:end] = self._v_codec.encode(v)
        self._lengths[layer] = start + tokens
        return self._k_codec.decode(self._keys[layer][:end]), self._v_codec.decode(self._values[layer][:end])

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The resident K and V of `layer`, decoded, in slot order."""
        held = self._lengths[layer]
        self._settle(held, 0)
        rows = self._valid_rows(held)
        return self._k_codec.decode(self._keys[layer][:rows]), self._v_codec.decode(self._values[layer][:rows])

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k_codec.decode(self._k_codec.encode(k)), self._v_codec.decode(self._v_codec.encode(v))

    # -- the static path (recorded steps): the device slot table only ------------------------------------

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self._slots(positions)
        self._keys[layer].index_copy_(0, slots, self._k_codec.encode(k))
        self._values[layer].index_copy_(0, slots, self._v_codec.encode(v))

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        src, dst = self._slots(source), self._slots(destination)
        for buffer in (*self._keys.values(), *self._values.values()):
            buffer.index_copy_(0, dst, buffer.index_select(0, src))

    def gather(self, layer: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `min(size, pool)` slots as stored (views); the op masks them at `attention_position`."""
        if not 0 < size <= self.max_context:
            raise ValueError(f"a window of {size} rows does not fit the context size {self.max_context}")
        size = min(size, self.pool_tokens)
        return self._keys[layer][:size], self._values[layer][:size]

    def commit(self, length: int) -> None:
        if length > self.max_context:
            raise LuceboxError(f"context overflow: {length} positions do not fit in the context size {self.max_context}")
        for layer in self._lengths:
            self._lengths[layer] = max(self._lengths[layer], length)

    def rollback(self, length: int) -> None:
        """Forget every position from `length` on: a pointer move; chunks past it are dropped at the next
        plan (a verify's `move` still reads the rows past `length` after this)."""
        if length < 0:
            raise ValueError(f"cannot crop to a negative length ({length})")
        for layer, held in self._lengths.items():
            self._lengths[layer] = min(held, length)
        self._pooled.rollback(length // CHUNK)
        if length // CHUNK < self._drafter_scored:  # chunks whose rows will be written again: unscored
            self._drafter_scores[length // CHUNK:] = self._unscored[length // CHUNK:]
            self._drafter_scored = length // CHUNK
        if length == 0:
            self._scored_at = 0

    # -- snapshots: not supported (the prefix cache asks for them only where they exist) -----------------

    def export_rows(self, length: int) -> dict[str, torch.Tensor]:
        raise LuceboxError("the kvflash KV policy cannot export its rows for the prefix cache (part of the context "
                           "may be paged out); run without --cache-reuse/prefix caching or with --kv-policy full")

    def import_rows(self, rows: Mapping[str, torch.Tensor], length: int, *, check_only: bool = False) -> None:
        raise LuceboxError("the kvflash KV policy cannot import prefix-cache rows; use --kv-policy full")


class KVFlashPolicy:
    """The `kvflash` policy as the flags configure it: the factory of each sequence's `KVFlashCache`
    (`KVPolicy.factory`), which also sums their residency and traffic for /props and /metrics."""

    def __init__(self, pool: int | str = "auto", policy: str = "lru", tau: int = 64,
                 scorer: DrafterScorer | None = None) -> None:
        """`scorer`: the drafter policy's (loaded on its first reselection, shared by every sequence)."""
        if str(pool).strip().lower() != "auto":
            pool_tokens(pool)  # checked now: a bad size fails before the weights load
        if int(tau) < 1:
            raise LuceboxError(f"--kvflash-tau must be at least 1, got {tau}")
        self.pool, self.policy, self.tau = pool, check_policy(policy), int(tau)
        if self.policy == "drafter" and scorer is None:
            raise LuceboxError("--kvflash-policy drafter needs a scorer model (--kvflash-scorer FILE)")
        self.scorer = scorer if self.policy == "drafter" else None
        self.traffic = PageTraffic()  # every sequence's paging, summed (counters: they never go down)
        self._caches: weakref.WeakSet[KVFlashCache] = weakref.WeakSet()
        self.pool_tokens = 0  # the pool of the last sequence made (it depends on the context)

    def __call__(self, layers: Mapping[int, KVLayerShape], max_context: int, **options) -> KVFlashCache:
        cache = KVFlashCache(layers, max_context, pool=self.pool, policy=self.policy, tau=self.tau,
                             traffic=self.traffic, scorer=self.scorer, **options)
        self._caches.add(cache)
        self.pool_tokens = cache.pool_tokens
        return cache

    def max_pass(self, max_context: int) -> int:
        """The most tokens one forward pass may add to a sequence of `max_context` (the engine's -ub cap)."""
        chunks = pool_tokens(self.pool, max_context) // CHUNK
        if chunks * CHUNK >= max_context:
            return max_context
        return (chunks - SINK_CHUNKS - TRAILING_CHUNKS - 1) * CHUNK

    def describe(self) -> dict[str, int | str | bool]:
        """The pool asked for, residency summed over the live sequences, and all the paging done."""
        caches = list(self._caches)
        totals = {key: sum(int(cache.info()[key]) for cache in caches)
                  for key in ("resident_chunks", "host_chunks", "device_bytes", "host_bytes",
                              "host_reserved_bytes")}
        totals.update(attrs.asdict(self.traffic))
        return {"enabled": True, "pool": str(self.pool), "pool_tokens": self.pool_tokens, "policy": self.policy,
                "tau": self.tau, "sequences": len(caches), **totals,
                **(self.scorer.describe() if self.scorer is not None else {})}
