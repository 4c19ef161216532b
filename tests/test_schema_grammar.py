"""Tools' JSON schemas as grammars (`schema_grammar`, in JSON's syntax here; the families' own syntaxes are
tested with their parsers), and the reading of schemas the parsers share (`json_schema`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from lucebox_core.constraints import lark_constraint
from lucebox_core.json_schema import admitted_types, item_schema, member_schema
from lucebox_core.schema_grammar import JsonSyntax, SchemaGrammar, SchemaNotSupported, pattern_regex
from lucebox_core.tokenizer import Tokenizer

VOCAB = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "vocab" / "ggml-vocab-qwen35.gguf"

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"$defs": {"Node": {"type": "object", "properties": {
        "v": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2}}, "required": ["v"]}},
     "$ref": "#/$defs/Node"},
    {"type": "array", "prefixItems": [{"type": "number", "minimum": -1, "maximum": 1}, {"const": "x"}],
     "items": False, "minItems": 1},
    {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}, {"type": "boolean"}]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}},
                "required": ["kind", "n"], "additionalProperties": False},
               {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"],
                "additionalProperties": False}]},
    {"type": "object", "additionalProperties": {"type": "integer", "maximum": 5}},
    {"type": ["integer", "string"], "maxLength": 2, "minimum": 10, "maximum": 20, "title": "ignored"},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(VOCAB)


@pytest.fixture(scope="module")
def bias(tokenizer) -> torch.Tensor:
    """A nudge toward JSON's short structural tokens, as a model has (random text would fill strings for ever)."""
    bias = torch.zeros(tokenizer.vocab_size)
    for piece in ['"', "}", ",", ":", '":', '",', '"}', "1", "true", "{", "]", "[", "null"]:
        bias[tokenizer.encode(piece, add_bos=False)] = 4.0
    return bias


def walk(tokenizer, lark: str, seed: int, bias: torch.Tensor, steps: int = 150) -> str | None:
    """Seeded random logits under the grammar: the text, or None if it did not finish in `steps`."""
    constraint = lark_constraint(tokenizer, lark)
    generator = torch.Generator().manual_seed(seed)
    chosen: list[int] = []
    for _ in range(steps):
        logits = torch.randn(tokenizer.vocab_size, generator=generator) + bias
        token = int(logits.masked_fill(~constraint.allowed(tokenizer.vocab_size), float("-inf")).argmax())
        constraint.accept(token)
        chosen.append(token)
        if constraint.finished or token in tokenizer.eot_ids:
            return tokenizer.decode([t for t in chosen if t not in tokenizer.eot_ids])
    return None


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_values_under_a_schema_validate(tokenizer, bias, index):
    schema = SCHEMAS[index]
    grammar = SchemaGrammar(JsonSyntax(), tool="t", root=schema)
    lark = "start: " + grammar.value(schema, "parameters") + "\n" + "\n".join(grammar.rules)
    finished = 0
    for seed in range(4):
        text = walk(tokenizer, lark, seed, bias)
        if text is not None:
            finished += 1
            jsonschema.validate(json.loads(text), schema)
    assert finished >= 3


def test_forbidden_text_never_appears_inside_strings(tokenizer):
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "t": {"type": "string", "pattern": "x"}},
              "required": ["s", "t"]}
    grammar = SchemaGrammar(JsonSyntax(["</parameter>"]), tool="t", root=schema)
    lark = "start: " + grammar.value(schema, "parameters") + "\n" + "\n".join(grammar.rules)
    constraint = lark_constraint(tokenizer, lark)
    for token in tokenizer.encode('{"s": "a</parameter', add_bos=False):
        constraint.accept(token)
    allowed = constraint.allowed(tokenizer.vocab_size)
    assert not allowed[tokenizer.encode(">", add_bos=False)[0]]  # the closing tag cannot be completed...
    assert allowed[tokenizer.encode("s", add_bos=False)[0]]  # ...but the string can go on otherwise


