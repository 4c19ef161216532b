"""HF checkpoint -> qwen35 GGUF: every tensor equals the transformed Hugging Face tensor (transforms
recomputed here independently, including the V-head reorder), for f32, q8_0, f16, bf16; tied and untied
output; `model.*` and `model.language_model.*` checkpoints (single file and sharded); vocabularies from
tokenizer.json and from a vocab GGUF; clear errors for bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants
from lucebox_qwen35 import layout
from lucebox_qwen35.convert import convert
from lucebox_qwen35.vocab import packaged_vocab_path

from lucebox_core.errors import LuceboxError

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

VOCAB = 320
K_HEADS, V_HEADS, HEAD = 2, 4, 16  # unequal GDN heads: the V reorder is visible


def text_config(tied: bool) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=K_HEADS, linear_num_value_heads=V_HEADS,
        linear_key_head_dim=HEAD, linear_value_head_dim=HEAD, tie_word_embeddings=tied,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    )


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world"] * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}, "add_bos_token": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
    }))


def save_checkpoint(folder: Path, *, tied: bool, conditional: bool, seed: int) -> dict[str, torch.Tensor]:
    """A tiny random Qwen3.5 saved like `save_pretrained`; `conditional` re-saves it the way
    Qwen3_5ForConditionalGeneration checkpoints look (language_model prefix, vision and MTP weights,
    two shards with an index). Returns the text weights by `model.*` name."""
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(text_config(tied)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms (0 or 1 at init), A_log, dt_bias: make every transform visible
                param.add_(torch.randn_like(param) * 0.5)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    state = {k: v.clone() for k, v in load_file(folder / "model.safetensors").items()}
    if conditional:
        config = json.loads((folder / "config.json").read_text())
        (folder / "model.safetensors").unlink()
        renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
        renamed["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
        renamed["mtp.fc.weight"] = torch.randn(64, 128)
        names = sorted(renamed)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in shards.items():
            save_file({k: renamed[k].contiguous() for k in keys}, folder / file)
        index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                  "text_config": config, "vision_config": {}, "tie_word_embeddings": tied}
        (folder / "config.json").write_text(json.dumps(config))
    return state


def tiled(width: int) -> np.ndarray:
    """Index of the grouped (HF) row behind each tiled (GGUF) row, written out head by head."""
    per_key = V_HEADS // K_HEADS
    order = []
    for j in range(per_key):  # GGUF: all first value heads of each key head, then all second ones...
        for k in range(K_HEADS):
            hf_head = k * per_key + j  # HF: the value heads of one key head are consecutive
            order.extend(range(hf_head * width, (hf_head + 1) * width))
    return np.array(order)


def expected_gguf(state: dict[str, torch.Tensor], tied: bool) -> dict[str, np.ndarray]:
    """llama.cpp's conversion of the HF weights, computed independently of the converter."""
    sd = {k: v.numpy().astype(np.float32) for k, v in state.items()}
    qk = 2 * K_HEADS * HEAD
    out = {"token_embd.weight": sd["model.embed_tokens.weight"]}
    for i in range(4):
        hf = f"model.layers.{i}."
        blk = f"blk.{i}."
        out[blk + "attn_norm.weight"] = sd[hf + "input_layernorm.weight"] + 1
        out[blk + "post_attention_norm.weight"] = sd[hf + "post_attention_layernorm.weight"] + 1
        out[blk + "ffn_gate.weight"] = sd[hf + "mlp.gate_proj.weight"]
        out[blk + "ffn_up.weight"] = sd[hf + "mlp.up_proj.weight"]
        out[blk + "ffn_down.weight"] = sd[hf + "mlp.down_proj.weight"]
        if i == 3:
            sa = hf + "self_attn."
            out[blk + "attn_q.weight"] = sd[sa + "q_proj.weight"]
            out[blk + "attn_k.weight"] = sd[sa + "k_proj.weight"]
            out[blk + "attn_v.weight"] = sd[sa + "v_proj.weight"]
            out[blk + "attn_output.weight"] = sd[sa + "o_proj.weight"]
            out[blk + "attn_q_norm.weight"] = sd[sa + "q_norm.weight"] + 1
            out[blk + "attn_k_norm.weight"] = sd[sa + "k_norm.weight"] + 1
        else:
            la = hf + "linear_attn."
            qkv = sd[la + "in_proj_qkv.weight"]
            out[blk + "attn_qkv.weight"] = np.concatenate([qkv[:qk], qkv[qk:][tiled(HEAD)]])
            out[blk + "attn_gate.weight"] = sd[la + "in_proj_z.weight"][tiled(HEAD)]
            conv = sd[la + "conv1d.weight"][:, 0, :]
            out[blk + "ssm_conv1d.weight"] = np.concatenate([conv[:qk], conv[qk:][tiled(HEAD)]])
            out[blk + "ssm_dt.bias"] = sd[la + "dt_bias"][tiled(1)]
            out[blk + "ssm_a"] = -np.exp(sd[la + "A_log"])[tiled(1)]
            out[blk + "ssm_beta.weight"] = sd[la + "in_proj_b.weight"][tiled(1)]
            out[blk + "ssm_alpha.weight"] = sd[la + "in_proj_a.weight"][tiled(1)]
            out[blk + "ssm_norm.weight"] = sd[la + "norm.weight"]  # not zero-centred: no +1
            out[blk + "ssm_out.weight"] = sd[la + "out_proj.weight"][:, tiled(HEAD)]
    out["output_norm.weight"] = sd["model.norm.weight"] + 1
    if not tied:
        out["output.weight"] = sd["lm_head.weight"]
    return out


