"""Gemma 4 responses: the streaming parser (thought channels, any chunking, typed arguments, cut-off calls),
the fixture chat templates' markup read back by it, and tool_choice as a grammar."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
from lucebox_gemma4.tool_calls import (coerce_value, create_parser, forced_prefix, parse_arguments, tool_call_grammar,
                                       tool_choice_constraint, tool_parameters)

from lucebox_core.chat_template import ChatTemplate, decode_tool_arguments
from lucebox_core.parsing import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from tool_call_helpers import (RICH_SCHEMA, RICH_TOOLS, assert_any_chunking_gives, assert_texts,
                               assert_tool_choice_is_checked, checked_calls, coalesce, drive, drive_auto, feed_all, ids,
                               random_chunks)

SHARED = Path(__file__).resolve().parents[2] / "shared"
TEMPLATES = SHARED / "fixtures" / "templates"
TEMPLATE_FILES = ["google-gemma-4-31B-it.jinja", "google-gemma-4-31B-it-interleaved.jinja"]
VOCAB = SHARED / "fixtures" / "vocab" / "ggml-vocab-gemma-4.gguf"

Q = '<|"|>'  # Gemma's string quote (one token)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
            "scale": {"type": "number"}, "unit": {"type": "string", "enum": ["c", "f"]},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}, "tags": {"type": "array",
                      "items": {"type": "string"}}}},
            "hours": {"type": "array", "items": {"type": "integer"}}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}}}}},
]  # fmt: skip


def call(name: str, body: str = "") -> str:
    return f"<|tool_call>call:{name}{{{body}}}<tool_call|>"


THOUGHT = "<|channel>thought\n{}<channel|>"

WELL_FORMED = [
    # (output, thinking, expected reasoning, expected content, [(name, arguments)])
    ("Hello, world. 2 < 3 and {a: b}.", False, "", "Hello, world. 2 < 3 and {a: b}.", []),
    (THOUGHT.format("The user greets me.\nI greet back.\n") + "\nHi there!", False,
     "The user greets me.\nI greet back.", "Hi there!", []),
    (THOUGHT.format("") + "The answer is 4.", False, "", "The answer is 4.", []),  # thinking off, empty channel
    ("Short thought.\n<channel|>Done.", True, "Short thought.", "Done.", []),  # prompt ended inside a channel
    ("<|channel>thought\nOpened anyway.<channel|>Done.", True, "Opened anyway.", "Done.", []),
    ("Let me check.\n\n" + call("get_weather", f"city:{Q}Paris{Q},days:3"), False, "", "Let me check.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    (THOUGHT.format("Need two lookups.") + call("get_weather", f"city:{Q}Paris{Q}") + call("run", f"code:{Q}ls{Q}")
     + "\n" + call("get_weather", f"city:{Q}Rome{Q},metric:false"), False, "Need two lookups.", "",
     [("get_weather", {"city": "Paris"}), ("run", {"code": "ls"}), ("get_weather", {"city": "Rome", "metric": False})]),
    (call("get_weather", f"city:{Q}São \"Paulo\", {{SP}}: a:b [x]{Q},where:{{lat:-23.5,tags:[{Q}big,city{Q},{Q}}}{Q}]}},"
          f"hours:[1,2,3],scale:1.5e3,unit:{Q}c{Q}"), False, "", "",
     [("get_weather", {"city": "São \"Paulo\", {SP}: a:b [x]", "where": {"lat": -23.5, "tags": ["big,city", "}"]},
                       "hours": [1, 2, 3], "scale": 1500.0, "unit": "c"})]),
    (call("run", f"code:{Q}x = '<tool_call|>'\nif a < b:\n    print({{'k': [1]}})\n{Q}"), False, "", "",
     [("run", {"code": "x = '<tool_call|>'\nif a < b:\n    print({'k': [1]})\n"})]),
    # typed by the schema: a quoted number, a bare string, Python's None and True
    (call("get_weather", f"days:{Q}4{Q},city:Oslo,metric:True,extra:None,n:-7,id:007"), False, "", "",
     [("get_weather", {"days": 4, "city": "Oslo", "metric": True, "extra": None, "n": -7, "id": "007"})]),
    (call("run", "code:007"), False, "", "", [("run", {"code": "007"})]),
    (call("get_weather") + " All done.", False, "", "All done.", [("get_weather", {})]),
    ("<|tool_call>call:run<tool_call|>", False, "", "", [("run", {})]),
    (call("get_weather", f"{Q}city{Q}:{Q}Nice{Q}, days : 2 "), False, "", "", [("get_weather", {"city": "Nice", "days": 2})]),
    ("a <|tool or <|chan and <|\"|> are text", False, "", "a <|tool or <|chan and <|\"|> are text", []),
    ("<|tool_call>not a call<tool_call|>", False, "", "<|tool_call>not a call<tool_call|>", []),
]  # fmt: skip

CHANNEL_MARKUP = ("<|channel>", "<channel|>")


def parse(chunks: list[str], *, thinking: bool = False, tools=TOOLS) -> list:
    return feed_all(create_parser(tools=tools, thinking=thinking, call_id=ids), chunks)


def check_invariants(events: list, output: str) -> list[tuple[str, dict]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert not any(tag in content + reasoning for tag in CHANNEL_MARKUP), (content, reasoning)
    # a call's head (with a name) never leaks into the content; `<|tool_call>call:{` is no call, and is text
    assert not re.search(r"<\|tool_call>\s*call:\s*[A-Za-z_][\w.\-]*\s*\{", content), content
    return checked_calls(events, output, opening="<|tool_call>call:")


@pytest.mark.parametrize("case", range(len(WELL_FORMED)))
def test_any_chunking_gives_the_same_events_and_keeps_the_invariants(case):
    output, thinking, reasoning, content, expected_calls = WELL_FORMED[case]
    reference = coalesce(parse([output], thinking=thinking))
    assert_texts(reference, reasoning, content)
    assert check_invariants(reference, output) == expected_calls
    if expected_calls:  # arguments are typed JSON, not just equal after a loose comparison
        for (_, got), (_, want) in zip(check_invariants(reference, output), expected_calls):
            assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    assert_any_chunking_gives(reference, output, lambda chunks: parse(chunks, thinking=thinking), check_invariants,
                              seed=case)


PIECES = ["<|tool_call>", "call:", "get_weather", "run", "{", "}", "[", "]", ",", ":", Q, "<tool_call|>", "<|channel>",
          "thought", "<channel|>", "\n", " ", "a", "12", "<", "|", "days", "city", "true", "None", "<|", "tool_c"]


@pytest.mark.parametrize("thinking", [False, True])
def test_random_markup_soup_is_chunking_invariant_and_well_formed(thinking):
    """Malformed output of every kind: never stuck, never invalid JSON, the same events for any chunking."""
    rng = random.Random(7 + thinking)
    for _ in range(250):
        output = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 30)))
        reference = coalesce(parse([output], thinking=thinking))
        check_invariants(reference, output)
        for _ in range(4):
            assert coalesce(parse(random_chunks(output, rng, rng.choice([1, 3, 7])), thinking=thinking)) == reference, output


def test_calls_and_raw_text_cover_the_output_exactly():
    """What is not content or reasoning is the calls' raw text: nothing of a call leaks, nothing is lost."""
    output = "Checking.\n" + call("get_weather", f"city:{Q}Paris{Q}") + call("run", f"code:{Q}a,b{Q}")
    events = parse([output])
    raws = [e.raw_text for e in events if isinstance(e, ToolCallEnd)]
    assert "".join(raws) == output[len("Checking.\n") :]
    assert [e.arguments_json for e in events if isinstance(e, ToolCallEnd)] == ['{"city": "Paris"}', '{"code": "a,b"}']


