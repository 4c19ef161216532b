"""Tool calls held to their tools' JSON schemas, through the real server on tiny models of both families.

Random weights write noise, so each case samples several seeds at temperature 1 and checks that every call
the server returns validates with `jsonschema` against its tool's schema; the only exception is a call that
`max_tokens` cut off, and then the finish reason says so. Under tool_choice "auto" a random model would
hardly ever open a call, so OpenAI's `logit_bias` makes the opening tag likely: the text stays free, the call
is held to the schema. The last tests watch the decode loop: a constrained request computes the mask of the
next step while the model runs this one (see `lucebox_core.mask_ahead`).
"""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest
import torch

from lucebox_core.constraints import GrammarConstraint
from conftest import SERVED_FAMILIES, loaded_service, tiny_family_model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 16},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "day": {"anyOf": [{"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "minItems": 1, "maxItems": 2},
        "where": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                   "exact": {"type": "boolean"}},
                  "required": ["lat"], "additionalProperties": False},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
    "$defs": {"Tag": {"type": "string", "maxLength": 6}},
}  # fmt: skip
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["query", "limit"], "additionalProperties": False}  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = (1, 2, 3)
MAX_TOKENS = 192  # the trained default model writes long numbers and strings within the bounds

@pytest.fixture(scope="module", params=SERVED_FAMILIES)
def service(request, tmp_path_factory):
    model = tiny_family_model(request.param, tmp_path_factory)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's small ops run far faster on one thread of this 2-core machine
    try:
        yield from loaded_service(tmp_path_factory, model=model, ctx_size=1024, parallel=1)
    finally:
        torch.set_num_threads(threads)


def assert_calls_validate(calls: list[tuple[str, str]], cut: bool) -> int:
    """Every call validates against its tool's schema, but the last when `max_tokens` cut the output; how many
    were checked."""
    checked = 0
    for index, (name, arguments) in enumerate(calls):
        if cut and index == len(calls) - 1:
            continue  # the call max_tokens cut off: no promise (the finish reason says so)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        checked += 1
    return checked


def run_seeds(ask, seeds=SEEDS, *, forced: bool = True) -> None:
    """`ask(seed)` -> (calls, cut) for each seed: every call validates, a forced choice always gives one, and
    most seeds give a whole one."""
    whole = 0
    for seed in seeds:
        calls, cut = ask(seed)
        assert calls or not forced, f"seed {seed}: no tool call"
        whole += assert_calls_validate(calls, cut) > 0
    assert whole >= 2, "most seeds should finish a call within max_tokens"


def chat(oai, seed: int, **request) -> tuple[list[tuple[str, str]], bool]:
    result = oai.chat.completions.create(model="m", messages=ASK, tools=OPENAI_TOOLS, max_tokens=MAX_TOKENS,
                                        temperature=1.0, seed=seed, **request)
    choice = result.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert choice.finish_reason in (("tool_calls", "length") if calls else ("stop", "length"))
    return calls, choice.finish_reason == "length"


# ----------------------------------------------------------------------------------- chat completions


@pytest.mark.slow
def test_named_tool_choice_gives_arguments_that_validate(oai):
    named = {"type": "function", "function": {"name": "get_weather"}}
    run_seeds(lambda seed: chat(oai, seed, tool_choice=named))


@pytest.mark.slow
def test_named_tool_choice_streams_fragments_that_join_into_valid_arguments(oai):
    def ask(seed: int):
        stream = oai.chat.completions.create(
            model="m", messages=ASK, tools=OPENAI_TOOLS, tool_choice={"type": "function", "function": {"name": "search"}},
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, stream=True)
        names, arguments, finish = {}, {}, None
        for chunk in stream:
            for piece in chunk.choices[0].delta.tool_calls or []:
                if piece.function.name:
                    names[piece.index] = piece.function.name
                arguments[piece.index] = arguments.get(piece.index, "") + (piece.function.arguments or "")
            finish = chunk.choices[0].finish_reason or finish
        assert set(names.values()) == {"search"} and finish in ("tool_calls", "length")
        return [(names[i], arguments[i]) for i in sorted(names)], finish == "length"

    run_seeds(ask)


@pytest.mark.slow
def test_required_tool_choice_gives_arguments_that_validate(oai):
    run_seeds(lambda seed: chat(oai, seed, tool_choice="required"))


@pytest.mark.slow
def test_auto_tool_choice_holds_each_call_the_model_opens_to_its_schema(oai, service):
    tokenizer = service.loaded.tokenizer
    opening = tokenizer.token_to_id("<tool_call>") or tokenizer.token_to_id("<|tool_call>")
    # The opening tag is the likeliest token wherever the text is free, the end of the turn next (by a margin
    # wider than a trained model's logits: the default model is one).
    bias = {str(opening): 100, **{str(t): 60 for t in tokenizer.eot_ids}}
    run_seeds(lambda seed: chat(oai, seed, tool_choice="auto", logit_bias=bias), forced=False)


