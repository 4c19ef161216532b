"""Turning a model's raw output into reasoning, content and tool calls, while it streams.

A response parser is fed the generated text in pieces of any size (`feed`) and returns events; `finish`
flushes what it still holds. Text that might be the start of a tag (`<thi`, `<tool_c`) is held back
until it is known; so coalescing adjacent deltas of one kind gives the same events whatever the chunking.

This module has the family-independent parts: the event records, the `<think>…</think>` splitter
(`ReasoningParser`) that hands everything outside the reasoning to a content parser (a family's
tool-call parser, or `PlainContent`), and the lookup of a family's parser in the plugin registry.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import attrs

from .errors import LuceboxError
from .specs import ResponseParser

__all__ = [
    "PLAIN_PARSER",
    "ContentDelta",
    "ContentParser",
    "Event",
    "PlainContent",
    "ReasoningDelta",
    "ReasoningParser",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "create_plain_parser",
    "partial_suffix",
    "response_parser_for",
]


@attrs.frozen
class ReasoningDelta:
    text: str


@attrs.frozen
class ContentDelta:
    text: str


@attrs.frozen
class ToolCallStart:
    index: int  # 0, 1, ... in the order the calls appear
    id: str
    name: str


@attrs.frozen
class ToolCallArgsDelta:
    index: int
    fragment: str  # the fragments of one call concatenate to its `arguments_json`


@attrs.frozen
class ToolCallEnd:
    index: int
    arguments_json: str  # a JSON object, values typed by the tool's schema
    raw_text: str  # the call exactly as generated, to re-render the same tokens in a later turn


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


def partial_suffix(text: str, tags: Iterable[str]) -> int:
    """Length of the longest end of `text` that is the beginning (not all) of one of `tags`."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return longest


class ContentParser(Protocol):
    """What reads the text outside the reasoning: emits ContentDelta and tool-call events."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


class PlainContent:
    """A content parser that recognises nothing: all text is content."""

    def feed(self, text: str) -> list[Event]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[Event]:
        return []

    def constraint_for(self, tool_choice: Any, tokenizer: Any, *, thinking: bool = False) -> None:
        return None


class ReasoningParser:
    """Splits a leading `<think>…</think>` block off as reasoning; the rest goes to a content parser.

    The output is reasoning from its start when the prompt ended inside the think block (`thinking`,
    as Qwen3.5's template leaves it with `<think>\\n`), or when the output itself opens with the tag.
    Newlines that the chat templates put around the tags are dropped, as the templates do on re-render:
    leading and trailing ones of the reasoning, leading ones of the content after it.
    """

    def __init__(
        self,
        content: ContentParser | None = None,
        *,
        thinking: bool = False,
        open_tag: str = "<think>",
        close_tag: str = "</think>",
    ) -> None:
        self.content = content if content is not None else PlainContent()
        self._open, self._close = open_tag, close_tag
        self.thinking = thinking
        self._mode = "reasoning" if thinking else "start"  # start: the output may still open the tag
        self._buffer = ""
        self._held_newlines = ""  # at the end of the reasoning so far: dropped if `</think>` follows
        self._reasoning_begun = False
        self._strip_content_newlines = False

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        return events + self.content.finish()

    def constraint_for(self, tool_choice: Any, tokenizer: Any) -> Any:
        """A `Constraint` that makes the model honour `tool_choice`, or None (see the content parser)."""
        build = getattr(self.content, "constraint_for", None)
        return build(tool_choice, tokenizer, thinking=self.thinking) if build else None

    def _drain(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._mode == "start":
                rest = self._buffer.lstrip()
                if rest.startswith(self._open):
                    self._buffer = rest[len(self._open) :]
                    self._mode = "reasoning"
                elif self._open.startswith(rest) and not final:
                    return events  # whitespace or part of the tag so far: not decided yet
                else:
                    self._mode = "content"
            elif self._mode == "reasoning":
                end = self._buffer.find(self._close)
                if end < 0:
                    keep = 0 if final else partial_suffix(self._buffer, [self._close])
                    cut = len(self._buffer) - keep
                    self._reason(self._buffer[:cut], events, closing=final)
                    self._buffer = self._buffer[cut:]
                    return events
                self._reason(self._buffer[:end], events, closing=True)
                self._buffer = self._buffer[end + len(self._close) :]
                self._mode, self._strip_content_newlines = "content", True
            else:
                if self._strip_content_newlines:
                    self._buffer = self._buffer.lstrip("\n")
                    if not self._buffer and not final:
                        return events
                    self._strip_content_newlines = False
                text, self._buffer = self._buffer, ""
                if text:
                    events += self.content.feed(text)
                return events

    def _reason(self, text: str, events: list[Event], *, closing: bool) -> None:
        text = self._held_newlines + text
        if not self._reasoning_begun:
            text = text.lstrip("\n")
        body = text.rstrip("\n")
        self._held_newlines = "" if closing else text[len(body) :]
        if body:
            self._reasoning_begun = True
            events.append(ReasoningDelta(body))


def create_plain_parser(*, tools: Any = None, thinking: bool = False, **_: Any) -> ReasoningParser:
    """The parser for families without a tool-call format of their own: reasoning and content only."""
    return ReasoningParser(PlainContent(), thinking=thinking)


PLAIN_PARSER = ResponseParser(
    name="plain",
    factory=create_plain_parser,
    description="<think>...</think> reasoning, everything else content; no tool calls",
)


def response_parser_for(architecture: str | None, registry: Any = None) -> ResponseParser:
    """The response parser a plugin provides for `architecture`, or `PLAIN_PARSER` when none does."""
    if registry is None:
        from .plugins import registry as process_registry

        registry = process_registry()
    for spec in registry.response_parsers():
        if architecture in spec.architectures:
            return spec
    return PLAIN_PARSER


# -- tool definitions and tool_choice, as every family's parser reads them ---------------------------


def tool_parameters(tools: Iterable[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Function name -> JSON schema of its parameters, from OpenAI (`function.parameters`), flat
    (Responses API `parameters`) or Anthropic (`input_schema`) tool definitions."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        spec = tool.get("function", tool)
        if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
            schema = spec.get("parameters") or spec.get("input_schema") or {}
            found[spec["name"]] = dict(schema) if isinstance(schema, Mapping) else {}
    return found


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema's `type` names (a string or a list), else none."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def chosen_tool_name(tool_choice: Any) -> str | None:
    """The function a `tool_choice` object names (OpenAI `{"type": "function", "function": {...}}` or flat),
    None for the string choices; a LuceboxError for an object that names none."""
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function", tool_choice)
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise LuceboxError(f"tool_choice names no function: {json.dumps(tool_choice)}")
        return name
    return None
