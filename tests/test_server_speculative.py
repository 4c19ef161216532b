"""The server with a DFlash drafter: same output as without, accepted lengths in timings, /props, /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest

from lucebox_core.loading import default_model_path
from lucebox_core.plugins import registry
from lucebox_core.server.app import create_app
from lucebox_core.server.service import ModelService, ServeConfig
from lucebox_core.server.testing import ServerThread

ASK = [{"role": "user", "content": "Count to five."}]


@pytest.fixture(scope="module", params=["qwen35", "gemma4"])
def services(request, tmp_path_factory):
    """A plain and a drafted server of one family: qwen35's default model, or a tiny gemma4 (its sliding
    layers' rings wrap within the test's tokens) with a drafter written for it."""
    patch = pytest.MonkeyPatch()
    home = tmp_path_factory.mktemp("lucebox-home")
    patch.setenv("LUCEBOX_HOME", str(home))
    synthesizer = registry().named
    if request.param == "qwen35":
        target = default_model_path(announce=False)
    else:
        target = home / "gemma4-tiny.gguf"
        synthesizer("lucebox_synthesizers", "gemma4", "synth").write(target, size="tiny", type="f32", seed=3)
    draft = home / "draft.gguf"
    synthesizer("lucebox_synthesizers", f"{request.param}-dflash-draft", "synth").write(
        draft, size="tiny", type="f32", seed=1, target=target)
    plain = ModelService(ServeConfig(model=str(target), ctx_size=512))
    speculative = ModelService(ServeConfig(model=str(target), ctx_size=512, model_draft=str(draft),
                                           spec_type="ddtree", tree_budget=8))
    for service in (plain, speculative):
        service.load()
        assert service.status == "ok", service.error
    yield plain, speculative
    for service in (plain, speculative):
        service.close()
    patch.undo()


def test_drafted_output_equals_plain_greedy_and_reports_acceptance(services):
    plain, speculative = services
    texts = []
    for service in (plain, speculative):
        with ServerThread(create_app(service.config, service)) as url:
            response = httpx.post(f"{url}/v1/chat/completions", json={
                "model": "m", "messages": ASK, "max_tokens": 6, "temperature": 0}, timeout=300).json()
            texts.append(response["choices"][0]["message"]["content"])
            timings = response["usage"]["timings"]
            if service is speculative:
                assert timings["accepted_lengths"] and all(n >= 1 for n in timings["accepted_lengths"])
                props = httpx.get(f"{url}/props").json()
                assert props["speculative"]["enabled"] and props["speculative_mode"] == "dflash"
                assert props["speculative"]["spec_type"] == "ddtree" and props["model"]["draft_path"]
                metrics = httpx.get(f"{url}/metrics").text
                count = next(line for line in metrics.splitlines()
                             if line.startswith("lucebox_speculative_accepted_length_count"))
                assert float(count.split()[-1]) >= 1
            else:
                assert "accepted_lengths" not in timings
    assert texts[0] == texts[1]


def test_streaming_with_a_drafter(services):
    _, speculative = services
    with ServerThread(create_app(speculative.config, speculative)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        stream = client.chat.completions.create(model="m", messages=ASK, max_tokens=5, temperature=0, stream=True)
        finish = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
        assert finish[-1] in ("length", "stop")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def test_tools_under_auto_keep_drafting_until_a_call_opens(services):
    """tool_choice "auto" holds each call to its schema, but masks nothing until the model opens one: the
    drafter keeps working (and greedy output is the plain server's), and a call, once opened, is decoded
    plainly under its grammar."""
    plain, speculative = services
    opening = plain.loaded.tokenizer.token_to_id("<tool_call>") or plain.loaded.tokenizer.token_to_id("<|tool_call>")
    for bias in (None, {str(opening): 100}):
        answers = []
        for service in (plain, speculative):
            with ServerThread(create_app(service.config, service)) as url:
                request = {"model": "m", "messages": ASK, "max_tokens": 24, "temperature": 0, "tools": [WEATHER],
                           "tool_choice": "auto", **({"logit_bias": bias} if bias else {})}
                answers.append(httpx.post(f"{url}/v1/chat/completions", json=request, timeout=300).json())
        first, second = ((m["content"], [(c["function"]["name"], c["function"]["arguments"])
                                         for c in m.get("tool_calls") or []])
                         for m in (a["choices"][0]["message"] for a in answers))
        assert first == second
        if bias is None:  # nothing opened a call: the steps after the first were drafted
            assert answers[1]["usage"]["timings"]["accepted_lengths"]
        else:
            assert first[1], "the biased opening tag starts a call"


def test_a_thinking_budget_with_a_drafter_closes_the_thought_as_without(services):
    """The budget masks nothing until it is spent: the drafter runs within the thought, and the thought closes
    after the same tokens as on the plain server."""
    plain, speculative = services
    if plain.loaded.gguf.architecture == "gemma4":
        pytest.skip("the Gemma-4 template does not open the thought for the model")
    answers = []
    for service in (plain, speculative):
        with ServerThread(create_app(service.config, service)) as url:
            answers.append(httpx.post(f"{url}/v1/messages", json={
                "model": "c", "max_tokens": 12, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 6},
                "messages": [{"role": "user", "content": "Think, then answer."}]}, timeout=300).json())
    assert [b["type"] for b in answers[0]["content"]] == ["thinking", "text"]
    assert answers[0]["content"] == answers[1]["content"]
    assert answers[1]["usage"]["timings"]["accepted_lengths"]