@pytest.mark.parametrize(
    "schema, keyword",
    [({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"not": {"type": "string"}}, "not"),
     ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
     ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}, "oneOf"),
     ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf"),
     ({"$ref": "https://example.com/schema.json"}, "$ref")],
)  # fmt: skip
def test_what_no_grammar_enforces_is_refused_by_tool_and_keyword(schema, keyword):
    with pytest.raises(SchemaNotSupported, match=rf"tool 'lookup'.*{re.escape(keyword)}"):
        SchemaGrammar(JsonSyntax(), tool="lookup", root=schema).value(schema, "parameters.properties.x")
    if keyword != "$ref":  # lenient ("auto"): left out, the rest of the schema kept
        lenient = SchemaGrammar(JsonSyntax(), tool="lookup", root=schema, lenient=True)
        assert lenient.value(schema, "parameters") is not None and lenient.ignored


@pytest.mark.parametrize(
    "schema, message",
    [({"type": "strnig"}, "'strnig' is not a JSON type"), ({"properties": []}, "properties"),
     ({"type": "string", "maxLength": -1}, "maxLength"), ({"type": "string", "pattern": "a(?=b)"}, "pattern"),
     ({"enum": "red"}, "enum"), ({"type": "number", "minimum": "0"}, "minimum"), ({"$ref": "#/$defs/Nope"}, "names nothing")],
)  # fmt: skip
def test_malformed_schemas_are_named(schema, message):
    with pytest.raises(SchemaNotSupported, match=re.escape(message)):
        SchemaGrammar(JsonSyntax(), tool="t", root={"type": "object", "properties": {"x": schema}}).value(
            {"type": "object", "properties": {"x": schema}, "required": ["x"]}, "parameters")


def test_a_tool_needs_an_object_and_satisfiable_required_keys():
    grammar = SchemaGrammar(JsonSyntax(), tool="t", root={})
    with pytest.raises(SchemaNotSupported, match="arguments are an object"):
        grammar.tool_object({"type": "string"})
    with pytest.raises(SchemaNotSupported, match="'n' cannot be satisfied"):
        grammar.tool_object({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
                             "required": ["n"]})
    # An optional key no value satisfies is left out; a tool without declared keys takes none.
    assert grammar.tool_object({"properties": {"n": {"enum": []}}}) and grammar.tool_object({})


@pytest.mark.parametrize(
    "pattern, matches, misses",
    [("^[0-9]{2}$", ["12"], ["123", "a12"]), ("ab", ["ab", "xaby"], ["a", "ba"]), ("^x", ["x", "xyz"], ["ax"]),
     ("y$", ["y", "xy"], ["yx"]), (r"a\$", ["a$", "ba$c"], ["a"])],
)  # fmt: skip
def test_patterns_keep_their_search_semantics(pattern, matches, misses):
    regex = re.compile(pattern_regex(pattern).replace("(?s:.*)", ".*"), re.S)
    assert all(regex.fullmatch(text) and re.search(pattern, text) for text in matches)
    assert not any(regex.fullmatch(text) for text in misses)


def test_reading_a_schema_follows_references_and_branches():
    root = {"$defs": {"Unit": {"enum": ["c", "f"]}, "Point": {"type": "object", "properties": {"x": {"type": "number"}}}},
            "type": "object", "properties": {
                "unit": {"$ref": "#/$defs/Unit"}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                "where": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]},
                "pair": {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "boolean"}}},
            "additionalProperties": {"type": "boolean"}}  # fmt: skip
    assert admitted_types(member_schema(root, "unit", root), root) == {"string"}
    assert admitted_types(member_schema(root, "maybe", root), root) == {"integer", "null"}
    assert admitted_types(member_schema(member_schema(root, "where", root), "x", root), root) >= {"number"}
    pair = member_schema(root, "pair", root)
    assert item_schema(pair, 0, root) == {"type": "string"} and item_schema(pair, 3, root) == {"type": "boolean"}
    assert member_schema(root, "other", root) == {"type": "boolean"}  # additionalProperties
    assert admitted_types({}, root) is None and admitted_types(False, root) == frozenset()
