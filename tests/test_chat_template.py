"""Chat templates render exactly as transformers' `apply_chat_template` does, and fail only as TemplateError.

The reference is a real transformers tokenizer (a tiny word-level vocabulary carrying the template and
the BOS/EOS strings), so the comparison covers transformers' input preparation as well as its jinja
environment.
"""

from __future__ import annotations

import copy
import json
import random
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from lucebox_core.chat_template import ChatTemplate, decode_tool_arguments, special_token_strings
from lucebox_core.errors import TemplateError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

FIXTURES = Path("/work/shared/fixtures")
TEMPLATE_FILES = sorted((FIXTURES / "templates").glob("*.jinja"))
BOS, EOS = "<|BOS|>", "<|EOS|>"


def make_reference_tokenizer(bos: str = BOS, eos: str = EOS):
    vocab = {bos: 0, eos: 1, "<unk>": 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)


REFERENCE = make_reference_tokenizer()


def reference_render(source: str, messages: list[dict], tokenizer=REFERENCE, **kwargs: Any) -> str:
    tokenizer.chat_template = source
    return tokenizer.apply_chat_template(copy.deepcopy(messages), tokenize=False, **copy.deepcopy(kwargs))


def outcome(render, *args, **kwargs) -> tuple[str, str]:
    """("ok", text) or ("raised", error type name)."""
    try:
        return "ok", render(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return "raised", type(exc).__name__


# --- conversations ------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
                "days": {"type": "integer", "description": "Forecast length", "nullable": True},
                "hours": {"type": "array", "items": {"type": "integer"}, "description": "Hours of the day"},
                "where": {
                    "type": "object",
                    "description": "Coordinates",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat"],
                },
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web for a query.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]

WEATHER_ARGS = {"city": "Zürich", "unit": "celsius", "hours": [9, 12], "where": {"lat": 47.37, "lon": 8.54}}
SEARCH_ARGS = {"query": 'rain "today" <b>&</b>'}


def tool_round(arguments_as_json: bool) -> list[dict]:
    def call(call_id: str, name: str, arguments: dict) -> dict:
        args = json.dumps(arguments, ensure_ascii=False) if arguments_as_json else arguments
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}

    return [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Zürich, and search for rain news?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "Two tools are needed.",
            "tool_calls": [
                call("call_1", "get_weather", WEATHER_ARGS),
                call("call_2", "search", SEARCH_ARGS),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "name": "search", "content": "No rain expected."},
        {"role": "assistant", "content": "It is 21 °C and dry."},
    ]


