"""The generic response-parser pieces: events, the <think> splitter, partial tags, the registry lookup."""

from __future__ import annotations

import random

import pytest

from lucebox_core.parsing import (
    PLAIN_PARSER,
    ContentDelta,
    ReasoningDelta,
    ReasoningParser,
    create_plain_parser,
    partial_suffix,
    response_parser_for,
)
from tool_call_helpers import coalesce, random_chunks
from tool_call_helpers import feed_all as parse


@pytest.mark.parametrize(
    "text, tags, expected",
    [("hello <thi", ["<think>"], 4), ("hello <think", ["<think>"], 6), ("hello", ["<think>"], 0),
     ("a\n</para", ["\n</parameter>", "</parameter>"], 7), ("x<", ["<a>", "<b>"], 1), ("<think>", ["<think>"], 0)],
)  # fmt: skip
def test_partial_suffix_is_the_longest_proper_tag_prefix_at_the_end(text, tags, expected):
    assert partial_suffix(text, tags) == expected


CASES = [
    # (output, thinking, reasoning, content)
    ("\nI should add.\n\n</think>\n\n4", True, "I should add.", "4"),
    ("<think>\nplan\n</think>\n\nanswer", False, "plan", "answer"),
    ("  <think>plan</think>answer", False, "plan", "answer"),
    ("no reasoning at all", False, "", "no reasoning at all"),
    ("<thinking is fun", False, "", "<thinking is fun"),
    ("cut off while thinking\n", True, "cut off while thinking", ""),
    ("a\n\nb\n</think>c", True, "a\n\nb", "c"),
]


@pytest.mark.parametrize("output, thinking, reasoning, content", CASES)
def test_reasoning_split_is_the_same_for_any_chunking(output, thinking, reasoning, content):
    whole = coalesce(parse(ReasoningParser(thinking=thinking), [output]))
    expected = ([ReasoningDelta(reasoning)] if reasoning else []) + ([ContentDelta(content)] if content else [])
    assert whole == expected
    rng = random.Random(len(output))
    for _ in range(60):
        events = parse(ReasoningParser(thinking=thinking), random_chunks(output, rng, largest=4))
        assert coalesce(events) == expected
        assert all(e.text for e in events), "no empty deltas"
        joined = "".join(e.text for e in events if isinstance(e, ContentDelta))
        assert "<think>" not in joined and "</think>" not in joined


def test_one_character_at_a_time_holds_only_what_may_be_a_tag():
    parser = ReasoningParser(thinking=True)
    seen = [parser.feed(c) for c in "abc</th"]
    assert [e for batch in seen for e in batch] == [ReasoningDelta("a"), ReasoningDelta("b"), ReasoningDelta("c")]
    assert parser.feed("ink>") == []  # the tag closes; the content is still empty
    assert parser.feed("x") == [ContentDelta("x")]


def test_plain_parser_factory_and_spec():
    assert PLAIN_PARSER.is_available() == (True, "")
    parser = PLAIN_PARSER.create(tools=None, thinking=False)
    assert coalesce(parse(parser, ["<think>r</think>", "<tool_call>x"])) == [
        ReasoningDelta("r"), ContentDelta("<tool_call>x")
    ]  # fmt: skip
    assert create_plain_parser(thinking=True).constraint_for("required", tokenizer=None) is None


class _FakeRegistry:
    """Only `response_parsers()`: the one method the lookup uses."""

    def __init__(self, specs):
        self._specs = specs

    def response_parsers(self):
        return self._specs


def test_response_parser_for_picks_the_family_and_falls_back_to_plain():
    from lucebox_core.specs import ResponseParser

    qwen = ResponseParser(name="qwen35", factory="x:y", architectures=["qwen35", "qwen35moe"])
    registry = _FakeRegistry([qwen])
    assert response_parser_for("qwen35moe", registry) is qwen
    assert response_parser_for("gemma4", registry) is PLAIN_PARSER


def test_lucebox_response_parsers_hook_of_installed_plugins():
    """Whatever parsers the installed plugins return must load and parse (qwen35 once it registers)."""
    from lucebox_core.plugins import discover

    registry = discover()
    # Each family closes its reasoning its own way (Qwen `</think>`, Gemma-4 `<channel|>`).
    closings = {"qwen35": "r</think>c", "gemma4": "r<channel|>c"}
    for spec in registry.response_parsers():
        assert spec.is_available()[0], spec
        assert coalesce(parse(spec.create(tools=None, thinking=False), ["plain"])) == [ContentDelta("plain")], spec
        if spec.name in closings:
            parser = spec.create(tools=None, thinking=True)
            assert coalesce(parse(parser, [closings[spec.name]])) == [ReasoningDelta("r"), ContentDelta("c")], spec
    spec = response_parser_for("qwen35", registry)
    assert spec.name in ("qwen35", "plain")
