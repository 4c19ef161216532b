"""Laguna's text side: its Laguna-style BPE against transformers' tokenizer (stored test vectors and live), the
Laguna-XS.2 chat template through the core's renderer, the `<tool_call>` parser as it streams, and a tiny
synthetic Laguna served over HTTP to the OpenAI SDK."""

from __future__ import annotations

import json
import random

import openai
import pytest

from lucebox_core.chat_prompt import render_chat
from lucebox_core.chat_template import ChatTemplate
from lucebox_core.parsing import ContentDelta, ReasoningDelta, ToolCallEnd, ToolCallStart
from lucebox_core.tokenizer import Tokenizer
from lucebox_laguna import synth
from lucebox_laguna.tool_calls import create_parser

from conftest import loaded_service

SEPARATOR = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="module")
def metadata():
    vocab = synth.laguna_vocab(None, 100352)
    md = {key: value for key, (value, _, _) in vocab.keys.items()}
    md.update({"tokenizer.ggml.tokens": vocab.tokens, "tokenizer.ggml.token_type": vocab.token_types,
               "tokenizer.ggml.merges": vocab.merges})
    return md


@pytest.fixture(scope="module")
def tokenizer(metadata):
    return Tokenizer.from_metadata(metadata)


def _vectors():
    data = synth.data_dir()
    inputs = (data / "laguna-vocab.inp").read_bytes().decode("utf-8").split(SEPARATOR)  # byte for byte: \r stays
    outputs = (data / "laguna-vocab.out").read_text(encoding="utf-8").splitlines()
    assert len(inputs) == len(outputs) > 30
    return [(text, [int(i) for i in line.split()]) for text, line in zip(inputs, outputs)]


def test_the_vocabulary_has_lagunas_size_and_ids(tokenizer):
    assert tokenizer.vocab_size == 100352 and tokenizer.pre == "laguna"
    assert tokenizer.token_to_id("〈|EOS|〉") == 2 and tokenizer.token_to_id("</assistant>") == 24
    assert tokenizer.is_eog(2) and tokenizer.is_eog(24) and not tokenizer.add_bos
    assert tokenizer.is_control(tokenizer.token_to_id("<tool_call>"))
    assert len(tokenizer.unused_ids()) == 100352 - 8192  # the padding up to the model's table


def test_tokens_match_the_stored_transformers_vectors(tokenizer):
    for text, expected in _vectors():
        assert tokenizer.encode(text, add_bos=False) == expected, repr(text)
        assert tokenizer.decode(expected) == text


def test_tokens_match_transformers_on_random_text(tokenizer):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(synth.data_dir() / "tokenizer.json"))
    rng = random.Random(7)
    alphabet = "abcXYZ 0123456789\n\n\t  .,;:'\"!?()[]{}<>/\\-_=+*&^%$#@~`|éüß東京🚀\r"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        expected = reference(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert tokenizer.encode(text, add_bos=False) == expected, repr(text)


def test_the_chat_template_renders_lagunas_turns(metadata, tokenizer):
    template = ChatTemplate.from_metadata(metadata, metadata["tokenizer.ggml.tokens"])
    messages = [{"role": "user", "content": "Weather in Paris? <tool_call>"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    rendered = render_chat(template, tokenizer, messages, tools=tools)
    assert rendered.text.startswith("〈|EOS|〉<system>\n") and rendered.text.endswith("<user>\nWeather in Paris? "
                                                                                      "<tool_call>\n</user>\n"
                                                                                      "<assistant>\n</think>")
    assert "<available_tools>\n" in rendered.text
    ids = rendered.encode(tokenizer)
    assert ids[0] == 2 and ids[-1] == tokenizer.token_to_id("</think>")
    # The template's markup became control tokens; the user's "<tool_call>" stayed text.
    assert ids.count(tokenizer.token_to_id("<tool_call>")) == rendered.text.count("<tool_call>") - 1
    thinking = render_chat(template, tokenizer, messages, enable_thinking=True)
    assert thinking.text.endswith("<assistant>\n<think>")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "units": {"type": "object"}}}}}]
CALL = ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New\nYork</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n"
        '<arg_value>{"t": "C"}</arg_value>\n</tool_call>\nDone.')


def _parse(text, chunk, **options):
    parser = create_parser(tools=TOOLS, call_id=lambda i: f"call{i}", **options)
    events = []
    for start in range(0, len(text), chunk):
        events += parser.feed(text[start : start + chunk])
    return events + parser.finish()


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_a_call_reads_the_same_in_any_chunking(chunk):
    events = _parse(CALL, chunk)
    assert [e for e in events if isinstance(e, ToolCallStart)] == [ToolCallStart(0, "call0", "get_weather")]
    (end,) = [e for e in events if isinstance(e, ToolCallEnd)]
    assert end.arguments_json == '{"city": "New\\nYork", "days": 3, "units": {"t": "C"}}'
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Let me check.Done."