def test_string_arguments_stream_before_the_string_closes():
    parser = create_parser(tools=TOOLS, call_id=ids)
    events = parser.feed(f"<|tool_call>call:run{{code:{Q}print(1)\nprint(2)<|")
    assert events[0] == ToolCallStart(0, "call_0", "run")
    streamed = "".join(e.fragment for e in events if isinstance(e, ToolCallArgsDelta))
    assert streamed == '{"code": "print(1)\\nprint(2)'  # the value so far, as JSON text; `<|` held back
    events = parser.feed('"|>}<tool_call|>')
    assert [e.fragment for e in events if isinstance(e, ToolCallArgsDelta)] == ['"', "}"]
    assert isinstance(events[-1], ToolCallEnd) and json.loads(events[-1].arguments_json) == {"code": "print(1)\nprint(2)"}


def test_reasoning_streams_and_holds_back_only_a_possible_tag():
    parser = create_parser(tools=TOOLS)
    assert parser.feed("<|channel>thou") == []  # may still be the channel's name
    assert parser.feed("ght\nStep one.\n") == [ReasoningDelta("Step one.")]  # the newline may end the thought
    assert parser.feed("Step two.<chan") == [ReasoningDelta("\nStep two.")]
    assert parser.feed("nel|>\nAnswer") == [ContentDelta("Answer")]


