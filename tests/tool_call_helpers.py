"""What the response-parser tests of every family share: feeding a parser chunk by chunk, random chunkings,
the chunking-independent form of the events, the checks every tool call passes, and generation under a
tool_choice constraint."""

from __future__ import annotations

import json
import random

import pytest
import torch

from lucebox_core.parsing import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart


def ids(index: int) -> str:
    """Call ids that tests can name (the parsers' own are random)."""
    return f"call_{index}"


def feed_all(parser, chunks: list[str]) -> list:
    """Every event of `parser` fed `chunks` one by one, then finished."""
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def random_chunks(text: str, rng: random.Random, largest: int = 7) -> list[str]:
    chunks, at = [], 0
    while at < len(text):
        size = rng.randint(1, largest)
        chunks.append(text[at : at + size])
        at += size
    return chunks


def coalesce(events: list) -> list:
    """Adjacent deltas of one kind (and one call) merged: the form that does not depend on the chunking."""
    merged: list = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, (ContentDelta, ReasoningDelta)) and type(last) is type(event):
            merged[-1] = type(event)(last.text + event.text)
        elif isinstance(event, ToolCallArgsDelta) and isinstance(last, ToolCallArgsDelta) and last.index == event.index:
            merged[-1] = ToolCallArgsDelta(event.index, last.fragment + event.fragment)
        else:
            merged.append(event)
    return merged


def assert_texts(events: list, reasoning: str, content: str) -> None:
    """The coalesced `events` reason `reasoning` and say `content` (one delta each, none where it is empty)."""
    assert [e.text for e in events if isinstance(e, ReasoningDelta)] == ([reasoning] if reasoning else [])
    assert [e.text for e in events if isinstance(e, ContentDelta)] == ([content] if content else [])


def assert_any_chunking_gives(reference: list, output: str, parse, check, *, seed: int, trials: int = 80) -> None:
    """Every chunking of `output` tried (one character at a time, then random pieces) parses, by `parse(chunks)`,
    to the coalesced `reference`, with `check(events, output)`'s invariants kept."""
    rng = random.Random(seed)
    for trial in range(trials):
        chunks = list(output) if trial == 0 else random_chunks(output, rng, largest=rng.choice([2, 5, 13]))
        events = parse(chunks)
        assert coalesce(events) == reference, chunks
        check(events, output)


def checked_calls(events: list, output: str, *, opening: str | None = None) -> list[tuple[str, dict]]:
    """The (name, arguments) of each call among `events`, checked: its fragments make its arguments, its raw
    text is a piece of `output` (starting with `opening` and its name, when given), indices count 0, 1, ..."""
    calls = []
    for start in (e for e in events if isinstance(e, ToolCallStart)):
        fragments = "".join(e.fragment for e in events if isinstance(e, ToolCallArgsDelta) and e.index == start.index)
        (end,) = [e for e in events if isinstance(e, ToolCallEnd) and e.index == start.index]
        assert fragments == end.arguments_json
        assert end.raw_text in output
        assert opening is None or end.raw_text.startswith(opening + start.name), end.raw_text
        calls.append((start.name, json.loads(end.arguments_json)))
    assert [s.index for s in events if isinstance(s, ToolCallStart)] == list(range(len(calls)))
    return calls


def assert_tool_choice_is_checked(tool_choice_constraint, parser, tokenizer, schemas: dict) -> None:
    """"auto" and "none" force nothing, "required" forces a call (also through the parser), and a function
    not among the tools is an error."""
    assert tool_choice_constraint(tokenizer, schemas, "auto") is None
    assert tool_choice_constraint(tokenizer, schemas, "none") is None
    assert parser.constraint_for("required", tokenizer) is not None
    with pytest.raises(Exception, match="not among the tools"):
        tool_choice_constraint(tokenizer, schemas, {"function": {"name": "missing"}})


def drive(constraint, tokenizer, seed: int, steps: int, prefix: str = "", *,
          padded_logits: int = 0) -> tuple[list[int], bool]:
    """Random logits (seeded) under the constraint; returns the ids and whether it finished. `padded_logits`:
    rows past the vocabulary, as a padded LM head has (the constraint must mask them)."""
    generator = torch.Generator().manual_seed(seed)
    chosen = tokenizer.encode(prefix, add_bos=False, parse_special=True) if prefix else []
    for token in chosen:
        assert constraint.allowed(tokenizer.vocab_size)[token]
        constraint.accept(token)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops on 2 cores are far faster on one thread
    try:
        for _ in range(steps):
            logits = torch.randn(tokenizer.vocab_size + padded_logits, generator=generator)
            token = int(logits.masked_fill(~constraint.allowed(logits.shape[-1]), float("-inf")).argmax())
            constraint.accept(token)
            chosen.append(token)
            if constraint.finished or token in tokenizer.eot_ids:
                return chosen, True
    finally:
        torch.set_num_threads(threads)
    return chosen, False


# A tool schema with what real tool definitions use: bounds, enums, patterns, unions, references, nesting.
RICH_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "day": {"anyOf": [{"type": "string", "pattern": "^[0-9]{2}-[0-9]{2}$"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "minItems": 1, "maxItems": 2},
        "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                                   "exact": {"type": "boolean"}},
                  "required": ["lat"], "additionalProperties": False},
        "code": {"type": "string", "maxLength": 6},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
    "$defs": {"Tag": {"type": "string", "maxLength": 4}},
}  # fmt: skip
RICH_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": RICH_SCHEMA}},
              {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


def drive_auto(constraint, tokenizer, opening: list[int], seed: int, steps: int = 160) -> tuple[list[int], int]:
    """Random logits under an "auto" constraint: free text (masked by nothing while it is `dormant`), with the
    `opening` tag's tokens written every fifth free step so calls open; returns the ids and how many calls
    ended."""
    generator = torch.Generator().manual_seed(seed)
    chosen: list[int] = []
    ended, free_steps, forcing = 0, 0, []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            logits = torch.randn(tokenizer.vocab_size, generator=generator)
            allowed = constraint.allowed(tokenizer.vocab_size)
            if allowed is None:
                assert constraint.dormant
                free_steps += 1
                logits[list(tokenizer.eot_ids)] = float("-inf")
                if not forcing and free_steps % 5 == 0:
                    forcing = list(opening)
                if forcing:
                    logits[forcing.pop(0)] = float("inf")
            else:
                forcing = []
                logits = logits.masked_fill(~allowed, float("-inf"))
            token = int(logits.argmax())
            was_dormant = constraint.dormant
            constraint.accept(token)
            ended += not was_dormant and constraint.dormant
            chosen.append(token)
            assert not constraint.finished  # text may always follow a call
    finally:
        torch.set_num_threads(threads)
    return chosen, ended
