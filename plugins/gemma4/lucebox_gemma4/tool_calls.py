"""Gemma 4 responses: thought channels, content and tool calls, read as they stream; calls forced by grammar.

The chat templates (google-gemma-4-*.jinja) teach this format, and print it back the same way:

    <|channel>thought
    …the reasoning…<channel|>Let me look.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

Arguments are Gemma's own object syntax: keys bare (`<|"|>key<|"|>` is read too), strings between
`<|"|>` tokens (so they may hold commas, braces, colons and newlines), numbers, `true`/`false`, `null`
(the templates print Python's `None`, so that is null too), `{…}` and `[…]`. Several calls follow one
another with nothing between them; the model then stops on `<|tool_response>` (an end-of-generation id).

Thinking is switched on by `<|think|>` in the system turn. The generation prompt is `<|turn>model\\n`,
followed, when thinking is off, by an empty `<|channel>thought\\n<channel|>`: with thinking on the model
writes the channel itself, so the output opens with it. A channel is read as reasoning wherever it
appears (the templates strip every one from an assistant's content), and never reaches the content.
`thinking=True` means the output starts inside a channel (a prompt that ended with its opening).

Arguments stream as JSON fragments (`{"city": "Paris", "days": 3}`, Python's json spacing, as the Qwen
parser writes them): a string's text as it arrives, other values once they end, typed by the tool's
JSON schema where it declares a type. A call cut off at the end of the output is still a call once its
name is known (at its `{`): open strings and containers are closed where the text stops, a half-written
key is dropped. Before that, the text is given back as content.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lucebox_core.errors import LuceboxError
from lucebox_core.json_schema import admitted_types, item_schema, member_schema, value_type
from lucebox_core.parsing import chosen_tool_name, tool_parameters  # noqa: F401 (tool_parameters: the module's API)
from lucebox_core.parsing import (Event, ReasoningDelta, StreamedCall, StreamingToolCallParser, ToolCallEnd,
                                  partial_suffix, tool_call_constraint)

from .markup import CALL_CLOSE, CALL_OPEN, CALL_PREFIX, CHANNEL_CLOSE, CHANNEL_OPEN, NAME_LIMIT, NAME_STOP, QUOTE, THOUGHT
from .tool_grammar import tool_call_grammar

__all__ = ["GemmaResponseParser", "coerce_value", "create_parser", "forced_prefix", "parse_arguments",
           "tool_call_grammar", "tool_choice_constraint", "tool_parameters"]  # fmt: skip


def create_parser(
    *,
    tools: Iterable[Mapping[str, Any]] | None = None,
    thinking: bool = False,
    call_id: Callable[[int], str] | None = None,
) -> GemmaResponseParser:
    """The response parser for one Gemma 4 response (the `ResponseParser` factory).

    Without tools (none given, or `tool_choice: "none"`) nothing is read as a call: `<|tool_call>`
    markup is content. Thought channels are reasoning either way.
    """
    return GemmaResponseParser(tools, thinking=thinking, call_id=call_id)


# --- schemas and values -------------------------------------------------------------------------------


def _wants_string(schema: Any, root: Any = None) -> bool:
    """Whether a `<|"|>` string stays a string under `schema` (else it is read as the type it admits)."""
    types = admitted_types(schema, root)
    return types is None or "string" in types


def _scalar(text: str) -> Any:
    """A bare (unquoted) value by its syntax: JSON number, true/false/null (and Python's spellings)."""
    stripped = text.strip()
    words = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None, "none": None}
    if stripped in words:
        return words[stripped]
    try:
        value = json.loads(stripped)
    except ValueError:
        return stripped  # a bare word: the model meant a string
    return value if isinstance(value, (int, float)) else stripped


