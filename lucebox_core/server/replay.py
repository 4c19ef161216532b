"""Tool-call replay: the text a model generated for its tool calls, given back verbatim next turn.

A client sends tool calls back as structured JSON; the chat template re-renders them in its canonical
form, which can differ from what the model actually wrote (spacing, number formats, parameter order).
The next prompt would then not extend the previous one token for token, which costs a prefix-cache hit
and, worse, shows the model a turn it did not write. So the raw text of each response that made tool
calls is kept (bounded, least recently used out first), keyed by its call ids, and an assistant message
whose calls are all known is rendered from that text instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_ENTRIES = 4096
MAX_BYTES = 16 * 1024 * 1024


def _key(call_ids: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    # The same call is `call_X` in OpenAI's APIs and `toolu_X` in Anthropic's: key by the X.
    return tuple(str(call_id).split("_", 1)[-1] for call_id in call_ids)


class ToolCallReplay:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple[str, ...], str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def remember(self, call_ids: list[str], raw_text: str) -> None:
        """Keep `raw_text` (what followed the reasoning, tool-call markup included) for these calls."""
        if not call_ids or not raw_text.strip():
            return
        key = _key(call_ids)
        size = len(raw_text.encode())
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._bytes -= len(self._entries.pop(key).encode())
            self._entries[key] = raw_text
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped.encode())

    def restore(self, messages: list[dict]) -> list[dict]:
        """`messages` with each assistant turn whose tool calls are all known replaced by its raw text."""
        restored = []
        for message in messages:
            calls = message.get("tool_calls") if message.get("role") == "assistant" else None
            ids = _key([call.get("id") for call in calls or () if isinstance(call, dict)])
            with self._lock:
                raw = self._entries.get(ids) if calls and len(ids) == len(calls) else None
                if raw is not None:
                    self._entries.move_to_end(ids)
            if raw is None:
                restored.append(message)
                continue
            replayed = {k: v for k, v in message.items() if k not in ("tool_calls", "content")}
            replayed["content"] = raw
            restored.append(replayed)
        return restored


def content_after_reasoning(raw_text: str, started_in_reasoning: bool, close: str = "</think>") -> str:
    """What a response said after its thought (closed by `close`): the part a template renders as the
    assistant's content."""
    if close in raw_text:
        return raw_text.rsplit(close, 1)[1].lstrip("\n")
    return "" if started_in_reasoning else raw_text
