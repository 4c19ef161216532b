"""Sampling as device work only: what a recorded decode step can end with, so it hands out a token, not logits.

`Sampler` (sampling.py) builds the penalties from a host list of the history and draws with a
`torch.Generator`; both need the host every token. `DeviceSampler` gives the same distribution from device
state alone, so the draw can be recorded into the decode step's graph and replayed:

- the penalties read a count per vocabulary id of the tokens in the window (`repeat_last_n`), kept on the
  device: each draw adds the chosen token and, through a ring of the window's tokens, takes away the one
  that leaves the window (empty ring slots and the leaving token of a window not yet full point at a spare
  count past the vocabulary, which nothing reads); `logit_bias` is a dense vector built once per request;
- the filters (top-k, top-p, min-p) and temperature are `Sampler.probabilities`' own operations, with the
  knobs read from a device vector, so one recording serves any values; only top-k's `k` fixes a shape;
- the draw is Gumbel-max over the filtered, tempered logits with uniforms from a counter-based hash of
  (seed, draw counter, vocabulary id): the counter is a device tensor the draw advances, so a replay draws
  afresh and a seed replays exactly, on any device, with no generator state to register with a graph.

What a recording may depend on is `DrawShape` (part of the step's recording key); what changes per request
or per draw sits in `SamplerBuffers`, tensors that stay put for the life of a sequence's state (they belong
to it, as the recordings do) and are refilled in place by `DeviceSampler.load`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from .errors import LuceboxError
from .sampling import SamplingParams

_MASK32 = 0xFFFFFFFF
# Where the knobs sit in the parameter vector.
_TEMPERATURE, _TOP_P, _MIN_P, _REPEAT, _FREQUENCY, _PRESENCE = range(6)


@attrs.frozen
class DrawShape:
    """The host-side choices a recorded draw depends on: which stages run, and the shapes they have."""

    vocab: int
    greedy: bool
    top_k: int  # 0: off (also when it would keep the whole vocabulary)
    top_p: bool
    min_p: bool
    penalties: bool  # repeat/presence/frequency over a window of the history
    window: int  # tokens the penalties look at: -1 all of the history, else the ring's size (> 0)
    bias: bool
    suppress: bool

    @classmethod
    def of(cls, params: SamplingParams, vocab: int, suppressed: bool) -> "DrawShape":
        p = params
        penalties = p.repeat_last_n != 0 and (p.repeat_penalty != 1.0 or p.presence_penalty != 0.0
                                              or p.frequency_penalty != 0.0)
        return cls(vocab=vocab, greedy=p.greedy, top_k=p.top_k if 0 < p.top_k < vocab else 0,
                   top_p=p.top_p < 1.0, min_p=p.min_p > 0.0, penalties=penalties,
                   window=p.repeat_last_n if penalties else 0, bias=bool(p.logit_bias), suppress=suppressed)


class SamplerBuffers:
    """The device tensors draws read and update, by name, made on first use and reused after (a recording
    holds their addresses). One set per sequence state."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._tensors: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (name, shape, dtype)
        tensor = self._tensors.get(key)
        if tensor is None:
            tensor = self._tensors[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        return tensor


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xor-shift and multiply rounds) of int64 tensors holding 32-bit
    values. Products may pass 2**63 and wrap; masking keeps their low 32 bits, which wrapping preserves."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniforms(seed: torch.Tensor, counter: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) (float64, 23 random bits, never 0 or 1), one per entry of `ids`, a function of
    the seed's two 32-bit halves (`seed` `[2]`), the draw `counter` `[1]` and the ids alone."""
    per_draw = _mix32(seed[0:1] ^ _mix32(counter + _mix32(seed[1:2])))
    bits = _mix32(_mix32(ids ^ per_draw) ^ seed[1:2])
    return ((bits >> 9).double() + 0.5) * (1.0 / (1 << 23))


