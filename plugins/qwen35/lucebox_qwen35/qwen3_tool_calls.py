"""Qwen3 tool calls (the `qwen3` family): Hermes-style JSON between `<tool_call>` tags, read as it streams and
forced by grammar. Qwen3-0.6B's chat template teaches exactly this:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Reasoning is a leading `<think>…</think>` block. The reading is the Qwen3.5 parser's JSON-call path
(`tool_calls.QwenToolCallParser`), with only `<tool_call>` opening a call (Qwen3 writes no bare `<function=`
nor XML parameters). The grammar (`tool_call_grammar`) writes a call as `json.dumps` does, its arguments an
object of the tool's declared parameters, each held to its schema (the core's `SchemaGrammar` in JSON).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lucebox_core.parsing import (Event, ParameterCall, PlainContent, ReasoningParser, partial_suffix,
                                  tool_call_constraint)
from lucebox_core.schema_grammar import JsonSyntax, SchemaGrammar, SchemaNotSupported, checked, lark_string

from .tool_calls import CALL_CLOSE, CALL_OPEN, QwenToolCallParser

__all__ = ["Qwen3ToolCallParser", "create_parser", "tool_call_grammar"]

_NAME_LIMIT = 256


def create_parser(*, tools: Iterable[Mapping[str, Any]] | None = None, thinking: bool = False,
                  call_id: Callable[[int], str] | None = None) -> ReasoningParser:
    """The response parser for one Qwen3 response (the `ResponseParser` factory). Without tools (none given, or
    `tool_choice: "none"`) nothing is read as a call: all is content."""
    content = Qwen3ToolCallParser(tools, call_id=call_id) if tools else PlainContent()
    return ReasoningParser(content, thinking=thinking)


class Qwen3ToolCallParser(QwenToolCallParser):
    """The content parser for Qwen3's JSON calls (see the module docstring)."""

    def constraint_for(self, tool_choice: Any, tokenizer: Any, *, thinking: bool = False,
                       shadow: Callable[[], Any] | None = None) -> Any:
        """The constraint that holds the output to `tool_choice` and the tools' schemas; `shadow` makes a fresh
        parser of the whole response, for "auto"."""
        return tool_call_constraint(tokenizer, self.schemas, tool_choice, tool_call_grammar, thinking=thinking,
                                    shadow=shadow)

    def _in_content(self, events: list[Event], final: bool) -> bool:
        at = self._buffer.find(CALL_OPEN)
        if at < 0:
            keep = 0 if final else partial_suffix(self._buffer, (CALL_OPEN,))
            self._content(self._buffer[: len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        self._content(self._buffer[:at], events)
        self._call = ParameterCall(self._calls, CALL_OPEN, space_before=self._held_space)
        self._held_space = ""  # whitespace before a call is dropped (given back if it is no call)
        self._buffer = self._buffer[at + len(CALL_OPEN) :]
        self._state = "call_open"
        return True

    def _in_call_open(self, events: list[Event], final: bool) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith("{"):
            self._state = "json_call"
        elif rest or final:
            self._abandon_call(events)
        else:
            return False
        return True


def tool_call_grammar(
    tokenizer: Any, schemas: Mapping[str, Mapping[str, Any]], *, thinking: bool = False, single: bool = False,
    opened: bool = False, lenient: bool = False,
) -> str:
    """The Lark grammar (llguidance dialect) of one or more Qwen3 JSON calls to the functions in `schemas`.

    `opened`: one call from its `<tool_call>` on, for "auto"'s calls. `lenient`: schema keywords no grammar
    can enforce are ignored rather than refused.
    """
    from lucebox_core.constraints import REASONING_RULES, lark_literal, reasoning_rule

    open_call, close_call = lark_literal(tokenizer, CALL_OPEN), lark_literal(tokenizer, CALL_CLOSE)
    functions, rules = [], []
    for i, (function, schema) in enumerate(schemas.items()):
        if not function or len(function) > _NAME_LIMIT or CALL_CLOSE in function:
            raise SchemaNotSupported(f"tool {function!r}: a Qwen3 tool call cannot name it")
        grammar = SchemaGrammar(JsonSyntax([CALL_CLOSE]), tool=function, root=schema, lenient=lenient,
                                prefix=f"j{i}")
        arguments = checked(lambda grammar=grammar, schema=schema: grammar.tool_object(schema))
        rules += grammar.rules
        head = lark_string('{"name": ' + json.dumps(function, ensure_ascii=False) + ', "arguments": ')
        rules.append(f'function_{i}: {head} {arguments} "}}"')
        functions.append(f"function_{i}")
    call = f'call: {open_call} "\\n" ({" | ".join(functions)}) "\\n" {close_call}'
    if opened:
        start = "call"
    else:
        calls = "call" if single else 'call ("\\n" call)*'
        start = f"{reasoning_rule(tokenizer) + ' ' if thinking else ''}{calls}"
    return "\n".join([f"start: {start}", call, REASONING_RULES, *rules])
