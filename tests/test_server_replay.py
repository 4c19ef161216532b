"""Tool-call replay: a follow-up turn re-renders the model's own tool-call text, byte for byte."""

from __future__ import annotations

import json

import openai
import pytest

from lucebox_core.server.app import create_app
from lucebox_core.server.generation import Conversation, render_chat
from lucebox_core.server.replay import ToolCallReplay
from lucebox_core.server.service import ModelService, ServeConfig
from lucebox_core.server.testing import ServerThread

FORECAST = {"type": "function", "function": {
    "name": "forecast", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
# What a model might write: a zero-padded number and a trailing space the canonical rendering would not have.
RAW_CALL = "<tool_call>\n<function=forecast>\n<parameter=city>\nParis \n</parameter>\n<parameter=days>\n03\n</parameter>\n</function>\n</tool_call>"
ASKED = [{"role": "user", "content": "Weather in Paris for three days?"}]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("LUCEBOX_HOME", str(tmp_path_factory.mktemp("lucebox-home")))
    service = ModelService(ServeConfig(ctx_size=512))
    service.load()
    assert service.status == "ok", service.error
    yield service
    service.close()
    patch.undo()


def follow_up(call_id: str) -> list[dict]:
    return ASKED + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "forecast", "arguments": json.dumps({"city": "Paris ", "days": 3})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]


def test_follow_up_extends_the_first_prompt_with_the_raw_call(service):
    first = render_chat(service, Conversation(messages=ASKED, tools=[FORECAST]))
    service.tool_replay.remember(["call_replay1"], RAW_CALL)
    second = render_chat(service, Conversation(messages=follow_up("call_replay1"), tools=[FORECAST]))
    assert second.text.startswith(first.text + RAW_CALL + "<|im_end|>")
    assert second.ids[: len(first.ids)] == first.ids
    # Without the replay the canonical rendering differs (03 -> 3): the test above is not vacuous.
    unknown = render_chat(service, Conversation(messages=follow_up("call_unknown"), tools=[FORECAST]))
    assert not unknown.text.startswith(first.text + RAW_CALL)


def test_anthropic_ids_find_the_same_call(service):
    service.tool_replay.remember(["call_replay2"], RAW_CALL)
    second = render_chat(service, Conversation(messages=follow_up("toolu_replay2"), tools=[FORECAST]))
    assert RAW_CALL in second.text


def test_generated_calls_are_remembered_and_replayed(service):
    with ServerThread(create_app(service.config, service)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        result = client.chat.completions.create(
            model="m", messages=ASKED, tools=[FORECAST], max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "forecast"}})
        calls = result.choices[0].message.tool_calls
        assert calls, "the grammar forces a call"
        messages = ASKED + [result.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
        prompt = render_chat(service, Conversation(messages=messages, tools=[FORECAST]))
        first = render_chat(service, Conversation(messages=ASKED, tools=[FORECAST]))
        raw = next(text for key, text in service.tool_replay._entries.items() if calls[0].id.endswith(key[0]))
        assert prompt.text.startswith(first.text + raw.strip())


def test_replay_store_is_bounded():
    store = ToolCallReplay(max_entries=3, max_bytes=1000)
    for index in range(5):
        store.remember([f"call_{index}"], f"text {index}")
    assert len(store) == 3
    assert store.restore([{"role": "assistant", "tool_calls": [{"id": "call_0"}]}])[0].get("content") is None
    assert store.restore([{"role": "assistant", "tool_calls": [{"id": "call_4"}]}])[0]["content"] == "text 4"
    store.remember(["call_big"], "x" * 900)
    store.remember(["call_big2"], "y" * 900)
    assert store.nbytes <= 1000