def _split_seed(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed & _MASK32, seed >> 32


def adjusted_logits(shape: DrawShape, buffers: SamplerBuffers, logits: torch.Tensor) -> torch.Tensor:
    """`logits` (`[vocab]` or `[1, vocab]`) as float32 `[vocab]` with the suppressed ids at -inf, the biases
    added and the penalties applied: `Sampler.apply_penalties(Sampler.suppress(logits))`'s operations, with
    the window's counts read from the device."""
    vocab = shape.vocab
    x = logits.reshape(-1).float()
    if shape.suppress:
        x = x.masked_fill(buffers.get("suppressed", (vocab,), torch.bool), float("-inf"))
    if shape.bias:
        x = x + buffers.get("bias", (vocab,), torch.float32)
    if shape.penalties:
        params = buffers.get("params", (6,), torch.float32)
        counts = buffers.get("counts", (vocab + 1,), torch.float32)[:vocab]
        repeat = params[_REPEAT]
        penalized = torch.where(x > 0, x / repeat, x * repeat)
        penalized = penalized - counts * params[_FREQUENCY] - params[_PRESENCE]
        x = torch.where(counts > 0, penalized, x)  # exactly the logit where the token is not in the window
    return x


def filtered_logits(shape: DrawShape, buffers: SamplerBuffers, x: torch.Tensor) -> torch.Tensor:
    """Adjusted logits `x` after top-k, top-p and min-p (dropped ids at -inf) and divided by the temperature:
    their softmax is `Sampler.probabilities`, by the same operations (ties fall as they do there)."""
    params = buffers.get("params", (6,), torch.float32)
    keep = torch.ones_like(x, dtype=torch.bool)
    masked = x
    if shape.top_k:
        keep &= x >= torch.topk(x, shape.top_k).values[-1]
        masked = x.masked_fill(~keep, float("-inf"))
    if shape.top_p:
        sorted_logits, order = torch.sort(masked, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= params[_TOP_P]
        # The most likely id always stays. Not `drop_sorted[0] = False`: on CUDA that copies a host scalar,
        # which a graph capture refuses (a fill is a kernel with the value as its argument).
        drop_sorted.narrow(0, 0, 1).fill_(False)
        keep &= ~torch.zeros_like(keep).scatter(0, order, drop_sorted)
        masked = x.masked_fill(~keep, float("-inf"))
    if shape.min_p:
        probs = torch.softmax(masked, dim=-1)
        keep &= probs >= params[_MIN_P] * probs.max()
        masked = x.masked_fill(~keep, float("-inf"))
    return masked / params[_TEMPERATURE]


def draw(shape: DrawShape, buffers: SamplerBuffers, logits: torch.Tensor) -> torch.Tensor:
    """The next token (`[1]` long, on the logits' device) from `logits` (`[vocab]` or `[1, vocab]`), updating
    the penalty window and the draw counter in place. Device work only, of shapes `shape` fixes: recordable.

    Greedy is the adjusted logits' argmax; otherwise Gumbel-max over the filtered logits, which picks each
    kept token with its probability under their softmax."""
    x = adjusted_logits(shape, buffers, logits)
    if shape.greedy:
        token = torch.argmax(x).reshape(1)
    else:
        scaled = filtered_logits(shape, buffers, x)
        counter = buffers.get("counter", (1,), torch.long)
        ids = buffers.get("ids", (shape.vocab,), torch.long)
        gumbel = -torch.log(-torch.log(uniforms(buffers.get("seed", (2,), torch.long), counter, ids)))
        token = torch.argmax(scaled.double() + gumbel).reshape(1)
        counter.add_(1)
    if shape.penalties:
        _push(shape, buffers, token)
    return token


def _push(shape: DrawShape, buffers: SamplerBuffers, token: torch.Tensor) -> None:
    """Count `token` in the penalties' window; with a ring, uncount the token that leaves it."""
    counts = buffers.get("counts", (shape.vocab + 1,), torch.float32)
    one = torch.ones(1, dtype=torch.float32, device=counts.device)
    if shape.window > 0:
        ring = buffers.get("ring", (shape.window,), torch.long)
        slot = buffers.get("ring_slot", (1,), torch.long)
        counts.index_add_(0, ring.index_select(0, slot), -one)
        ring.index_copy_(0, slot, token)
        slot.add_(1).remainder_(shape.window)
    counts.index_add_(0, token, one)


class DeviceSampler:
    """One request's sampling on the device: `load` fills the sequence's `SamplerBuffers` for its params and
    history, `sample(logits, history)` draws eagerly, and `recorded()` is the draw a recorded step ends with.

    `accounted` is how many tokens of the history the device window holds (the history it was loaded from
    plus one per draw): `sample` reloads when the caller's history has moved otherwise (tokens accepted by
    speculative decoding, which draws on its own)."""

    def __init__(self, params: SamplingParams, buffers: SamplerBuffers, vocab: int,
                 suppressed: torch.Tensor | None = None, history: Sequence[int] = ()):
        self.params = params
        self.buffers = buffers
        self.shape = DrawShape.of(params, vocab, suppressed is not None)
        p = params
        values = [p.temperature, p.top_p, p.min_p, p.repeat_penalty, p.frequency_penalty, p.presence_penalty]
        buffers.get("params", (6,), torch.float32).copy_(torch.tensor(values, dtype=torch.float32))
        if suppressed is not None:
            buffers.get("suppressed", (vocab,), torch.bool).copy_(suppressed, non_blocking=True)
        if self.shape.bias:
            outside = [t for t, _ in p.logit_bias if not 0 <= t < vocab]
            if outside:  # on a GPU an index past the vector would be a device-side assert, not an error
                raise LuceboxError(f"logit_bias names token {outside[0]}, outside the vocabulary [0, {vocab})")
            bias = buffers.get("bias", (vocab,), torch.float32).zero_()
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
            values = torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32)
            bias.index_add_(0, ids.to(bias.device), values.to(bias.device))
        if not self.shape.greedy:
            seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()).item())
            buffers.get("seed", (2,), torch.long).copy_(torch.tensor(_split_seed(seed), dtype=torch.long))
            buffers.get("counter", (1,), torch.long).zero_()
            ids = buffers.get("ids", (vocab,), torch.long)
            torch.arange(vocab, out=ids)
        self.accounted = -1
        self.load(history)

    def load(self, history: Sequence[int]) -> None:
        """Fill the penalties' window from `history` (one small copy to the device)."""
        self.accounted = len(history)
        if not self.shape.penalties:
            return
        window = self.shape.window
        tokens = list(history) if window < 0 else list(history[-window:])
        counts = self.buffers.get("counts", (self.shape.vocab + 1,), torch.float32).zero_()
        device = counts.device
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.long).to(device)
            counts.index_add_(0, ids, torch.ones(len(tokens), dtype=torch.float32, device=device))
        if window > 0:
            ring = self.buffers.get("ring", (window,), torch.long).fill_(self.shape.vocab)  # the spare count
            if tokens:
                ring[: len(tokens)] = torch.tensor(tokens, dtype=torch.long).to(device)
            self.buffers.get("ring_slot", (1,), torch.long).fill_(len(tokens) % window)

    def sample(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """The next token as a `[1]` long tensor where `logits` are, drawn eagerly (without waiting for the
        device), after `history` (the tokens so far; only its length is read unless it moved)."""
        if self.accounted != len(history):
            self.load(history)
        token = draw(self.shape, self.buffers, logits)
        self.accounted += 1
        return token

    def recorded(self) -> "RecordedDraw":
        """The draw as a recorded step runs it: a function of the logits, the shape and the buffers only."""
        return RecordedDraw(self.shape, self.buffers, self)


@attrs.frozen(eq=False)
class RecordedDraw:
    """What `run_decode_step` appends to a step: `key` joins the recording's key; `__call__(logits)` draws
    (reading only `shape` and `buffers`, so a replay in a later request is right); `drawn()` is told after
    each step ran (host bookkeeping, outside any recording)."""

    shape: DrawShape
    buffers: SamplerBuffers
    owner: Any

    @property
    def key(self) -> tuple:
        return ("draw", self.shape, id(self.buffers))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return draw(self.shape, self.buffers, logits)

    def drawn(self) -> None:
        self.owner.accounted += 1
