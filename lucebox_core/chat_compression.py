"""Which parts of a chat a prefill compressor may shorten, and FlowKV: each aged message compressed once.

PFlash shortens long prompts by keeping the chunks a scorer finds relevant to the question. Lucebox
applies it to the rendered prompt as a whole, which can cut tool definitions and tool results, the parts an
agent depends on. Here the chat's structure decides first (`plan_messages`): the system prompt, any message
that is not plain text, every tool call and tool result, the last user message and the last `hot_window`
messages are never touched; only older plain-text user and assistant messages ("aged free text") may be
compressed. Tool definitions are not messages and are never handed to the compressor.

FlowKV: a message, once compressed, is replaced by the same text in every later turn (cached by a hash of
its role and content), so the rendered prompt of turn k+1 extends turn k's and the prefix cache keeps
hitting; only messages that newly age out of the hot window are compressed, once each.

An oversized question: when the protected parts alone (the chat rendered with its aged free text left out:
system prompt, tool definitions, tool calls and results, the hot messages and the last user message) already
reach the threshold, compressing the aged text cannot bring the prompt under it. Under `always` the last user
message's text (a plain string) is then compressed too; its last chunks, the question, are kept by the
selection's tail, and FlowKV keeps it: later turns show it compressed too, hot or not, so their prompts
still extend this one. Under `auto` the request is left uncompressed. Either way the decision is logged and counted
(`CompressionStats.skipped` by reason, `last_user`). Tool definitions are never compressed in any case.

A compressor is anything with `compress(pieces: list[Piece]) -> list[str]`: the pieces are the chat's
texts in order, each `protected` or not, and the answer holds a text for each (a protected one returned as
it is). The question a scorer scores against is the last pieces' text (the last user message is always one).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from .errors import LuceboxError

MODES = ("off", "auto", "always")
DEFAULT_HOT_WINDOW = 2  # Lucebox's PFLASH_FREEZE_HOT_WINDOW
CACHE_ENTRIES = 4096
# Why a wanted compression did not happen (`/metrics`: lucebox_prefill_compression_skipped_total{reason=...}).
PROTECTED_OVER_THRESHOLD = "protected_over_threshold"  # auto: the protected parts alone reach the threshold
NOTHING_COMPRESSIBLE = "nothing_compressible"  # no aged free text (and the last user message not taken)

log = logging.getLogger("lucebox.prefill_compression")


@attrs.frozen
class Piece:
    text: str
    protected: bool
    role: str = "user"


class Compressor(Protocol):
    def compress(self, pieces: list[Piece]) -> list[str]: ...


def last_user_index(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)


def is_free_text(message: dict) -> bool:
    """A plain-text user or assistant message (not a tool call, a tool result or a list of parts)."""
    return (message.get("role") in ("user", "assistant") and isinstance(message.get("content"), str)
            and bool(message.get("content")) and not message.get("tool_calls"))


def plan_messages(messages: list[dict], hot_window: int = DEFAULT_HOT_WINDOW) -> list[bool]:
    """For each message, whether a compressor may shorten its content (see the module's docstring)."""
    last_user = last_user_index(messages)
    first_hot = len(messages) - max(0, hot_window)
    return [i < first_hot and i != last_user and is_free_text(m) for i, m in enumerate(messages)]


def without_compressible(messages: list[dict], compressible: list[bool]) -> list[dict]:
    """The chat with the compressible messages' text left out: what no compression can shorten."""
    return [{**m, "content": ""} if c else m for m, c in zip(messages, compressible)]


@attrs.define
class CompressionStats:
    requests: int = 0  # chats compressed
    messages: int = 0  # messages compressed (fresh)
    reused: int = 0  # messages replaced from the FlowKV cache
    chars_in: int = 0
    chars_out: int = 0
    seconds: float = 0.0  # in the compressor
    last_user: int = 0  # oversized chats (under always) whose last user message was compressed too
    skipped: dict[str, int] = attrs.Factory(dict)  # wanted but left uncompressed, by reason


class ChatCompressor:
    """Applies a compressor to chats under a mode (`off`, `auto`: prompts of at least `threshold` tokens,
    `always`), with FlowKV's per-message cache. Thread-safe."""

    def __init__(self, compressor: Compressor, *, mode: str = "auto", threshold: int = 32768,
                 hot_window: int = DEFAULT_HOT_WINDOW, name: str = ""):
        if mode not in MODES:
            raise LuceboxError(f"--prefill-compression must be one of {', '.join(MODES)}, got {mode!r}")
        if threshold < 1 or hot_window < 0:
            raise LuceboxError(f"--prefill-threshold must be positive ({threshold}) and the hot window at least 0 "
                               f"({hot_window})")
        self.compressor, self.mode, self.threshold, self.hot_window, self.name = compressor, mode, threshold, hot_window, name
        self.stats = CompressionStats()
        self._done: OrderedDict[str, str] = OrderedDict()  # FlowKV: message hash -> its compressed text
        self._lock = threading.Lock()

    def wanted(self, prompt_tokens: int) -> bool:
        return self.mode == "always" or (self.mode == "auto" and prompt_tokens >= self.threshold)

    def apply(self, messages: list[dict], measure: Callable[[list[dict]], int] | None = None) -> list[dict]:
        """`messages` with their aged free text compressed (new dicts where changed; the rest as given).
        `measure(messages)`: the target's prompt tokens for a chat; with it, a chat whose protected parts
        alone reach the threshold is handled as the module's docstring says."""
        import time

        compressible = plan_messages(messages, self.hot_window)
        last_user = last_user_index(messages)
        if measure is not None:
            protected_tokens = measure(without_compressible(messages, compressible))
            if protected_tokens >= self.threshold:
                if self.mode == "always" and last_user >= 0 and is_free_text(messages[last_user]):
                    log.info("prefill compression: the protected parts alone take %d tokens (threshold %d); "
                             "compressing the last user message too (--prefill-compression always)",
                             protected_tokens, self.threshold)
                    compressible[last_user] = True
                    with self._lock:
                        self.stats.last_user += 1
                elif self.mode == "always":
                    log.info("prefill compression: the protected parts alone take %d tokens (threshold %d) and the "
                             "last user message is not plain text: aged text only", protected_tokens, self.threshold)
                elif self.mode == "auto":
                    log.info("prefill compression skipped: the protected parts alone take %d tokens (threshold %d); "
                             "compressing aged text cannot bring the prompt under it, and the last user message is "
                             "compressed only under --prefill-compression always", protected_tokens, self.threshold)
                    self._skip(PROTECTED_OVER_THRESHOLD)
                    return messages
        # FlowKV: a message compressed in an earlier turn is shown compressed in every later one (hot or not),
        # so each turn's prompt extends the last's; only compressible ones are scored afresh.
        keys = [_key(m) if c or (i != last_user and is_free_text(m)) else None
                for i, (m, c) in enumerate(zip(messages, compressible))]
        with self._lock:
            known = {k: self._done[k] for k in keys if k is not None and k in self._done}
        if not any(compressible) and not known:
            self._skip(NOTHING_COMPRESSIBLE)
            return messages
        fresh = [i for i, k in enumerate(keys) if compressible[i] and k not in known]
        texts: dict[int, str] = {}
        if fresh:
            # The pieces: every message's text, only the fresh aged ones unprotected (a reused one is
            # shown as already compressed, as the target will see it).
            pieces = [Piece(known.get(keys[i], m.get("content")) if isinstance(m.get("content"), str) else "",
                            protected=i not in fresh, role=str(m.get("role"))) for i, m in enumerate(messages)]
            start = time.perf_counter()
            answer = self.compressor.compress(pieces)
            elapsed = time.perf_counter() - start
            if len(answer) != len(pieces):
                raise LuceboxError(f"the prefill compressor {self.name!r} answered {len(answer)} texts for {len(pieces)}")
            texts = {i: answer[i] for i in fresh}
            with self._lock:
                self.stats.seconds += elapsed
                self.stats.messages += len(fresh)
                self.stats.chars_in += sum(len(messages[i]["content"]) for i in fresh)
                self.stats.chars_out += sum(len(texts[i]) for i in fresh)
                for i in fresh:
                    self._done[keys[i]] = texts[i]
                while len(self._done) > CACHE_ENTRIES:
                    self._done.popitem(last=False)
        with self._lock:
            self.stats.requests += 1
            self.stats.reused += len(known)
        out = []
        for i, message in enumerate(messages):
            if i in texts:
                out.append({**message, "content": texts[i]})
            elif keys[i] is not None and keys[i] in known:
                out.append({**message, "content": known[keys[i]]})
            else:
                out.append(message)
        return out

    def _skip(self, reason: str) -> None:
        with self._lock:
            self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + 1

    def apply_text(self, text: str) -> str:
        """A raw prompt (no chat structure to go by) compressed whole: the selection's forced last chunks keep
        its question. Not cached: a raw prompt has no turns to reuse."""
        import time

        start = time.perf_counter()
        [out] = self.compressor.compress([Piece(text, protected=False)])
        with self._lock:
            self.stats.seconds += time.perf_counter() - start
            self.stats.requests += 1
            self.stats.messages += 1
            self.stats.chars_in += len(text)
            self.stats.chars_out += len(out)
        return out

    def describe(self) -> dict[str, Any]:
        with self._lock:
            stats = attrs.asdict(self.stats)
        ratio = stats["chars_out"] / stats["chars_in"] if stats["chars_in"] else None
        describe = getattr(self.compressor, "describe", None)  # the scorer's residency and loads, where it has one
        scorer = describe() if describe is not None else None
        return {"compressor": self.name, "mode": self.mode, "threshold": self.threshold, "hot_window": self.hot_window,
                "compression_ratio": ratio, **stats, "scorer": scorer,
                "scorer_loads": scorer.get("loads", 0) if scorer else 0,
                "scorer_load_seconds": scorer.get("load_seconds", 0.0) if scorer else 0.0}


def _key(message: dict) -> str:
    return hashlib.sha256(f"{message.get('role')}\0{message.get('content')}".encode()).hexdigest()
