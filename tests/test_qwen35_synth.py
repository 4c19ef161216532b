"""Synthetic qwen35 GGUF files: layout, metadata, vocabulary, type mixes, weight statistics, the
default model. Files are read back with `gguf.GGUFReader` and dequantized with gguf's numpy code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, quants
from lucebox_qwen35 import default, layout, synth
from lucebox_core.filetypes import stays_f32, tensor_type, use_more_bits
from lucebox_core.ggufio import GGUFFile
from lucebox_core.gguf_out import TensorPlan
from lucebox_qwen35.vocab import CHAT_CONTROL_TOKENS, packaged_chat_template, packaged_vocab_path

from lucebox_core.errors import LuceboxError

TINY = layout.size("tiny")
FAST_TYPES = ["q8_0", "q4_k_m"]  # GGUFReader needs seconds to parse a 248,320-token vocabulary


@pytest.fixture(scope="module")
def written(tiny_quantized_files) -> dict[str, Path]:
    """The tiny file in each of FAST_TYPES, seed 0 (written once a session, tests/conftest.py)."""
    assert set(tiny_quantized_files) == set(FAST_TYPES)
    return tiny_quantized_files


@pytest.fixture(scope="module")
def readers(tiny_quantized_readers) -> dict[str, GGUFReader]:
    return tiny_quantized_readers


def numpy_shape(t) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape))


def dequantized(t) -> np.ndarray:
    return quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(numpy_shape(t))


# -- layout -----------------------------------------------------------------------------------


def test_27b_and_0_8b_shapes_match_llama_cpp():
    # Hand-computed from models.md 1.1 and llama.cpp's qwen35 loader (numpy order: rows=out, cols=in).
    s = layout.tensor_shapes(layout.size("27b"))
    assert s["blk.0.attn_qkv.weight"] == (2 * 16 * 128 + 48 * 128, 5120) == (10240, 5120)
    assert s["blk.0.attn_gate.weight"] == (6144, 5120)
    assert s["blk.0.ssm_conv1d.weight"] == (10240, 4)
    assert s["blk.0.ssm_out.weight"] == (5120, 6144)
    assert s["blk.0.ssm_beta.weight"] == s["blk.0.ssm_alpha.weight"] == (48, 5120)
    assert s["blk.0.ssm_a"] == s["blk.0.ssm_dt.bias"] == (48,)
    assert s["blk.0.ssm_norm.weight"] == (128,)
    assert s["blk.3.attn_q.weight"] == (2 * 24 * 256, 5120)
    assert s["blk.3.attn_k.weight"] == s["blk.3.attn_v.weight"] == (1024, 5120)
    assert s["blk.3.attn_output.weight"] == (5120, 6144)
    assert s["blk.3.attn_q_norm.weight"] == (256,)
    assert s["blk.63.ffn_down.weight"] == (5120, 17408)
    assert s["output.weight"] == s["token_embd.weight"] == (248320, 5120)
    assert "blk.3.attn_qkv.weight" not in s and "blk.2.attn_q.weight" not in s and "blk.64.attn_norm.weight" not in s
    assert layout.size("27b").full_layers == list(range(3, 64, 4))
    assert len(s) == 3 + 16 * 11 + 48 * 14

    s = layout.tensor_shapes(layout.size("0.8b"))
    assert "output.weight" not in s  # tied
    assert s["blk.0.attn_qkv.weight"] == (6144, 1024)
    assert s["blk.3.attn_q.weight"] == (4096, 1024)
    assert s["blk.23.ffn_up.weight"] == (3584, 1024)


def test_tiny_size_is_k_quant_friendly_and_exercises_the_v_reorder():
    assert TINY.ssm_n_group < TINY.ssm_dt_rank and TINY.full_layers and TINY.tied_output
    assert TINY.vocab == 248320
    for name, shape in layout.tensor_shapes(TINY).items():
        assert stays_f32(name, shape) or shape[-1] % 256 == 0, name


def test_config_round_trips_through_metadata():
    for name in layout.SIZES:
        cfg = layout.size(name)
        names = layout.tensor_shapes(cfg)
        assert layout.Qwen35Config.from_gguf_metadata(cfg.to_gguf_metadata(), tensor_names=names) == cfg


def test_v_head_reorder_is_llama_cpp_tiling():
    # 2 key heads, 6 value heads of width 1: grouped [K0v0 K0v1 K0v2 K1v0 K1v1 K1v2] -> tiled.
    grouped = np.array([0, 1, 2, 10, 11, 12])
    tiled = layout.reorder_v_heads(grouped, 0, 2, 6, 1)
    assert tiled.tolist() == [0, 10, 1, 11, 2, 12]
    assert layout.tiled_to_grouped(tiled, 0, 2, 6, 1).tolist() == grouped.tolist()


# -- type mixes -------------------------------------------------------------------------------


def test_use_more_bits_matches_llama_cpp():
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(64) if use_more_bits(i, 64)] == list(range(8)) + list(range(10, 56, 3)) + list(range(56, 64))


def test_q4_k_m_fallbacks_for_rows_that_are_not_256_multiples():
    kw = dict(n_layer=8, tied_output=False)
    assert tensor_type("blk.1.ffn_up.weight", (96, 64), "q4_k_m", **kw) == Q.Q5_0
    assert tensor_type("blk.0.ffn_down.weight", (64, 96), "q4_k_m", **kw) == Q.Q8_0
    assert tensor_type("blk.1.ffn_up.weight", (96, 40), "q4_k_m", **kw) == Q.F16
    assert tensor_type("output.weight", (320, 64), "q4_k_m", **kw) == Q.Q8_0
    assert tensor_type("token_embd.weight", (320, 256), "q4_k_m", **kw) == Q.Q4_K  # untied: plain
    assert tensor_type("token_embd.weight", (320, 256), "q4_k_m", n_layer=8, tied_output=True) == Q.Q6_K
    assert tensor_type("blk.0.ssm_conv1d.weight", (1024, 4), "q8_0", **kw) == Q.F32
    assert tensor_type("blk.0.ssm_a", (4,), "f16", **kw) == Q.F32
    assert tensor_type("blk.0.ffn_up.weight", (96, 40), "q8_0", **kw) == Q.F16  # converter's fallback


def test_q4_k_m_mix_of_the_tiny_file(readers):
    types = {t.name: t.tensor_type for t in readers["q4_k_m"].tensors}
    more_bits = {0, 3, 6, 7}
    for name, ggml_type in types.items():
        layer = layout.layer_of(name)
        if name == "token_embd.weight":  # tied to the output: quantized like `output.weight`
            expected = Q.Q6_K
        elif name.endswith(("_norm.weight", ".ssm_a", ".ssm_dt.bias", ".ssm_conv1d.weight")):
            expected = Q.F32
        elif name.endswith((".attn_qkv.weight", ".attn_v.weight", ".ffn_down.weight")):
            expected = Q.Q6_K if layer in more_bits else Q.Q4_K
        else:
            expected = Q.Q4_K
        assert ggml_type == expected, name
    assert sum(t == Q.Q6_K for t in types.values()) == 1 + 2 + 2 + 4  # embd, qkv 0/6, v 3/7, down 0/3/6/7


# -- the written files ------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", FAST_TYPES)
def test_tensor_names_shapes_and_types(readers, type_name):
    reader = readers[type_name]
    expected = layout.tensor_shapes(TINY)
    assert [t.name for t in reader.tensors] == list(expected)
    for t in reader.tensors:
        assert numpy_shape(t) == expected[t.name], t.name
        assert t.tensor_type == tensor_type(t.name, expected[t.name], type_name, n_layer=8, tied_output=True)


@pytest.mark.parametrize("type_name", FAST_TYPES)
def test_metadata(readers, type_name):
    f = readers[type_name].fields
    value = lambda key: f[key].contents()
    assert value("general.architecture") == "qwen35"
    assert "RANDOM WEIGHTS" in value("general.name")
    assert value("general.file_type") == {"q8_0": 7, "q4_k_m": 15}[type_name]
    assert value("qwen35.block_count") == 8
    assert value("qwen35.embedding_length") == 256
    assert value("qwen35.feed_forward_length") == 768
    assert value("qwen35.attention.head_count") == 2 and value("qwen35.attention.head_count_kv") == 1
    assert value("qwen35.attention.key_length") == value("qwen35.attention.value_length") == 256
    assert value("qwen35.ssm.conv_kernel") == 4 and value("qwen35.ssm.state_size") == 128
    assert value("qwen35.ssm.group_count") == 2 and value("qwen35.ssm.time_step_rank") == 4
    assert value("qwen35.ssm.inner_size") == 512
    assert value("qwen35.full_attention_interval") == 4
    assert value("qwen35.attention.recurrent_layers") == [True, True, True, False] * 2
    assert value("qwen35.rope.dimension_sections") == [11, 11, 10, 0]
    assert value("qwen35.rope.dimension_count") == 64
    assert value("qwen35.rope.freq_base") == pytest.approx(1e7)
    assert value("qwen35.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert value("qwen35.context_length") == 262144
    md = {k: value(k) for k in f if not k.startswith("GGUF.")}
    assert layout.Qwen35Config.from_gguf_metadata(md, tensor_names=[t.name for t in readers[type_name].tensors]) == TINY


def test_padded_vocabulary_and_special_tokens(written, readers):
    md = GGUFFile(written["q8_0"])
    f = readers["q8_0"].fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    assert tokens == md.get("tokenizer.ggml.tokens")  # our reader agrees with gguf's
    assert len(tokens) == len(types) == 248320
    source = GGUFFile(packaged_vocab_path())
    real = source.get("tokenizer.ggml.tokens")
    # Every real token (and so every merge) keeps its id; only placeholders were replaced.
    assert tokens[:151646] == real[:151646]
    assert f["tokenizer.ggml.merges"].contents() == source.get("tokenizer.ggml.merges")
    for text, token_id in CHAT_CONTROL_TOKENS.items():
        assert real[token_id].startswith("[PAD")
        assert tokens.index(text) == token_id and types[token_id] == 3
    assert tokens[-1] == "[PAD248319]" and types[-1] == 3 and types[200000] == 3
    assert f["tokenizer.ggml.eos_token_id"].contents() == tokens.index("<|im_end|>")
    assert f["tokenizer.ggml.eot_token_id"].contents() == tokens.index("<|im_end|>")
    assert f["tokenizer.ggml.padding_token_id"].contents() == tokens.index("<|endoftext|>")
    assert f["tokenizer.ggml.add_bos_token"].contents() is False
    assert f["tokenizer.ggml.pre"].contents() == "qwen35" and f["tokenizer.ggml.model"].contents() == "gpt2"
    assert f["tokenizer.chat_template"].contents() == packaged_chat_template()


@pytest.mark.parametrize("type_name", FAST_TYPES)
def test_dequantized_weights_have_the_intended_scale(readers, type_name):
    for t in readers[type_name].tensors:
        w = dequantized(t)
        assert np.isfinite(w).all(), t.name
        if t.name.endswith("_norm.weight"):
            assert 0.9 <= w.min() and w.max() <= 1.1 and abs(w.mean() - 1) < 0.03, t.name
        elif t.name.endswith(".ssm_a"):
            assert (-16 <= w).all() and (w <= -1).all(), t.name
        elif t.name.endswith(".ssm_dt.bias"):
            assert (w > np.log(np.expm1(1e-3))).all() and (w < np.log(np.expm1(0.1))).all(), t.name
        elif t.name.endswith(".ssm_conv1d.weight"):
            assert np.abs(w).max() <= 0.5 and w.std() > 0.2, t.name
        else:
            tolerance = 0.003 if w.size >= 4096 else 0.006
            assert abs(w.std() - synth.WEIGHT_STD) < tolerance, (t.name, w.std())
            assert abs(w.mean()) < 0.002, t.name
            assert w.max() > 1.5 * synth.WEIGHT_STD and w.min() < -1.5 * synth.WEIGHT_STD
    embedding = dequantized(readers[type_name].tensors[0])
    assert len(np.unique(embedding[:4096], axis=0)) == 4096  # rows are independent


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ["f32", "f16"])
def test_float_files_read_back(tmp_path, type_name):
    path = synth.write(tmp_path / "tiny.gguf", size="tiny", type=type_name, seed=1)
    reader = GGUFReader(path)
    expected = layout.tensor_shapes(TINY)
    assert [t.name for t in reader.tensors] == list(expected)
    for t in reader.tensors:
        assert numpy_shape(t) == expected[t.name]
        w = dequantized(t)
        assert np.isfinite(w).all()
        if not stays_f32(t.name, expected[t.name]):
            assert abs(w.std() - synth.WEIGHT_STD) < 0.006, t.name
    path.unlink()  # 150-300 MB: do not leave it in pytest's kept temporary directories


def test_pooled_weights_for_large_files_are_well_scaled_and_not_repeated():
    # The 27b path: chunks copied from random offsets of one pool of blocks per type.
    weights = synth.RandomWeights(3, False, synth._small_tensor)
    for ggml_type in (Q.Q4_K, Q.Q6_K, Q.Q8_0):
        plan = TensorPlan("blk.0.ffn_up.weight", (8192, 512), ggml_type)
        data = np.concatenate([np.frombuffer(c, dtype=np.uint8) for c in weights(plan)])
        assert data.nbytes == plan.nbytes
        w = quants.dequantize(data, ggml_type).reshape(plan.shape)
        assert np.isfinite(w).all() and abs(w.std() - synth.WEIGHT_STD) < 0.001
        assert len(np.unique(w, axis=0)) == plan.shape[0]


def to_transformers(reader: GGUFReader, cfg: layout.Qwen35Config):
    """A transformers Qwen3_5ForCausalLM holding a GGUF's weights (llama.cpp's transforms undone)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_cfg = Qwen3_5TextConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv, head_dim=cfg.head_dim,
        linear_conv_kernel_dim=cfg.ssm_d_conv, linear_key_head_dim=cfg.ssm_d_state,
        linear_value_head_dim=cfg.ssm_d_state, linear_num_key_heads=cfg.ssm_n_group,
        linear_num_value_heads=cfg.ssm_dt_rank, tie_word_embeddings=cfg.tied_output, rms_norm_eps=cfg.eps,
        layer_types=["linear_attention" if r else "full_attention" for r in cfg.recurrent],
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.rope_dim / cfg.head_dim},
    )
    k, v, d = cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state
    untile = lambda x, dim, width: layout.tiled_to_grouped(x, dim, k, v, width)
    qk = 2 * cfg.gdn_key_dim
    renames = {
        "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight", "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight", "ssm_norm.weight": "linear_attn.norm.weight",
    }
    state = {}
    for t in reader.tensors:
        w = torch.from_numpy(dequantized(t).astype(np.float32))
        if t.name.endswith("_norm.weight") and "ssm_norm" not in t.name:
            w = w - 1
        if t.name == "token_embd.weight":
            state["model.embed_tokens.weight"] = w
            continue
        if t.name == "output_norm.weight":
            state["model.norm.weight"] = w
            continue
        if t.name == "output.weight":
            state["lm_head.weight"] = w
            continue
        _, layer, rest = t.name.split(".", 2)
        prefix = f"model.layers.{layer}."
        if rest in renames:
            state[prefix + renames[rest]] = w
        elif rest == "attn_qkv.weight":
            state[prefix + "linear_attn.in_proj_qkv.weight"] = torch.cat([w[:qk], untile(w[qk:], 0, d)])
        elif rest == "attn_gate.weight":
            state[prefix + "linear_attn.in_proj_z.weight"] = untile(w, 0, d)
        elif rest == "ssm_conv1d.weight":
            state[prefix + "linear_attn.conv1d.weight"] = torch.cat([w[:qk], untile(w[qk:], 0, d)])[:, None, :]
        elif rest == "ssm_dt.bias":
            state[prefix + "linear_attn.dt_bias"] = untile(w, 0, 1)
        elif rest == "ssm_a":
            state[prefix + "linear_attn.A_log"] = torch.log(-untile(w, 0, 1))
        elif rest in ("ssm_beta.weight", "ssm_alpha.weight"):
            state[prefix + f"linear_attn.in_proj_{'b' if 'beta' in rest else 'a'}.weight"] = untile(w, 0, 1)
        elif rest == "ssm_out.weight":
            state[prefix + "linear_attn.out_proj.weight"] = untile(w, 1, d)
        else:
            raise AssertionError(f"unmapped {t.name}")
    model = Qwen3_5ForCausalLM(hf_cfg).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