def coerce_value(text: str, schema: Mapping[str, Any] | None, *, quoted: bool = False, root: Any = None) -> Any:
    """A scalar's text as the value its schema asks for; `quoted` when it was a `<|"|>` string.

    Without a schema the syntax decides (a quoted value is a string, a bare one is read as a number, boolean
    or null, else it is a bare word: a string). Where the schema (`$ref`s followed into `root`, the tool's
    parameters schema) admits some types only, a value is read as one of them where its text parses as it
    (`<|"|>3<|"|>` for an integer is 3, a bare 007 for a string is "007"); text that does not parse as one
    stays as it was written.
    """
    types = admitted_types(schema, root)
    stripped = text.strip()
    if quoted:
        if _wants_string(schema, root):
            return text
        value = _scalar(stripped)
        if isinstance(value, str):
            value = text
            if types is not None and types & {"object", "array"}:  # JSON, or a Python literal ({'a': 1}), in quotes
                try:
                    value = json.loads(stripped)
                except ValueError:
                    try:
                        value = ast.literal_eval(stripped)
                    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
                        value = text
                    if not isinstance(value, (dict, list)):  # a set, a tuple, bytes...: not JSON, so the text
                        value = text
    else:
        value = _scalar(text)
        kind = value_type(value)
        if types is not None and kind not in types and not (kind == "integer" and "number" in types) \
                and "string" in types:
            return stripped  # a string written bare: its text, whatever it looks like
    if types is not None and "integer" in types and "number" not in types and isinstance(value, float) \
            and value.is_integer():
        value = int(value)
    return value


# --- the streaming parser -------------------------------------------------------------------------------


class _Frame:
    """An object or array being read inside a call's arguments."""

    def __init__(self, kind: str, schema: Any) -> None:
        self.kind = kind  # "object" or "array"
        self.schema = schema
        self.members = 0  # members (items) written to the JSON so far
        self.key: str | None = None  # the key whose value comes next (objects)


class _Call(StreamedCall):
    """One tool call being read (`value`: the scalar, or buffered string, being read)."""

    def __init__(self, index: int, *, space_before: str) -> None:
        super().__init__(index, CALL_OPEN, space_before=space_before)
        self.stack: list[_Frame] = []
        self.value_schema: Any = None


