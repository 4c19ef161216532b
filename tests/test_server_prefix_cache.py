"""The prefix cache through the real server (the default model with its drafter, real SDK clients): a
conversation's next turn reports the restored prompt tokens (OpenAI `prompt_tokens_details.cached_tokens`,
Responses `input_tokens_details.cached_tokens`, Anthropic `cache_read_input_tokens`), answers as it would
without the cache, and `/props` and `/metrics` show the cache's figures."""

import re

import httpx
import pytest

from conftest import loaded_service

SYSTEM = "You are a careful Python assistant. Answer with code."
FIRST = "Write a function that reverses a list."
SECOND = "Now make it reverse a string instead."


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-cache")


@pytest.fixture(scope="module")
def service(tmp_path_factory, kv_dir):
    yield from loaded_service(tmp_path_factory, ctx_size=1024, prefix_cache_min_tokens=1, kv_cache_dir=str(kv_dir))


def metric(url: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics").text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def _chat(oai, messages):
    return oai.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)


def test_the_next_turn_restores_the_conversation_so_far(oai, url, kv_dir):
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    first = _chat(oai, history)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached yet
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": SECOND}]
    second = _chat(oai, history)
    # Restored: the system prompt and the first user message (up to its end-of-turn token).
    restored = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < restored < first.usage.prompt_tokens
    assert second.usage.model_extra["timings"]["cache_n"] == restored
    again = _chat(oai, history)  # the same turn again: now the whole conversation up to the new message
    assert restored < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    assert again.choices[0].message.content == second.choices[0].message.content  # greedy: the cache changes nothing
    props = httpx.get(f"{url}/props").json()["prefix_cache"]
    assert props["enabled"] and props["hits"] >= 2 and props["held"] >= 2 and props["directory"].startswith(str(kv_dir))
    assert metric(url, "lucebox_prefix_cache_hits") >= 2
    assert metric(url, "lucebox_prompt_tokens_cached_total") >= restored + again.usage.prompt_tokens_details.cached_tokens
    assert metric(url, "lucebox_prefix_cache_disk_files") >= 1  # written in the background, under --kv-cache-dir


def test_anthropic_reports_cache_reads(claude):
    messages = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": "def f(x): return x[::-1]"},
                {"role": "user", "content": "And for a tuple?"}]
    cold = claude.messages.create(model="m", system=SYSTEM, messages=messages, max_tokens=6,
                                  extra_body={"temperature": 0})
    warm = claude.messages.create(model="m", system=SYSTEM, messages=messages, max_tokens=6,
                                  extra_body={"temperature": 0})
    assert warm.usage.cache_read_input_tokens > cold.usage.cache_read_input_tokens
    # The prompt is the same size: what was read from the cache is no longer counted as input.
    total = cold.usage.input_tokens + cold.usage.cache_read_input_tokens
    assert warm.usage.input_tokens + warm.usage.cache_read_input_tokens == total
    assert [b.text for b in warm.content] == [b.text for b in cold.content]


def test_responses_report_cached_tokens(oai):
    request = dict(model="m", instructions=SYSTEM, max_output_tokens=6, temperature=0,
                   input=[{"role": "user", "content": "Sort a list of numbers."},
                          {"role": "assistant", "content": "sorted(numbers)"},
                          {"role": "user", "content": "Descending, please."}])
    oai.responses.create(**request)
    warm = oai.responses.create(**request)
    assert 0 < warm.usage.input_tokens_details.cached_tokens < warm.usage.input_tokens