def test_random_weights_give_finite_varied_logits(readers):
    model = to_transformers(readers["q4_k_m"], TINY)
    ids = torch.tensor([[151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    assert 0.1 < float(logits.std(dim=-1).min()) and float(logits.std(dim=-1).max()) < 10
    assert len(set(logits.argmax(dim=-1).tolist())) > len(ids[0]) // 2  # not one token everywhere


def test_unknown_size_or_type_is_a_user_error(tmp_path):
    with pytest.raises(LuceboxError, match="huge"):
        synth.write(tmp_path / "x.gguf", size="huge")
    with pytest.raises(LuceboxError, match="q2_k"):
        synth.write(tmp_path / "x.gguf", type="q2_k")


# -- the default model --------------------------------------------------------------------------


def test_default_model_is_written_once_atomically_by_racing_processes(tmp_path, written):
    script = "import sys; from pathlib import Path; from lucebox_qwen35.default import provide; print(provide(Path(sys.argv[1])))"
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    path = default.default_path(tmp_path)
    assert outs == [str(path)] * 2
    assert os.listdir(path.parent) == [path.name]  # no temporary file left behind
    # Deterministic: identical to the q8_0 tiny file written by this process with seed 0.
    assert path.read_bytes() == written["q8_0"].read_bytes()
    mtime = path.stat().st_mtime_ns
    assert default.provide(tmp_path) == path and path.stat().st_mtime_ns == mtime  # not rewritten