CONVERSATIONS: dict[str, tuple[list[dict], list[dict] | None]] = {
    "system_user": (
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
        None,
    ),
    "user_only": ([{"role": "user", "content": "What is 2+2?"}], None),
    "multi_turn": (
        [
            {"role": "system", "content": "  Be kind.  \n"},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"},
        ],
        None,
    ),
    "reasoning_then_user": (
        [
            {"role": "user", "content": "Think: 3*7?"},
            {"role": "assistant", "content": "21", "reasoning_content": "3*7 is 21."},
            {"role": "user", "content": "And 4*6?"},
        ],
        None,
    ),
    "reasoning_last": (
        [
            {"role": "user", "content": "Think: 3*7?"},
            {"role": "assistant", "content": "21", "reasoning_content": "\n3*7 is 21.\n"},
        ],
        None,
    ),
    "reasoning_aliases": (
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning": "via reasoning"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "thinking": "via thinking"},
        ],
        None,
    ),
    "inline_think": (
        [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello to you."},
        ],
        None,
    ),
    "tools_no_calls": ([{"role": "user", "content": "Any tools?"}], TOOLS),
    "tool_round_dict_args": (tool_round(arguments_as_json=False), TOOLS),
    "tool_round_json_args": (tool_round(arguments_as_json=True), TOOLS),
    "tool_round_pending": (tool_round(arguments_as_json=False)[:5], TOOLS),
    "none_values": (
        [
            {"role": "user", "content": "Call it.", "tool_calls": None},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c9",
                        "type": "function",
                        "function": {"name": "search", "arguments": {"query": "x"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c9", "content": "found"},
        ],
        TOOLS,
    ),
    "content_parts": (
        [
            {"role": "system", "content": [{"type": "text", "text": "Parts system."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Two."}],
            },
        ],
        None,
    ),
    "unicode": (
        [{"role": "user", "content": '日本語 🚀 «quotes» "double" <tag> & \\backslash\\\n\ttab'}],
        [{"type": "function", "function": {"name": "ünï", "description": "é ☃ <>", "parameters": {}}}],
    ),
    "no_user_query": ([{"role": "system", "content": "Only a system prompt."}], None),
    "system_in_middle": (
        [
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Late system."},
        ],
        None,
    ),
}

VARIANTS = [
    {"add_generation_prompt": agp, **({} if thinking is None else {"enable_thinking": thinking})}
    for agp in (True, False)
    for thinking in (None, True, False)
]

TEXT_PIECES = [
    "hello", "Ünïcödé", "日本語", "🚀", " spaced ", "\n", "line\nbreak", "<b>", "&amp;", '"q"',
    "'s'", "{{ not jinja }}", "{% raw %}", "</think>", "tab\t", "  ", "x" * 30,
]  # fmt: skip


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randint(1, 5)))


def random_argument(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "float", "bool", "none"] + (["list", "dict"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return random_text(rng)
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "float":
        return round(rng.uniform(-10, 10), 3)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [random_argument(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_argument(rng, depth + 1) for i in range(rng.randint(0, 3))}


def random_conversation(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    """A plausible chat: optional system, user turns, assistants with reasoning and tool calls."""
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": random_text(rng)})
    call_number = 0
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": random_text(rng)})
        if rng.random() < 0.3:
            break  # end on a user turn, as a request does
        assistant: dict[str, Any] = {"role": "assistant", "content": random_text(rng)}
        if rng.random() < 0.5:
            assistant["reasoning_content"] = random_text(rng)
        calls = []
        for _ in range(rng.choice([0, 0, 1, 2])):
            call_number += 1
            arguments = {f"arg{i}": random_argument(rng) for i in range(rng.randint(0, 3))}
            function = {"name": rng.choice(["get_weather", "search"]), "arguments": arguments}
            calls.append({"id": f"call_{call_number}", "type": "function", "function": function})
        if calls:
            assistant["tool_calls"] = calls
        messages.append(assistant)
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": random_text(rng)})
        if calls and rng.random() < 0.7:
            messages.append({"role": "assistant", "content": random_text(rng)})
    return messages, (TOOLS if rng.random() < 0.6 else None)


RANDOM_CONVERSATIONS = {f"random_{seed}": random_conversation(random.Random(seed)) for seed in range(24)}


@pytest.fixture(scope="module", params=TEMPLATE_FILES, ids=lambda path: path.stem)
def template_file(request) -> Path:
    return request.param


@pytest.fixture(scope="module")
def compiled(template_file: Path) -> tuple[str, ChatTemplate]:
    source = template_file.read_text(encoding="utf-8")
    return source, ChatTemplate(source, bos_token=BOS, eos_token=EOS, name=template_file.name)


def assert_parity(source: str, ours: ChatTemplate, messages: list[dict], tools: list[dict] | None) -> int:
    """Compare every variant; return how many rendered (rather than raised)."""
    rendered = 0
    for variant in VARIANTS:
        expected = outcome(reference_render, source, messages, tools=tools, **variant)
        got = outcome(ours.render, copy.deepcopy(messages), tools=copy.deepcopy(tools), **variant)
        if expected[0] == "raised":
            assert got == ("raised", "TemplateError"), (
                f"{variant}: transformers raised {expected[1]}, we gave {got}"
            )
        else:
            assert got == expected, f"{variant}: rendering differs"
            rendered += 1
    return rendered


@pytest.mark.parametrize("conversation", list(CONVERSATIONS), ids=str)
def test_fixture_templates_match_transformers(compiled, conversation: str) -> None:
    source, ours = compiled
    messages, tools = CONVERSATIONS[conversation]
    rendered = assert_parity(source, ours, messages, tools)
    if conversation in ("system_user", "multi_turn", "tool_round_dict_args"):
        assert rendered == len(VARIANTS), "every template accepts this conversation"


def test_fixture_templates_match_transformers_on_random_conversations(compiled) -> None:
    source, ours = compiled
    rendered = sum(
        assert_parity(source, ours, *conversation) for conversation in RANDOM_CONVERSATIONS.values()
    )
    assert rendered > len(RANDOM_CONVERSATIONS) * len(VARIANTS) // 2, (
        "most random conversations should render"
    )


def test_variants_change_the_output(compiled) -> None:
    # Guards against a comparison that passes because nothing reaches the template.
    _, ours = compiled
    messages = CONVERSATIONS["multi_turn"][0]
    assert ours.render(messages, add_generation_prompt=True) != ours.render(
        messages, add_generation_prompt=False
    )
    with_tools = ours.render(messages, tools=TOOLS)
    assert "get_weather" in with_tools and "Zürich" not in with_tools


@pytest.mark.parametrize("bad_arguments", ["{not json", "[1, 2]", ""])
def test_decode_tool_arguments(bad_arguments: str) -> None:
    json_round, dict_round = tool_round(arguments_as_json=True), tool_round(arguments_as_json=False)
    decoded = decode_tool_arguments(json_round)
    assert decoded == dict_round
    assert json_round == tool_round(arguments_as_json=True), "the caller's messages are left alone"
    # Templates that iterate over arguments (Qwen3.5) reject JSON strings but accept them decoded.
    template = ChatTemplate.from_file(FIXTURES / "templates" / "Qwen3.5-4B.jinja")
    with pytest.raises(TemplateError, match="mapping"):
        template.render(json_round, tools=TOOLS)
    assert template.render(decoded, tools=TOOLS) == template.render(dict_round, tools=TOOLS)
    # Arguments that are not a JSON object are passed on unchanged for the template to judge.
    odd = copy.deepcopy(json_round)
    odd[2]["tool_calls"][0]["function"]["arguments"] = bad_arguments
    assert decode_tool_arguments(odd)[2]["tool_calls"][0]["function"]["arguments"] == bad_arguments


# --- environment details, against transformers ---------------------------------------------------

CUSTOM_TEMPLATES = {
    "tojson": (
        "{% set x = payload %}"
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}|"
        "{{ x | tojson(sort_keys=true) }}|{{ x | tojson(ensure_ascii=true) }}"
    ),
    "whitespace": "{% for m in messages %}\n    {% if m.role == 'user' %}\n  U:{{ m.content }}\n"
    "    {% endif %}\n{% endfor %}\n",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% if m.role == 'system' %}{% continue %}{% endif %}[{{ m.content }}]{% endfor %}",
    "special_tokens_and_kwargs": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}|{{ custom_flag }}|"
    "{{ enable_thinking is defined }}|{{ add_generation_prompt }}|{{ tools is none }}",
    "documents": "{% for d in documents %}<doc title={{ d.title }}>{{ d.text }}</doc>{% endfor %}"
    "{{ messages | length }}",
    "namespace_and_dict": "{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ ns.n }}|{{ dict(a=1, b=2) | dictsort }}|{{ dict.fromkeys(['x', 'y'], 0) | dictsort }}",
    "generation_scope": "{% set x = 'outer' %}"
    "{% generation %}{% set x = 'inner' %}<{{ x }}>{% endgeneration %}{{ x }}",
    "none_keys_dropped": "{{ messages[2] | tojson }}|{{ messages[2].tool_calls is defined }}",
    "undefined_prints_empty": "[{{ nothing }}][{{ messages[0].missing }}][{{ messages[0].get('missing') }}]",
}
PAYLOAD = {"b": "é <&> 'q' \"dq\" 🚀", "a": [1, 2.5, True, None, {"z": "ü"}]}


@pytest.mark.parametrize("name", list(CUSTOM_TEMPLATES))
def test_environment_matches_transformers(name: str) -> None:
    source = CUSTOM_TEMPLATES[name]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "user", "content": "U2", "tool_calls": None, "reasoning": None, "thinking": "T"},
    ]
    kwargs = {
        "custom_flag": "on",
        "payload": PAYLOAD,
        "documents": [{"title": "T1", "text": "body one"}, {"title": "T2", "text": "two"}],
    }
    expected = reference_render(source, messages, add_generation_prompt=True, **kwargs)
    got = ChatTemplate(source, bos_token=BOS, eos_token=EOS).render(messages, **kwargs)
    assert got == expected
    assert got  # something rendered


