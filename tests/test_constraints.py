"""Constrained decoding (llguidance) with the real qwen35 fixture vocabulary and random logits."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from lucebox_core.constraints import (
    ConstraintError,
    grammar_tokenizer,
    json_object_constraint,
    json_schema_constraint,
    lark_constraint,
    response_format_constraint,
)
from lucebox_core.tokenizer import Tokenizer

VOCAB = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "vocab" / "ggml-vocab-qwen35.gguf"
PADDED_VOCAB = 151_936 + 64  # an output layer larger than the vocabulary, as real checkpoints have


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(VOCAB)


@pytest.fixture
def one_thread():
    """Small torch ops on this 2-core machine are many times faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def drive(constraint, tokenizer, seed: int, steps: int, bias: torch.Tensor | None = None) -> tuple[list[int], bool]:
    """Pick the best allowed token under seeded random logits until the constraint finishes."""
    generator = torch.Generator().manual_seed(seed)
    chosen: list[int] = []
    for _ in range(steps):
        logits = torch.randn(PADDED_VOCAB, generator=generator)
        if bias is not None:
            logits += bias
        allowed = constraint.allowed(PADDED_VOCAB)
        assert allowed.dtype == torch.bool and allowed.shape == (PADDED_VOCAB,)
        assert not allowed[tokenizer.vocab_size :].any(), "ids past the vocabulary must be masked"
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        constraint.accept(token)
        chosen.append(token)
        if constraint.finished or token in tokenizer.eot_ids:
            return chosen, True
    return chosen, False


def test_token_table_is_cached_and_quick(tokenizer):
    start = time.perf_counter()
    first = grammar_tokenizer(tokenizer)
    built = time.perf_counter() - start
    assert built < 5.0  # well under a few seconds for 152k tokens (about one here)
    start = time.perf_counter()
    assert grammar_tokenizer(tokenizer) is first
    assert time.perf_counter() - start < 0.01
    assert first.vocab_size == tokenizer.vocab_size
    assert sorted(first.eos_tokens) == sorted(tokenizer.eot_ids)
    hello = tokenizer.encode(" hello", add_bos=False)
    assert first.decode_bytes(hello) == b" hello"  # byte-level pieces ("Ġhello") as raw bytes
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert first.is_special_token(im_end)


SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                       "city": {"type": "string", "maxLength": 8}},
                    "required": ["zip", "city"], "additionalProperties": False}},
     "required": ["name", "age", "tags", "address"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                "ok": {"type": "boolean"}},
                                "required": ["id", "ok"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
    {"enum": ["alpha", "beta", 3, None]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1},
                                      "label": {"type": "string", "enum": ["pos", "neg"]},
                                      "note": {"type": ["string", "null"], "maxLength": 5}},
     "required": ["score", "label"], "additionalProperties": False},
]  # fmt: skip


@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
def test_json_schema_outputs_validate(tokenizer, one_thread, schema_index):
    schema = SCHEMAS[schema_index]
    finished = 0
    for seed in range(5):
        constraint = json_schema_constraint(tokenizer, schema)
        chosen, done = drive(constraint, tokenizer, seed, 200)
        text = tokenizer.decode([t for t in chosen if t not in tokenizer.eot_ids])
        if done:
            finished += 1
            jsonschema.validate(json.loads(text), schema)
    assert finished >= 3, "random logits under these bounded schemas should mostly finish in 200 tokens"


def test_json_object_outputs_are_objects(tokenizer, one_thread):
    # A model favours short structural tokens; without that nudge random text fills strings for ever.
    bias = torch.zeros(PADDED_VOCAB)
    for piece in ['"', "}", ",", ":", '":', '",', '"}', "1", "true", "{"]:
        bias[tokenizer.encode(piece, add_bos=False)] = 4.0
    finished = 0
    for seed in range(6):
        constraint = json_object_constraint(tokenizer)
        chosen, done = drive(constraint, tokenizer, seed, 300, bias)
        if done:
            finished += 1
            value = json.loads(tokenizer.decode([t for t in chosen if t not in tokenizer.eot_ids]))
            assert isinstance(value, dict)
    assert finished >= 3


