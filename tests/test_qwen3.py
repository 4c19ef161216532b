"""The qwen3 family (dense Qwen3, Qwen3-0.6B's architecture, in lucebox-qwen): parity with transformers'
`Qwen3ForCausalLM` on tiny random checkpoints (tied and untied heads) converted to GGUF (logits of a prefill and
of step-by-step decoding, 32 greedy steps), the converted tokenizer against the `tokenizers` library, the GGUF
layout against llama.cpp's names and Qwen3-0.6B's shape, synthetic files through the engine, the CLI and a real
HTTP server, the chat template with tools, the response parser, and errors that name what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.errors import LuceboxError
from lucebox_core.ggufio import GGUFFile
from lucebox_core.sampling import SamplingParams
from lucebox_core.tokenizer import Tokenizer
from lucebox_qwen35 import convert_qwen3, layout_qwen3, synth
from lucebox_qwen35 import vocab as qwen_vocab
from lucebox_qwen35.qwen3 import load

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0)
VOCAB = 151936
# Qwen2's pre-tokenizer split, as Qwen3's tokenizer.json writes it.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
SPECIAL_ADDED = 14  # <|endoftext|> .. <|video_pad|> are special in Qwen3's tokenizer.json; the rest are not


def _hf_config(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645,
    )
    settings.update(overrides)
    return transformers.Qwen3Config(**settings)


def _write_tokenizer(folder: Path) -> None:
    """Qwen3's tokenizer files: the real Qwen-family BPE (the packaged vocabulary's tokens and merges) with the
    Qwen2 split, byte-level, Qwen3's added tokens at their ids, and Qwen3-0.6B's tokenizer_config."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = qwen_vocab.from_gguf(qwen_vocab.packaged_vocab_path())
    merged = {text: i for i, text in enumerate(vocab.tokens[:151643])}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tokenizer = HFTokenizer(models.BPE(vocab=merged, merges=merges, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    added = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *qwen_vocab.QWEN3_ADDED_TOKENS]
    for i, text in enumerate(added):
        token = AddedToken(text, special=i < SPECIAL_ADDED, normalized=False)
        (tokenizer.add_special_tokens if i < SPECIAL_ADDED else tokenizer.add_tokens)([token])
    tokenizer.save(str(folder / "tokenizer.json"))
    template = (Path(__file__).resolve().parents[1] / "plugins/qwen35/lucebox_qwen35/data/qwen3-chat-template.jinja")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": template.read_text(encoding="utf-8"), "model_max_length": 40960}))


def _random_checkpoint(folder: Path, *, tied: bool, seed: int):
    """A tiny random `Qwen3ForCausalLM` (every weight random, norms around 1), saved with tokenizer files."""
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(_hf_config(tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if name.endswith("norm.weight")
                        else 0.08 * torch.randn_like(param))
    model.save_pretrained(folder)
    _write_tokenizer(folder)
    return model


@pytest.fixture(scope="module", params=["tied", "untied"])
def hf_pair(request, tmp_path_factory):
    """A tiny random checkpoint, converted to an f32 GGUF by our converter and loaded by our loader."""
    tied = request.param == "tied"
    folder = tmp_path_factory.mktemp(f"qwen3-hf-{request.param}")
    model = _random_checkpoint(folder, tied=tied, seed=0 if tied else 1)
    gguf = convert_qwen3.convert(folder, folder / "tiny.gguf")
    return model, load(gguf), gguf


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 151643, (n,), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(hf_pair):
    hf, ours, _ = hf_pair
    ids = _ids(21)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    got = ours.forward(ours.new_state(64), ids)
    assert (got - expected).abs().max().item() < 1e-4
    # The cached path the engine decodes with: a prefill, then one token at a time.
    state = ours.new_state(64)
    steps = [ours.forward(state, ids[:5])] + [ours.forward(state, ids[i : i + 1]) for i in range(5, len(ids))]
    assert (torch.cat(steps) - expected).abs().max().item() < 1e-4


def test_greedy_tokens_match_transformers_for_32_steps(hf_pair):
    hf, ours, _ = hf_pair
    prompt = _ids(6, seed=2)
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 6:].tolist()
    state = ours.new_state(64)
    logits = ours.forward(state, prompt)[-1]
    got = []
    for _ in range(32):
        token = int(logits.argmax())
        got.append(token)
        logits = ours.forward(state, torch.tensor([token]))[-1]
    assert got == expected


def test_static_decode_step_equals_forward(hf_pair):
    _, ours, _ = hf_pair
    ids = _ids(12, seed=3)
    eager, static = ours.new_state(64), ours.new_state(64)
    ours.forward(eager, ids[:4]), ours.forward(static, ids[:4])
    for token in ids[4:]:
        expected = ours.forward(eager, token.reshape(1))
        got = ours.decode_step(static, token.reshape(1), graphs=False)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_converted_file_carries_llama_cpp_conventions(hf_pair):
    hf, ours, gguf = hf_pair
    file = GGUFFile(gguf)
    md = {key: file.get(key) for key in file.keys() if key not in ("tokenizer.ggml.merges", "tokenizer.ggml.tokens")}
    assert file.architecture == "qwen3"
    assert md["qwen3.attention.key_length"] == 32 and md["qwen3.embedding_length"] == 64  # head size not 64 / 4
    assert md["qwen3.attention.head_count"] == 4 and md["qwen3.attention.head_count_kv"] == 2
    assert md["qwen3.rope.freq_base"] == 1e6 and md["qwen3.block_count"] == 3
    assert md["tokenizer.ggml.pre"] == "qwen2" and md["tokenizer.ggml.eos_token_id"] == 151645
    assert md["tokenizer.ggml.eot_token_id"] == 151645 and md["tokenizer.ggml.bos_token_id"] == 151643
    assert md["tokenizer.ggml.add_bos_token"] is False and "<tool_call>" in md["tokenizer.chat_template"]
    tied = hf.config.tie_word_embeddings
    assert ("output.weight" in file.tensors) is not tied and ours.tied_embeddings is tied
    q_norm = hf.state_dict()["model.layers.1.self_attn.q_norm.weight"]
    torch.testing.assert_close(file.tensor("blk.1.attn_q_norm.weight").dequantize(), q_norm)  # stored as it is
    post = hf.state_dict()["model.layers.2.post_attention_layernorm.weight"]
    torch.testing.assert_close(file.tensor("blk.2.ffn_norm.weight").dequantize(), post)


def test_the_converted_tokenizer_is_the_checkpoints(hf_pair):
    """Our tokenizer on the converted GGUF splits text as the `tokenizers` library does with the checkpoint's
    tokenizer.json (the `qwen2` pre-tokenizer: words, digits one by one, combining marks apart: Devanagari's vowel
    signs split words under qwen2, not under qwen35), and Qwen3's
    added tokens are single tokens at their ids."""
    from tokenizers import Tokenizer as HFTokenizer

    _, _, gguf = hf_pair
    ours, theirs = Tokenizer.from_gguf(gguf), HFTokenizer.from_file(str(gguf.parent / "tokenizer.json"))
    for text in ("Hello world! It's 2026-12-03, 3.14159 apples.", "  def f(x):\n\treturn x**2\n\n",
                 "caf\u00e9 \u0928\u092e\u0938\u094d\u0924\u0947 \u4f60\u597d\u4e16\u754c \U0001f600",
                 "<think>\nplan</think>\n\n<tool_call>"):
        assert ours.encode(text, add_bos=False) == theirs.encode(text).ids, text
    assert ours.token_to_id("<think>") == 151667 and ours.token_to_id("</tool_call>") == 151658
    assert ours.token_to_id("<|im_end|>") == 151645 and ours.is_control(151645)


def test_the_0_6b_size_is_qwen3_0_6b():
    cfg = layout_qwen3.size("0.6b")
    shapes = layout_qwen3.tensor_shapes(cfg)
    assert (cfg.n_layer, cfg.hidden, cfg.ffn, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == (28, 1024, 3072, 16, 8, 128)
    assert cfg.rope_theta == 1e6 and cfg.eps == 1e-6 and cfg.vocab == 151936 and cfg.tied_output
    assert shapes["blk.0.attn_q.weight"] == (2048, 1024) and shapes["blk.27.attn_output.weight"] == (1024, 2048)
    assert shapes["blk.3.attn_k.weight"] == (1024, 1024) and shapes["blk.3.attn_k_norm.weight"] == (128,)
    assert "output.weight" not in shapes and "blk.28.attn_norm.weight" not in shapes
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert 0.59e9 < total < 0.60e9  # Qwen3-0.6B: 596M parameters, the embedding counted once
    metadata = {"general.architecture": "qwen3", **cfg.to_gguf_metadata()}
    assert layout_qwen3.Qwen3Config.from_gguf_metadata(metadata, tensor_names=shapes) == cfg


def test_a_qwen3_0_6b_config_converts_to_the_0_6b_size():
    """Qwen3-0.6B's config.json (models.md 1.5), as transformers 5 writes it (rope_parameters)."""
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": True,
        "attention_bias": False, "use_sliding_window": False, "rope_parameters": {"rope_type": "default",
                                                                                 "rope_theta": 1000000},
    }
    assert convert_qwen3.config_from_hf(config, tied_output=True) == layout_qwen3.size("0.6b")
    legacy = {**config, "rope_theta": 1000000, "rope_scaling": None}  # transformers 4's spelling
    del legacy["rope_parameters"]
    assert convert_qwen3.config_from_hf(legacy, tied_output=True) == layout_qwen3.size("0.6b")
    with pytest.raises(ValueError, match="attention_bias"):
        convert_qwen3.config_from_hf({**config, "attention_bias": True}, tied_output=True)
    with pytest.raises(ValueError, match="yarn"):
        convert_qwen3.config_from_hf({**config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
                                     tied_output=True)


# -- synthetic files -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return synth.write_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-q8_0.gguf", size="tiny", type="q8_0", seed=5)


def test_synthetic_tiny_generates_through_the_engine(tiny_file):
    model = load(tiny_file)
    assert model.config == layout_qwen3.size("tiny") and model.vocab_size == VOCAB and model.tied_embeddings
    tokenizer = Tokenizer.from_gguf(tiny_file)
    engine = Engine(model, tokenizer, ctx_size=128)
    prompt = tokenizer.encode("Hello from a tiny Qwen3")  # BOS as the file says: Qwen3 adds none
    assert prompt == tokenizer.encode("Hello from a tiny Qwen3", add_bos=False) and 151643 not in prompt
    first = engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=GREEDY, ignore_eos=True))
    again = engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=GREEDY, ignore_eos=True))
    assert len(first.token_ids) == 24 and first.token_ids == again.token_ids  # the reused state starts clean
    assert not set(first.token_ids) & set(tokenizer.unused_ids())  # padding rows 151669.. never sampled
    assert set(range(151669, VOCAB)) <= set(tokenizer.unused_ids())


