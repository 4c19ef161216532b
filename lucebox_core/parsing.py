"""Turning a model's raw output into reasoning, content and tool calls, while it streams.

A response parser is fed the generated text in pieces of any size (`feed`) and returns events; `finish`
flushes what it still holds. Text that might be the start of a tag (`<thi`, `<tool_c`) is held back
until it is known; so coalescing adjacent deltas of one kind gives the same events whatever the chunking.

This module has the family-independent parts: the event records, the `<think>…</think>` splitter
(`ReasoningParser`) that hands everything outside the reasoning to a content parser (a family's
tool-call parser, or `PlainContent`), the machinery every family's tool-call parser runs on
(`StreamingToolCallParser`), the tool_choice checks and the lookup of a family's parser in the plugin
registry.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import attrs

from .errors import LuceboxError
from .json_schema import coerce_value
from .specs import ResponseParser

__all__ = [
    "PLAIN_PARSER",
    "ContentDelta",
    "ContentParser",
    "Event",
    "PlainContent",
    "ReasoningDelta",
    "ReasoningParser",
    "StreamedCall",
    "StreamingToolCallParser",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "create_plain_parser",
    "partial_suffix",
    "response_parser_for",
    "tool_call_constraint",
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

    def constraint_for(self, tool_choice: Any, tokenizer: Any, **_: Any) -> None:
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
        """A `Constraint` that makes the model honour `tool_choice` and the tools' schemas, or None (see the
        content parser)."""
        build = getattr(self.content, "constraint_for", None)
        if build is None:
            return None
        if hasattr(self.content, "fresh"):  # a parser it can shadow the output with: "auto" can hold calls
            return build(tool_choice, tokenizer, thinking=self.thinking, shadow=self.fresh)
        return build(tool_choice, tokenizer, thinking=self.thinking)

    def fresh(self) -> ReasoningParser:
        """A parser like this one at the start of a response (what "auto" reads the output with)."""
        return ReasoningParser(self.content.fresh(), thinking=self.thinking, open_tag=self._open,
                               close_tag=self._close)

    @property
    def call_open(self) -> bool:
        """Whether the output so far has opened a tool call that has not ended."""
        return self._mode == "content" and bool(getattr(self.content, "call_open", False))

    def open_call_text(self) -> str:
        """The text of the open call so far, from its opening tag on."""
        return self.content.open_call_text()

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


def tool_call_constraint(
    tokenizer: Any,
    schemas: Mapping[str, Mapping[str, Any]],
    tool_choice: Any,
    grammar: Callable[..., str],
    *,
    thinking: bool = False,
    shadow: Callable[[], Any] | None = None,
) -> Any:
    """The constraint that holds the output to `tool_choice`, every call's arguments to its tool's JSON schema.

    `grammar(tokenizer, schemas, thinking=, single=, opened=, lenient=)` is the family's Lark grammar of calls
    to the chosen functions. "required": only calls, one or more, to any declared function; a named function:
    exactly one call to it. "auto": free text, each call the model opens held to the grammar from its opening
    on (`opened`); `shadow()` makes a fresh parser of the whole response, which tells when a call opens (no
    shadow: no constraint). A keyword a grammar cannot enforce is refused for a forced call and ignored under
    "auto" (`lenient`). None for "none" and no tools.
    """
    if tool_choice in (None, "none"):
        return None
    if tool_choice == "auto":
        if not schemas or shadow is None:
            return None
        from .constraints import OpenedCallConstraint

        return OpenedCallConstraint(tokenizer, grammar(tokenizer, schemas, opened=True, lenient=True), shadow())
    name = chosen_tool_name(tool_choice)
    if name is None and tool_choice != "required":
        raise LuceboxError(f"tool_choice must be 'auto', 'none', 'required' or a function, got {tool_choice!r}")
    names = [name] if name is not None else list(schemas)
    if not names:
        raise LuceboxError("tool_choice asks for a tool call but no tools were given")
    unknown = [n for n in names if n not in schemas]
    if unknown:
        raise LuceboxError(f"tool_choice names {unknown[0]!r}, which is not among the tools given")
    from .constraints import lark_constraint

    chosen = {n: schemas[n] for n in names}
    return lark_constraint(tokenizer, grammar(tokenizer, chosen, thinking=thinking, single=name is not None))


# -- the machinery of a family's streaming tool-call parser -----------------------------------------


class StreamedCall:
    """One tool call being read: its text as generated, its name once known, the JSON sent so far."""

    def __init__(self, index: int, opening: str, *, space_before: str) -> None:
        self.index = index
        self.space_before = space_before  # the content's whitespace before the call: given back if it is none
        self.raw = [opening]
        self.name = ""
        self.fragments: list[str] = []
        self.value: list[str] = []  # the text of the value being read
        self.streams_string = False  # whether that text goes out as a JSON string while it arrives


class StreamingToolCallParser:
    """A state machine over a buffer, which a family's tool-call parser fills with its states.

    Each step (`_in_STATE(events, final)`) consumes what it can decide and returns whether it made
    progress; it waits (returns False) while the text at the end might still become a tag, so the events,
    coalesced, do not depend on how the text was chunked. A call's text is moved into its `raw` as it is
    read (`_take`); what turns out to be no call goes out as content (`_abandon_call`).
    """

    _state = "content"

    def __init__(
        self, tools: Iterable[Mapping[str, Any]] | None, *, call_id: Callable[[int], str] | None = None
    ) -> None:
        self.tools = list(tools or ())
        self.schemas = tool_parameters(self.tools)
        self._call_id = call_id or (lambda index: f"call_{secrets.token_hex(12)}")
        self._buffer = ""
        self._held_space = ""  # content's trailing whitespace: dropped if a tool call follows
        self._calls = 0
        self._call: StreamedCall | None = None

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._drain(final=False)

    @property
    def call_open(self) -> bool:
        """Whether a call has opened (its opening tag was read) and not ended."""
        return self._call is not None

    def open_call_text(self) -> str:
        """The open call's text so far, from its opening tag on."""
        assert self._call is not None
        return "".join(self._call.raw) + self._buffer

    def _drain(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while getattr(self, f"_in_{self._state}")(events, final):
            pass
        return events

    def _take(self, size: int) -> None:
        """Move `size` characters from the buffer into the current call's raw text."""
        assert self._call is not None
        self._call.raw.append(self._buffer[:size])
        self._buffer = self._buffer[size:]

    def _content(self, text: str, events: list[Event]) -> None:
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body) :]
        if body:
            events.append(ContentDelta(body))

    def _name_call(self, events: list[Event], name: str) -> None:
        """The current call's name is known: the call starts."""
        call = self._call
        assert call is not None
        call.name = name
        events.append(ToolCallStart(call.index, self._call_id(call.index), name))

    def _arguments(self, events: list[Event], fragment: str) -> None:
        assert self._call is not None
        if fragment:
            self._call.fragments.append(fragment)
            events.append(ToolCallArgsDelta(self._call.index, fragment))

    def _value_text(self, events: list[Event], text: str) -> None:
        """Text of the value being read, taken from the buffer (and streamed, if it is a string)."""
        call = self._call
        assert call is not None
        if not text:
            return
        call.value.append(text)
        self._take(len(text))
        if call.streams_string:
            self._arguments(events, json.dumps(text, ensure_ascii=False)[1:-1])

    def _close_call(self, events: list[Event]) -> None:
        """The current call's arguments are complete: it ends, and content follows."""
        call = self._call
        assert call is not None
        events.append(ToolCallEnd(call.index, "".join(call.fragments), "".join(call.raw)))
        self._calls += 1
        self._call, self._state = None, "content"

    def _abandon_call(self, events: list[Event]) -> None:
        """What looked like a call is not one: its text so far goes out as content."""
        call = self._call
        assert call is not None
        self._call, self._state = None, "content"
        self._held_space = call.space_before
        self._content("".join(call.raw), events)