def test_padding_placeholders_are_never_allowed(tokenizer):
    pads = [i for i in range(tokenizer.vocab_size) if tokenizer.id_to_token(i).startswith("[PAD")]
    assert len(pads) > 100
    constraint = lark_constraint(tokenizer, "start: /(?s:.*)/")  # anything at all...
    allowed = constraint.allowed(PADDED_VOCAB)
    assert allowed[tokenizer.encode("hello", add_bos=False)].all()
    assert not allowed[pads].any()  # ...but never a placeholder


def test_completion_ends_on_end_of_generation_when_more_could_follow(tokenizer):
    constraint = json_schema_constraint(tokenizer, {"type": "integer"})
    for token in tokenizer.encode("42", add_bos=False):
        constraint.accept(token)
    allowed = constraint.allowed(tokenizer.vocab_size)
    assert not constraint.finished and constraint.complete
    assert all(allowed[t] for t in tokenizer.eot_ids)  # may stop here...
    assert allowed[tokenizer.encode("7", add_bos=False)[0]]  # ...or go on
    closed = json_object_constraint(tokenizer)
    for token in tokenizer.encode("{}", add_bos=False):
        closed.accept(token)
    assert closed.finished


def test_disallowed_token_and_bad_schemas_raise(tokenizer):
    constraint = json_object_constraint(tokenizer)
    with pytest.raises(ConstraintError, match="not allowed"):
        constraint.accept(tokenizer.encode("hello", add_bos=False)[0])
    with pytest.raises(ConstraintError):
        json_schema_constraint(tokenizer, {"type": "no-such-type"})
    with pytest.raises(ConstraintError):
        lark_constraint(tokenizer, "start: undefined_rule")


def test_response_format_shapes(tokenizer):
    assert response_format_constraint(tokenizer, None) is None
    assert response_format_constraint(tokenizer, {"type": "text"}) is None
    schema = {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]}
    for response_format in (
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},  # Chat Completions
        {"type": "json_schema", "name": "x", "schema": schema},  # Responses API text.format
    ):
        constraint = response_format_constraint(tokenizer, response_format)
        for token in tokenizer.encode('{"a": 1}', add_bos=False):
            constraint.accept(token)
        assert constraint.finished
    with pytest.raises(ConstraintError, match="not supported"):
        response_format_constraint(tokenizer, {"type": "yaml"})


def test_after_reasoning_leaves_the_thinking_free(tokenizer):
    constraint = json_schema_constraint(tokenizer, {"enum": [True]}, after_reasoning=True)
    for token in tokenizer.encode("Any <b>text</b>, {not json}.\n</think>\n\ntrue", add_bos=False):
        assert constraint.allowed(tokenizer.vocab_size)[token]
        constraint.accept(token)
    assert constraint.complete


class RandomLM:
    """A model whose logits are seeded noise: enough to drive the engine's loop end to end."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size, self.context_length = vocab_size, 4096
        self.generator = torch.Generator().manual_seed(seed)

    def new_state(self, max_tokens: int) -> None:
        return None

    def forward(self, state, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.randn(len(token_ids), self.vocab_size, generator=self.generator)


def test_engine_stops_when_the_schema_is_complete(tokenizer, one_thread):
    from lucebox_core.engine import Engine, GenerationRequest

    schema = SCHEMAS[3]
    results = []
    for seed in range(3):
        engine = Engine(RandomLM(PADDED_VOCAB, seed), tokenizer)
        request = GenerationRequest(prompt_ids=tokenizer.encode("Rate it:", add_bos=False), max_tokens=200,
                                    constraint=json_schema_constraint(tokenizer, schema))  # fmt: skip
        results.append(engine.generate(request))
    done = [r for r in results if r.finish_reason == "stop"]
    assert len(done) >= 2
    for result in done:
        jsonschema.validate(json.loads(result.text.replace("<|im_end|>", "").replace("<|endoftext|>", "")), schema)
