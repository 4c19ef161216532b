"""The HTTP server on tiny models of each family, driven by the real `openai` and `anthropic` SDKs and raw HTTP.

One model and one server (uvicorn on a thread, loopback, a free port) per family: the tiny default model
(qwen35) and a tiny synthetic Gemma-4; every request asks for a few tokens only, because the models have
random weights and this runs on a CPU.
"""

from __future__ import annotations

import asyncio
import json
import re

import anthropic
import attrs
import httpx
import jsonschema
import openai
import pytest

from lucebox_core.server import create_app
from lucebox_core.server.testing import ServerThread
from conftest import SERVED_FAMILIES, loaded_service, tiny_family_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"celsius": {"type": "boolean"}}, "required": ["celsius"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The current time", "parameters": {"type": "object", "properties": {}}}}
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module", params=SERVED_FAMILIES)
def service(request, tmp_path_factory):
    model = tiny_family_model(request.param, tmp_path_factory)
    yield from loaded_service(tmp_path_factory, model=model, ctx_size=512, parallel=2)


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# ----------------------------------------------------------------------------------- chat completions


def test_chat_stream_matches_non_stream(oai, service):
    settings = dict(model="gpt-4o", messages=HELLO, max_tokens=3, temperature=0)
    whole = oai.chat.completions.create(**settings)
    assert whole.model == service.model_name  # any model id is accepted; the served one is reported
    assert whole.object == "chat.completion"
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.message.role == "assistant"
    assert 1 <= whole.usage.completion_tokens <= 3 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(oai.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({chunk.id for chunk in chunks}) == 1 and len({chunk.created for chunk in chunks}) == 1
    *with_choices, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert all(chunk.usage is None for chunk in with_choices)
    assert [c.choices[0].finish_reason for c in with_choices][-1] == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert with_choices[-1].choices[0].delta.content is None
    streamed = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert streamed == choice.message.content  # greedy: the same tokens either way


def test_chat_logprobs_and_seeded_sampling(oai):
    result = oai.chat.completions.create(model="m", messages=HELLO, max_completion_tokens=2, logprobs=True,
                                         top_logprobs=3, temperature=0)
    entries = result.choices[0].logprobs.content
    assert len(entries) == result.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the best
        assert entry.logprob <= 0
    seeded = dict(model="m", messages=HELLO, max_tokens=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    first = oai.chat.completions.create(**{k: v for k, v in seeded.items() if k not in ("top_k", "min_p")},
                                        extra_body={"top_k": 0, "min_p": 0.0})
    second = oai.chat.completions.create(**{k: v for k, v in seeded.items() if k not in ("top_k", "min_p")},
                                         extra_body={"top_k": 0, "min_p": 0.0})
    assert first.choices[0].message.content == second.choices[0].message.content


def test_completions_text_and_token_ids_agree(oai, url):
    ids = httpx.post(f"{url}/tokenize", json={"content": "Once upon a time"}).json()["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["content"] == "Once upon a time"
    # A text prompt gets the model's BOS (Gemma-4 has one, Qwen3.5 not): ids sent as ids are taken as given.
    ids = httpx.post(f"{url}/tokenize", json={"content": "Once upon a time", "add_special": True}).json()["tokens"]
    by_text = oai.completions.create(model="x", prompt="Once upon a time", max_tokens=3, temperature=0)
    by_ids = oai.completions.create(model="x", prompt=ids, max_tokens=3, temperature=0)
    assert by_text.object == "text_completion"
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
    streamed = list(oai.completions.create(model="x", prompt=[ids], max_tokens=3, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == by_ids.choices[0].text
    assert streamed[-1].choices[0].finish_reason == by_ids.choices[0].finish_reason


def test_ignore_eos_runs_past_the_end_of_text(oai, service):
    # llama.cpp's `ignore_eos`: a bias makes the end-of-generation token the greedy pick at every step.
    eos = min(service.loaded.tokenizer.eot_ids)
    bias = {str(eos): 100}
    ended = oai.completions.create(model="x", prompt="Once upon a time", max_tokens=4, temperature=0, logit_bias=bias)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    kept_on = oai.completions.create(model="x", prompt="Once upon a time", max_tokens=4, temperature=0,
                                     logit_bias=bias, extra_body={"ignore_eos": True})
    assert kept_on.choices[0].finish_reason == "length" and kept_on.usage.completion_tokens == 4
    chat = oai.chat.completions.create(model="x", messages=HELLO, max_tokens=3, temperature=0, logit_bias=bias,
                                       extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3


def test_forced_tool_call(oai):
    result = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What time is it?"}], tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=40, temperature=0)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_time" and call.id
    assert json.loads(call.function.arguments) == {}
    assert "<tool_call>" not in (choice.message.content or "")


def test_named_tool_call_streams_argument_fragments(oai):
    stream = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0,
        stream=True)
    names, arguments, content, finish = {}, {}, [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for piece in delta.tool_calls or []:
            if piece.function.name:
                names[piece.index] = piece.function.name
                assert piece.id and piece.type == "function"
            arguments[piece.index] = arguments.get(piece.index, "") + (piece.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert names and set(names.values()) == {"get_weather"}
    for text in arguments.values():
        value = json.loads(text)  # whole JSON once the fragments are joined, even if cut short
        assert isinstance(value, dict) and set(value) == {"celsius"} and isinstance(value["celsius"], bool)
    assert "<tool_call>" not in "".join(content) and "<function" not in "".join(content)
    assert finish in ("tool_calls", "length")


def test_required_tool_choice(oai):
    result = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice="required",
        max_tokens=30, temperature=0)
    calls = result.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_tool_results_go_back_through_the_template(oai):
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    result = oai.chat.completions.create(model="m", messages=messages, tools=[CLOCK], max_tokens=2)
    assert result.usage.prompt_tokens > 20 and result.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_json_schema_output_validates(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    result = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    assert result.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(result.choices[0].message.content), schema)


def test_models_props_and_reasoning_fields(oai, url, service):
    models = oai.models.list().data
    assert [m.id for m in models] == [service.model_name]
    assert oai.models.retrieve("anything").id == service.model_name
    props = httpx.get(f"{url}/props").json()
    assert props["model"]["arch"] == service.loaded.gguf.architecture in SERVED_FAMILIES
    assert props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] == 2
    runtime = props["runtime"]
    assert runtime["kv_policy"] == "full" and runtime["cache_type_k"] == runtime["cache_type_v"] == "f32"
    assert runtime["op_kernels"] == []  # the torch reference backend runs no kernels of its own
    # Reasoning given back under either name is accepted (and rendered into the prompt the same way).
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"}]
    counts = []
    for key in ("reasoning_content", "reasoning"):
        messages = [dict(m) for m in base]
        messages[1][key] = "thinking it over"
        counts.append(oai.chat.completions.create(model="m", messages=messages, max_tokens=1).usage.prompt_tokens)
    assert counts[0] == counts[1]


# ------------------------------------------------------------------------------------------- responses


def test_responses_stream_then_previous_response_id(oai):
    events = list(oai.responses.create(
        model="gpt-5-codex", input="Hello there", instructions="Be brief.", max_output_tokens=2, stream=True,
        store=False, include=["reasoning.encrypted_content"], parallel_tool_calls=True, service_tier="auto",
        prompt_cache_key="abc", reasoning={"effort": "none"}))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert final.usage.output_tokens <= 2

    follow = oai.responses.create(model="gpt-5-codex", input="And again?", previous_response_id=final.id,
                                  max_output_tokens=1)
    assert follow.previous_response_id == final.id
    assert follow.usage.input_tokens > final.usage.input_tokens  # the earlier turn is in the prompt
    with pytest.raises(openai.BadRequestError) as error:
        oai.responses.create(model="m", input="x", previous_response_id="resp_unknown", max_output_tokens=1)
    assert error.value.body["param"] == "previous_response_id"


def test_responses_merge_instructions_and_developer_messages(oai):
    # Codex sends `instructions` and developer messages; Qwen's template takes one system message.
    result = oai.responses.create(model="m", instructions="You are terse.", max_output_tokens=1, input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
    assert result.status == "incomplete" and result.incomplete_details.reason == "max_output_tokens"


def test_responses_function_call_round_trip(oai):
    tool = {"type": "function", "name": "get_time", "description": "time", "parameters": {"type": "object", "properties": {}}}
    result = oai.responses.create(model="m", input="Time?", tools=[tool, {"type": "web_search"}],
                                  tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=40)
    calls = [item for item in result.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_time"] and json.loads(calls[0].arguments) == {}
    follow = oai.responses.create(model="m", previous_response_id=result.id, tools=[tool], max_output_tokens=1,
                                  input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "noon"}])
    assert follow.status in ("completed", "incomplete")


# -------------------------------------------------------------------------------------------- anthropic


def test_messages_stream_and_count_tokens(claude, service):
    request = dict(model="claude-test-model", max_tokens=3, system="Be brief.",
                   messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    with claude.messages.stream(**request, metadata={"user_id": "u"}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.model == service.model_name and final.role == "assistant"
    assert final.stop_reason in ("max_tokens", "end_turn") and final.usage.output_tokens <= 3
    assert "".join(block.text for block in final.content if block.type == "text") == text
    counted = claude.messages.count_tokens(model="claude-x", system="Be brief.", messages=request["messages"])
    assert counted.input_tokens == final.usage.input_tokens


def test_messages_forced_tool_use(claude):
    tool = {"name": "get_time", "description": "time", "input_schema": {"type": "object", "properties": {}}}
    message = claude.messages.create(model="claude-x", max_tokens=40, tools=[tool],
                                     tool_choice={"type": "tool", "name": "get_time"},
                                     messages=[{"role": "user", "content": "Time?"}])
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_time" and use.input == {} and use.id.startswith("toolu_")
    follow = claude.messages.create(model="claude-x", max_tokens=1, tools=[tool], messages=[
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": "get_time", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "noon"}]},
    ])
    # The whole prompt: what was processed plus what the prefix cache restored.
    assert (follow.usage.input_tokens + follow.usage.cache_read_input_tokens
            > message.usage.input_tokens + message.usage.cache_read_input_tokens)


# --------------------------------------------------------------------------------- bad requests (raw)


@pytest.mark.parametrize(
    "body, param, code",
    [
        (b'{"messages": [', None, "malformed_json"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', "max_tokens", None),
        (b'{"messages": "hi"}', "messages", None),
        (b'{"model": "m"}', "messages", None),
        (b'[1, 2]', None, None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}', "max_tokens", "context_length_exceeded"),
        (json.dumps({"messages": [{"role": "user", "content": "word " * 600}]}).encode(), "messages", "context_length_exceeded"),
        (b'{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0].role", None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 7}', "temperature", None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}', "n", None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": {"name": "nope"}}}', "tool_choice", None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}', "response_format", None),
    ],
)
def test_bad_chat_requests_get_openai_errors(url, body, param, code):
    response = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param and error["code"] == code


def test_bad_requests_on_other_endpoints(url):
    post = lambda path, body: httpx.post(f"{url}{path}", json=body)  # noqa: E731
    too_long = post("/v1/messages", {"model": "c", "max_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]})
    assert too_long.status_code == 400
    assert too_long.json()["type"] == "error" and too_long.json()["error"]["type"] == "invalid_request_error"
    missing = post("/v1/messages", {"model": "c", "messages": []})
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    assert post("/v1/completions", {"prompt": [[1], [2]]}).status_code == 400
    assert post("/v1/completions", {"prompt": [10**9]}).json()["error"]["param"] == "prompt"
    assert post("/v1/responses", {"input": [{"type": "message", "role": "wizard", "content": "x"}]}).status_code == 400
    assert post("/detokenize", {"tokens": [-1]}).status_code == 400
    missing_route = httpx.get(f"{url}/v2/nothing")
    assert missing_route.status_code == 404 and "error" in missing_route.json()
    wrong_method = httpx.get(f"{url}/v1/chat/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


# ----------------------------------------------------------------------------------- serving behaviour


def test_sixteen_concurrent_streams_all_complete(url):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=240)

    async def one(index: int) -> tuple[str | None, int]:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Count to {index}"}], max_tokens=2, stream=True,
            stream_options={"include_usage": True})
        finish, tokens = None, 0
        async for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            elif chunk.usage:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    assert len(results) == 16
    assert all(finish in ("length", "stop") and tokens >= 1 for finish, tokens in results)


def test_metrics_move(oai, url):
    before = httpx.get(f"{url}/metrics").text
    oai.chat.completions.create(model="m", messages=HELLO, max_tokens=2)
    after = httpx.get(f"{url}/metrics").text
    label = '{endpoint="/v1/chat/completions",status="200"}'
    assert metric(after, "lucebox_requests_total", label) == metric(before, "lucebox_requests_total", label) + 1
    assert metric(after, "lucebox_generated_tokens_total") > metric(before, "lucebox_generated_tokens_total")
    assert metric(after, "lucebox_prompt_tokens_total") > metric(before, "lucebox_prompt_tokens_total")
    assert metric(after, "lucebox_time_to_first_token_seconds_count") == metric(before, "lucebox_time_to_first_token_seconds_count") + 1
    assert "# TYPE lucebox_queue_depth gauge" in after and "lucebox_decode_tokens_per_second_bucket" in after


def test_api_key_is_enforced(service):
    config = attrs.evolve(service.config, api_key="sekret")
    with ServerThread(create_app(config, service)) as base:
        assert httpx.get(f"{base}/health").status_code == 200  # probes need no key
        denied = httpx.get(f"{base}/v1/models")
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        wrong = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        anthropic_denied = httpx.post(f"{base}/v1/messages/count_tokens", json={"messages": []})
        assert anthropic_denied.status_code == 401 and anthropic_denied.json()["type"] == "error"
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{base}/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0)
        assert good.models.list().data
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="bad", max_retries=0).models.list()
        counted = anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0).messages.count_tokens(
            model="c", messages=[{"role": "user", "content": "hi"}])
        assert counted.input_tokens > 0


# ------------------------------------------------------------------------------------------- reasoning


def _opens_the_thought(service) -> None:
    # Qwen3.5's template leaves the model inside `<think>` when thinking is on; Gemma-4's does not (the model
    # opens its thought channel itself, which a random-weight one never does): tested in test_gemma4.py.
    if service.loaded.gguf.architecture == "gemma4":
        pytest.skip("the Gemma-4 template does not open the thought for the model")


def test_reasoning_goes_out_under_both_names(oai, service):
    _opens_the_thought(service)
    request = dict(model="m", messages=HELLO, max_tokens=3, temperature=0,
                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    whole = oai.chat.completions.create(**request).choices[0].message
    assert whole.content == "" and whole.reasoning_content and whole.reasoning == whole.reasoning_content
    deltas = [c.choices[0].delta for c in oai.chat.completions.create(**request, stream=True) if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == whole.reasoning_content
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == streamed


def test_thinking_budget_closes_the_thought(claude, service):
    _opens_the_thought(service)
    message = claude.messages.create(model="claude-x", max_tokens=8, thinking={"type": "enabled", "budget_tokens": 3},
                                     extra_body={"temperature": 0},  # greedy: a random seed made it flaky
                                     messages=[{"role": "user", "content": "Think, then answer."}])
    kinds = [block.type for block in message.content]
    assert kinds[0] == "thinking" and message.content[0].thinking
    assert "</think>" not in message.content[0].thinking
    # 3 thinking tokens, the forced `</think>`, then 4 tokens of answer.
    assert kinds == ["thinking", "text"] and message.content[1].text
    assert message.usage.output_tokens == 8 and message.stop_reason == "max_tokens"


def test_out_of_range_sampling_values_are_client_errors(url):
    body = {"messages": HELLO, "max_tokens": 1}
    for extra, param in (({"seed": 2**64}, "seed"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                         ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {str(10**9): 1}}, "logit_bias")):
        response = httpx.post(f"{url}/v1/chat/completions", json={**body, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"].startswith(param), response.text