@pytest.mark.parametrize(
    "text, schema, quoted, expected",
    [("42", {"type": "integer"}, False, 42), ("4.0", {"type": "integer"}, False, 4),
     ("4", {"type": "integer"}, True, 4), ("x", {"type": "integer"}, True, "x"),
     ("true", {"type": "boolean"}, True, True), ("None", {"type": ["string", "null"]}, False, None),
     ("007", {"type": "string"}, False, "007"), ("-7", None, False, -7), ("007", None, False, "007"), ("7", None, True, "7"),
     ("3", {"enum": [3, 4]}, True, 3), ("3", {"enum": ["3", "4"]}, False, "3"), ("word", None, False, "word"),
     ("{'a': 1}", {"type": "object"}, True, {"a": 1}), (" 1.5 ", {"type": "number"}, False, 1.5)],
)  # fmt: skip
def test_values_are_typed_by_the_schema(text, schema, quoted, expected):
    value = coerce_value(text, schema, quoted=quoted)
    assert value == expected and type(value) is type(expected)


def test_parse_arguments_reads_the_syntax_on_its_own():
    assert parse_arguments(f"{{a:[{{b:{Q}x,y{Q}}},null,-2],c:{{}}}}") == {"a": [{"b": "x,y"}, None, -2], "c": {}}
    assert parse_arguments(f"{{n:{Q}5{Q}}}", {"properties": {"n": {"type": "integer"}}}) == {"n": 5}


CUT_OFF = [
    # (output, arguments_json of the one call it still is)
    (f"<|tool_call>call:get_weather{{city:{Q}Par", '{"city": "Par"}'),
    (f"<|tool_call>call:get_weather{{city:{Q}Par<|\"", '{"city": "Par"}'),  # half a closing quote: not text
    (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},da", '{"city": "Paris"}'),  # half a key: dropped
    ("<|tool_call>call:get_weather{days:", "{}"),  # a key without a value: dropped
    ("<|tool_call>call:get_weather{days:12", '{"days": 12}'),
    (f"<|tool_call>call:get_weather{{where:{{tags:[{Q}a{Q},{Q}b", '{"where": {"tags": ["a", "b"]}}'),
    ("<|tool_call>call:get_weather{hours:[1,2,", '{"hours": [1, 2]}'),
    ("<|tool_call>call:get_weather{", "{}"),
    ("<|tool_call>call:get_weather{days:2}", '{"days": 2}'),  # closed, but the closing tag never came
    ("<|tool_call>call:get_weather{days:2}<tool_ca", '{"days": 2}'),
]


@pytest.mark.parametrize("output, arguments", CUT_OFF)
def test_a_call_cut_off_after_its_name_is_still_a_call(output, arguments):
    reference = coalesce(parse([output]))
    assert reference[0] == ToolCallStart(0, "call_0", "get_weather")
    assert reference[-1] == ToolCallEnd(0, arguments, output)
    assert not [e for e in reference if isinstance(e, ContentDelta)]
    rng = random.Random(len(output))
    for _ in range(30):
        assert coalesce(parse(random_chunks(output, rng, 4))) == reference


def test_a_call_cut_off_before_its_name_is_content():
    for output in ["Sure. <|tool_call>", "<|tool_call>call:get_", "x <|tool_ca", "<|tool_call>cal"]:
        events = coalesce(parse([output]))
        assert events == [ContentDelta(output)], output
        assert coalesce(parse(list(output))) == events


