"""Qwen3.5 / Qwen3-Coder tool calls, read from the output as it streams, and forced by grammar.

The chat templates teach this format (values sit between newlines; non-strings are JSON):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Also read: a bare `<function=…>…</function>` (Qwen3-Coder sometimes drops the wrapper) and the older
Qwen JSON form `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.

Arguments stream as JSON fragments: a string parameter's text as it arrives, other values once their
`</parameter>` closes (parsed, and typed by the tool's JSON schema: a parameter whose schema admits only
strings is its text as written, any other is JSON). A call cut off at the end of the output is still a
call once its function name is known (its open value is closed where the text stops); before that, the
text is given back as content.

The grammar that holds calls to the tools' schemas (`tool_call_grammar`) writes values the same way, so
the parser reads back exactly what the grammar allowed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lucebox_core.json_schema import coerce_value, is_text_parameter, member_schema  # noqa: F401 (coerce_value: the module's API)
from lucebox_core.parsing import chosen_tool_name, tool_parameters  # noqa: F401 (tool_parameters: the module's API)
from lucebox_core.parsing import (
    Event,
    PlainContent,
    ReasoningParser,
    ParameterCall,
    ParameterToolCallParser,
    partial_suffix,
    tool_call_constraint,
)
from lucebox_core.schema_grammar import (JsonSyntax, SchemaGrammar, SchemaNotSupported, StringShape, ValueSyntax,
                                         checked, containing, lark_string, regex_item)

__all__ = ["QwenToolCallParser", "coerce_value", "create_parser", "forced_prefix", "is_text_parameter",
           "tool_call_grammar", "tool_choice_constraint", "tool_parameters"]  # fmt: skip

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
_NAME_LIMIT = 256  # a "name" longer than this is not a tag after all


def create_parser(
    *,
    tools: Iterable[Mapping[str, Any]] | None = None,
    thinking: bool = False,
    call_id: Callable[[int], str] | None = None,
) -> ReasoningParser:
    """The response parser for one Qwen3.5 response (the `ResponseParser` factory).

    Without tools (none given, or `tool_choice: "none"`) nothing is read as a call: all is content.
    """
    content = QwenToolCallParser(tools, call_id=call_id) if tools else PlainContent()
    return ReasoningParser(content, thinking=thinking)


class QwenToolCallParser(ParameterToolCallParser):
    """The content parser for Qwen's XML tool calls (see the module docstring)."""

    def constraint_for(self, tool_choice: Any, tokenizer: Any, *, thinking: bool = False,
                       shadow: Callable[[], Any] | None = None) -> Any:
        """The constraint that holds the output to `tool_choice` and the tools' schemas (see
        `tool_choice_constraint`); `shadow` makes a fresh parser of the whole response, for "auto"."""
        return tool_choice_constraint(tokenizer, self.schemas, tool_choice, thinking=thinking, shadow=shadow)

    # --- the state machine: each step consumes from the buffer, returns whether it made progress ---

    def _in_content(self, events: list[Event], final: bool) -> bool:
        starts = [(i, tag) for tag in (CALL_OPEN, FUNCTION_OPEN) if (i := self._buffer.find(tag)) >= 0]
        if not starts:
            keep = 0 if final else partial_suffix(self._buffer, (CALL_OPEN, FUNCTION_OPEN))
            self._content(self._buffer[: len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        at, tag = min(starts)
        self._content(self._buffer[:at], events)
        self._call = ParameterCall(self._calls, tag, space_before=self._held_space)
        self._held_space = ""  # whitespace before a call is dropped (given back if it is no call)
        self._buffer = self._buffer[at + len(tag) :]
        self._state = "call_open" if tag == CALL_OPEN else "function_name"
        return True

    def _in_call_open(self, events: list[Event], final: bool) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(FUNCTION_OPEN):
            self._take(len(self._buffer) - len(rest) + len(FUNCTION_OPEN))
            self._state = "function_name"
        elif rest.startswith("{"):
            self._state = "json_call"
        elif FUNCTION_OPEN.startswith(rest) and not final:
            return False
        else:
            self._abandon_call(events)
        return True

    def _in_function_name(self, events: list[Event], final: bool) -> bool:
        end = self._buffer.find(">")
        name = self._buffer[:end].strip() if end >= 0 else ""
        if end < 0 and not final and len(self._buffer) <= _NAME_LIMIT and "\n" not in self._buffer:
            return False
        if end < 0 or not name or len(name) > _NAME_LIMIT or any(c in name for c in "<\n"):
            self._abandon_call(events)
            return True
        self._take(end + 1)
        self._name_call(events, name)
        self._state = "parameters"
        return True

    def _in_parameters(self, events: list[Event], final: bool) -> bool:
        rest = self._buffer.lstrip()
        skipped = len(self._buffer) - len(rest)
        for tag, state in ((PARAMETER_OPEN, "parameter_name"), (FUNCTION_CLOSE, "call_close")):
            if rest.startswith(tag):
                self._take(skipped + len(tag))
                self._state = state
                return True
        if not rest or (not final and (PARAMETER_OPEN.startswith(rest) or FUNCTION_CLOSE.startswith(rest))):
            return False
        # Stray text inside a call: kept in raw_text, skipped up to the next tag.
        next_tag = rest.find("<", 1)
        if next_tag < 0 and not final:
            return False
        self._take(skipped + (next_tag if next_tag >= 0 else len(rest)))
        return True

    def _in_parameter_name(self, events: list[Event], final: bool) -> bool:
        end = self._buffer.find(">")
        if end < 0:
            return False
        call = self._call
        assert call is not None
        name = self._buffer[:end].strip()
        self._take(end + 1)
        root = self.schemas.get(call.name, {})
        call.parameter_schema = member_schema(root, name, root)
        # Parameters the schema does not type are read as text, as the template wrote them.
        call.streams_string = is_text_parameter(call.parameter_schema, root)
        call.value = []
        opening = ("{" if not call.fragments else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        self._arguments(events, opening + ('"' if call.streams_string else ""))
        self._state = "value_start"
        return True

    def _in_value_start(self, events: list[Event], final: bool) -> bool:
        if not self._buffer and not final:
            return False
        if self._buffer.startswith("\n"):
            self._take(1)
        self._state = "value"
        return True

    def _in_value(self, events: list[Event], final: bool) -> bool:
        end = self._buffer.find(PARAMETER_CLOSE)
        if end < 0:
            # Hold back what may begin the closing tag; when cut off, the value ends where the text
            # does, less a half-written closing tag.
            keep = partial_suffix(self._buffer, ("\n" + PARAMETER_CLOSE, PARAMETER_CLOSE))
            self._value_text(events, self._buffer[: len(self._buffer) - keep])
            if final:
                self._take(len(self._buffer))
                self._close_value(events)
                self._state = "parameters"
            return False
        value = self._buffer[:end]
        value = value.removesuffix("\n")
        self._value_text(events, value)  # takes the value out of the buffer
        self._take(end - len(value) + len(PARAMETER_CLOSE))
        self._close_value(events)
        self._state = "parameters"
        return True

    def _in_call_close(self, events: list[Event], final: bool) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(CALL_CLOSE):
            self._take(len(self._buffer) - len(rest) + len(CALL_CLOSE))
        elif (not rest or CALL_CLOSE.startswith(rest)) and not final:
            return False
        self._end_call(events)
        return True

    def _in_json_call(self, events: list[Event], final: bool) -> bool:
        end = self._buffer.find(CALL_CLOSE)
        if end < 0 and not final:
            return False
        body = self._buffer if end < 0 else self._buffer[:end]
        try:
            parsed = json.loads(body)
            name, arguments = parsed["name"], parsed.get("arguments", parsed.get("parameters", {}))
            if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
                raise TypeError("not a call")
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (ValueError, KeyError, TypeError):
            if final:
                self._abandon_call(events)
            else:  # "</tool_call>" inside a JSON string: read on to the next closing tag
                return self._json_call_not_closed_at(end, events)
            return True
        self._take(end + len(CALL_CLOSE) if end >= 0 else len(self._buffer))
        self._name_call(events, name)
        self._arguments(events, json.dumps(arguments, ensure_ascii=False))
        self._end_call(events, arguments_done=True)
        return True

    def _json_call_not_closed_at(self, end: int, events: list[Event]) -> bool:
        later = self._buffer.find(CALL_CLOSE, end + 1)
        if later < 0:
            return False
        self._abandon_call(events)  # two closing tags and neither ends valid JSON: not a call
        return True


# --- tool_choice ------------------------------------------------------------------------------------


def forced_prefix(tool_choice: Any) -> str:
    """Text to put at the start of the answer so the model can only go on with a call ("" if none).

    For a named function the prefix includes the function header; the parser must then be fed the
    prefix first (it is part of the answer), and the prompt must end with it.
    """
    name = chosen_tool_name(tool_choice)
    if name is not None:
        return f"{CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n"
    return f"{CALL_OPEN}\n" if tool_choice == "required" else ""


def tool_choice_constraint(
    tokenizer: Any, schemas: Mapping[str, Mapping[str, Any]], tool_choice: Any, *, thinking: bool = False,
    shadow: Callable[[], Any] | None = None,
) -> Any:
    """The constraint for `tool_choice`: only tool calls (after the reasoning, when `thinking`) for "required"
    (any declared function, one or more calls) or a named function (exactly one call); for "auto" (given
    `shadow`, a factory of fresh response parsers) free text, with each call the model opens held to the
    grammar. Either way every call's arguments follow its tool's JSON schema. None for "none".
    """
    return tool_call_constraint(tokenizer, schemas, tool_choice, tool_call_grammar, thinking=thinking, shadow=shadow)


class _TextValues(ValueSyntax):
    """A text parameter's value: its text as written, then the closing tag (one lexeme, so the value ends at
    the first `</parameter>`, where the parser ends it)."""

    forbidden = (PARAMETER_CLOSE,)
    closing = "\n" + PARAMETER_CLOSE + "\n"

    def string(self, grammar: SchemaGrammar, shape: StringShape) -> str:
        body = regex_item(f"(?s:.{shape.length()})")
        if shape.pattern is not None:
            body = f"{regex_item(shape.pattern)} & {body}"
        body = f"({body}) & ~{containing(PARAMETER_CLOSE)}"
        return grammar.terminal(f"({body}) {lark_string(self.closing)}", ("text", shape))

    def string_literal(self, text: str) -> str | None:
        return None if PARAMETER_CLOSE in text else lark_string(text + self.closing)

    def render(self, value: Any) -> str | None:
        raise SchemaNotSupported(f"internal: a text parameter cannot hold {value!r}")


def _parameters(function: str, schema: Mapping[str, Any], index: int, *, lenient: bool) -> tuple[str, list[str]]:
    """The Lark expression of a call's parameters (in the schema's order, the required ones always there) and
    the rules it uses."""
    json_values = SchemaGrammar(JsonSyntax([PARAMETER_CLOSE]), tool=function, root=schema, lenient=lenient,
                                prefix=f"j{index}")
    text_values = SchemaGrammar(_TextValues(), tool=function, root=schema, lenient=lenient, prefix=f"t{index}")
    parts = []
    for member in json_values.tool_members(schema):
        name = member.name
        expr = None
        if name and name == name.strip() and not any(c in name for c in "<>\n"):
            read_as = member_schema(schema, name, schema)  # the schema the parser types this parameter by
            if is_text_parameter(read_as, schema):
                expr = text_values.value(member.schema if read_as is not None else {"type": "string"}, member.where)
            else:
                expr = json_values.value(member.schema, member.where)
                expr = None if expr is None else f"{expr} {lark_string(_TextValues.closing)}"
        if expr is None:
            if member.required:
                raise json_values.fail(member.where, f"the required parameter {name!r} cannot be written or satisfied")
            continue
        parts.append((f"{lark_string(f'{PARAMETER_OPEN}{name}>{chr(10)}')} {expr}", member.required))
    return json_values.sequence(parts, ""), json_values.rules + text_values.rules


def tool_call_grammar(
    tokenizer: Any, schemas: Mapping[str, Mapping[str, Any]], *, thinking: bool = False, single: bool = False,
    opened: bool = False, lenient: bool = False,
) -> str:
    """The Lark grammar (llguidance dialect) of one or more Qwen XML calls to the functions in `schemas`.

    `opened`: one call, from whichever opening the parser takes for a call (`<tool_call>` or a bare
    `<function=`) on, for "auto"'s calls. `lenient`: schema keywords no grammar can enforce are ignored
    rather than refused.
    """
    from lucebox_core.constraints import REASONING_RULES, lark_literal, reasoning_rule

    open_call, close_call = lark_literal(tokenizer, CALL_OPEN), lark_literal(tokenizer, CALL_CLOSE)
    functions, rules = [], []
    for i, (function, schema) in enumerate(schemas.items()):
        if not function or function != function.strip() or len(function) > _NAME_LIMIT or any(c in function for c in "<>\n"):
            raise SchemaNotSupported(f"tool {function!r}: a Qwen tool call cannot name it (no <, > or newlines)")
        parameters, used = checked(lambda: _parameters(function, schema, i, lenient=lenient))
        rules += used
        head = lark_string(f"{FUNCTION_OPEN}{function}>\n")
        rules.append(f"function_{i}: {head} {parameters}".rstrip())
        functions.append(f"function_{i}")
    body = f'({" | ".join(functions)}) "</function>"'
    if opened:
        start = f'call | {body} ("\\n" {close_call})?'
    else:
        calls = "call" if single else 'call ("\\n" call)*'
        start = f"{reasoning_rule(tokenizer) + ' ' if thinking else ''}{calls}"
    lines = [f"start: {start}", f'call: {open_call} "\\n" {body} "\\n" {close_call}', REASONING_RULES, *rules]
    return "\n".join(lines)