def test_a_call_cut_by_max_tokens_says_length(oai, claude):
    named = {"type": "function", "function": {"name": "get_weather"}}
    result = oai.chat.completions.create(model="m", messages=ASK, tools=OPENAI_TOOLS, tool_choice=named,
                                         max_tokens=3, temperature=1.0, seed=1)
    assert result.choices[0].finish_reason == "length"
    message = claude.messages.create(model="c", max_tokens=3, messages=ASK, tools=ANTHROPIC_TOOLS,
                                     tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "max_tokens"


# ------------------------------------------------------------------------------------------- responses


RESPONSES_TOOLS = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_responses_function_calls_validate(oai, tool_choice):
    def ask(seed: int):
        result = oai.responses.create(model="m", input="Weather in Paris?", tools=RESPONSES_TOOLS,
                                      tool_choice=tool_choice, max_output_tokens=MAX_TOKENS, temperature=1.0,
                                      extra_body={"seed": seed})
        calls = [(item.name, item.arguments) for item in result.output if item.type == "function_call"]
        return calls, result.status == "incomplete"

    run_seeds(ask)


# -------------------------------------------------------------------------------------------- anthropic


ANTHROPIC_TOOLS = [{"name": n, "description": n, "input_schema": s} for n, s in SCHEMAS.items()]


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_anthropic_tool_use_inputs_validate(claude, tool_choice):
    def ask(seed: int):  # Anthropic's API has no seed: each run samples afresh
        message = claude.messages.create(model="c", max_tokens=MAX_TOKENS, messages=ASK, tools=ANTHROPIC_TOOLS,
                                         tool_choice=tool_choice, extra_body={"temperature": 1.0})
        uses = [(block.name, json.dumps(block.input)) for block in message.content if block.type == "tool_use"]
        return uses, message.stop_reason == "max_tokens"

    run_seeds(ask)


# ------------------------------------------------------------------------------------ what is refused


def test_a_keyword_no_grammar_enforces_is_refused_by_name_for_a_forced_call(url):
    schema = {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"},
                                                       "uniqueItems": True}}}
    body = {"messages": ASK, "max_tokens": 4, "tools": [{"type": "function", "function": {"name": "pick",
                                                                                          "parameters": schema}}]}
    forced = httpx.post(f"{url}/v1/chat/completions", json={**body, "tool_choice": "required"}, timeout=60)
    assert forced.status_code == 400, forced.text
    error = forced.json()["error"]
    assert "'pick'" in error["message"] and "uniqueItems" in error["message"] and error["param"] == "tool_choice"
    # Under "auto" it is ignored (documented), the rest of the schema still holds.
    assert httpx.post(f"{url}/v1/chat/completions", json={**body, "tool_choice": "auto"}, timeout=60).status_code == 200
    malformed = {**body, "tools": [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integr"}}}}}]}
    for choice in ("auto", "required"):
        response = httpx.post(f"{url}/v1/chat/completions", json={**malformed, "tool_choice": choice}, timeout=60)
        assert response.status_code == 400 and "integr" in response.json()["error"]["message"], response.text
    anthropic_body = {"model": "c", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"},
                      "tools": [{"name": "pick", "input_schema": schema}]}
    refused = httpx.post(f"{url}/v1/messages", json=anthropic_body, timeout=60)
    assert refused.status_code == 400 and "uniqueItems" in refused.json()["error"]["message"]


# ------------------------------------------------------------------------------- the mask, ahead of time


def test_the_next_mask_is_computed_while_the_model_runs_the_step(oai, service, monkeypatch):
    """The decode loop's timeline, not a clock: the model's step that feeds generated token k waits (up to a few
    seconds) for a mask computation that has seen token k, the mask of the step after. Computed ahead, it
    begins at once on a worker thread; computed after the step (the old loop), it cannot begin until the step
    returns, and the wait runs out."""
    model = service.engine.model
    step, accept, allowed = model.forward, GrammarConstraint.accept, GrammarConstraint.allowed
    seen = {"accepted": 0, "mask_saw": -1, "steps": 0, "waited_out": 0, "mask_threads": set(), "step_threads": set(),
            "prefilled": False}
    progress = threading.Condition()

    def counting_accept(self, token_id):
        accept(self, token_id)
        with progress:
            seen["accepted"] += 1

    def recording_allowed(self, vocab_size):
        with progress:
            seen["mask_threads"].add(threading.get_ident())
            seen["mask_saw"] = max(seen["mask_saw"], seen["accepted"])
            progress.notify_all()
        return allowed(self, vocab_size)

    engine_prefill = service.engine.prefill

    def marking_prefill(*args, **kwargs):
        # A prefill may run a one-token piece (it is cut at turn boundaries): only what follows it is decoding.
        seen["prefilled"] = False
        engine_prefill(*args, **kwargs)
        seen["prefilled"] = True

    def waiting_step(state, token_ids, **kwargs):
        if len(token_ids) == 1 and seen["prefilled"]:  # a decode step, feeding generated token k
            seen["steps"] += 1
            seen["step_threads"].add(threading.get_ident())
            k = seen["steps"]
            with progress:
                if not seen["waited_out"] and not progress.wait_for(lambda: seen["mask_saw"] >= k, timeout=5):
                    seen["waited_out"] += 1  # once is proof enough: the rest of the answer goes at full speed
        return step(state, token_ids, **kwargs)

    monkeypatch.setattr(GrammarConstraint, "accept", counting_accept)
    monkeypatch.setattr(GrammarConstraint, "allowed", recording_allowed)
    monkeypatch.setattr(model, "forward", waiting_step)
    monkeypatch.setattr(service.engine, "prefill", marking_prefill)
    result = oai.chat.completions.create(model="m", messages=ASK, tools=OPENAI_TOOLS[1:], tool_choice="required",
                                         max_tokens=24, temperature=1.0, seed=5)
    assert result.choices[0].message.tool_calls
    assert seen["steps"] >= 3
    assert seen["waited_out"] == 0, "a decode step ran before the mask of the step after it began"
    assert not seen["mask_threads"] & seen["step_threads"], "masks are computed on the decode thread"