def test_a_thought_cut_off_is_reasoning():
    assert coalesce(parse(["<|channel>thought\nI was thinking abo"])) == [ReasoningDelta("I was thinking abo")]
    assert coalesce(parse(["<|channel>thou"])) == []  # the channel's name, nothing said yet


def test_without_tools_nothing_is_parsed_as_a_call():
    output = call("run", f"code:{Q}ls{Q}")
    assert coalesce(parse([output], tools=None)) == [ContentDelta(output)]
    assert coalesce(parse([output], tools=[])) == [ContentDelta(output)]
    # thoughts are still reasoning
    events = coalesce(parse([THOUGHT.format("hm") + "Ok " + output], tools=None))
    assert events == [ReasoningDelta("hm"), ContentDelta("Ok " + output)]


def test_a_malformed_call_closes_at_its_tag():
    output = f"<|tool_call>call:get_weather{{where:{{lat:1,tags:[{Q}a{Q}<tool_call|>After."
    events = coalesce(parse([output]))
    assert events[-2].arguments_json == '{"where": {"lat": 1, "tags": ["a"]}}'
    assert events[-1] == ContentDelta("After.")


# --- the chat templates write what the parser reads -----------------------------------------------------


def render(template: str, messages: list[dict], **kwargs) -> str:
    source = ChatTemplate.from_file(TEMPLATES / template, bos_token="<bos>", eos_token="<eos>")
    return source.render(decode_tool_arguments(messages), tools=[t for t in TOOLS], **kwargs)


CALLS = [
    {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": {
        "city": "Paris, FR: {centre} [1]", "days": 3, "metric": True, "scale": 0.5,
        "where": {"lat": 48.85, "tags": ["a,b", "c:d"]}, "hours": [9, 17]}}},
    {"id": "call_b", "type": "function", "function": {"name": "run", "arguments": json.dumps({"code": "ls -l\necho }"})}},
]  # fmt: skip


def conversation(*, reasoning: str | None = None, user_after: bool = True) -> list[dict]:
    assistant = {"role": "assistant", "content": "", "tool_calls": CALLS}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris, and list files."},
        assistant,
        {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "name": "run", "content": "a.txt"},
    ]
    if user_after:
        messages += [{"role": "assistant", "content": "Sunny; one file."}, {"role": "user", "content": "Thanks!"}]
    return messages


def expected_calls() -> list[tuple[str, dict]]:
    calls = []
    for item in CALLS:
        arguments = item["function"]["arguments"]
        calls.append((item["function"]["name"], json.loads(arguments) if isinstance(arguments, str) else arguments))
    return calls


@pytest.mark.parametrize("template", TEMPLATE_FILES)
@pytest.mark.parametrize("thinking", [False, True])
def test_templates_render_the_markup_the_parser_reads(template, thinking):
    text = render(template, conversation(), enable_thinking=thinking)
    assert text.startswith("<bos><|turn>system\n" + ("<|think|>\n" if thinking else "") + "You are terse.")
    assert "<|tool>declaration:get_weather{description:<|\"|>Weather for a city.<|\"|>" in text
    assert "<|turn>user\nWeather in Paris, and list files.<turn|>" in text
    # thinking on: the model opens its thought itself; off: the prompt holds an empty one
    assert text.endswith("<|turn>model\n" if thinking else "<|turn>model\n<|channel>thought\n<channel|>")
    found = re.findall(r"<\|tool_call>.*?<tool_call\|>", text, flags=re.S)
    assert len(found) == 2
    assert found[0].startswith("<|tool_call>call:get_weather{city:<|\"|>Paris, FR: {centre} [1]<|\"|>,days:3,")
    # The round trip: the template's text for the calls, read by the parser, gives the same calls back.
    segment = text[text.index(found[0]) : text.index(found[1]) + len(found[1])]
    assert segment == "".join(found)  # the calls follow one another with nothing between
    events = parse([segment])
    assert check_invariants(events, segment) == expected_calls()
    assert [e.raw_text for e in events if isinstance(e, ToolCallEnd)] == found
    assert not [e for e in events if isinstance(e, ContentDelta)]