CASES = {
    "untied-causal": dict(tied=False, conditional=False, seed=1),
    "tied-conditional-sharded": dict(tied=True, conditional=True, seed=2),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    case = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    state = save_checkpoint(folder, tied=case["tied"], conditional=case["conditional"], seed=case["seed"])
    return folder, expected_gguf(state, case["tied"]), case


def read(path: Path) -> tuple[GGUFReader, dict]:
    reader = GGUFReader(path)
    return reader, {t.name: t for t in reader.tensors}


def test_f32_tensors_equal_the_transformed_checkpoint(checkpoint, tmp_path):
    folder, expected, case = checkpoint
    _, tensors = read(convert(folder, tmp_path / "m.gguf", type="f32"))
    assert set(tensors) == set(expected)
    assert ("output.weight" in tensors) != case["tied"]
    for name, want in expected.items():
        t = tensors[name]
        assert t.tensor_type == Q.F32
        assert tuple(int(d) for d in reversed(t.shape)) == want.shape, name
        np.testing.assert_allclose(np.asarray(t.data).reshape(want.shape), want, rtol=1e-6, atol=0, err_msg=name)


def test_q8_0_matches_gguf_numpy_quantization(checkpoint, tmp_path):
    folder, expected, _ = checkpoint
    _, tensors = read(convert(folder, tmp_path / "m.gguf", type="q8_0"))
    n_quantized = 0
    for name, want in expected.items():
        t = tensors[name]
        if want.ndim == 1 or name.endswith("_norm.weight") or "ssm_conv1d" in name:
            assert t.tensor_type == Q.F32, name  # llama.cpp keeps these in F32
            np.testing.assert_allclose(np.asarray(t.data).reshape(want.shape), want, rtol=1e-6, err_msg=name)
            continue
        n_quantized += 1
        assert t.tensor_type == Q.Q8_0, name
        raw = np.asarray(t.data)
        np.testing.assert_array_equal(raw.reshape(-1), quants.quantize(want, Q.Q8_0).reshape(-1), err_msg=name)
        got = quants.dequantize(raw, Q.Q8_0).reshape(want.shape)
        blocks = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True)
        step = blocks / 127  # the block scale d; error <= d/2 plus the fp16 rounding of d (x 127 / 2048)
        assert (np.abs(got - want).reshape(-1, 32) <= 0.6 * step + 1e-8).all(), name
    assert n_quantized >= 20


def test_f16_and_bf16(checkpoint, tmp_path):
    folder, expected, _ = checkpoint
    for type_name, ggml_type in (("f16", Q.F16), ("bf16", Q.BF16)):
        _, tensors = read(convert(folder, tmp_path / f"{type_name}.gguf", type=type_name))
        want = expected["blk.0.attn_qkv.weight"]
        t = tensors["blk.0.attn_qkv.weight"]
        assert t.tensor_type == ggml_type
        got = quants.dequantize(np.asarray(t.data), ggml_type).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-2 if type_name == "bf16" else 1e-3, atol=1e-6)
        assert tensors["blk.0.ssm_a"].tensor_type == Q.F32
        assert tensors["blk.0.ssm_conv1d.weight"].tensor_type == Q.F32


