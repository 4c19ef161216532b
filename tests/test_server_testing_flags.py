"""The server's testing aids and its request log, through the real server and the real SDKs:
`--log-requests` (one JSON line per request, its shape without its text), `--force-tool-call NAME[=JSON]`
(a forced call with pinned arguments, then tools off once the result comes back), `--short-answers`
(answers that end with `stop`), and `-n` capping what a client asks for before the context check."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import loaded_service
from lucebox_core.server.request_log import read_request_log, request_shape
from test_cli import assert_one_line_error, lucebox

READ_TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
    "required": ["path"]}}}
OTHER_TOOL = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
PINNED = {"path": "docs/NOTES.md", "lines": 3}


@pytest.fixture(scope="module")
def log_file(tmp_path_factory):
    return tmp_path_factory.mktemp("request-log") / "requests.jsonl"


@pytest.fixture(scope="module")
def service(tmp_path_factory, log_file):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield from loaded_service(tmp_path_factory, ctx_size=1024, parallel=1, n_predict=48, short_answers=40,
                                  request_log=str(log_file),
                                  force_tool_calls=(f"read_file={json.dumps(PINNED)}",))
    finally:
        torch.set_num_threads(threads)


def test_forced_call_has_the_pinned_arguments_then_the_result_gets_a_text_answer(oai, log_file):
    ask = [{"role": "user", "content": "What do the notes say?"}]
    first = oai.chat.completions.create(model="m", messages=ask, tools=[OTHER_TOOL, READ_TOOL], max_tokens=4000)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == PINNED
    assert first.choices[0].finish_reason == "tool_calls"

    follow = ask + [first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "The notes say hello."}]
    stream = oai.chat.completions.create(model="m", messages=follow, tools=[OTHER_TOOL, READ_TOOL], stream=True,
                                         max_tokens=4000)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert 1 <= len(text) <= 40 and chunks[-1].choices[0].finish_reason == "stop"  # --short-answers

    posts = [e for e in read_request_log(log_file) if e["method"] == "POST"][-2:]
    assert [e["request"]["messages"] for e in posts] == [["user"], ["user", "assistant:tool_calls*1", "tool"]]
    assert posts[0]["request"]["tools"] == ["search", "read_file"] and posts[1]["request"]["stream"] is True
    assert all(e["status"] == 200 and e["path"] == "/v1/chat/completions" for e in posts)
    assert "notes say" not in log_file.read_text()  # shapes, never the text


def test_anthropic_forced_call_and_other_tools_untouched(claude, oai, log_file):
    tool = {"name": "read_file", "input_schema": READ_TOOL["function"]["parameters"]}
    message = claude.messages.create(model="m", max_tokens=32000, tools=[tool],
                                     messages=[{"role": "user", "content": "Read the notes."}])
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and uses[0].input == PINNED and message.stop_reason == "tool_use"
    # A request that does not offer the forced tool is left alone (its answer is short text).
    other = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tools=[OTHER_TOOL])
    assert other.choices[0].finish_reason == "stop" and not other.choices[0].message.tool_calls
    entry = read_request_log(log_file)[-2]
    assert entry["path"] == "/v1/messages" and entry["request"]["max_tokens"] == 32000
    assert entry["client"]["user-agent"].startswith("Anthropic/Python")


def test_a_malformed_body_is_logged_as_such(url, log_file):
    import httpx

    response = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    entry = read_request_log(log_file)[-1]
    assert entry["status"] == 400 and entry["request"] == {"body": "not JSON (9 bytes)"}


def test_request_shape_of_responses_and_anthropic_bodies():
    responses = {"model": "m", "stream": True, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "x"}]},
        {"type": "function_call", "name": "shell", "arguments": "{}", "call_id": "c"},
        {"type": "function_call_output", "call_id": "c", "output": "secret"}],
        "tools": [{"type": "function", "name": "shell"}, {"type": "web_search"}], "instructions": "be brief"}
    shape = request_shape(responses)
    assert shape["messages"] == ["user:input_text", "function_call", "function_call_output"]
    assert shape["tools"] == ["shell", "web_search"] and shape["system"] is True
    assert "secret" not in json.dumps(shape) and "be brief" not in json.dumps(shape)


@pytest.mark.parametrize("value, needle", [
    ("=", "give a tool name"), ('read={"path": ', "not JSON"), ("read=[1]", "must be a JSON object")])
def test_bad_force_tool_call_values_are_one_line_errors(value, needle):
    assert_one_line_error(lucebox("serve", "--port", "0", "--force-tool-call", value), "--force-tool-call", needle)


def test_bad_short_answers_is_a_one_line_error():
    assert_one_line_error(lucebox("serve", "--port", "0", "--short-answers", "0"), "--short-answers")
