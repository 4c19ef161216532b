"""Qwen3.5 tool calls: the streaming parser (any chunking, typed arguments, raw text) and tool_choice."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jsonschema
import pytest
from lucebox_qwen35.tool_calls import (coerce_value, create_parser, forced_prefix, tool_choice_constraint,
                                       tool_parameters)

from lucebox_core.parsing import ContentDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from tool_call_helpers import (RICH_SCHEMA, RICH_TOOLS, assert_any_chunking_gives, assert_texts,
                               assert_tool_choice_is_checked, checked_calls, coalesce, drive, drive_auto, feed_all, ids)

SHARED = Path(__file__).resolve().parents[2] / "shared"
TEMPLATES = SHARED / "fixtures" / "templates"
VOCAB = SHARED / "fixtures" / "vocab" / "ggml-vocab-qwen35.gguf"

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "scale": {"type": "number"}, "options": {"type": "object"}, "hours": {"type": "array"},
        "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}}}}},
]  # fmt: skip

CALL = "<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def call(name: str, **params: str) -> str:
    return CALL.format(name=name, params="".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()))


WELL_FORMED = [
    # (output, thinking, expected reasoning, expected content, [(name, arguments)])
    ("Let me check.\n</think>\n\n" + call("get_weather", city="Paris", days="3"), True, "Let me check.", "",
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("I'll run it.\n\n" + call("run", code="x = '<tool_call>'\nif a < b:\n    print(x)\n"), False, "", "I'll run it.",
     [("run", {"code": "x = '<tool_call>'\nif a < b:\n    print(x)\n"})]),
    (call("get_weather", city="São \"Paulo\"", metric="True", scale="1.5", unit="c", options='{"a": [1, 2]}',
          hours="[1, 2]") + "\n" + call("run", code=""), False, "", "",
     [("get_weather", {"city": "São \"Paulo\"", "metric": True, "scale": 1.5, "unit": "c", "options": {"a": [1, 2]},
                       "hours": [1, 2]}), ("run", {"code": ""})]),
    ("<tools are fun, and <function is a word; a < b.", False, "", "<tools are fun, and <function is a word; a < b.",
     []),
    ("<think>\nhm\n</think>\n\nNo tool needed.", False, "hm", "No tool needed.", []),
    (call("get_weather"), False, "", "", [("get_weather", {})]),
    ("<function=run>\n<parameter=code>\nls\n</parameter>\n</function>", False, "", "", [("run", {"code": "ls"})]),
    ('<tool_call>\n{"name": "run", "arguments": {"code": "ls -l"}}\n</tool_call>', False, "", "",
     [("run", {"code": "ls -l"})]),
]  # fmt: skip

MARKUP = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "<think>", "</think>")


def parse(chunks: list[str], *, thinking: bool = False, tools=TOOLS) -> list:
    return feed_all(create_parser(tools=tools, thinking=thinking, call_id=ids), chunks)


def check_invariants(events: list, output: str) -> list[tuple[str, dict]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert not any(tag in content for tag in MARKUP), content
    return checked_calls(events, output)


@pytest.mark.parametrize("case", range(len(WELL_FORMED)))
def test_any_chunking_gives_the_same_events_and_keeps_the_invariants(case):
    output, thinking, reasoning, content, expected_calls = WELL_FORMED[case]
    reference = coalesce(parse([output], thinking=thinking))
    assert_texts(reference, reasoning, content)
    assert check_invariants(reference, output) == expected_calls
    assert_any_chunking_gives(reference, output, lambda chunks: parse(chunks, thinking=thinking), check_invariants,
                              seed=case)


def test_string_arguments_stream_before_the_parameter_closes():
    parser = create_parser(tools=TOOLS, call_id=ids)
    events = parser.feed("<tool_call>\n<function=run>\n<parameter=code>\nprint(1)\nprint(2)")
    assert ToolCallStart(0, "call_0", "run") in events
    streamed = "".join(e.fragment for e in events if isinstance(e, ToolCallArgsDelta))
    assert streamed == '{"code": "print(1)\\nprint(2)'  # the value so far, as JSON text


@pytest.mark.parametrize(
    "text, schema, expected",
    [("42", {"type": "integer"}, 42), ("4.0", {"type": "integer"}, 4), ("x", {"type": "integer"}, "x"),
     ("False", {"type": "boolean"}, False), ("None", {"type": ["string", "null"]}, None),
     ("{'a': 1}", {"type": "object"}, {"a": 1}), ("[1, 2]", {"type": "array"}, [1, 2]),
     ("007", {"type": "string"}, "007"), ("3", None, "3"), ("3", {"enum": [3, 4]}, 3)],
)  # fmt: skip
def test_values_are_typed_by_the_schema(text, schema, expected):
    assert coerce_value(text, schema) == expected
    assert type(coerce_value(text, schema)) is type(expected)


def test_a_call_cut_off_after_its_name_is_still_a_call():
    output = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar\n</param"
    events = coalesce(parse([output]))
    assert events[0] == ToolCallStart(0, "call_0", "get_weather")
    assert events[-1] == ToolCallEnd(0, '{"city": "Par"}', output)
    cut_in_name = coalesce(parse(["<tool_call>\n<function=get_weather>\n<parameter=ci"]))
    assert cut_in_name[-1].arguments_json == "{}"
    cut_in_number = coalesce(parse(["<tool_call>\n<function=get_weather>\n<parameter=days>\n12"]))
    assert cut_in_number[-1].arguments_json == '{"days": 12}'


def test_a_call_cut_off_before_its_name_is_content():
    for output in ["Sure. <tool_call>\n<func", "<tool_call>\n<function=get_", "x <tool_ca"]:
        events = coalesce(parse([output]))
        assert events == [ContentDelta(output)]


def test_without_tools_nothing_is_parsed_as_a_call():
    output = call("run", code="ls")
    assert coalesce(parse([output], tools=None)) == [ContentDelta(output)]


def _render_qwen(template: str, messages: list[dict]) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string((TEMPLATES / template).read_text()).render(messages=messages, tools=TOOLS)


@pytest.mark.parametrize("template", ["Qwen3.5-4B.jinja", "Qwen3-Coder.jinja"])
def test_raw_text_is_what_the_template_renders_back(template):
    """A parsed call sent back in history renders to the very text the model wrote (same tokens)."""
    output = call("get_weather", city="Paris", days="3", metric="True") + "\n" + call("run", code="a\nb")
    ends = [e for e in parse([output]) if isinstance(e, ToolCallEnd)]
    tool_calls = [{"type": "function", "function": {"name": n, "arguments": json.loads(e.arguments_json)}}
                  for n, e in zip(["get_weather", "run"], ends)]  # fmt: skip
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": tool_calls}]
    rendered = _render_qwen(template, messages)
    assert "".join(e.raw_text for e in ends) in rendered.replace("</tool_call>\n<tool_call>", "</tool_call><tool_call>")
    assert output in rendered


def test_forced_prefix_for_tool_choice():
    assert forced_prefix("required") == "<tool_call>\n"
    assert forced_prefix({"type": "function", "function": {"name": "run"}}) == "<tool_call>\n<function=run>\n"
    assert forced_prefix("auto") == "" and forced_prefix("none") == ""
    parser = create_parser(tools=TOOLS, call_id=ids)  # the prefix is fed as part of the answer
    events = coalesce(parser.feed(forced_prefix({"function": {"name": "run"}})) + parser.feed("</function>\n</tool_call>"))
    assert events[0] == ToolCallStart(0, "call_0", "run")


# --- tool_choice as a grammar --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers():
    """The fixture vocabulary as is (tags are plain text) and with the tags as control tokens."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_core.tokenizer import Tokenizer

    metadata = dict(GGUFFile(VOCAB).metadata)
    tokens, types = list(metadata["tokenizer.ggml.tokens"]), list(metadata["tokenizer.ggml.token_type"])
    for offset, tag in enumerate(["<think>", "</think>", "<tool_call>", "</tool_call>"]):
        tokens[151646 + offset], types[151646 + offset] = tag, 3  # padding ids become control tokens
    metadata.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    return {"text tags": Tokenizer.from_gguf(VOCAB), "control tags": Tokenizer.from_metadata(metadata)}


