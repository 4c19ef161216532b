"""Laguna tool calls, read from the output as it streams.

Laguna-XS.2's chat template teaches this format (a string value as written, any other value as JSON):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

Arguments stream as JSON fragments: a string parameter's text as it arrives, other values once their
`</arg_value>` closes (parsed and typed by the tool's JSON schema, as Qwen's text-or-JSON parameters are:
`lucebox_core.json_schema.coerce_value`). A call cut off at the end of the output is still a call once its
function name is known; before that, the text is given back as content. Reasoning is a leading
`<think>…</think>` block (the template opens the answer with `</think>` when thinking is off).

The grammar that holds calls to the tools' schemas (`tool_grammar.py`) writes values the same way, so the
parser reads back exactly what the grammar allowed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lucebox_core.json_schema import is_text_parameter, member_schema
from lucebox_core.parsing import Event, ParameterCall, ParameterToolCallParser, PlainContent, ReasoningParser, partial_suffix

from .markup import CALL_CLOSE, CALL_OPEN, KEY_CLOSE, KEY_OPEN, NAME_LIMIT, VALUE_CLOSE, VALUE_OPEN
from .tool_grammar import tool_choice_constraint

__all__ = ["LagunaToolCallParser", "create_parser"]


def create_parser(*, tools: Iterable[Mapping[str, Any]] | None = None, thinking: bool = False,
                  call_id: Callable[[int], str] | None = None) -> ReasoningParser:
    """The response parser for one Laguna response (the `ResponseParser` factory). Without tools (none given,
    or `tool_choice: "none"`) nothing is read as a call: all is content."""
    content = LagunaToolCallParser(tools, call_id=call_id) if tools else PlainContent()
    return ReasoningParser(content, thinking=thinking)


class LagunaToolCallParser(ParameterToolCallParser):
    """The content parser for Laguna's `<tool_call>` calls (see the module docstring)."""

    def constraint_for(self, tool_choice: Any, tokenizer: Any, *, thinking: bool = False,
                       shadow: Callable[[], Any] | None = None) -> Any:
        """The constraint that holds the output to `tool_choice` and the tools' schemas (`tool_grammar`);
        `shadow` makes a fresh parser of the whole response, for "auto"."""
        return tool_choice_constraint(tokenizer, self.schemas, tool_choice, thinking=thinking, shadow=shadow)

    # --- the state machine: each step consumes from the buffer, returns whether it made progress ---

    def _in_content(self, events: list[Event], final: bool) -> bool:
        at = self._buffer.find(CALL_OPEN)
        if at < 0:
            keep = 0 if final else partial_suffix(self._buffer, (CALL_OPEN,))
            self._content(self._buffer[: len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._content(self._buffer[:at], events)
        self._call = ParameterCall(self._calls, CALL_OPEN, space_before=self._held_space)
        self._held_space = ""
        self._buffer = self._buffer[at + len(CALL_OPEN) :]
        self._state = "function_name"
        return True

    def _in_function_name(self, events: list[Event], final: bool) -> bool:
        ends = [i for i in (self._buffer.find("\n"), self._buffer.find("<")) if i >= 0]
        end = min(ends) if ends else -1
        if end < 0 and not final and len(self._buffer) <= NAME_LIMIT:
            return False
        name = (self._buffer if end < 0 else self._buffer[:end]).strip()
        if not name or len(name) > NAME_LIMIT or any(c in name for c in "<>"):
            self._abandon_call(events)
            return True
        self._take(len(self._buffer) if end < 0 else end)
        self._name_call(events, name)
        self._state = "parameters"
        return True

    def _in_parameters(self, events: list[Event], final: bool) -> bool:
        rest = self._buffer.lstrip()
        skipped = len(self._buffer) - len(rest)
        for tag, state in ((KEY_OPEN, "parameter_name"), (CALL_CLOSE, "call_close")):
            if rest.startswith(tag):
                self._take(skipped + len(tag))
                if state == "call_close":
                    self._end_call(events)
                else:
                    self._state = state
                return True
        if not rest or (not final and (KEY_OPEN.startswith(rest) or CALL_CLOSE.startswith(rest))):
            return False
        next_tag = rest.find("<", 1)  # stray text inside a call: kept in its raw text, skipped
        if next_tag < 0 and not final:
            return False
        self._take(skipped + (next_tag if next_tag >= 0 else len(rest)))
        return True

    def _in_parameter_name(self, events: list[Event], final: bool) -> bool:
        end = self._buffer.find(KEY_CLOSE)
        if end < 0:
            return False
        call = self._call
        assert call is not None
        name = self._buffer[:end].strip()
        self._take(end + len(KEY_CLOSE))
        root = self.schemas.get(call.name, {})
        call.parameter_schema = member_schema(root, name, root)
        call.streams_string = is_text_parameter(call.parameter_schema, root)
        call.value = []
        opening = ("{" if not call.fragments else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        self._arguments(events, opening + ('"' if call.streams_string else ""))
        self._state = "value_start"
        return True

    def _in_value_start(self, events: list[Event], final: bool) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(VALUE_OPEN):
            self._take(len(self._buffer) - len(rest) + len(VALUE_OPEN))
            self._state = "value"
            return True
        if not final and (not rest or VALUE_OPEN.startswith(rest)):
            return False
        self._state = "value"  # a value without its opening tag: read up to the closing one all the same
        return True

    def _in_value(self, events: list[Event], final: bool) -> bool:
        end = self._buffer.find(VALUE_CLOSE)
        if end < 0:
            keep = partial_suffix(self._buffer, (VALUE_CLOSE,))
            self._value_text(events, self._buffer[: len(self._buffer) - keep])
            if final:
                self._take(len(self._buffer))
                self._close_value(events)
                self._state = "parameters"
            return False
        self._value_text(events, self._buffer[:end])
        self._take(len(VALUE_CLOSE))
        self._close_value(events)
        self._state = "parameters"
        return True