def test_tojson_has_transformers_semantics() -> None:
    source = CUSTOM_TEMPLATES["tojson"]
    got = ChatTemplate(source).render([], payload=PAYLOAD).split("|")
    assert got == [
        json.dumps(PAYLOAD, ensure_ascii=False),
        json.dumps(PAYLOAD, ensure_ascii=False, indent=2),
        json.dumps(PAYLOAD, ensure_ascii=False, separators=(",", ":")),
        json.dumps(PAYLOAD, ensure_ascii=False, sort_keys=True),
        json.dumps(PAYLOAD, ensure_ascii=True),
    ]


def test_strftime_now() -> None:
    template = ChatTemplate("{{ strftime_now('%Y-%m-%d %H') }}")
    before = datetime.now().strftime("%Y-%m-%d %H")
    got = template.render([])
    assert got in (before, datetime.now().strftime("%Y-%m-%d %H"))


def test_special_tokens_can_be_overridden() -> None:
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}", bos_token="<s>", eos_token="</s>")
    assert template.render([]) == "<s>|</s>"
    assert template.render([], bos_token="[B]") == "[B]|</s>"


def test_inputs_are_copied_to_plain_types() -> None:
    class Rich(str):
        def dangerous(self) -> str:
            return "called"

    template = ChatTemplate("{{ thing }}|{{ messages[0].content.dangerous }}|{{ messages[0].content }}")
    messages = [{"role": "user", "content": Rich("plain")}]
    assert template.render(messages, thing=object()) == "<object>||plain"


