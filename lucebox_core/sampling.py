"""The one sampler: penalties, then top-k, top-p, min-p, temperature, then a draw (or argmax).

The order and the meaning of each knob follow llama.cpp's default chain, so that the same flags give the
same distribution in both engines. All work is done in torch on the logits' device; only the chosen id
comes back to the host. This sampler reads the history as a host list and draws with a `torch.Generator`:
it serves the speculative verifier's walk, logprobs and eager callers, and is the reference the engine's
plain decoding sampler (`device_sampling.DeviceSampler`, device state only, recordable in a graph) equals.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

import attrs
import torch

from .errors import LuceboxError


def _non_negative(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise LuceboxError(f"{attribute.name} must be >= 0, got {value}")


def _unit_interval(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise LuceboxError(f"{attribute.name} must be between 0 and 1, got {value}")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick each next token. `temperature == 0` is greedy; `top_k == 0` and `top_p == 1` are off."""

    temperature: float = attrs.field(default=0.8, validator=_non_negative)
    top_k: int = attrs.field(default=40, validator=_non_negative)
    top_p: float = attrs.field(default=0.95, validator=_unit_interval)
    min_p: float = attrs.field(default=0.05, validator=_unit_interval)
    repeat_penalty: float = attrs.field(default=1.0, validator=_non_negative)
    repeat_last_n: int = 64  # how many recent tokens the penalties look at; -1 means all
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # Added to the named tokens' logits before everything else (OpenAI's `logit_bias`): (token id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=lambda pairs: tuple(
        (int(t), float(b)) for t, b in (pairs.items() if isinstance(pairs, Mapping) else pairs)))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def from_gguf_defaults(cls, metadata: Mapping[str, Any], **overrides: Any) -> "SamplingParams":
        """llama.cpp's defaults, replaced by the GGUF's `general.sampling.*` keys, then by `overrides`."""
        keys = {
            "temperature": "general.sampling.temp",
            "top_k": "general.sampling.top_k",
            "top_p": "general.sampling.top_p",
            "min_p": "general.sampling.min_p",
            "repeat_penalty": "general.sampling.penalty_repeat",
            "repeat_last_n": "general.sampling.penalty_last_n",
        }
        values: dict[str, Any] = {}
        for field, key in keys.items():
            if key in metadata and isinstance(metadata[key], (int, float)) and not isinstance(metadata[key], bool):
                values[field] = metadata[key]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class Sampler:
    """Picks tokens for one sequence; owns its random generator so a seed replays exactly.

    `suppressed`: a boolean mask over the vocabulary of ids never to be picked (unused entries and padding
    placeholders, whose untrained logits a random or poorly trained model may well rank first)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu",
                 suppressed: torch.Tensor | None = None):
        self.params = params
        self.suppressed = suppressed.to(device) if suppressed is not None else None
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            self.generator.manual_seed(seed)

    def suppress(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (`[..., vocab]`) with the suppressed ids at -inf (a copy; `logits` itself is untouched)."""
        if self.suppressed is None or logits.shape[-1] != self.suppressed.shape[0]:
            return logits
        return logits.masked_fill(self.suppressed, float("-inf"))

    @property
    def penalizes(self) -> bool:
        """Whether logit biases or the repeat/presence/frequency penalties (which look at the history) change
        any logit: then the raw logits' argmax is not the greedy choice."""
        p = self.params
        return bool(p.logit_bias) or (p.repeat_last_n != 0 and (p.repeat_penalty != 1.0 or p.presence_penalty != 0.0
                                                                or p.frequency_penalty != 0.0))

    def apply_penalties(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """`logits` with the logit biases added and the penalties applied (a new tensor where anything changes)."""
        p = self.params
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=logits.device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device)
            logits = logits.index_add(0, ids, bias)
        if not history or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
            return logits
        window = history if p.repeat_last_n < 0 else history[-p.repeat_last_n :] if p.repeat_last_n > 0 else []
        if not window:
            return logits
        counts = Counter(window)
        ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        freq = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        picked = logits[ids]
        if p.repeat_penalty != 1.0:
            picked = torch.where(picked > 0, picked / p.repeat_penalty, picked * p.repeat_penalty)
        picked = picked - freq * p.frequency_penalty - p.presence_penalty
        logits = logits.clone()
        logits[ids] = picked
        return logits

    def probabilities(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """The distribution a draw is made from (after every filter), as float32 over the vocabulary."""
        p = self.params
        logits = self.apply_penalties(self.suppress(logits.float()), history)
        if p.greedy:
            probs = torch.zeros_like(logits)
            probs[int(torch.argmax(logits))] = 1.0
            return probs
        keep = torch.ones_like(logits, dtype=torch.bool)
        if p.top_k > 0 and p.top_k < logits.numel():
            threshold = torch.topk(logits, p.top_k).values[-1]
            keep &= logits >= threshold
        masked = logits.masked_fill(~keep, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(masked, descending=True)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
            drop_sorted = before >= p.top_p  # keep the smallest prefix whose mass reaches top_p
            drop_sorted[0] = False
            keep &= ~torch.zeros_like(keep).scatter(0, order, drop_sorted)
            masked = logits.masked_fill(~keep, float("-inf"))
        if p.min_p > 0.0:
            probs = torch.softmax(masked, dim=-1)
            keep &= probs >= p.min_p * probs.max()
            masked = logits.masked_fill(~keep, float("-inf"))
        return torch.softmax(masked / p.temperature, dim=-1)

    def sample(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """The next token id for logits of shape [vocab]."""
        return int(self.sample_tensor(logits, history))

    def sample_tensor(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """The next token id as a one-element long tensor where `logits` are, without waiting for the device
        (though the penalties' history goes to the device as small tensors each call)."""
        if self.params.greedy:
            return torch.argmax(self.apply_penalties(self.suppress(logits.float()), history)).reshape(1)
        probs = self.probabilities(logits, history)
        return torch.multinomial(probs, 1, generator=self.generator).reshape(1)


class StopMatcher:
    """Finds stop strings in streamed text, across token boundaries.

    `push(piece)` returns the text that is safe to show now, holding back any tail that could still
    grow into a stop string; `stopped` turns true once one is found (the stop string itself is dropped).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.pending + piece
        first = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
            self.stopped = True
            self.pending = ""
            return text[:first]
        hold = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:length]):
                    hold = max(hold, length)
                    break
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return "" if self.stopped else text