def test_metadata_and_tokenizer_json_vocabulary(checkpoint, tmp_path):
    from tokenizers import Tokenizer

    folder, _, case = checkpoint
    reader, tensors = read(convert(folder, tmp_path / "m.gguf", type="f32"))
    md = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert md["general.architecture"] == "qwen35" and md["general.file_type"] == 0
    assert md["qwen35.ssm.group_count"] == K_HEADS and md["qwen35.ssm.time_step_rank"] == V_HEADS
    assert md["qwen35.ssm.state_size"] == HEAD and md["qwen35.ssm.inner_size"] == V_HEADS * HEAD
    assert md["qwen35.attention.recurrent_layers"] == [True, True, True, False]
    assert md["qwen35.rope.dimension_count"] == 8 and md["qwen35.rope.freq_base"] == pytest.approx(1e6)
    assert md["qwen35.rope.dimension_sections"] == [11, 11, 10, 0]  # llama.cpp's default when absent
    cfg = layout.Qwen35Config.from_gguf_metadata(md, tensor_names=tensors)
    hf_text = text_config(case["tied"]).to_dict()
    assert cfg == layout.Qwen35Config.from_hf_config(hf_text, tied_output=case["tied"])
    assert cfg.tied_output == case["tied"]

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    size = tokenizer.get_vocab_size()
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == VOCAB
    assert tokens[:size] == [tokenizer.id_to_token(i) for i in range(size)]
    assert tokens[size:] == [f"[PAD{i}]" for i in range(size, VOCAB)] and set(types[size:]) == {5}
    assert [types[i] for i in range(3)] == [3, 3, 3] and set(types[3:size]) == {1}
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert md["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen35"
    assert md["tokenizer.ggml.eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    assert md["tokenizer.ggml.padding_token_id"] == tokenizer.token_to_id("<|endoftext|>")
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert md["tokenizer.chat_template"].startswith("{% for m in messages %}")


def test_vocabulary_from_a_vocab_gguf(checkpoint, tmp_path):
    folder, _, _ = checkpoint
    vocab_path = tmp_path / "vocab.gguf"
    writer = GGUFWriter(vocab_path, "qwen35")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list([f"t{i}" for i in range(300)])
    writer.add_token_types([1] * 299 + [3])
    writer.add_token_merges(["t 1", "t 2"])
    writer.add_eos_token_id(299)
    writer.add_key_value("tokenizer.ggml.custom_ids", [5, 6], GGUFValueType.ARRAY, GGUFValueType.UINT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    reader, _ = read(convert(folder, tmp_path / "m.gguf", type="f32", vocab=vocab_path))
    f = reader.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    assert tokens[:300] == [f"t{i}" for i in range(300)] and tokens[300:] == [f"[PAD{i}]" for i in range(300, 320)]
    assert f["tokenizer.ggml.token_type"].contents()[298:302] == [1, 3, 5, 5]
    assert f["tokenizer.ggml.merges"].contents() == ["t 1", "t 2"]
    assert f["tokenizer.ggml.eos_token_id"].contents() == 299
    assert f["tokenizer.ggml.custom_ids"].contents() == [5, 6]
    assert f["tokenizer.ggml.custom_ids"].types == [GGUFValueType.ARRAY, GGUFValueType.UINT32]

    with pytest.raises(LuceboxError, match="151936 tokens, more than the model's 320"):
        convert(folder, tmp_path / "big.gguf", vocab=packaged_vocab_path())


# -- bad input --------------------------------------------------------------------------------------


@pytest.fixture()
def plain(tmp_path) -> Path:
    folder = tmp_path / "hf"
    save_checkpoint(folder, tied=False, conditional=False, seed=5)
    return folder


def test_bad_input_is_a_user_error_naming_file_and_key(plain, tmp_path):
    out = tmp_path / "out.gguf"
    with pytest.raises(LuceboxError, match="config.json: missing"):
        convert(tmp_path / "nowhere", out)
    with pytest.raises(LuceboxError, match="unknown type 'q4_k_m'"):
        convert(plain, out, type="q4_k_m")

    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(LuceboxError, match="model_type 'llama'"):
        convert(plain, out)
    (plain / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(LuceboxError, match=r"model.layers.0.mlp.gate_proj.weight has shape \[96, 64\], expected \[128, 64\]"):
        convert(plain, out)
    (plain / "config.json").write_text(json.dumps(config))

    weights = load_file(plain / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.linear_attn.A_log"}, plain / "model.safetensors")
    with pytest.raises(LuceboxError, match=r"missing tensor model.layers.1.linear_attn.A_log \(for blk.1.ssm_a\)"):
        convert(plain, out)
    save_file({**weights, "model.layers.3.self_attn.q_proj.bias": torch.zeros(128)}, plain / "model.safetensors")
    with pytest.raises(LuceboxError, match="no place for: model.layers.3.self_attn.q_proj.bias"):
        convert(plain, out)
    save_file(weights, plain / "model.safetensors")

    (plain / "tokenizer.json").unlink()
    with pytest.raises(LuceboxError, match="no tokenizer.json"):
        convert(plain, out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]  # nothing half-written
    shutil.rmtree(plain)
