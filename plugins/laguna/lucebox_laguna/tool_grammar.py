"""The grammar of Laguna tool calls, each call's arguments held to its tool's JSON schema (llguidance's Lark).

A call is written as Laguna-XS.2's template writes one:

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

A parameter whose schema admits only strings is its text as written (never containing `</arg_value>`), any
other value JSON, as the parser reads them (`lucebox_core.json_schema.coerce_value`). The tags are control
tokens in Laguna's vocabulary; where a vocabulary has them as text, they are text (`lark_literal`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lucebox_core.json_schema import is_text_parameter, member_schema
from lucebox_core.parsing import tool_call_constraint
from lucebox_core.schema_grammar import (JsonSyntax, SchemaGrammar, SchemaNotSupported, StringShape, ValueSyntax,
                                         checked, containing, lark_string, regex_item)

from .markup import CALL_CLOSE, CALL_OPEN, KEY_CLOSE, KEY_OPEN, NAME_LIMIT, VALUE_CLOSE, VALUE_OPEN


class _TextValues(ValueSyntax):
    """A text parameter's value: its text as written, never containing the closing tag (whose token, or text,
    follows it in the call's rule)."""

    forbidden = (VALUE_CLOSE,)

    def string(self, grammar: SchemaGrammar, shape: StringShape) -> str:
        body = regex_item(f"(?s:.{shape.length()})")
        if shape.pattern is not None:
            body = f"{regex_item(shape.pattern)} & {body}"
        return grammar.terminal(f"({body}) & ~{containing(VALUE_CLOSE)}", ("text", shape))

    def string_literal(self, text: str) -> str | None:
        return None if VALUE_CLOSE in text else lark_string(text)

    def render(self, value: Any) -> str | None:
        raise SchemaNotSupported(f"internal: a text parameter cannot hold {value!r}")


def _bad_name(name: str) -> bool:
    return not name or name != name.strip() or len(name) > NAME_LIMIT or any(c in name for c in "<>\n")


def _parameters(tokenizer: Any, function: str, schema: Mapping[str, Any], index: int, *,
                lenient: bool) -> tuple[str, list[str]]:
    """The Lark expression of a call's parameters (in the schema's order, the required ones always there) and
    the rules it uses."""
    from lucebox_core.constraints import lark_literal

    key_open, key_close = lark_literal(tokenizer, KEY_OPEN), lark_literal(tokenizer, KEY_CLOSE)
    value_open, value_close = lark_literal(tokenizer, VALUE_OPEN), lark_literal(tokenizer, VALUE_CLOSE)
    json_values = SchemaGrammar(JsonSyntax([VALUE_CLOSE]), tool=function, root=schema, lenient=lenient,
                                prefix=f"j{index}")
    text_values = SchemaGrammar(_TextValues(), tool=function, root=schema, lenient=lenient, prefix=f"t{index}")
    parts = []
    for member in json_values.tool_members(schema):
        name = member.name
        expr = None
        if not _bad_name(name):
            read_as = member_schema(schema, name, schema)  # the schema the parser types this parameter by
            if is_text_parameter(read_as, schema):
                expr = text_values.value(member.schema if read_as is not None else {"type": "string"}, member.where)
            else:
                expr = json_values.value(member.schema, member.where)
        if expr is None:
            if member.required:
                raise json_values.fail(member.where, f"the required parameter {name!r} cannot be written or satisfied")
            continue
        parts.append((f'{key_open} {lark_string(name)} {key_close} "\\n" {value_open} {expr} {value_close} "\\n"',
                      member.required))
    return json_values.sequence(parts, ""), json_values.rules + text_values.rules


def tool_call_grammar(tokenizer: Any, schemas: Mapping[str, Mapping[str, Any]], *, thinking: bool = False,
                      single: bool = False, opened: bool = False, lenient: bool = False) -> str:
    """The Lark grammar of one or more Laguna calls to the functions in `schemas` (`single`: exactly one;
    `opened`: one call from its opening tag on, for "auto"; `lenient`: keywords no grammar can enforce are
    ignored rather than refused)."""
    from lucebox_core.constraints import REASONING_RULES, lark_literal, reasoning_rule

    open_call, close_call = lark_literal(tokenizer, CALL_OPEN), lark_literal(tokenizer, CALL_CLOSE)
    functions, rules = [], []
    for i, (function, schema) in enumerate(schemas.items()):
        if _bad_name(function):
            raise SchemaNotSupported(f"tool {function!r}: a Laguna tool call cannot name it (no <, > or newlines)")
        parameters, used = checked(lambda: _parameters(tokenizer, function, schema, i, lenient=lenient))
        rules += used
        rules.append(f"function_{i}: {lark_string(function + chr(10))} {parameters}".rstrip())
        functions.append(f"function_{i}")
    call = f'{open_call} ({" | ".join(functions)}) {close_call}'
    if opened:
        start = "call"
    else:
        calls = "call" if single else 'call ("\\n" call)*'
        start = f"{reasoning_rule(tokenizer) + ' ' if thinking else ''}{calls}"
    return "\n".join([f"start: {start}", f"call: {call}", REASONING_RULES, *rules])


def tool_choice_constraint(tokenizer: Any, schemas: Mapping[str, Mapping[str, Any]], tool_choice: Any, *,
                           thinking: bool = False, shadow: Callable[[], Any] | None = None) -> Any:
    """The constraint for `tool_choice` ("required", a named function, or "auto" with `shadow`, a factory of
    fresh response parsers), every call's arguments held to its tool's schema. None for "none"."""
    return tool_call_constraint(tokenizer, schemas, tool_choice, tool_call_grammar, thinking=thinking, shadow=shadow)
