"""PFlash through the real server: the default model (qwen35's vocabulary) with a tiny qwen3 scorer (another
vocabulary: the compression goes through text). Aged free text is shortened; tool definitions, the system
prompt and the last user message reach the target verbatim; the next turn reuses the compressed text; off by
default, and then the request path is unchanged."""

import httpx
import pytest

from conftest import loaded_service
from lucebox_core.chat_prompt import render_chat
from lucebox_core.server.generation import Conversation
from lucebox_core.server.generation import render_chat as render_request

LOG = "\n".join(f"2026-12-0{i % 9 + 1} worker {i}: processed batch {i * 37 % 101} in {i % 7}.{i % 10}s"
                for i in range(60))
TOOL_TEXT = "Read a file of the repository and return its lines, numbered, " * 12
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": TOOL_TEXT.strip(), "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
CHAT = [{"role": "system", "content": "You answer questions about logs."},
        {"role": "user", "content": "Here is the log:\n" + LOG},
        {"role": "assistant", "content": "I have read it."},
        {"role": "user", "content": "Which worker processed batch 74?"}]


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    from lucebox_qwen35 import synth

    return str(synth.write_qwen3(tmp_path_factory.mktemp("scorer") / "qwen3-scorer.gguf", size="tiny", type="f32",
                                 seed=2))


@pytest.fixture(scope="module")
def service(tmp_path_factory, scorer):
    yield from loaded_service(tmp_path_factory, ctx_size=4096, prefill_compression="always", prefill_drafter=scorer,
                              prefill_keep_ratio=0.25, prefix_cache_slots=0)


def test_aged_text_is_compressed_and_the_rest_reaches_the_target_verbatim(service, oai, url):
    full = render_chat(service.loaded.chat_template, service.loaded.tokenizer, CHAT, tools=TOOLS,
                       add_generation_prompt=True).encode(service.loaded.tokenizer)
    answer = oai.chat.completions.create(model="m", messages=CHAT, tools=TOOLS, max_tokens=4, temperature=0)
    assert answer.usage.prompt_tokens < 0.6 * len(full)
    prompt = render_request(service, Conversation(messages=CHAT, tools=TOOLS)).text
    assert TOOL_TEXT.strip() in prompt  # the tool definition, whole
    for message in (CHAT[0], CHAT[3]):  # the system prompt and the last user message
        assert message["content"] in prompt
    assert LOG not in prompt and LOG.splitlines()[0][:20] in prompt  # shortened, its head kept
    props = httpx.get(f"{url}/props").json()["prefill_compression"]
    assert props["mode"] == "always" and props["compressor"].startswith("pflash:") and props["messages"] >= 1
    assert 0 < props["compression_ratio"] < 0.6
    # On the CPU the scorer stays loaded: parking saves GPU memory, and host RAM is not what it addresses.
    assert props["scorer"]["residency"] == "resident" and "GPU memory only" in props["scorer"]["reason"]
    assert props["scorer_loads"] == 0 and props["scorer"]["weight_bytes"] > 0
    # The next turn: the log message is not scored again (FlowKV), the prompt renders it the same way.
    later = CHAT + [{"role": "assistant", "content": "Worker 2."}, {"role": "user", "content": "And batch 11?"}]
    reused_before = props["reused"]
    oai.chat.completions.create(model="m", messages=later, tools=TOOLS, max_tokens=2, temperature=0)
    assert httpx.get(f"{url}/props").json()["prefill_compression"]["reused"] > reused_before
    metrics = httpx.get(f"{url}/metrics").text
    assert "lucebox_prefill_compression_messages " in metrics


def test_without_a_scorer_the_server_says_what_to_pass(tmp_path_factory, monkeypatch):
    from lucebox_core.server import ModelService, ServeConfig

    monkeypatch.setenv("LUCEBOX_HOME", str(tmp_path_factory.mktemp("lucebox-home")))
    service = ModelService(ServeConfig(prefill_compression="auto", ctx_size=512))
    service.load()
    assert service.status == "error" and "--prefill-drafter" in service.error


def test_off_by_default(tmp_path_factory):
    from lucebox_core.server import ServeConfig

    assert ServeConfig().prefill_compression == "off"
    for service in loaded_service(tmp_path_factory, ctx_size=512):
        assert service.chat_compressor is None
        prompt = render_request(service, Conversation(messages=CHAT, tools=TOOLS)).text
        assert LOG in prompt


def test_an_unknown_compressor_or_bad_number_fails_before_the_socket_opens():
    import subprocess
    import sys

    for args, needle in ((["--prefill-compression", "always", "--prefill-compressor", "nope"],
                          "no installed plugin provides the prefill compressor (--prefill-compressor) 'nope'"),
                         (["--prefill-keep-ratio", "0"], "--prefill-keep-ratio must be in (0, 1]"),
                         (["--prefill-curve", "lots"], "--prefill-curve: 'lots' is not TOKENS:RATIO")):
        run = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "serve", "--port", "0", *args],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and needle in run.stderr, run.stderr


def test_generate_compresses_a_raw_prompt_and_keeps_its_question(scorer, tmp_path):
    import subprocess
    import sys

    from lucebox_qwen35 import synth

    target = synth.write_qwen3(tmp_path / "target.gguf", size="tiny", type="f32", seed=5)
    question = "Which worker processed batch 74?"
    run = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "generate", "-m", str(target), "-p", LOG + "\n" +
                          question, "-n", "2", "--temp", "0", "--prefill-compression", "always", "--prefill-drafter",
                          scorer, "--prefill-keep-ratio", "0.3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    line = next(line for line in run.stderr.splitlines() if line.startswith("prefill compression:"))
    before, after = (int(n) for n in line.split(":")[1].split("characters")[0].split("->"))
    assert before == len(LOG + "\n" + question) and after < 0.6 * before
    # In process, the same compression: the question (the prompt's last chunk) is kept whole.
    from lucebox_core.chat_compression import Piece
    from lucebox_core.loading import load_model
    from lucebox_core.pflash import PFlashCompressor
    from lucebox_core.prefill_compression import CompressionConfig

    from lucebox_core.block_sparse import BlockSparseConfig

    loaded = load_model(scorer)
    [text] = PFlashCompressor(loaded.model, loaded.tokenizer, CompressionConfig(keep_ratio=0.3),
                              sparse=BlockSparseConfig(alpha=0.85)).compress(
        [Piece(LOG + "\n" + question, protected=False)])
    assert text.endswith(question) and len(text) == after


def test_a_raw_completions_prompt_is_compressed_whole(service, oai):
    question = "\nWhich worker processed batch 74? Answer:"
    full = len(service.loaded.tokenizer.encode(LOG + question, parse_special=True))
    answer = oai.completions.create(model="m", prompt=LOG + question, max_tokens=2, temperature=0)
    assert answer.usage.prompt_tokens < 0.6 * full