@pytest.mark.parametrize("template", TEMPLATE_FILES)
def test_parsed_calls_render_back_to_the_same_text(template):
    """A parsed call sent back in history renders to the very text that was parsed (same tokens)."""
    text = render(template, conversation())
    found = re.findall(r"<\|tool_call>.*?<tool_call\|>", text, flags=re.S)
    starts = [e for e in parse(["".join(found)]) if isinstance(e, ToolCallStart)]
    ends = [e for e in parse(["".join(found)]) if isinstance(e, ToolCallEnd)]
    again = [{"id": f"x{i}", "type": "function", "function": {"name": s.name, "arguments": e.arguments_json}}
             for i, (s, e) in enumerate(zip(starts, ends))]  # fmt: skip
    messages = conversation()
    messages[2] = {**messages[2], "tool_calls": again}
    rerendered = render(template, messages)
    assert re.findall(r"<\|tool_call>.*?<tool_call\|>", rerendered, flags=re.S) == found


@pytest.mark.parametrize("template", TEMPLATE_FILES)
def test_a_rendered_thought_and_calls_read_back_as_reasoning_and_calls(template):
    """The model turn after the last user message keeps its thought: the parser splits it off again."""
    text = render(template, conversation(reasoning="Two tools: weather, then files.", user_after=False),
                  enable_thinking=True)
    turn = text[text.index("<|turn>model\n") + len("<|turn>model\n") :]
    turn = turn[: turn.rindex("<tool_call|>") + len("<tool_call|>")]
    assert turn.startswith("<|channel>thought\nTwo tools: weather, then files.")
    events = coalesce(parse([turn]))
    assert events[0] == ReasoningDelta("Two tools: weather, then files.")
    assert check_invariants(events, turn) == expected_calls()
    assert not [e for e in events if isinstance(e, ContentDelta)]


def test_tool_responses_render_in_gemma_markup():
    text = render(TEMPLATE_FILES[0], conversation())
    assert "<tool_call|><|tool_response>response:get_weather{value:<|\"|>sunny<|\"|>}<tool_response|>" in text
    assert "<|tool_response>response:run{value:<|\"|>a.txt<|\"|>}<tool_response|>Sunny; one file.<turn|>" in text
    # the interleaved template reads Gemma's own `tool_responses` on the assistant message
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": CALLS[:1],
                 "tool_responses": [{"name": "get_weather", "response": {"temp": 20, "sky": "clear"}}]}]  # fmt: skip
    text = render(TEMPLATE_FILES[1], messages)
    assert "<tool_call|><|tool_response>response:get_weather{sky:<|\"|>clear<|\"|>,temp:20}<tool_response|>" in text


# --- tool_choice ---------------------------------------------------------------------------------------


def test_forced_prefix_for_tool_choice():
    assert forced_prefix("required") == "<|tool_call>call:"
    assert forced_prefix({"type": "function", "function": {"name": "run"}}) == "<|tool_call>call:run{"
    assert forced_prefix("auto") == "" and forced_prefix("none") == ""
    parser = create_parser(tools=TOOLS, call_id=ids)  # the prefix is fed as part of the answer
    events = coalesce(parser.feed(forced_prefix({"function": {"name": "run"}})) + parser.feed("}<tool_call|>"))
    assert events[0] == ToolCallStart(0, "call_0", "run") and events[-1].arguments_json == "{}"


@pytest.fixture(scope="module")
def tokenizer():
    from lucebox_core.tokenizer import Tokenizer

    return Tokenizer.from_gguf(VOCAB)


SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}, "metric": {"type": "boolean"},
        "where": {"type": "object", "properties": {"ok": {"type": "boolean"}}}}},
    "noop": {},
}  # fmt: skip


@pytest.mark.parametrize("thinking", [False, True])
def test_required_tool_choice_forces_a_parsable_call(tokenizer, thinking):
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
    prefix = "Let me see.<channel|>" if thinking else "<|tool_call>call:"
    finished = 0
    for seed in range(6):
        constraint = tool_choice_constraint(tokenizer, tool_parameters(tools), "required", thinking=thinking)
        chosen, done = drive(constraint, tokenizer, seed, 80, prefix)
        if not done:
            continue
        finished += 1
        text = tokenizer.decode([t for t in chosen if t not in tokenizer.eot_ids])
        events = parse([text], tools=tools, thinking=thinking)
        calls = check_invariants(events, text)
        assert calls and not [e for e in events if isinstance(e, ContentDelta)], text
        for name, arguments in calls:
            properties = SCHEMAS[name].get("properties", {})
            assert set(arguments) <= set(properties), text
            for key, value in arguments.items():
                spec = properties[key]
                if "enum" in spec:
                    assert value in spec["enum"]
                elif spec["type"] == "object":
                    assert isinstance(value, dict) and all(isinstance(v, bool) for v in value.values())
                else:
                    assert type(value).__name__ == {"integer": "int", "boolean": "bool"}[spec["type"]], text
    assert finished >= 3


