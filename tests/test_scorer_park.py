"""PFlash's scorer parked (loaded for each compression, released before the target's prefill) against the scorer
kept resident, through the real server: the same compressed prompt and greedy answer, a load per compressed
request, nothing of the scorer alive after; `--prefill-skip-park` keeps it loaded. And the oversized question:
when the protected parts alone reach the threshold, `always` compresses the last user message too, `auto` leaves
the chat uncompressed and counts why."""

import re

import httpx
import pytest

from conftest import loaded_service
from lucebox_core.chat_prompt import render_chat
from lucebox_core.scorer_park import PARK_MARGIN_BYTES, decide_residency
from lucebox_core.server import create_app
from lucebox_core.server.generation import Conversation
from lucebox_core.server.generation import render_chat as render_request
from lucebox_core.server.testing import ServerThread
from test_server_prefill_compression import CHAT, LOG, TOOL_TEXT, TOOLS

THRESHOLD = 600  # target tokens: CHAT's protected parts are under it, CHAT as a whole and LOG alone over it
QUESTION = "Which worker processed batch 74?"
OVERSIZED = [{"role": "system", "content": "You answer questions about logs."},
             {"role": "user", "content": "Here is the log:\n" + LOG + "\n" + QUESTION}]
MIB = 2**20


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    from lucebox_qwen35 import synth

    return str(synth.write_qwen3(tmp_path_factory.mktemp("scorer") / "qwen3-scorer.gguf", size="tiny", type="f32",
                                 seed=2))


def _service(tmp_path_factory, scorer, **config):
    return loaded_service(tmp_path_factory, ctx_size=4096, prefill_drafter=scorer, prefill_keep_ratio=0.25,
                          prefill_threshold=THRESHOLD, prefix_cache_slots=0, **config)


@pytest.fixture(scope="module")
def parked(tmp_path_factory, scorer):
    """Parked (forced: on the CPU it would stay), under auto."""
    yield from _service(tmp_path_factory, scorer, prefill_compression="auto", prefill_force_park=True)


@pytest.fixture(scope="module")
def resident(tmp_path_factory, scorer):
    """--prefill-skip-park wins over the forced parking: resident, under always."""
    yield from _service(tmp_path_factory, scorer, prefill_compression="always", prefill_force_park=True,
                        prefill_skip_park=True)


def _ask(base, messages, **extra):
    answer = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": "m", "messages": messages, "max_tokens": 6, "temperature": 0, **extra}).json()
    return answer["choices"][0]["message"]["content"], answer["usage"]["prompt_tokens"]


def _tokens(service, messages):
    """The target's prompt tokens for the chat as it is (no compression)."""
    return len(render_chat(service.loaded.chat_template, service.loaded.tokenizer, messages, tools=TOOLS,
                           add_generation_prompt=True).encode(service.loaded.tokenizer))


def test_residency_follows_the_free_memory_on_a_gpu_and_stays_on_the_cpu():
    sizes = dict(weight_bytes=1200 * MIB, kv_bytes=3000 * MIB)
    needed = 1200 * MIB + 3000 * MIB + PARK_MARGIN_BYTES
    fits = decide_residency(device="cuda:0", free_bytes=needed, **sizes)
    assert not fits.parked and fits.reason.startswith("fits") and fits.needed_bytes == needed
    tight = decide_residency(device="cuda:0", free_bytes=needed - 1, **sizes)
    assert tight.parked and "does not fit" in tight.reason
    assert tight.describe()["residency"] == "parked" and tight.describe()["free_bytes"] == needed - 1
    kept = decide_residency(device="cuda:0", free_bytes=0, skip_park=True, **sizes)
    assert not kept.parked and "--prefill-skip-park" in kept.reason
    cpu = decide_residency(device="cpu", free_bytes=0, **sizes)  # host RAM is not what parking saves
    assert not cpu.parked and "GPU memory only" in cpu.reason
    assert decide_residency(device="cpu", free_bytes=10**15, force_park=True, **sizes).parked