# --- errors ---------------------------------------------------------------------------------------

SANDBOX_ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ ''['__class__'] }}",
    "{{ messages.__class__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__['os'] }}",
    "{{ lipsum.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__code__ }}",
    "{{ namespace.__init__ }}",
    "{{ dict.__call__.__globals__ }}",
    "{{ messages | attr('__class__') }}",
    "{{ '{0.__class__.__mro__}'.format(1) }}",
    "{{ range.__globals__ }}",
    "{% set ns = namespace(_secret=1) %}",
    "{% set ns = namespace() %}{% set ns._secret = 1 %}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
]


@pytest.mark.parametrize("source", SANDBOX_ESCAPES)
def test_sandbox_escapes_raise_template_error(source: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match=r"^evil\.jinja .*line 1") as caught:
        ChatTemplate(source, name="evil.jinja").render(messages)
    assert "outside its sandbox" in str(caught.value)
    assert messages == [{"role": "user", "content": "hi"}]


def test_raise_exception_message_surfaces() -> None:
    path = FIXTURES / "templates" / "Qwen3.5-4B.jinja"
    template = ChatTemplate.from_file(path)
    with pytest.raises(TemplateError) as caught:
        template.render([{"role": "system", "content": "no user here"}])
    message = str(caught.value)
    assert "No user query found in messages." in message
    assert str(path) in message
    # The line jinja reports is the template's own line that calls raise_exception.
    line = int(message.split(" at line ")[1].split(":")[0])
    assert "No user query found" in path.read_text().splitlines()[line - 1]


def test_syntax_error_names_template_and_line() -> None:
    with pytest.raises(TemplateError, match=r"^broken\.jinja syntax error at line 3"):
        ChatTemplate("ok\n{% if x %}\n{% for %}\n{% endif %}", name="broken.jinja")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("line one\n{{ messages[0].nothing.deeper }}", r"undefined value at line 2"),
        ("{{ undefined_name + 'x' }}", r"undefined value at line 1"),
        ("{{ 1 / 0 }}", r"ZeroDivisionError"),
        ("{{ 'a' + 1 }}", r"TypeError"),
        ("{{ messages | tojson(indent='bad indent', sort_keys=1, separators=3) }}", r"TypeError"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"recursed too deeply"),
        ("{{ range(10**9) | list }}", r"sandbox|OverflowError"),
    ],
)
def test_other_failures_are_template_errors(source: str, expected: str) -> None:
    with pytest.raises(TemplateError, match=r"^T ") as caught:
        ChatTemplate(source, name="T").render([{"role": "user", "content": "hi"}])
    assert re.search(expected, str(caught.value)), str(caught.value)