def test_the_grammar_allows_a_call_first_and_nothing_else(tokenizer):
    constraint = tool_choice_constraint(tokenizer, tool_parameters(TOOLS), "required")
    allowed = constraint.allowed(tokenizer.vocab_size)
    # Not thinking: the forced call is the answer, no thought first.
    assert allowed[tokenizer.token_to_id("<|tool_call>")] and not allowed[tokenizer.token_to_id("<|channel>")]
    assert not allowed[tokenizer.encode("Hello", add_bos=False)[0]]
    assert not allowed[tokenizer.token_to_id("<turn|>")]  # the turn cannot end before a call


def test_named_tool_choice_allows_only_that_function(tokenizer):
    schemas = tool_parameters(TOOLS)
    constraint = tool_choice_constraint(tokenizer, schemas, {"type": "function", "function": {"name": "run"}})
    for token in tokenizer.encode("<|tool_call>call:", add_bos=False, parse_special=True):
        constraint.accept(token)
    allowed = constraint.allowed(tokenizer.vocab_size)
    assert allowed[tokenizer.encode("run", add_bos=False)[0]]
    assert not allowed[tokenizer.encode("get", add_bos=False)[0]]
    for token in tokenizer.encode("run{code:", add_bos=False, parse_special=True):
        constraint.accept(token)
    allowed = constraint.allowed(tokenizer.vocab_size)
    assert allowed[tokenizer.token_to_id(Q)]  # a string parameter: only a quoted string
    assert not allowed[tokenizer.encode("7", add_bos=False)[0]]
    parser = create_parser(tools=TOOLS, thinking=False)
    assert_tool_choice_is_checked(tool_choice_constraint, parser, tokenizer, schemas)
    with pytest.raises(Exception, match="no tools"):
        tool_choice_constraint(tokenizer, {}, "required")


def test_the_grammar_types_nested_values_and_enums(tokenizer):
    grammar = tool_call_grammar(tokenizer, tool_parameters(TOOLS))
    assert '"unit:" ("<|\\"|>c<|\\"|>" | "<|\\"|>f<|\\"|>")' in grammar
    assert '"call:get_weather"' in grammar and '"call:run"' in grammar
    assert re.search(r'"lat:" G0_\d+', grammar) and re.search(r'"hours:" g0_\d+', grammar)


def test_a_named_call_validates_against_its_schema(tokenizer):
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


@pytest.mark.parametrize("thinking", [False, True])
def test_auto_leaves_text_free_and_holds_each_opened_call_to_its_schema(tokenizer, thinking):
    parser = create_parser(tools=RICH_TOOLS, thinking=thinking)
    constraint = parser.constraint_for("auto", tokenizer)
    assert constraint.dormant and constraint.allowed(tokenizer.vocab_size) is None
    # A call tag inside a thought is reasoning: nothing to hold.
    prefix = tokenizer.encode(("" if thinking else "<|channel>thought\n") + "Maybe <|tool_call>call:x{}.<channel|>",
                              add_bos=False, parse_special=True)
    for token in prefix:
        constraint.accept(token)
        assert constraint.dormant
    opening = tokenizer.encode("<|tool_call>", add_bos=False, parse_special=True)
    chosen, ended = drive_auto(constraint, tokenizer, opening, seed=3)
    text = tokenizer.decode(prefix + chosen)
    calls = checked_calls(parse([text], tools=RICH_TOOLS, thinking=thinking), text)
    assert ended >= 2 and len(calls[:ended]) == ended, text
    for name, arguments in calls[:ended]:
        jsonschema.validate(arguments, RICH_SCHEMA if name == "get_weather" else {"type": "object", "properties": {}})
