"""The grammar of Gemma 4 tool calls: each call's arguments in Gemma's own syntax, held to its tool's JSON schema.

The core's `SchemaGrammar` walks the schema; `GemmaValues` says how Gemma writes what it finds: keys bare
(`city:`), or between `<|"|>` quotes when a bare key would not read back as itself; strings between `<|"|>`
quotes, never holding one (the parser ends a string at the first); numbers, booleans and null as JSON;
`{…}` and `[…]` with bare commas. The parser (`tool_calls.GemmaResponseParser`) reads the values back typed by the same
schema.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lucebox_core.schema_grammar import (SchemaGrammar, SchemaNotSupported, StringShape, ValueSyntax, checked,
                                         containing, lark_string, regex_item)

from .markup import CALL_CLOSE, CALL_OPEN, CALL_PREFIX, CHANNEL_CLOSE, NAME_LIMIT, NAME_STOP, QUOTE

__all__ = ["GemmaValues", "tool_call_grammar"]

_KEY_STOP = set(":{}[],<")  # what ends a bare key in the parser


class GemmaValues(ValueSyntax):
    """Gemma's value syntax (see the module docstring)."""

    forbidden = (QUOTE,)
    member_separator = item_separator = '","'

    def __init__(self, tokenizer: Any) -> None:
        from lucebox_core.constraints import lark_literal

        self.quote = lark_literal(tokenizer, QUOTE)
        self.special = self.quote.startswith("<[")  # the quote is a control token: text cannot spell it

    def key(self, name: str) -> str | None:
        if name and name == name.strip() and not (set(name) & _KEY_STOP) and not name.startswith(QUOTE):
            return lark_string(name + ":")
        if QUOTE in name:
            return None
        return f'{self._quoted(name)} ":"'

    def any_key(self, grammar: SchemaGrammar) -> str:
        return grammar.terminal('/[A-Za-z_][A-Za-z0-9_]{0,63}/ ":"', "any_key")

    def string(self, grammar: SchemaGrammar, shape: StringShape) -> str:
        body = regex_item(f"(?s:.{shape.length()})")
        if shape.pattern is not None:
            body = f"{regex_item(shape.pattern)} & {body}"
        body = f"({body}) & ~{containing(QUOTE)}"
        if self.special:
            return f"{self.quote} {grammar.terminal(body, ('text', shape))} {self.quote}"
        # The text and its closing quote are one lexeme: it ends at the first quote, as the parser's string does.
        return f"{lark_string(QUOTE)} {grammar.terminal(f'({body}) {lark_string(QUOTE)}', ('text', shape))}"

    def string_literal(self, text: str) -> str | None:
        return None if QUOTE in text else self._quoted(text)

    def _quoted(self, text: str) -> str:
        if not self.special:
            return lark_string(QUOTE + text + QUOTE)
        return f"{self.quote} {lark_string(text)} {self.quote}" if text else f"{self.quote} {self.quote}"

    def render(self, value: Any) -> str | None:
        if isinstance(value, str):
            return None if QUOTE in value or self.special else QUOTE + value + QUOTE
        if isinstance(value, Mapping):
            members = []
            for key, item in value.items():
                written = self.render(item)
                bare = key and key == key.strip() and not (set(key) & _KEY_STOP) and not key.startswith(QUOTE)
                if written is None or (not bare and (QUOTE in key or self.special)):
                    return None
                members.append(f"{key if bare else QUOTE + key + QUOTE}:{written}")
            return "{" + ",".join(members) + "}"
        if isinstance(value, list):
            items = [self.render(item) for item in value]
            return None if any(i is None for i in items) else "[" + ",".join(items) + "]"  # type: ignore[arg-type]
        return json.dumps(value)


def tool_call_grammar(
    tokenizer: Any, schemas: Mapping[str, Mapping[str, Any]], *, thinking: bool = False, single: bool = False,
    opened: bool = False, lenient: bool = False,
) -> str:
    """The Lark grammar (llguidance dialect) of one or more Gemma calls to the functions in `schemas`.

    With `thinking` the output is inside a thought channel from its start, which the grammar lets run to its
    close; otherwise the calls come first (a forced call is the answer: an optional thought before it let a
    weak model wander in the thought until the token limit, with no call at all). `opened`: one call, from its
    `<|tool_call>` on ("auto"'s calls). `lenient`: schema keywords no grammar can enforce are ignored rather
    than refused.
    """
    from lucebox_core.constraints import lark_literal

    syntax = GemmaValues(tokenizer)
    open_call, close_call = lark_literal(tokenizer, CALL_OPEN), lark_literal(tokenizer, CALL_CLOSE)
    close_channel = lark_literal(tokenizer, CHANNEL_CLOSE)
    if close_channel.startswith("<["):
        thought_rules = [f"thought_end: THOUGHT_TEXT {close_channel} GAP", "THOUGHT_TEXT: /(?s:.*)/"]
    else:
        thought_rules = ["thought_end: thought_text GAP", "thought_text[lazy]: /(?s:.*)<channel\\|>/"]
    functions, rules = [], []
    for i, (function, schema) in enumerate(schemas.items()):
        if not function or len(function) > NAME_LIMIT or set(function) & NAME_STOP:
            raise SchemaNotSupported(f"tool {function!r}: a Gemma tool call cannot name it (no spaces or punctuation "
                                     "such as {}[],:<>)")
        grammar = SchemaGrammar(syntax, tool=function, root=schema, lenient=lenient, prefix=f"g{i}")
        arguments = checked(lambda: grammar.tool_object(schema))
        rules += grammar.rules
        rules.append(f"function_{i}: {lark_string(CALL_PREFIX + function)} {arguments}")
        functions.append(f"function_{i}")
    if opened:
        start = "call"
    else:
        start = f"{'thought_end ' if thinking else ''}{'call' if single else 'call+'}"
    lines = [f"start: {start}", f"call: {open_call} ({' | '.join(functions)}) {close_call}", *thought_rules,
             r"GAP: /\n{0,2}/", *rules]
    return "\n".join(lines)