def test_reasoning_then_a_call_cut_off():
    # With thinking on, the prompt ends with "<think>": the answer opens inside the reasoning.
    events = _parse("I should look.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                    "<arg_value>Par", 3, thinking=True)
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "I should look."
    (end,) = [e for e in events if isinstance(e, ToolCallEnd)]
    assert end.arguments_json == '{"city": "Par"}'


def test_text_that_is_no_call_stays_content():
    events = _parse("use <tool_call><b>not a call</b> here", 4)
    assert not [e for e in events if isinstance(e, (ToolCallStart, ToolCallEnd))]
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "use <tool_call><b>not a call</b> here"


# -- calls held to their schemas --------------------------------------------------------------------------


@pytest.mark.parametrize("thinking", [False, True])
def test_required_tool_choice_forces_a_parsable_call(tokenizer, thinking):
    import jsonschema
    from tool_call_helpers import RICH_SCHEMA, RICH_TOOLS, checked_calls, drive

    from lucebox_laguna.tool_grammar import tool_choice_constraint

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in RICH_TOOLS}
    finished = 0
    for seed in range(4):
        constraint = tool_choice_constraint(tokenizer, schemas, "required", thinking=thinking)
        prefix = "Let me see.</think>\n" if thinking else ""
        chosen, done = drive(constraint, tokenizer, seed, 150, prefix, padded_logits=16)
        if not done:
            continue
        finished += 1
        text = tokenizer.decode([t for t in chosen if not tokenizer.is_eog(t)])
        events = _events(text, RICH_TOOLS, thinking)
        calls = checked_calls(events, text)
        assert calls and not "".join(e.text for e in events if isinstance(e, ContentDelta)).strip(), text
        for name, arguments in calls:
            jsonschema.validate(arguments, RICH_SCHEMA if name == "get_weather" else {})
    assert finished >= 2


def test_a_named_choice_allows_only_that_function_and_auto_holds_opened_calls(tokenizer):
    import jsonschema
    from tool_call_helpers import RICH_SCHEMA, RICH_TOOLS, assert_tool_choice_is_checked, checked_calls, drive_auto

    from lucebox_laguna.tool_grammar import tool_choice_constraint

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in RICH_TOOLS}
    constraint = tool_choice_constraint(tokenizer, schemas, {"type": "function", "function": {"name": "noop"}})
    constraint.accept(tokenizer.token_to_id("<tool_call>"))
    allowed = constraint.allowed(tokenizer.vocab_size)
    assert allowed[tokenizer.encode("no", add_bos=False)[0]] and not allowed[tokenizer.encode("get", add_bos=False)[0]]
    assert_tool_choice_is_checked(tool_choice_constraint, create_parser(tools=RICH_TOOLS), tokenizer, schemas)

    parser = create_parser(tools=RICH_TOOLS)
    auto = parser.constraint_for("auto", tokenizer)
    assert auto.dormant and auto.allowed(tokenizer.vocab_size) is None
    chosen, ended = drive_auto(auto, tokenizer, [tokenizer.token_to_id("<tool_call>")], seed=7)
    text = tokenizer.decode(chosen)
    whole = checked_calls(_events(text, RICH_TOOLS, False), text)[:ended]
    assert ended >= 2 and len(whole) == ended, text
    for name, arguments in whole:
        jsonschema.validate(arguments, RICH_SCHEMA if name == "get_weather" else {"type": "object"})


def _events(text, tools, thinking):
    parser = create_parser(tools=tools, thinking=thinking)
    return parser.feed(text) + parser.finish()


# -- served -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    model = synth.write(tmp_path_factory.mktemp("laguna") / "tiny-q8_0.gguf", size="tiny", type="q8_0", seed=3)
    yield from loaded_service(tmp_path_factory, model=str(model), ctx_size=512, parallel=1)


def test_served_laguna_answers_the_openai_sdk(oai, service):
    assert service.loaded.gguf.architecture == "laguna"
    reply = oai.chat.completions.create(model="laguna", messages=[{"role": "user", "content": "Hello"}],
                                        max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens <= 4
    prompt = render_chat(service.loaded.chat_template, service.loaded.tokenizer,
                         [{"role": "user", "content": "Hello"}]).encode(service.loaded.tokenizer)
    assert reply.usage.prompt_tokens == len(prompt)  # rendered with Laguna-XS.2's template
    stream = list(oai.chat.completions.create(model="laguna", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=4, temperature=0, stream=True, tools=TOOLS))
    assert stream[-1].choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_a_forced_tool_call_comes_back_parsed(oai):
    reply = oai.chat.completions.create(
        model="laguna", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80)
    choice = reply.choices[0]  # greedy on a fixed random model: the grammar's shortest way out is a call
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) <= {"city", "days", "units"} and isinstance(arguments.get("days", 0), int)