@pytest.mark.parametrize("kind", ["text tags", "control tags"])
@pytest.mark.parametrize("thinking", [False, True])
def test_required_tool_choice_forces_a_parsable_call(tokenizers, kind, thinking):
    tokenizer = tokenizers[kind]
    schemas = {"get_weather": {"type": "object", "properties": {
        "days": {"type": "integer", "minimum": 1, "maximum": 7}, "unit": {"enum": ["c", "f"]},
        "metric": {"type": "boolean"}}}, "noop": {}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in schemas.items()]
    finished = 0
    for seed in range(6):
        constraint = tool_choice_constraint(tokenizer, tool_parameters(tools), "required", thinking=thinking)
        prefix = "Let me see.\n</think>\n\n" if thinking else ""
        chosen, done = drive(constraint, tokenizer, seed, 120, prefix, padded_logits=16)
        if not done:
            continue
        finished += 1
        text = tokenizer.decode([t for t in chosen if t not in tokenizer.eot_ids])
        events = parse([text[len(prefix):] if thinking else text], tools=tools)
        calls = check_invariants(events, text)
        assert calls and not [e for e in events if isinstance(e, ContentDelta)], text
        for name, arguments in calls:
            assert name in schemas
            for key, value in arguments.items():
                spec = schemas[name]["properties"][key]
                assert value in spec["enum"] if "enum" in spec else type(value).__name__ == {
                    "integer": "int", "boolean": "bool"}[spec["type"]]  # fmt: skip
    assert finished >= 3