@pytest.mark.parametrize("cache_k, cache_v, tolerance", [("f16", "f16", 5e-3), ("q8_0", "bf16", 5e-2),
                                                          ("f32", "q8_0", 5e-2)])
def test_quantized_kv_caches_track_the_f32_cache(tiny_file, cache_k, cache_v, tolerance):
    ids = _ids(20, seed=7)
    exact = load(tiny_file, cache_type_k="f32", cache_type_v="f32")
    stored = load(tiny_file, cache_type_k=cache_k, cache_type_v=cache_v)
    reference, state = exact.forward(exact.new_state(64), ids), stored.new_state(64)
    steps = [stored.forward(state, ids[:6])] + [stored.forward(state, ids[i : i + 1]) for i in range(6, len(ids))]
    error = (torch.cat(steps) - reference).abs().max().item()
    assert 0 < error < tolerance if cache_k != "f32" or cache_v != "f32" else error == 0


def test_every_synthesized_type_loads_and_decodes(tmp_path):
    """f16 and q4_k_m files decode through the loader (weights kept in their types); the K-quant file holds
    llama.cpp's Q4_K_M mix where rows split into 256-blocks (the 256-wide ffn_down) and its fallbacks elsewhere."""
    for type_ in ("f16", "q4_k_m"):
        path = synth.write_qwen3(tmp_path / f"{type_}.gguf", size="tiny", type=type_, seed=9)
        model = load(path)
        logits = model.forward(model.new_state(32), _ids(8, seed=4))
        assert torch.isfinite(logits).all() and logits.shape == (8, VOCAB)
        file = GGUFFile(path)
        types = {file.tensor(name).ggml_type.name for name in file.tensors}
        assert types == ({"F16", "F32"} if type_ == "f16" else {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"}), types
        path.unlink()


def _write_broken(path: Path, *, drop: str | None = None, reshape: tuple[str, tuple[int, ...]] | None = None,
                  drop_key: str | None = None, override: dict | None = None) -> Path:
    """A tiny qwen3 file with one tensor left out, one tensor of the wrong shape, one metadata key missing or
    some keys given other values."""
    import attrs

    from lucebox_core.gguf_out import add_arch_metadata
    from lucebox_core.synthetic import write_random_model

    cfg = layout_qwen3.size("tiny")
    plans = [p for p in synth.qwen3_tensor_plans(cfg, "f32") if p.name != drop]
    if reshape is not None:
        plans = [attrs.evolve(p, shape=reshape[1]) if p.name == reshape[0] else p for p in plans]
    tokens = qwen_vocab.qwen3(None, cfg.vocab)

    def add_metadata(writer) -> None:
        metadata = {k: v for k, v in {**cfg.to_gguf_metadata(), **(override or {})}.items() if k != drop_key}
        add_arch_metadata(writer, "qwen3", metadata, layout_qwen3.METADATA_TYPES)
        tokens.add_to_writer(writer)

    return write_random_model(path, plans, arch="qwen3", title="Qwen3", size="tiny", type="f32", seed=1,
                              small_tensor=synth._qwen3_small_tensor, add_metadata=add_metadata)


def test_a_missing_or_misshaped_tensor_and_a_missing_key_are_named(tmp_path):
    missing = _write_broken(tmp_path / "missing.gguf", drop="blk.2.ffn_up.weight")
    with pytest.raises(LuceboxError, match=r"missing\.gguf.*blk\.2\.ffn_up\.weight"):
        load(missing)
    missing.unlink()
    wrong = _write_broken(tmp_path / "wrong.gguf", reshape=("blk.1.attn_k_norm.weight", (64,)))
    with pytest.raises(LuceboxError, match=r"wrong\.gguf.*blk\.1\.attn_k_norm\.weight"):
        load(wrong)
    wrong.unlink()
    no_layers = _write_broken(tmp_path / "keyless.gguf", drop_key="qwen3.block_count")
    with pytest.raises(LuceboxError, match=r"keyless\.gguf.*qwen3\.block_count"):
        load(no_layers)
    no_layers.unlink()
    uneven = _write_broken(tmp_path / "uneven.gguf", override={"qwen3.attention.head_count_kv": 3})
    with pytest.raises(LuceboxError, match=r"uneven\.gguf.*attention heads 4 not a multiple of KV heads 3"):
        load(uneven)
    uneven.unlink()
    partial = _write_broken(tmp_path / "partial.gguf", override={"qwen3.rope.dimension_count": 16})
    with pytest.raises(LuceboxError, match=r"partial\.gguf.*qwen3\.rope\.dimension_count 16"):
        load(partial)


def test_converter_errors_name_the_tensor_and_the_field(hf_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, gguf = hf_pair
    source = gguf.parent
    weights = load_file(source / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    with pytest.raises(LuceboxError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        convert_qwen3.convert(tmp_path, tmp_path / "x.gguf")
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(LuceboxError, match=r"config\.json: use_sliding_window"):
        convert_qwen3.convert(tmp_path, tmp_path / "x.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    with pytest.raises(LuceboxError, match="not a dense Qwen3"):
        convert_qwen3.convert(tmp_path, tmp_path / "x.gguf")


@pytest.mark.slow
def test_cli_synth_and_generate(tmp_path, tiny_file):
    cli = [sys.executable, "-m", "lucebox_core.cli"]
    out = tmp_path / "cli.gguf"
    run = subprocess.run(cli + ["synth", "--arch", "qwen3", "--size", "tiny", "--type", "q8_0", "--seed", "5",
                                "-o", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert out.read_bytes() == tiny_file.read_bytes()  # a function of the seed
    run = subprocess.run(cli + ["generate", "-m", str(out), "--chat", "-p", "Hi", "-n", "6", "--temp", "0",
                                "--ignore-eos", "--json", "-ctk", "q8_0", "-ctv", "f16"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout.strip().splitlines()[-1])["token_ids"]) == 6
    bad = subprocess.run(cli + ["synth", "--arch", "qwen3", "--size", "huge", "-o", str(tmp_path / "x.gguf")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "tiny, 0.6b" in bad.stderr


def test_cli_convert_picks_the_qwen3_converter(tmp_path, hf_pair):
    _, ours, converted = hf_pair
    run = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "convert", str(converted.parent), "-o",
                          str(tmp_path / "c.gguf"), "--type", "q8_0"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    file = GGUFFile(tmp_path / "c.gguf")
    assert file.architecture == "qwen3" and file.tensor("blk.2.ffn_down.weight").ggml_type.name == "Q8_0"
    quantized = load(file)
    ids = _ids(10, seed=5)
    expected = ours.forward(ours.new_state(16), ids)
    error = (quantized.forward(quantized.new_state(16), ids) - expected).abs().max() / expected.abs().max()
    assert 0 < error.item() < 0.05  # Q8_0 weights: near the f32 file (a few % of the largest logit), not equal


# -- the chat template and the response parser -----------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def test_the_chat_template_renders_tools_calls_and_results(tiny_file):
    from lucebox_core.chat_prompt import render_chat
    from lucebox_core.chat_template import ChatTemplate

    file = GGUFFile(tiny_file)
    tokenizer = Tokenizer.from_gguf(tiny_file)
    template = ChatTemplate.from_metadata(file.metadata)  # as `load_model` reads it
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]
    rendered = render_chat(template, tokenizer, messages, tools=[WEATHER])
    text = rendered.text
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = rendered.encode(tokenizer)
    # <|im_start|> opens five turns (system, user, assistant, the tool's result as a user turn, the answer);
    # <tool_call> and <tool_response> are single tokens.
    assert ids.count(151644) == 5 and 151657 in ids and 151665 in ids
    no_thinking = render_chat(template, tokenizer, messages[:2], enable_thinking=False).text
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_response_parser_reads_reasoning_and_json_tool_calls():
    from lucebox_core.parsing import ReasoningDelta, ToolCallEnd, ToolCallStart, response_parser_for

    spec = response_parser_for("qwen3")
    assert spec.name == "qwen3" and spec.reasoning_tags == ("<think>", "</think>")
    parser = spec.create(tools=[WEATHER], thinking=True)
    output = ('Let me check.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"days": 2}}\n</tool_call>')
    events = []
    for at in range(0, len(output), 7):  # streamed in pieces that cut the tags
        events += parser.feed(output[at : at + 7])
    events += parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert reasoning.strip() == "Let me check."
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [s.name for s in starts] == ["get_weather"]
    assert json.loads(ends[0].arguments_json) == {"city": "Paris", "days": 2}


@pytest.mark.parametrize("thinking", [False, True])
def test_required_calls_are_json_held_to_the_schemas(tiny_file, thinking):
    """Under "required", random logits write only Qwen3 JSON calls (after the reasoning, when thinking), which
    the parser reads back with arguments valid against each tool's schema."""
    import jsonschema
    from tool_call_helpers import RICH_SCHEMA, RICH_TOOLS, checked_calls, drive

    from lucebox_qwen35.qwen3_tool_calls import create_parser

    tokenizer = Tokenizer.from_gguf(tiny_file)
    finished = 0
    for seed in range(3):
        parser = create_parser(tools=RICH_TOOLS, thinking=thinking)
        constraint = parser.constraint_for("required", tokenizer)
        prefix = "Let me see.</think>\n\n" if thinking else ""
        chosen, done = drive(constraint, tokenizer, seed, 150, prefix)
        if not done:
            continue
        finished += 1
        text = tokenizer.decode([t for t in chosen if not tokenizer.is_eog(t)])
        events = parser.feed(text) + parser.finish()
        calls = checked_calls(events, text, opening="<tool_call>\n{\"name\": \"")
        assert calls, text
        for name, arguments in calls:
            jsonschema.validate(arguments, RICH_SCHEMA if name == "get_weather" else {"type": "object"})
    assert finished >= 2


def test_auto_holds_each_opened_call_to_its_schema(tiny_file):
    import jsonschema
    from tool_call_helpers import RICH_SCHEMA, RICH_TOOLS, checked_calls, drive_auto

    from lucebox_qwen35.qwen3_tool_calls import create_parser

    tokenizer = Tokenizer.from_gguf(tiny_file)
    auto = create_parser(tools=RICH_TOOLS).constraint_for("auto", tokenizer)
    assert auto.dormant and auto.allowed(tokenizer.vocab_size) is None
    chosen, ended = drive_auto(auto, tokenizer, [tokenizer.token_to_id("<tool_call>")], seed=7)
    text = tokenizer.decode(chosen)
    reader = create_parser(tools=RICH_TOOLS)
    whole = checked_calls(reader.feed(text) + reader.finish(), text)[:ended]
    assert ended >= 2 and len(whole) == ended, text
    for name, arguments in whole:
        jsonschema.validate(arguments, RICH_SCHEMA if name == "get_weather" else {"type": "object"})


# -- serving -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory, tiny_file):
    from conftest import loaded_service

    yield from loaded_service(tmp_path_factory, model=str(tiny_file), ctx_size=512, parallel=1)


def test_the_server_answers_chat_and_forced_tool_calls(oai):
    reply = oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                        temperature=0)
    assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"
    forced = oai.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    calls = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    arguments = json.loads(calls[0].function.arguments)
    assert isinstance(arguments["city"], str) and set(arguments) <= {"city", "days"}


LLAMA_SERVER = os.environ.get("LUCEBOX_LLAMA_SERVER", "")


@pytest.mark.slow
@pytest.mark.skipif(not os.access(LLAMA_SERVER, os.X_OK), reason="set LUCEBOX_LLAMA_SERVER to a llama-server binary "
                    "(a CPU build of the llama.cpp in ../shared/tools/llamacpp) to compare with llama.cpp")
def test_greedy_tokens_match_llama_cpp_on_the_cpu(tmp_path):
    """llama.cpp on the CPU (f32 KV, flash attention off) and Lucebox give the same 24 greedy tokens (argmax over
    every row, padding included, as llama.cpp's greedy is) on the tiny f32 file."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import llamacpp_crosscheck as crosscheck

    path = synth.write_qwen3(tmp_path / "tiny-f32.gguf", size="tiny", type="f32", seed=1)
    prompts = crosscheck.PROMPTS_BY_ARCH["qwen3"]
    theirs = crosscheck.llama_tokens(LLAMA_SERVER, path, prompts, port=8958, ngl=0)
    ours, _ = crosscheck.argmax_tokens(path, prompts, "cpu")
    assert ours == theirs


@pytest.mark.slow
@pytest.mark.skipif(not os.access(LLAMA_SERVER, os.X_OK), reason="set LUCEBOX_LLAMA_SERVER to a llama-server binary "
                    "(a CPU build of the llama.cpp in ../shared/tools/llamacpp) to compare with llama.cpp")
def test_converted_checkpoints_run_in_llama_cpp_as_in_transformers(hf_pair):
    """Our converter's file (tied head, and untied) in llama.cpp gives transformers' greedy tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import llamacpp_crosscheck as crosscheck

    hf, _, gguf = hf_pair
    prompts = crosscheck.PROMPTS_BY_ARCH["qwen3"]
    theirs = crosscheck.llama_tokens(LLAMA_SERVER, gguf, prompts, port=8959, ngl=0)
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=crosscheck.N_TOKENS, do_sample=False,
                                min_new_tokens=crosscheck.N_TOKENS)[0, len(p):].tolist() for p in prompts]
    assert theirs == expected


# -- PFlash's scorer -------------------------------------------------------------------------------------


def test_tail_attention_scores_match_transformers_attention(hf_pair):
    """PFlash's token importance from our scorer's tail queries and keys equals the same arithmetic on
    transformers' own attention probabilities (eager attention, `output_attentions`)."""
    from lucebox_core.prefill_compression import tail_scores

    hf, ours, _ = hf_pair
    ids, tail = _ids(40, seed=3), 8
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = hf(ids[None], output_attentions=True).attentions  # per layer [1, H, S, S]
    running = None
    for layer in attentions:
        per_layer = layer[0, :, -tail:, :].amax(dim=0)
        running = per_layer if running is None else torch.maximum(running, per_layer)
    expected = torch.nn.functional.avg_pool1d(running.mean(0)[None, None], 13, 1, 6, count_include_pad=False)[0, 0]
    queries, keys = ours.tail_attention(ids, tail)
    assert [tuple(q.shape) for q in queries] == [(4, tail, 32)] * 3 and tuple(keys[0].shape) == (2, 40, 32)
    assert torch.allclose(tail_scores(queries, keys), expected.float(), atol=1e-5)


def test_block_sparse_scoring_keeps_every_block_at_alpha_zero_and_fewer_above(hf_pair):
    from lucebox_core.block_sparse import BlockSparseConfig, block_mask
    from lucebox_core.prefill_compression import tail_scores

    _, ours, _ = hf_pair
    ids = _ids(150, seed=4)  # ten 16-token blocks
    dense = tail_scores(*ours.tail_attention(ids, 8))
    every = tail_scores(*ours.tail_attention(ids, 8, sparse=BlockSparseConfig(block=16, alpha=0.0)))
    assert torch.allclose(every, dense, atol=1e-5)
    config = BlockSparseConfig(block=16, sink=1, window=1, last_full=0, alpha=0.99)
    sparse = tail_scores(*ours.tail_attention(ids, 8, sparse=config))
    assert sparse.shape == dense.shape and not torch.allclose(sparse, dense, atol=1e-5)  # blocks were skipped


def test_pflash_keeps_protected_messages_and_compresses_aged_text(hf_pair):
    from lucebox_core.chat_compression import ChatCompressor
    from lucebox_core.pflash import PFlashCompressor
    from lucebox_core.prefill_compression import CompressionConfig

    _, ours, gguf = hf_pair
    from lucebox_core.loading import load_model

    tokenizer = load_model(gguf).tokenizer
    config = CompressionConfig(keep_ratio=0.25, chunk=8, head_chunks=1, tail_chunks=1, anchor_query_tokens=16)
    chats = ChatCompressor(PFlashCompressor(ours, tokenizer, config), mode="always", hot_window=1, name="pflash")
    lines = [f"line {i}: the value of item {i} is {i * 7 % 13} units" for i in range(40)]
    chat = [{"role": "system", "content": "Answer from the log."},
            {"role": "user", "content": "\n".join(lines)},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "What is the value of item 17?"}]
    compressed = chats.apply(chat)
    assert [m["content"] for m in compressed if m is not compressed[1]] == [m["content"] for m in chat if m is not chat[1]]
    kept = compressed[1]["content"]
    original_ids = tokenizer.encode(chat[1]["content"], add_bos=False)
    kept_ids = tokenizer.encode(kept, add_bos=False)
    assert 0.1 * len(original_ids) < len(kept_ids) < 0.6 * len(original_ids)
    assert kept.startswith("line 0:")  # the first chunk of the prompt is always kept
    # Kept chunks, in their order: the kept text is the original with parts left out.
    rest = iter(chat[1]["content"])
    assert all(char in rest for char in kept)
    assert chats.apply(chat)[1]["content"] == kept  # FlowKV: the same text next time, not rescored
    assert chats.describe()["messages"] == 2 and chats.describe()["reused"] == 2  # the log and "Noted."