@pytest.mark.parametrize(
    ("messages", "kwargs"),
    [
        ("not a list", {}),
        ([["role", "user"]], {}),
        ([{"role": "user", "content": "x"}], {"tools": [lambda: None]}),
        ([{"role": "user", "content": "x"}], {"documents": "text"}),
    ],
)
def test_bad_inputs_are_template_errors(messages: Any, kwargs: dict) -> None:
    with pytest.raises(TemplateError, match=r"^chat template: "):
        ChatTemplate("{{ messages }}").render(messages, **kwargs)


def test_non_string_source_is_a_template_error() -> None:
    with pytest.raises(TemplateError, match="must be a string"):
        ChatTemplate(b"{{ x }}")  # type: ignore[arg-type]


# --- loading --------------------------------------------------------------------------------------


def read_metadata(path: Path) -> dict[str, Any]:
    try:
        from lucebox_core.ggufio import GGUFFile
    except ImportError:
        import gguf

        reader = gguf.GGUFReader(path)
        return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    return dict(GGUFFile(path).metadata)


@pytest.mark.parametrize(
    ("vocab", "bos", "eos"),
    [
        ("ggml-vocab-qwen35.gguf", "<|endoftext|>", "<|endoftext|>"),
        ("ggml-vocab-gemma-4.gguf", "<bos>", "<eos>"),
    ],
)
def test_from_metadata(vocab: str, bos: str, eos: str) -> None:
    metadata = read_metadata(FIXTURES / "vocab" / vocab)
    template = ChatTemplate.from_metadata(metadata)
    assert template is not None
    assert (template.bos_token, template.eos_token) == (bos, eos)
    assert template.source == metadata["tokenizer.chat_template"]
    assert "tokenizer.chat_template" in template.name

    messages = CONVERSATIONS["multi_turn"][0]
    expected = reference_render(
        template.source, messages, make_reference_tokenizer(bos, eos), add_generation_prompt=True
    )
    assert template.render(messages) == expected
    assert special_token_strings(metadata) == (bos, eos)
    from_file = ChatTemplate.from_file(FIXTURES / "templates" / "google-gemma-4-31B-it.jinja", bos_token=bos)
    assert from_file.render(messages).startswith(bos)


def test_from_metadata_without_template_and_with_explicit_tokens() -> None:
    assert ChatTemplate.from_metadata({"tokenizer.ggml.bos_token_id": 0}) is None
    metadata = {"tokenizer.chat_template": "{{ bos_token }}", "tokenizer.ggml.bos_token_id": 1,
                "tokenizer.ggml.eos_token_id": 99}  # fmt: skip
    template = ChatTemplate.from_metadata(metadata, ["a", "b", "c"])
    assert template is not None and (template.bos_token, template.eos_token) == ("b", "")
    numpy = pytest.importorskip("numpy")
    metadata |= {"tokenizer.ggml.eos_token_id": numpy.uint32(2), "tokenizer.ggml.tokens": ["x", "y", "z"]}
    template = ChatTemplate.from_metadata(metadata)
    assert template is not None and (template.bos_token, template.eos_token) == ("y", "z")
    with pytest.raises(TemplateError, match="tokenizer.chat_template"):
        ChatTemplate.from_metadata({"tokenizer.chat_template": 5})


def test_from_file(tmp_path: Path) -> None:
    path = FIXTURES / "templates" / "Qwen3-Coder.jinja"
    template = ChatTemplate.from_file(path)
    messages = CONVERSATIONS["system_user"][0]
    assert template.render(messages) == reference_render(
        path.read_text(), messages, add_generation_prompt=True
    )
    assert str(path) in template.name

    missing = tmp_path / "missing.jinja"
    with pytest.raises(TemplateError, match="missing.jinja"):
        ChatTemplate.from_file(missing)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}")
    with pytest.raises(TemplateError, match=r"broken\.jinja syntax error at line 1"):
        ChatTemplate.from_file(broken)