class ParameterCall(StreamedCall):
    """A call whose arguments arrive as named parameters, each value text in the family's markup."""

    def __init__(self, index: int, opening: str, *, space_before: str) -> None:
        super().__init__(index, opening, space_before=space_before)
        self.parameter_schema: Mapping[str, Any] | None = None  # the schema of the parameter being read


class ParameterToolCallParser(StreamingToolCallParser):
    """The part of a streaming parser that families whose calls carry named text parameters share (Qwen's
    `<parameter=...>`, Laguna's `<arg_key>`/`<arg_value>`): how a response ends, how a value is closed (a
    string value streamed as it arrives; any other value read as its schema says, JSON or text, then sent
    whole), how a call ends, and content right after a call losing its leading whitespace. The family's
    subclass holds the state machine of its markup."""

    _call: ParameterCall | None

    def __init__(
        self, tools: Iterable[Mapping[str, Any]] | None, *, call_id: Callable[[int], str] | None = None
    ) -> None:
        super().__init__(tools, call_id=call_id)
        self._after_call = False  # content right after a call loses its leading whitespace

    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        if self._call is not None:
            if self._call.name:  # cut off inside the call: it ends where the text does
                self._take(len(self._buffer))
                self._end_call(events)
            else:  # never got as far as a name: it was text
                self._abandon_call(events)
        if self._buffer:
            self._content(self._buffer, events)
            self._buffer = ""
        self._held_space = ""
        return events

    def fresh(self) -> ParameterToolCallParser:
        return type(self)(self.tools)

    def _content(self, text: str, events: list[Event]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        super()._content(text, events)

    def _close_value(self, events: list[Event]) -> None:
        call = self._call
        assert call is not None
        if call.streams_string:
            self._arguments(events, '"')
        else:
            value = coerce_value("".join(call.value), call.parameter_schema, self.schemas.get(call.name, {}))
            self._arguments(events, json.dumps(value, ensure_ascii=False))

    def _end_call(self, events: list[Event], *, arguments_done: bool = False) -> None:
        call = self._call
        assert call is not None
        if self._state in ("value_start", "value"):
            self._close_value(events)
        if not arguments_done:
            self._arguments(events, "}" if call.fragments else "{}")
        self._close_call(events)
        self._after_call = True
