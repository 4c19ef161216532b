"""The one decode loop.

A `Sequence` owns everything one conversation needs between calls: the model state (KV cache, recurrent
and conv state), the tokens so far, its sampler. `Engine.stream` prefills the new prompt tokens in chunks,
then decodes token by token, turning ids into UTF-8-safe text, stopping on an end-of-generation id, a
stop string (matched across token boundaries) or the token budget.

The model is anything with `vocab_size`, `context_length`, `new_state(max_tokens)` and
`forward(state, token_ids) -> logits[len(token_ids), vocab]` (which advances the state). A model that also
has `reset_state(state)` gets its finished sequences' states back for later requests (`Engine.release`):
buffers, and the CUDA graphs recorded on them, are reused rather than made again per request. The engine
waits for the device, and copies sampled tokens back, through the backend's device services (`backend`:
the model's ops by default).
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence as Seq
from typing import Any, Protocol

import attrs
import torch

from .errors import LuceboxError
from .mask_ahead import MaskAhead
from .prefix_cache import PrefixCache, turn_boundaries
from .device_sampling import DeviceSampler, SamplerBuffers
from .sampling import Sampler, SamplingParams, StopMatcher
from .speculative.loop import ForcedStep, forced_accept_counts

log = logging.getLogger("lucebox.engine")

# Prefill pieces of at most this many tokens run as recorded decode steps where the model records them (see
# `Engine._prefill_piece`): the prompt's tail after its last turn boundary (a chat template's header of the
# answer, ~3 tokens) and short turns restored from the prefix cache.
STEPPED_PIECE_TOKENS = 6


class CausalLM(Protocol):
    vocab_size: int
    context_length: int

    def new_state(self, max_tokens: int) -> Any: ...

    def forward(self, state: Any, token_ids: torch.Tensor) -> torch.Tensor: ...


@attrs.frozen(kw_only=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple)
    max_tokens: int = 128
    sampling: SamplingParams = attrs.Factory(SamplingParams)
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    constraint: Any = None  # a `Constraint`: restricts which tokens may come next (grammars, JSON schema)
    speculative: bool = True  # use the engine's drafter, if it has one (logprobs and constraints decode plainly)
    # `--force-accept`: the plain greedy continuation of this request, and the mean number of drafts per
    # step to replace with it, so the real verifier accepts exactly that many (benchmarks, tests).
    force_accept: float | None = None
    force_reference: tuple[int, ...] = attrs.field(default=(), converter=tuple)


class Constraint(Protocol):
    """Constrained decoding: a mask of the tokens allowed next, advanced by each token chosen.

    A constraint may also say it is `dormant` (masks nothing for now, whatever comes): the engine then may
    decode speculatively, feeding it the accepted tokens, and goes on plainly once it wakes. The engine calls
    `accept` then `allowed` for the next step on a worker thread (`MaskAhead`), never two calls at once.
    """

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        """Boolean mask over the vocabulary, or None when anything goes."""

    def accept(self, token_id: int) -> None: ...

    @property
    def finished(self) -> bool:
        """True once the constrained output is complete: generation stops there."""


@attrs.frozen
class Step:
    """One generated token and the text it made visible (possibly empty while UTF-8 or a stop is pending)."""

    token_id: int | None
    text: str
    finish_reason: str | None = None  # "stop" | "length" on the last step
    logprob: float | None = None  # of token_id under the model (when the request asks for logprobs)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the most likely alternatives, best first


@attrs.define
class Timings:
    prompt_tokens: int = 0  # prompt tokens run through the model (not those restored from the prefix cache)
    prompt_seconds: float = 0.0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    # Speculative decoding: per verify step, the tokens it produced (accepted drafts + the bonus).
    accepted_lengths: list[int] = attrs.Factory(list)
    # Tokens decoded plainly because the speculation governor judged drafting slower (--tree-budget auto).
    governed_plain_tokens: int = 0

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@attrs.define
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    timings: Timings


@attrs.define
class Sequence:
    """A conversation's state; call `Engine.stream` again with more prompt ids to continue it."""

    state: Any
    tokens: list[int] = attrs.Factory(list)  # every token the model has seen, in order
    pending_logits: torch.Tensor | None = None  # logits after the last token, not yet sampled from
    unfed: list[int] = attrs.Factory(list)  # generated tokens the model has not seen yet (the last one)
    draft: Any = None  # the drafter's state for this sequence (speculative decoding)
    streaming: bool = False  # a `stream` over it is open: it cannot be released or streamed again
    # The device tensors sampling keeps between draws: the state's, like its recordings, which read them.
    sampler_buffers: SamplerBuffers | None = None

    @property
    def length(self) -> int:
        return len(self.tokens) + len(self.unfed)