def test_named_tool_choice_allows_only_that_function(tokenizers):
    tokenizer = tokenizers["control tags"]
    schemas = tool_parameters(TOOLS)
    choice = {"type": "function", "function": {"name": "run"}}
    constraint = tool_choice_constraint(tokenizer, schemas, choice)
    prefix_ids = tokenizer.encode("<tool_call>\n<function=", add_bos=False, parse_special=True)
    for token in prefix_ids:
        constraint.accept(token)
    allowed = constraint.allowed(tokenizer.vocab_size)
    assert allowed[tokenizer.encode("run", add_bos=False)[0]]
    assert not allowed[tokenizer.encode("get", add_bos=False)[0]]
    parser = create_parser(tools=TOOLS, thinking=False)
    assert_tool_choice_is_checked(tool_choice_constraint, parser, tokenizer, schemas)


@pytest.mark.parametrize("kind", ["text tags", "control tags"])
def test_a_named_call_validates_against_its_schema(tokenizers, kind):
    tokenizer = tokenizers[kind]
    finished = 0
    for seed in range(5):
        constraint = tool_choice_constraint(tokenizer, tool_parameters(RICH_TOOLS), {"function": {"name": "get_weather"}})
        chosen, done = drive(constraint, tokenizer, seed, 150)
        if done:
            finished += 1
            text = tokenizer.decode([t for t in chosen if t not in tokenizer.eot_ids])
            (call,) = check_invariants(parse([text], tools=RICH_TOOLS), text)
            assert call[0] == "get_weather"
            jsonschema.validate(call[1], RICH_SCHEMA)
    assert finished >= 3


@pytest.mark.parametrize("kind", ["text tags", "control tags"])
@pytest.mark.parametrize("thinking", [False, True])
def test_auto_leaves_text_free_and_holds_each_opened_call_to_its_schema(tokenizers, kind, thinking):
    tokenizer = tokenizers[kind]
    parser = create_parser(tools=RICH_TOOLS, thinking=thinking)
    constraint = parser.constraint_for("auto", tokenizer)
    assert constraint.dormant and constraint.allowed(tokenizer.vocab_size) is None
    opening = tokenizer.encode("<tool_call>", add_bos=False, parse_special=True)
    prefix = tokenizer.encode("Think <tool_call> here.\n</think>\n\n" if thinking else "", add_bos=False,
                              parse_special=True)
    for token in prefix:  # a call tag inside the reasoning is reasoning: nothing to hold
        constraint.accept(token)
        assert constraint.dormant
    chosen, ended = drive_auto(constraint, tokenizer, opening, seed=7)
    text = tokenizer.decode(prefix + chosen)
    events = parse([text], tools=RICH_TOOLS, thinking=thinking)
    calls = checked_calls(events, text)
    whole = calls[:ended]
    assert ended >= 2 and len(whole) == ended, text
    for name, arguments in whole:
        jsonschema.validate(arguments, RICH_SCHEMA if name == "get_weather" else {"type": "object", "properties": {}})