def test_a_parked_scorer_compresses_as_the_resident_one_and_is_released_after_each_use(parked, resident):
    full = _tokens(parked, CHAT)
    protected = _tokens(parked, [CHAT[0], {**CHAT[1], "content": ""}, *CHAT[2:]])
    assert protected < THRESHOLD <= full  # auto compresses it, the aged log only: as always does
    slot = parked.chat_compressor.compressor.scorer_slot
    assert slot.residency.parked and not slot.loaded  # the start-up load (checked, measured) already released
    answers = {}
    for name, service in (("parked", parked), ("resident", resident)):
        with ServerThread(create_app(service.config, service)) as base:
            answers[name] = _ask(base, CHAT, tools=TOOLS)
            props = httpx.get(f"{base}/props").json()["prefill_compression"]
            metrics = httpx.get(f"{base}/metrics").text
        answers[name + " props"] = props
        answers[name + " metrics"] = metrics
    assert answers["parked"] == answers["resident"]  # the same kept text: the same prompt tokens, the same answer
    assert answers["parked"][1] < 0.6 * full
    parked_props, resident_props = answers["parked props"], answers["resident props"]
    assert parked_props["scorer"]["residency"] == "parked" and "forced" in parked_props["scorer"]["reason"]
    assert parked_props["scorer_loads"] == 1 and parked_props["scorer"]["loaded"] is False
    assert not slot.loaded  # no reference to the scorer left: its weak reference is dead
    assert "lucebox_prefill_compression_scorer_loads 1" in answers["parked metrics"]
    assert resident_props["scorer"]["residency"] == "resident"
    assert "--prefill-skip-park" in resident_props["scorer"]["reason"]
    assert resident_props["scorer_loads"] == 0 and resident_props["scorer"]["loaded"] is True
    prefill_seconds = re.search(r"^lucebox_prefill_seconds_total (\S+)$", answers["resident metrics"], re.M)
    assert float(prefill_seconds.group(1)) > 0  # the target's prefill, timed apart from the scorer
    # Another aged message: scored afresh, so loaded once more, and released again.
    later = [CHAT[0], {"role": "user", "content": "Another log:\n" + LOG.replace("worker", "node")}, *CHAT[2:]]
    with ServerThread(create_app(parked.config, parked)) as base:
        _ask(base, later, tools=TOOLS)
        assert httpx.get(f"{base}/props").json()["prefill_compression"]["scorer_loads"] == 2
    assert not slot.loaded


def test_an_oversized_question_is_compressed_under_always(resident):
    full = _tokens(resident, OVERSIZED)
    assert full >= THRESHOLD  # the protected parts (here all of the chat) alone
    before = resident.chat_compressor.describe()["last_user"]
    with ServerThread(create_app(resident.config, resident)) as base:
        _, prompt_tokens = _ask(base, OVERSIZED, tools=TOOLS)
    assert prompt_tokens < 0.6 * full
    assert resident.chat_compressor.describe()["last_user"] == before + 1
    prompt = render_request(resident, Conversation(messages=OVERSIZED, tools=TOOLS)).text  # FlowKV: the same text
    assert LOG not in prompt and LOG.splitlines()[0][:20] in prompt  # shortened, its head kept
    assert QUESTION in prompt  # the question: the last chunks, kept
    assert TOOL_TEXT.strip() in prompt and OVERSIZED[0]["content"] in prompt  # tools and system prompt whole
    # The next turn shows the question's message as it was compressed (FlowKV), not scored again.
    reused = resident.chat_compressor.describe()["reused"]
    later = OVERSIZED + [{"role": "assistant", "content": "Worker 2."}, {"role": "user", "content": "And batch 11?"}]
    assert render_request(resident, Conversation(messages=later, tools=TOOLS)).text.startswith(prompt.split(
        "<|im_start|>assistant")[0].rsplit("<|im_end|>", 1)[0])
    assert resident.chat_compressor.describe()["reused"] == reused + 1
    # A chat with nothing to compress (no aged text, the last user message short): left as it is, and said so.
    short = [OVERSIZED[0], {"role": "user", "content": QUESTION}]
    assert render_request(resident, Conversation(messages=short, tools=TOOLS)).text.count(QUESTION) == 1
    assert resident.chat_compressor.describe()["skipped"] == {"nothing_compressible": 1}


def test_an_oversized_question_is_left_whole_under_auto_and_counted(parked):
    loads = parked.chat_compressor.describe()["scorer_loads"]
    with ServerThread(create_app(parked.config, parked)) as base:
        _, prompt_tokens = _ask(base, OVERSIZED, tools=TOOLS)
        metrics = httpx.get(f"{base}/metrics").text
    assert 'lucebox_prefill_compression_skipped_total{reason="protected_over_threshold"} 1' in metrics
    assert parked.chat_compressor.describe()["scorer_loads"] == loads  # not even loaded for it
    prompt = render_request(parked, Conversation(messages=OVERSIZED, tools=TOOLS))
    assert OVERSIZED[1]["content"] in prompt.text and TOOL_TEXT.strip() in prompt.text  # uncompressed
    assert prompt_tokens == len(prompt.ids) >= _tokens(parked, OVERSIZED)


def test_the_serve_flags_reach_the_config():
    from lucebox_core.cli import build_parser

    args = build_parser().parse_args(["serve", "--prefill-skip-park", "--prefill-force-park"])
    assert args.prefill_skip_park and args.prefill_force_park
    assert not build_parser().parse_args(["serve"]).prefill_skip_park