def never_generated(tokenizer: Any, vocab_size: int) -> torch.Tensor | None:
    """The boolean mask over the model's `vocab_size` outputs of ids no generation may pick: the
    vocabulary's unused entries (`tokenizer.unused_ids()`: padding placeholders) and any output row past the
    tokenizer's vocabulary (a padded output layer); None when there are none."""
    unused = [i for i in (tokenizer.unused_ids() if hasattr(tokenizer, "unused_ids") else ()) if i < vocab_size]
    named = int(getattr(tokenizer, "vocab_size", vocab_size))
    if not unused and named >= vocab_size:
        return None
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.tensor(unused, dtype=torch.long)] = True
    mask[named:] = True
    return mask


class Engine:
    """`speculative`: a `lucebox_core.speculative.SpeculativeDecoder` (drafter + verifier) for the model, or None."""

    def __init__(self, model: CausalLM, tokenizer: Any, *, ctx_size: int | None = None,
                 prefill_chunk: int | None = None, speculative: Any = None, idle_sequences: int = 1,
                 backend: Any = None, prefix_cache: PrefixCache | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.backend = backend if backend is not None else getattr(model, "ops", None)
        self.ctx_size = min(ctx_size or model.context_length, model.context_length)
        # Tokens per prefill forward call: the model's preference (large on a GPU, where a chunk's cost is
        # reading the weights once), else 512.
        if prefill_chunk is not None and prefill_chunk < 1:
            raise LuceboxError(f"-ub/--ubatch-size must be at least 1, got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk or getattr(model, "prefill_chunk", 512))
        # Models that can stop at the last position's logits skip the output head for the rest of a chunk
        # (at 248K vocabulary, 2 GB of logits for a 4096-token chunk).
        self._last_only = "last_only" in inspect.signature(model.forward).parameters
        self.eog_ids = frozenset(getattr(tokenizer, "eot_ids", ()) or ())
        self.suppressed = never_generated(tokenizer, model.vocab_size)
        self._suppressed_on: dict[str, torch.Tensor] = {}  # the mask per device it was needed on
        self.speculative = speculative
        # Finished sequences kept for reuse (`release`), at most `idle_sequences` of them.
        self.idle_sequences = idle_sequences
        self._idle: list[Sequence] = []
        self._idle_lock = threading.Lock()
        self._mask_workers: ThreadPoolExecutor | None = None  # constraints' masks, computed ahead (made on first use)
        # The prefix cache (`prefix_cache`), for models whose states can be snapshotted.
        if prefix_cache is not None and not hasattr(model, "restore_state"):
            log.warning("the prefix cache is off: %s cannot snapshot its state", type(model).__name__)
            prefix_cache = None
        self.prefix_cache = prefix_cache

    def new_sequence(self) -> Sequence:
        """An empty sequence: a released one emptied for reuse where there is one, else a new state."""
        reset = getattr(self.model, "reset_state", None)
        with self._idle_lock:
            recycled = self._idle.pop() if self._idle and reset is not None else None
        if recycled is not None:
            reset(recycled.state)
            sequence = Sequence(recycled.state, sampler_buffers=recycled.sampler_buffers)
            if self.speculative is not None:
                sequence.draft = self.speculative.recycle(sequence.state, recycled.draft, self.ctx_size)
            return self._bind_tokens(sequence)
        sequence = Sequence(self.model.new_state(self.ctx_size))
        if self.speculative is not None:
            sequence.draft = self.speculative.prepare(sequence.state, self.ctx_size)
        return self._bind_tokens(sequence)

    def _bind_tokens(self, sequence: Sequence) -> Sequence:
        """Show a KV policy that reads the sequence (KVFlash's drafter) its tokens: those the model has seen,
        through a weak reference (the state must not keep its sequence alive)."""
        from .kv import bind_tokens

        owner = weakref.ref(sequence)
        bind_tokens(getattr(sequence.state, "kv", None), lambda: getattr(owner(), "tokens", ()), self.tokenizer)
        return sequence

    def release(self, sequence: Sequence) -> None:
        """Give back a sequence that is finished with (it must not be used again): the next `new_sequence`
        empties and reuses its state, so the decode step and verify pass replay the CUDA graphs recorded
        for it instead of recording them again (at 27B a recording costs about as much as a dozen steps,
        which a short answer would otherwise pay in full). Models without `reset_state` are not pooled."""
        if getattr(self.model, "reset_state", None) is None or sequence.streaming:
            return  # an open stream still commits into the state when it is closed: never pool that
        with self._idle_lock:
            # By state: a recycled state comes back in a new Sequence, and an old one released again must
            # not put the same state in the pool twice.
            if len(self._idle) < self.idle_sequences and all(s.state is not sequence.state for s in self._idle):
                self._idle.append(sequence)

    def _synchronize(self) -> None:
        """Wait for the model's device (a timing must count the work, not its launch)."""
        if self.backend is not None:
            self.backend.synchronize()

    def prefill(self, sequence: Sequence, token_ids: Seq[int], timings: Timings | None = None) -> None:
        """Run new prompt tokens through the model in chunks; keep the last position's logits.

        The prompt is split at its turn boundaries (after each end-of-turn token) as well as every
        `prefill_chunk` tokens, cache or no cache: a state snapshotted at a boundary is then exactly the state
        any later prefill of the same tokens passes through (see `prefix_cache`). A fresh sequence first
        restores the longest cached boundary prefix of the prompt, and a new boundary worth keeping is
        snapshotted on the way."""
        if sequence.length + len(token_ids) > self.ctx_size:
            raise LuceboxError(
                f"the prompt needs {sequence.length + len(token_ids)} positions but the context holds "
                f"{self.ctx_size}; shorten the prompt or raise -c/--ctx-size"
            )
        # The last token generated by an earlier call was never fed: it goes first.
        token_ids, sequence.unfed = [*sequence.unfed, *token_ids], []
        if not token_ids:
            return
        start = time.perf_counter()
        boundaries = turn_boundaries(token_ids, self.eog_ids)
        fresh = not sequence.tokens
        done = self._restore_prefix(sequence, token_ids, boundaries) if fresh else 0
        snapshot_at = self._snapshot_point(token_ids, boundaries, done) if fresh else None
        logits = None
        for begin, end in self._prefill_pieces(done, len(token_ids), boundaries):
            chunk = list(token_ids[begin:end])
            logits = self._prefill_piece(sequence, chunk)
            sequence.tokens.extend(chunk)
            if end == snapshot_at:
                self._take_snapshot(sequence)
        assert logits is not None
        sequence.pending_logits = logits[-1]
        self._synchronize()
        if timings is not None:
            timings.prompt_tokens += len(token_ids) - done
            timings.cached_tokens += done
            timings.prompt_seconds += time.perf_counter() - start

    def _prefill_piece(self, sequence: Sequence, chunk: list[int]) -> torch.Tensor:
        """One piece of a prefill through the model; the logits of (at least) its last token.

        A piece of at most `STEPPED_PIECE_TOKENS` on a model whose decode step is recorded goes through that
        step token by token: an eager forward call costs a thousand kernel launches of host time whatever its
        length (the 27B on the H200: 85 ms for 3 tokens at depth 32K, 13 ms of it on the GPU), a replayed step
        ~10 ms a token. What a piece runs on depends on its length alone (while the step records: one whose
        recording failed has warned, and runs pieces as forward calls again), so a cold prefill and one restored
        from the prefix cache still cut and run the same pieces (the same bits)."""
        decode = getattr(sequence.state, "decode", None)
        recorded = getattr(self.model, "decode_graphs", False) and getattr(decode, "failure", None) is None
        if len(chunk) <= STEPPED_PIECE_TOKENS and recorded:  # (a step whose recording failed runs eagerly: slower)
            for token in chunk:
                logits = self.model.forward(sequence.state, torch.tensor([token], dtype=torch.long))
            return logits
        tensor = self._piece_ids(chunk)
        if self._last_only:
            return self.model.forward(sequence.state, tensor, last_only=True)
        return self.model.forward(sequence.state, tensor)

    def _piece_ids(self, chunk: list[int]) -> torch.Tensor:
        """A piece's ids, already on the model's device where it has one, copied without making the host wait.

        A copy from pageable host memory waits for the device's stream to drain: for everything queued before
        it (the previous piece; a restored snapshot's 2.3 GB of KV, on the 27B at 32K). The host, which paces
        a short piece's thousands of launches, would then start each piece only once the GPU is idle. Through
        pinned memory the copy is queued like a kernel (the H200, session 15: the one host wait of a forward
        call)."""
        ids = torch.tensor(chunk, dtype=torch.long)
        device = getattr(self.backend, "device", None)
        if device is None or torch.device(device).type == "cpu":
            return ids
        staged = self.backend.host_buffer(tuple(ids.shape), torch.long)
        staged.copy_(ids)
        return staged.to(device, non_blocking=True)

    def _prefill_pieces(self, begin: int, end: int, boundaries: Seq[int]) -> Iterator[tuple[int, int]]:
        """Spans of the prefill from `begin` to `end`: cut at each turn boundary, then every `prefill_chunk`."""
        cuts = [b for b in boundaries if begin < b < end] + [end]
        for cut in cuts:
            for piece in range(begin, cut, self.prefill_chunk):
                yield piece, min(piece + self.prefill_chunk, cut)
            begin = cut

    def _restore_prefix(self, sequence: Sequence, token_ids: list[int], boundaries: list[int]) -> int:
        """Restore the longest cached boundary prefix of `token_ids` into the (empty) sequence; its length."""
        if self.prefix_cache is None:
            return 0
        snapshot = self.prefix_cache.lookup(token_ids, boundaries)
        if snapshot is None:
            return 0
        try:
            self.model.restore_state(sequence.state, snapshot.tensors, snapshot.length)
        except LuceboxError as exc:  # another configuration's snapshot: computed afresh instead
            log.warning("prefix cache: a cached prefix of %d tokens does not fit this sequence (%s)", snapshot.length, exc)
            return 0
        sequence.tokens = list(snapshot.tokens)
        return snapshot.length

    def _snapshot_point(self, token_ids: list[int], boundaries: list[int], done: int) -> int | None:
        """The boundary this prefill snapshots at: its last new one, when worth keeping and not cached yet."""
        cache = self.prefix_cache
        candidates = [b for b in boundaries if done < b < len(token_ids)]
        if cache is None or not candidates or not cache.worth_keeping(candidates[-1]):
            return None
        return None if cache.contains(token_ids[: candidates[-1]]) else candidates[-1]

    def _take_snapshot(self, sequence: Sequence) -> None:
        try:
            tensors = self.model.snapshot_state(sequence.state)
        except LuceboxError as exc:
            log.warning("prefix cache: no snapshot taken (%s)", exc)
            return
        self.prefix_cache.store(sequence.tokens, tensors)

    def stream(self, sequence: Sequence, request: GenerationRequest, timings: Timings | None = None) -> Iterator[Step]:
        """Prefill `request.prompt_ids` onto `sequence`, then yield one `Step` per generated token."""
        if sequence.streaming:
            raise LuceboxError("this sequence is being generated on already: finish or close that stream first")
        sequence.streaming = True
        try:
            # Closing this generator closes the inner one first, whose cleanup commits the tokens emitted.
            yield from self._stream(sequence, request, timings)
        finally:
            sequence.streaming = False

    def _mask_ahead(self, constraint: Any) -> MaskAhead:
        """The request's constraint, run a step ahead on a worker thread (see `mask_ahead`; inline with
        `LUCEBOX_MASK_AHEAD=0`)."""
        workers = None
        if os.environ.get("LUCEBOX_MASK_AHEAD", "1") != "0":
            with self._idle_lock:
                if self._mask_workers is None:
                    self._mask_workers = ThreadPoolExecutor(max_workers=16, thread_name_prefix="lucebox-mask")
            workers = self._mask_workers
        device = getattr(self.backend, "device", None)
        pinned = self.backend.host_buffer if self.backend is not None and getattr(device, "type", "cpu") != "cpu" else None
        return MaskAhead(constraint, self.model.vocab_size, workers, pinned)

    def _stream(self, sequence: Sequence, request: GenerationRequest, timings: Timings | None) -> Iterator[Step]:
        timings = timings if timings is not None else Timings()
        ahead = self._mask_ahead(request.constraint) if request.constraint is not None else None
        if ahead is not None:
            ahead.start()  # the first mask is computed while the prompt is prefilled
        self.prefill(sequence, request.prompt_ids, timings)
        if sequence.pending_logits is None:
            raise LuceboxError("nothing to generate from: the prompt is empty")
        device = sequence.pending_logits.device
        sampler = Sampler(request.sampling, device=device, suppressed=self._suppressed_mask(device))
        on_device = self._device_sampler(sequence, request.sampling, device)
        # Plain steps end with the draw (recorded with the step where the model records its decode step),
        # unless a constraint masks each step's logits on the host's word first.
        fused = (ahead is None and getattr(self.model, "decode_graphs", False)
                 and "sampler" in inspect.signature(self.model.decode_step).parameters)
        drawn, drawn_from = None, None  # a token the step drew from the pending logits it made
        detokenizer = self.tokenizer.detokenizer()
        stops = StopMatcher(request.stop)
        generated: list[int] = []
        if request.max_tokens <= 0:
            yield Step(None, "", "length")
            return
        speculative = (
            self.speculative is not None and sequence.draft is not None and request.speculative
            and request.logprobs is None and (ahead is None or ahead.dormant)
        )
        forced_counts = forced_accept_counts(request.force_accept) if request.force_accept is not None else None
        # The speculative decoder's governor (with --tree-budget auto) may judge plain steps faster for now.
        governor = getattr(self.speculative, "governor", None) if speculative else None
        governed_next = False  # the next step is a plain one the governor decided, its token fed ahead
        landing: torch.Tensor | None = None  # host memory a token sampled on the device is copied to
        try:
            while True:
                start = time.perf_counter()  # decode time counts the model and sampler, not the consumer
                seconds_before = timings.decode_seconds
                block, fed_ahead, step_logits, governed = None, False, None, governed_next
                if speculative and (sequence.length + self.speculative.max_nodes > self.ctx_size
                                    or (ahead is not None and not ahead.dormant)):
                    # No room left for a whole candidate tree, or the constraint masks tokens from now on:
                    # finish plainly, feeding the pending token first.
                    speculative = False
                    if sequence.pending_logits is None and sequence.unfed:
                        self._feed_pending(sequence)
                if governed:
                    governor.take_plain()
                elif (speculative and governor is not None and sequence.pending_logits is None and sequence.unfed
                      and not governor.draft_next()):
                    # Drafting does not pay now: the pending token is fed as plain decoding feeds it.
                    governed = True
                    self._feed_pending(sequence)
                if speculative and sequence.pending_logits is None and sequence.unfed:
                    # The pending token is the root of a drafted block: one target pass verifies it all.
                    root = sequence.unfed[0]
                    forced = None
                    if forced_counts is not None:
                        after = request.force_reference[len(generated):]
                        forced = ForcedStep(tuple(after[: self.speculative.block_size]), next(forced_counts))
                    block = self.speculative.step(
                        sequence.state, sequence.draft, root, sequence.tokens + [root], sampler, forced
                    )
                    self._synchronize()
                    timings.accepted_lengths.append(len(block.tokens))
                    tokens = block.tokens
                else:
                    logits = step_logits = sequence.pending_logits
                    if drawn is not None and drawn_from is logits:
                        chosen = drawn
                    else:
                        if ahead is not None:
                            logits = self._masked(logits, ahead.mask())
                        chosen = on_device.sample(logits, sequence.tokens + sequence.unfed)
                    drawn = drawn_from = None
                    fed_ahead = ((not speculative or (governed and governor.plain_ahead()))
                                 and self._more_wanted_after_next(sequence, generated, request))
                    if fed_ahead:
                        if landing is None:  # pinned, so the copy does not wait for the step queued after it
                            landing = self._host_buffer()
                        token, next_logits, drawn = self._feed_before_reading(
                            sequence, chosen, landing, ahead.after if ahead is not None else None,
                            on_device if fused else None)
                        # Recorded at once: the model holds the token whatever the checks below raise.
                        sequence.tokens.append(token)
                        sequence.unfed, sequence.pending_logits = [], next_logits[-1]
                        drawn_from = sequence.pending_logits
                    else:
                        token = int(chosen)
                        if ahead is not None:  # the next mask is made while this token is emitted and fed
                            ahead.after(lambda token=token: token)
                    tokens = [token]
                emitted = 0
                try:
                    for token in tokens:
                        info = (None, ())
                        if block is None and request.logprobs is not None:
                            info = self._logprobs(sampler.suppress(step_logits), token, request.logprobs)
                        emitted += 1
                        generated.append(token)
                        if ahead is not None:
                            if block is None:
                                ahead.accepted(token)
                            else:
                                ahead.accept_now(token)
                        # The new token is fed to the model only when another one is wanted after it (or,
                        # fed ahead, when no length limit ends the answer at it).
                        if block is not None:  # the previous pending token is now part of the committed path
                            sequence.tokens.append(sequence.unfed[0])
                        if not fed_ahead:
                            sequence.unfed, sequence.pending_logits = [token], None
                        if token in self.eog_ids and not request.ignore_eos:
                            yield Step(token, stops.push(detokenizer.flush()) + stops.flush(), "stop", *info)
                            return
                        piece = detokenizer.push(token)
                        if ahead is not None and not ahead.dormant:
                            # A constraint holds this text (a tool call, a JSON answer): a stop string does not
                            # cut it short; the text around it is still matched.
                            text = stops.flush() + piece
                        else:
                            text = stops.push(piece)
                        if stops.stopped:
                            yield Step(token, text, "stop", *info)
                            return
                        timings.decode_seconds += time.perf_counter() - start
                        if ahead is not None and ahead.finished:
                            yield Step(token, text + stops.push(detokenizer.flush()) + stops.flush(), "stop", *info)
                            return
                        if len(generated) >= request.max_tokens or sequence.length >= self.ctx_size:
                            yield Step(token, text + stops.push(detokenizer.flush()) + stops.flush(), "length", *info)
                            return
                        yield Step(token, text, None, *info)
                        start = time.perf_counter()
                        if block is not None and ahead is not None and not ahead.dormant:
                            break  # the constraint masks the next token: the rest of the block was drawn unmasked
                finally:
                    if block is not None and emitted:
                        # Keep exactly what was emitted: the root and the accepted nodes before the last
                        # emitted token, which stays pending like any sampled token.
                        block.commit(emitted)
                if block is None and not speculative and not fed_ahead:
                    token = tokens[0]
                    logits = self.model.forward(sequence.state, torch.tensor([token], dtype=torch.long))
                    sequence.tokens.append(token)
                    sequence.unfed, sequence.pending_logits = [], logits[-1]
                    self._synchronize()
                timings.decode_seconds += time.perf_counter() - start
                if speculative and governor is not None and (block is not None or governed):
                    governor.record(block is not None, emitted, timings.decode_seconds - seconds_before)
                    timings.governed_plain_tokens += emitted if governed else 0
                governed_next = governed and fed_ahead
        finally:
            timings.decode_tokens += len(generated)

    def _feed_pending(self, sequence: Sequence) -> None:
        """Feed the pending (unfed) token as plain decoding does: its logits become the next to sample from."""
        logits = self.model.forward(sequence.state, torch.tensor(sequence.unfed, dtype=torch.long))
        sequence.tokens.extend(sequence.unfed)
        sequence.unfed, sequence.pending_logits = [], logits[-1]

    def _device_sampler(self, sequence: Sequence, params: SamplingParams, device: torch.device) -> DeviceSampler:
        """The request's device sampler over the sequence's sampling buffers (made on first use)."""
        if sequence.sampler_buffers is None or sequence.sampler_buffers.device != torch.device(device):
            sequence.sampler_buffers = SamplerBuffers(device)
        vocab = sequence.pending_logits.shape[-1]
        suppressed = self._suppressed_mask(device)
        if suppressed is not None and suppressed.shape[0] != vocab:
            suppressed = None  # as `Sampler.suppress` does
        return DeviceSampler(params, sequence.sampler_buffers, vocab, suppressed, sequence.tokens + sequence.unfed)

    def _suppressed_mask(self, device: torch.device) -> torch.Tensor | None:
        if self.suppressed is None:
            return None
        key = str(device)
        if key not in self._suppressed_on:
            self._suppressed_on[key] = self.suppressed.to(device)
        return self._suppressed_on[key]

    def _more_wanted_after_next(self, sequence: Sequence, generated: list[int], request: GenerationRequest) -> bool:
        """Whether the next sampled token certainly gets a successor fed to the model, as far as the length
        limits tell (max_tokens, the context): then it can be fed before the host knows it. A stop string or
        end-of-generation token may still end the answer there; the token then stays fed (the sequence
        holds it and the logits after it), which a later call continues from as well as from an unfed one."""
        return (len(generated) + 1 < request.max_tokens and not sequence.unfed
                and len(sequence.tokens) + 1 < self.ctx_size)

    def _feed_before_reading(self, sequence: Sequence, chosen: torch.Tensor, landing: torch.Tensor,
                             on_sampled: Callable[[Callable[[], int]], None] | None = None,
                             drawing: DeviceSampler | None = None) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """Feed the sampled token `chosen` (still on the device) to the model, then read it: the device
        computes the next step while the host detokenizes, checks stops and hands the token out, instead of
        idling between steps (what a host-side round trip per token costs: ~0.8 ms of a 27B step, ~0.4 ms of
        a 0.8B one on an H200). The read waits for the sampling only, not the step queued after it.
        `on_sampled(read)` is told how to read the token before the step is run (a constraint's worker
        computes the next mask meanwhile). With `drawing`, the model's decode step also draws the token after
        `chosen` (in its recording): returned third, still on the device (else None)."""
        landing.copy_(chosen, non_blocking=True)
        # Marks the copy on the model's device's stream (the backend's device, which need not be the
        # current device).
        sampled = self.backend.record_event() if self.backend is not None else None
        if on_sampled is not None:
            on_sampled(lambda: self._read_sampled(landing, sampled))
        drawn = None
        if drawing is None:
            logits = self.model.forward(sequence.state, chosen)
        else:
            logits, drawn = self.model.decode_step(sequence.state, chosen, sampler=drawing.recorded())
        return self._read_sampled(landing, sampled), logits, drawn

    def _read_sampled(self, landing: torch.Tensor, sampled: Any) -> int:
        """The token copied to `landing`, once the copy (marked by the event `sampled`) has run."""
        if sampled is not None:
            self.backend.wait_event(sampled)
        return int(landing[0])

    @staticmethod
    def _masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """`logits` with the tokens a constraint does not allow at -inf (ids past its mask too)."""
        if allowed is None:
            return logits
        allowed = allowed.to(logits.device, non_blocking=True)
        size = logits.shape[-1]
        if allowed.shape[-1] != size:
            padded = torch.zeros(size, dtype=torch.bool, device=logits.device)
            padded[: min(size, allowed.shape[-1])] = allowed[:size]
            allowed = padded
        return logits.masked_fill(~allowed, float("-inf"))

    def _host_buffer(self) -> torch.Tensor:
        """Where a sampled token's copy lands: pinned on a GPU, so it does not wait for the step after it."""
        if self.backend is not None:
            return self.backend.host_buffer((1,), torch.long)
        return torch.empty(1, dtype=torch.long)

    @staticmethod
    def _logprobs(logits: torch.Tensor, token: int, top: int | None) -> tuple[float | None, tuple]:
        if top is None:
            return None, ()
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        alternatives = ()
        if top > 0:
            values, ids = torch.topk(logprobs, top)
            alternatives = tuple(zip(ids.tolist(), values.tolist()))
        return float(logprobs[token]), alternatives

    def generate(self, request: GenerationRequest, sequence: Sequence | None = None) -> GenerationResult:
        """Run `request` to the end on `sequence` (continued), or on a sequence of its own (released after)."""
        owned = sequence is None
        sequence = sequence if sequence is not None else self.new_sequence()
        timings = Timings()
        ids: list[int] = []
        text: list[str] = []
        finish = "length"
        for step in self.stream(sequence, request, timings):
            if step.token_id is not None:
                ids.append(step.token_id)
            text.append(step.text)
            if step.finish_reason:
                finish = step.finish_reason
        if owned:
            self.release(sequence)
        return GenerationResult(ids, "".join(text), finish, timings)