class GemmaResponseParser(StreamingToolCallParser):
    """Reasoning, content and tool calls of a Gemma 4 response (see the module docstring).

    A state machine over a buffer (the core's machinery): each step consumes what it can decide, and waits
    (returns False) while the text at the end might still become a tag, so the events, coalesced, do not
    depend on how the text was chunked.
    """

    _call: _Call | None

    def __init__(
        self,
        tools: Iterable[Mapping[str, Any]] | None = None,
        *,
        thinking: bool = False,
        call_id: Callable[[int], str] | None = None,
    ) -> None:
        super().__init__(tools, call_id=call_id)
        self.tools_enabled = bool(tools)
        self.thinking = thinking
        self._state = "thinking_start" if thinking else "content"
        self._strip_content = ""  # characters stripped from the start of the content that comes next
        self._held_newlines = ""  # at the end of the reasoning so far: dropped if the channel closes
        self._channel_begun = False  # this channel has written reasoning
        self._reasoned = False  # some channel has

    # --- the response parser protocol (what the server calls; `feed` is the machinery's) ---

    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        if self._call is not None:
            if self._call.name:  # cut off inside the call: it ends where the text does
                self._end_call(events, cut_off=True)
            else:  # never got as far as a name: it was text
                self._abandon_call(events)
        if self._state in ("channel", "channel_head", "thinking_start"):
            self._reason(self._buffer, events, closing=True)
            self._buffer, self._state = "", "content"
        if self._buffer:
            self._content(self._buffer, events)
            self._buffer = ""
        self._held_space = ""
        return events

    def constraint_for(self, tool_choice: Any, tokenizer: Any, *, thinking: bool | None = None) -> Any:
        """The constraint that holds the output to `tool_choice` and the tools' schemas (`tool_choice_constraint`)."""
        in_thought = self.thinking if thinking is None else thinking
        return tool_choice_constraint(tokenizer, self.schemas, tool_choice, thinking=in_thought, shadow=self.fresh)

    def fresh(self) -> GemmaResponseParser:
        """A parser like this one, at the start of a response (what "auto" reads the output with)."""
        return GemmaResponseParser(self.tools, thinking=self.thinking)

    # --- the state machine: each step consumes from the buffer, returns whether it made progress ---

    def _in_content(self, events: list[Event], final: bool) -> bool:
        if self._strip_content:  # after a channel or a call, as the templates trim them
            self._buffer = self._buffer.lstrip(self._strip_content)
            if not self._buffer:
                return False
            self._strip_content = ""
        tags = (CHANNEL_OPEN, CHANNEL_CLOSE, CALL_OPEN) if self.tools_enabled else (CHANNEL_OPEN, CHANNEL_CLOSE)
        starts = [(i, tag) for tag in tags if (i := self._buffer.find(tag)) >= 0]
        if not starts:
            keep = 0 if final else partial_suffix(self._buffer, tags)
            self._content(self._buffer[: len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        at, tag = min(starts)
        self._content(self._buffer[:at], events)
        self._buffer = self._buffer[at + len(tag) :]
        if tag == CHANNEL_OPEN:
            self._held_space = ""  # whitespace before a thought is not content either
            self._state = "channel_head"
        elif tag == CHANNEL_CLOSE:  # a close without an open: dropped, as the templates' strip_thinking does
            pass
        else:
            self._call = _Call(self._calls, space_before=self._held_space)
            self._held_space = ""  # whitespace before a call is dropped (given back if it is no call)
            self._state = "call_head"
        return True

    def _in_thinking_start(self, events: list[Event], final: bool) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(CHANNEL_OPEN):  # the model opened the channel itself after all
            self._buffer = rest[len(CHANNEL_OPEN) :]
        elif CHANNEL_OPEN.startswith(rest) and not final:
            return False
        self._state = "channel_head"
        return True

    def _in_channel_head(self, events: list[Event], final: bool) -> bool:
        if self._buffer.startswith(THOUGHT) or (final and THOUGHT.startswith(self._buffer)):
            self._buffer = self._buffer[len(THOUGHT) :]
        elif THOUGHT.startswith(self._buffer):
            return False
        self._state, self._channel_begun = "channel", False
        return True

    def _in_channel(self, events: list[Event], final: bool) -> bool:
        ends = [(i, tag) for tag in (CHANNEL_CLOSE, CHANNEL_OPEN) if (i := self._buffer.find(tag)) >= 0]
        if not ends:
            keep = 0 if final else partial_suffix(self._buffer, [CHANNEL_CLOSE, CHANNEL_OPEN])
            cut = len(self._buffer) - keep
            self._reason(self._buffer[:cut], events, closing=False)
            self._buffer = self._buffer[cut:]
            return False
        end, tag = min(ends)
        self._reason(self._buffer[:end], events, closing=True)
        self._buffer = self._buffer[end + len(tag) :]
        if tag == CHANNEL_OPEN:  # a channel opened inside one: a new thought (the templates strip the tag)
            self._state = "channel_head"
        else:
            self._state, self._strip_content = "content", "\n"
        return True

    def _in_call_head(self, events: list[Event], final: bool) -> bool:
        """`call:NAME{` after `<|tool_call>`; the call is known (ToolCallStart) at its `{`."""
        rest = self._buffer.lstrip()
        if not rest.startswith(CALL_PREFIX):
            if CALL_PREFIX.startswith(rest) and not final:
                return False
            self._abandon_call(events)
            return True
        head = rest[len(CALL_PREFIX) :]
        size = next((i for i, c in enumerate(head) if c in NAME_STOP), len(head))
        name, after = head[:size], head[size:].lstrip()
        if not after:  # the name may go on, or the `{` is still to come
            if not final and size <= NAME_LIMIT:
                return False
            self._abandon_call(events)
            return True
        no_arguments = after.startswith(CALL_CLOSE)
        if not name or size > NAME_LIMIT or not (after.startswith("{") or no_arguments):
            if no_arguments or not CALL_CLOSE.startswith(after) or final:
                self._abandon_call(events)
                return True
            return False  # `call:NAME<tool_ca…`: wait for the rest of the tag
        call = self._call
        assert call is not None
        self._take(len(self._buffer) - len(after) + (0 if no_arguments else 1))  # `after` ends the buffer
        self._name_call(events, name)
        self._arguments(events, "{}" if no_arguments else "{")
        self._state = "call_close" if no_arguments else "key"
        if not no_arguments:
            call.stack.append(_Frame("object", self.schemas.get(name, {})))
        return True

    def _in_key(self, events: list[Event], final: bool) -> bool:
        """Inside an object, before a key (or its closing brace)."""
        call = self._call
        assert call is not None
        rest = self._skip(" \t\r\n,")
        if not rest:
            return False
        if rest[0] in "}]":
            self._take(1)
            self._close_container(events)
            return True
        if rest.startswith("<"):
            if self._undecided(rest, final):
                return False
            if self._at_call_close(events):
                return True
            end = rest.find(QUOTE, len(QUOTE)) if rest.startswith(QUOTE) else -1  # a quoted key
            colon = rest.find(":", end + len(QUOTE)) if end >= 0 else -1
            if rest.startswith(QUOTE) and (colon < 0 or rest[end + len(QUOTE) : colon].strip()):
                if not final and colon < 0:
                    return False
                self._take(len(rest) if end < 0 else end + len(QUOTE))  # not a key after all: skipped
                return True
            if colon >= 0:
                call.stack[-1].key, self._state = rest[len(QUOTE) : end], "value"
                self._take(colon + 1)
                return True
        stops = [i for c in ":{}[],<" if (i := rest.find(c, 1 if c == "<" else 0)) >= 0]
        if not stops:
            if not final and len(rest) <= NAME_LIMIT:
                return False
            self._take(len(rest))  # no key after all: skipped (kept in raw_text)
            return True
        at = min(stops)
        if rest[at] == ":" and rest[:at].strip():
            call.stack[-1].key = rest[:at].strip()
            self._take(at + 1)
            self._state = "value"
        else:  # stray text where a key belongs: skipped
            self._take(max(at, 1))
        return True

    def _in_value(self, events: list[Event], final: bool) -> bool:
        """Before a value: a member's (after `key:`) or an array item's (after `[` or `,`)."""
        call = self._call
        assert call is not None
        frame = call.stack[-1]
        rest = self._skip()
        if not rest:
            return False
        first = rest[0]
        if first in "}]":  # a key without a value, or `[]` / a trailing comma: the container closes
            frame.key, self._state = None, "after"
            return True
        if first == ",":  # a key without a value (dropped), or an empty array item
            self._take(1)
            frame.key, self._state = None, "key" if frame.kind == "object" else "value"
            return True
        if first == "<":
            if self._undecided(rest, final):
                return False
            if self._at_call_close(events):
                return True
            if rest.startswith(QUOTE):
                self._take(len(QUOTE))
                schema = self._member_schema()
                self._open_value(events)
                call.value_schema, call.value, self._state = schema, [], "string"
                call.streams_string = _wants_string(call.value_schema, self._root())
                self._arguments(events, '"' if call.streams_string else "")
                return True
        if first in "{[":
            schema = self._member_schema()
            self._take(1)
            self._open_value(events)
            self._arguments(events, first)
            call.stack.append(_Frame("object" if first == "{" else "array", schema))
            self._state = "key" if first == "{" else "value"
            return True
        call.value_schema, call.value = self._member_schema(), []
        self._state = "bare"
        return True

    def _in_string(self, events: list[Event], final: bool) -> bool:
        end = self._buffer.find(QUOTE)
        if end < 0:
            # Hold back what may begin the closing quote; when cut off, the string ends where the text
            # does, less a half-written quote.
            keep = partial_suffix(self._buffer, [QUOTE])
            self._value_text(events, self._buffer[: len(self._buffer) - keep])
            return False
        self._value_text(events, self._buffer[:end])
        self._take(len(QUOTE))
        self._close_scalar(events)
        return True

    def _in_bare(self, events: list[Event], final: bool) -> bool:
        stops = [i for c in ",}]<" if (i := self._buffer.find(c, 1 if c == "<" else 0)) >= 0]
        if not stops and not final:
            return False
        at = min(stops) if stops else len(self._buffer)
        call = self._call
        assert call is not None
        call.value.append(self._buffer[:at])
        self._take(at)
        self._close_scalar(events)
        return True

    def _in_after(self, events: list[Event], final: bool) -> bool:
        """After a value inside an object or array: a comma, the closing bracket, or the call's end."""
        call = self._call
        assert call is not None
        rest = self._skip()
        if not rest:
            return False
        frame = call.stack[-1]
        if rest[0] == ",":
            self._take(1)
            self._state = "key" if frame.kind == "object" else "value"
        elif rest[0] in "}]":
            self._take(1)
            self._close_container(events)
        elif rest[0] == "<" and self._undecided(rest, final):
            return False
        elif not (rest[0] == "<" and self._at_call_close(events)):
            self._state = "key" if frame.kind == "object" else "value"  # a missing comma: read on
        return True

    def _in_call_close(self, events: list[Event], final: bool) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(CALL_CLOSE):
            self._take(len(self._buffer) - len(rest) + len(CALL_CLOSE))
        elif not rest or CALL_CLOSE.startswith(rest):
            if not final:
                return False
            self._take(len(self._buffer))  # cut off in the closing tag: it is still the call's
        self._end_call(events)
        return True

    # --- helpers ---

    def _skip(self, chars: str | None = None) -> str:
        """Move leading whitespace (or `chars`) into the call's raw text; what is left of the buffer."""
        rest = self._buffer.lstrip(chars)
        self._take(len(self._buffer) - len(rest))
        return rest

    @staticmethod
    def _undecided(rest: str, final: bool) -> bool:
        """Whether `rest` may still grow into a string quote or the call's closing tag."""
        return not final and (QUOTE.startswith(rest) or CALL_CLOSE.startswith(rest))

    def _at_call_close(self, events: list[Event]) -> bool:
        """At `<tool_call|>` while containers are open (a malformed call): they close, the call ends."""
        rest = self._buffer.lstrip()
        if not rest.startswith(CALL_CLOSE):
            return False
        self._take(len(self._buffer) - len(rest) + len(CALL_CLOSE))
        self._end_call(events)
        return True

    def _member_schema(self) -> Any:
        call = self._call
        assert call is not None
        frame = call.stack[-1]
        if frame.kind == "object":
            return member_schema(frame.schema, frame.key or "", self._root())
        return item_schema(frame.schema, frame.members, self._root())

    def _root(self) -> Any:
        """The schema of the current call's arguments (what `$ref`s point into)."""
        return self.schemas.get(self._call.name, {}) if self._call is not None else {}

    def _open_value(self, events: list[Event]) -> None:
        """The JSON before a value: a separator, and for an object member its key."""
        call = self._call
        assert call is not None
        frame = call.stack[-1]
        head = ", " if frame.members else ""
        if frame.kind == "object":
            head += json.dumps(frame.key or "", ensure_ascii=False) + ": "
        frame.members += 1
        self._arguments(events, head)

    def _close_scalar(self, events: list[Event]) -> None:
        """The end of a string (`string` state) or bare value (`bare` state): its JSON is written."""
        call = self._call
        assert call is not None
        if self._state == "string":
            value = None if call.streams_string else coerce_value("".join(call.value), call.value_schema, quoted=True,
                                                                          root=self._root())
            self._arguments(events, '"' if call.streams_string else json.dumps(value, ensure_ascii=False))
        else:
            text = "".join(call.value)
            if text.strip():
                self._open_value(events)
                value = coerce_value(text, call.value_schema, root=self._root())
                self._arguments(events, json.dumps(value, ensure_ascii=False))
        call.value, call.stack[-1].key = [], None
        self._state = "after"

    def _close_container(self, events: list[Event]) -> None:
        call = self._call
        assert call is not None
        frame = call.stack.pop()
        self._arguments(events, "}" if frame.kind == "object" else "]")
        self._state = "after" if call.stack else "call_close"

    def _end_call(self, events: list[Event], *, cut_off: bool = False) -> None:
        """The call's end: what is still open closes, innermost first (a cut-off or malformed call)."""
        call = self._call
        assert call is not None
        if cut_off:
            if self._state == "string":  # the string ends where the text does, less a half-written quote
                keep = partial_suffix(self._buffer, [QUOTE])
                self._value_text(events, self._buffer[: len(self._buffer) - keep])
            elif self._state == "bare":
                call.value.append(self._buffer)
            self._take(len(self._buffer))
        if self._state in ("string", "bare"):
            self._close_scalar(events)
        while call.stack:
            self._close_container(events)
        self._close_call(events)
        self._strip_content = " \t\r\n"

    def _reason(self, text: str, events: list[Event], *, closing: bool) -> None:
        # Newlines the templates put around a thought are not part of it (`thought\n…\n<channel|>`).
        text = self._held_newlines + text
        if not self._channel_begun:
            text = text.lstrip("\n")
        body = text.rstrip("\n")
        self._held_newlines = "" if closing else text[len(body) :]
        if body:
            if not self._channel_begun and self._reasoned:
                body = "\n\n" + body  # a second thought in one response: kept apart from the first
            self._channel_begun = self._reasoned = True
            events.append(ReasoningDelta(body))


def parse_arguments(text: str, schema: Mapping[str, Any] | None = None) -> Any:
    """Gemma's argument syntax (`{city:<|"|>Paris<|"|>,days:3}`) as a Python value, typed by `schema`."""
    parser = GemmaResponseParser([{"name": "f", "parameters": dict(schema or {})}], call_id=lambda i: "")
    events = parser.feed(f"{CALL_OPEN}{CALL_PREFIX}f{text}{CALL_CLOSE}") + parser.finish()
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    if not ends:
        raise LuceboxError(f"not Gemma tool-call arguments: {text[:80]!r}")
    return json.loads(ends[0].arguments_json)


# --- tool_choice ------------------------------------------------------------------------------------


def forced_prefix(tool_choice: Any) -> str:
    """Text to put at the start of the answer so the model can only go on with a call ("" if none).

    For a named function the prefix includes the call's head up to its `{`; the parser must then be
    fed the prefix first (it is part of the answer), and the prompt must end with it.
    """
    name = chosen_tool_name(tool_choice)
    if name is not None:
        return f"{CALL_OPEN}{CALL_PREFIX}{name}{{"
    return f"{CALL_OPEN}{CALL_PREFIX}" if tool_choice == "required" else ""


def tool_choice_constraint(
    tokenizer: Any, schemas: Mapping[str, Mapping[str, Any]], tool_choice: Any, *, thinking: bool = False,
    shadow: Callable[[], Any] | None = None,
) -> Any:
    """The constraint for `tool_choice`: only tool calls (after a thought channel, if `thinking`) for
    "required" (any declared function, one or more calls) or a named function (exactly one call); for
    "auto" (given `shadow`, a factory of fresh parsers) free text, with each call the model opens held to the
    grammar. Either way every call's arguments follow its tool's JSON schema (`tool_grammar`).
    """
    return tool_call_constraint(tokenizer, schemas, tool_choice, tool_call_grammar, thinking=thinking, shadow=shadow)
