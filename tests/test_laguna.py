"""The laguna family (lucebox-laguna): parity with transformers' `LagunaForCausalLM` on a tiny random checkpoint
converted to GGUF (logits, the cached decode path with the sliding rings wrapping, 32 greedy steps), the GGUF
layout against llama.cpp's names and Laguna-XS.2's shape, the synthetic files through the engine and the CLI,
and refusals of what the layout cannot hold."""

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
from lucebox_laguna import convert, layout, synth
from lucebox_laguna.loader import load

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0)
N_LAYER = 5
WINDOW = 8


def _hf_config(**overrides):
    settings = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYER, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_attention_heads_per_layer=[4, 8, 8, 8, 4],
        layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(N_LAYER)],
        sliding_window=WINDOW,
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
                               "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 64.0,
                               "beta_slow": 1.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
        moe_routed_scaling_factor=2.5, gating=True, max_position_embeddings=131072, bos_token_id=2,
        eos_token_id=[2, 24], pad_token_id=9,
    )
    settings.update(overrides)
    return transformers.LagunaConfig(**settings)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """A tiny random `LagunaForCausalLM` (norms, router bias and weights perturbed so every transform shows),
    saved as a checkpoint, converted to an f32 GGUF and loaded."""
    torch.manual_seed(0)
    model = transformers.LagunaForCausalLM(_hf_config()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif "e_score_correction_bias" in name:
                param.copy_(0.05 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn_like(buffer))
    folder = tmp_path_factory.mktemp("laguna-hf")
    model.save_pretrained(folder)
    gguf = convert.convert(folder, folder / "tiny.gguf")
    return model, load(gguf), gguf


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(32, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(hf_pair):
    hf, ours, _ = hf_pair
    ids = _ids(3 * WINDOW + 5)  # longer than the window: the sliding layers' mask matters
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    got = ours.forward(ours.new_state(128), ids)
    assert (got - expected).abs().max().item() < 1e-4
    # The cached path the engine decodes with: prefill, then one token at a time, the rings wrapping.
    state = ours.new_state(128)
    steps = [ours.forward(state, ids[:4])] + [ours.forward(state, ids[i : i + 1]) for i in range(4, len(ids))]
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
    ids = _ids(2 * WINDOW + 3, seed=3)
    eager, static = ours.new_state(64), ours.new_state(64)
    ours.forward(eager, ids[:5]), ours.forward(static, ids[:5])
    for token in ids[5:]:
        expected = ours.forward(eager, token.reshape(1))
        got = ours.decode_step(static, token.reshape(1), graphs=False)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_converted_file_carries_llama_cpp_conventions(hf_pair):
    hf, _, gguf = hf_pair
    file = GGUFFile(gguf)
    md = {key: file.get(key) for key in file.keys() if key != "tokenizer.ggml.merges"}
    assert file.architecture == "laguna"
    assert md["laguna.attention.head_count"] == [4, 8, 8, 8, 4]
    assert md["laguna.rope.scaling.type"] == "yarn" and md["laguna.rope.dimension_count"] == 8
    assert md["laguna.rope.dimension_count_swa"] == 16 and md["laguna.expert_gating_func"] == 2
    assert md["laguna.leading_dense_block_count"] == 1 and md["laguna.expert_weights_scale"] == 2.5
    assert md["tokenizer.ggml.pre"] == "laguna" and md["tokenizer.ggml.bos_token_id"] == 2
    assert md["tokenizer.ggml.eot_token_id"] == 24
    stack = file.tensor("blk.1.ffn_gate_exps.weight").dequantize()
    assert stack.shape == (8, 32, 64)
    expert = hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"][2, :32]  # transformers fuses [gate | up]
    torch.testing.assert_close(stack[2], expert)
    bias = hf.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"]
    torch.testing.assert_close(file.tensor("blk.1.exp_probs_b.bias").dequantize(), bias)


def test_tensor_names_are_llama_cpps():
    names = set(layout.tensor_shapes(layout.size("xs2")))
    for name in ("blk.0.ffn_gate.weight", "blk.1.exp_probs_b.bias", "blk.1.ffn_gate_shexp.weight",
                 "blk.39.attn_gate.weight", "blk.5.ffn_down_exps.weight", "output.weight"):
        assert name in names
    assert "blk.0.ffn_gate_inp.weight" not in names and "blk.1.ffn_gate.weight" not in names


def test_the_xs2_size_is_laguna_xs2():
    cfg = layout.size("xs2")
    shapes = layout.tensor_shapes(cfg)
    assert cfg.n_head[:4] == (48, 64, 64, 64) and shapes["blk.0.attn_gate.weight"] == (48, 2048)
    assert shapes["blk.1.attn_q.weight"] == (64 * 128, 2048) and shapes["blk.2.ffn_up_exps.weight"] == (256, 512, 2048)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert 32e9 < total < 34e9  # ~33B parameters
    assert cfg.yarn_attention_factor == pytest.approx(1.3466, abs=1e-4)
    metadata = {"general.architecture": "laguna", **cfg.to_gguf_metadata()}
    assert layout.LagunaConfig.from_gguf_metadata(metadata, tensor_names=shapes) == cfg


def test_an_xs2_style_config_converts_to_the_xs2_size():
    """Laguna-XS.2's config.json shape (models.md 1.4), with YaRN's factor and original context at the top level
    of `rope_parameters` as XS.2 stores them, reads as the `xs2` layout."""
    n = 40
    config = {
        "model_type": "laguna", "vocab_size": 100352, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": n, "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
        "num_attention_heads_per_layer": [48 if i % 4 == 0 else 64 for i in range(n)],
        "layer_types": ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)],
        "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1), "sliding_window": 512, "gating": True,
        "rope_parameters": {
            "factor": 32.0, "original_max_position_embeddings": 4096,
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
                               "beta_fast": 64.0, "beta_slow": 1.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "moe_routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    }
    assert convert.config_from_hf(config, tied_output=False) == layout.size("xs2")


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("laguna") / "tiny-q8_0.gguf", size="tiny", type="q8_0", seed=5)


def test_synthetic_tiny_generates_through_the_engine(tiny_file):
    from lucebox_core.assembly import build_engine  # noqa: F401 (the same path `lucebox generate` takes)

    model = load(tiny_file)
    assert model.config == layout.size("tiny") and model.vocab_size == 100352
    from lucebox_core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(tiny_file)
    engine = Engine(model, tokenizer, ctx_size=128)
    prompt = tokenizer.encode("Hello from a tiny Laguna", add_bos=True)
    first = engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=GREEDY, ignore_eos=True))
    again = engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=GREEDY, ignore_eos=True))
    assert len(first.token_ids) == 24 and first.token_ids == again.token_ids  # past the 16-row rings, same state reuse
    assert not set(first.token_ids) & set(tokenizer.unused_ids())  # padding placeholders never sampled


@pytest.mark.slow
def test_cli_synth_convert_and_generate(tmp_path, tiny_file, hf_pair):
    out = tmp_path / "cli.gguf"
    run = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "synth", "--arch", "laguna", "--size", "tiny",
                          "--type", "q8_0", "--seed", "5", "-o", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert out.read_bytes() == tiny_file.read_bytes()  # a function of the seed
    run = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "generate", "-m", str(out), "--chat", "-p", "Hi",
                          "-n", "6", "--temp", "0", "--ignore-eos", "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 6
    _, _, converted = hf_pair
    run = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "convert", str(converted.parent), "-o",
                          str(tmp_path / "c.gguf"), "--type", "f16"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert GGUFFile(tmp_path / "c.gguf").tensor("blk.2.ffn_down_exps.weight").ggml_type.name == "F16"
    bad = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "synth", "--arch", "laguna", "--size", "huge",
                          "-o", str(tmp_path / "x.gguf")], capture_output=True, text=True)
    assert bad.returncode == 2 and "tiny, xs2" in bad.stderr


def test_unsupported_layouts_are_refused_by_name(tmp_path):
    per_element = _hf_config(gating="per-element")
    with pytest.raises(ValueError, match="per-head"):
        convert.config_from_hf(per_element.to_dict(), tied_output=False)
    all_full = _hf_config(layer_types=["full_attention"] * N_LAYER)
    with pytest.raises(ValueError, match="every 4th layer"):
        convert.config_from_hf(all_full.to_dict(), tied_output=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    with pytest.raises(LuceboxError, match="not Laguna"):
        convert.convert(tmp_path, tmp_path / "x.gguf")


def test_a_missing_tensor_is_named(hf_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, gguf = hf_pair
    source = gguf.parent
    weights = load_file(source / "model.safetensors")
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    with pytest.raises(LuceboxError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        convert.convert(tmp_path, tmp_path / "x.gguf")


def test_family_ops_do_not_collide_with_any_backends_own():
    from lucebox_core.torch_backend import TorchBackend
    from lucebox_laguna.ops import LAGUNA_OPS

    assert not set(LAGUNA_OPS.references) & set(dir(TorchBackend))


LLAMA_SERVER = os.environ.get("LUCEBOX_LLAMA_SERVER", "")


@pytest.mark.slow
@pytest.mark.skipif(not os.access(LLAMA_SERVER, os.X_OK), reason="set LUCEBOX_LLAMA_SERVER to a llama-server binary "
                    "(a CPU build of the llama.cpp in ../shared/tools/llamacpp) to compare with llama.cpp")
def test_greedy_tokens_match_llama_cpp_on_the_cpu(tmp_path):
    """llama.cpp on the CPU (f32 KV, flash attention off) and Lucebox give the same 24 greedy tokens (argmax over
    every row, padding included, as llama.cpp's greedy is) on the tiny f32 file, prompts past the window."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import llamacpp_crosscheck as crosscheck

    path = synth.write(tmp_path / "tiny-f32.gguf", size="tiny", type="f32", seed=1)
    prompts = crosscheck.PROMPTS_BY_ARCH["laguna"]
    theirs = crosscheck.llama_tokens(LLAMA_SERVER, path, prompts, port=8957, ngl=0)
    ours, _ = crosscheck.argmax_tokens(path, prompts, "cpu")
    assert ours == theirs


def test_fused_projections_give_the_apart_logits(tiny_file):
    """A backend that stacks projections (`fuse_rows`, as the CUDA one does) gets [q | k | v | g] and the MLPs'
    [gate | up] back in the right rows: the same logits as the reference that keeps them apart."""
    from lucebox_core.torch_backend import TorchBackend, concat_rows

    class Stacking(TorchBackend):
        def fuse_rows(self, weights):
            return concat_rows(weights)

    ids = torch.randint(0, 100352, (12,), generator=torch.Generator().manual_seed(3))
    apart = load(tiny_file)
    fused = load(tiny_file, backend=Stacking("cpu", torch.float32))
    attention, shared = fused.layers[-1].self_attn, fused.layers[-1].mlp.shared_expert
    assert attention.in_proj is not None and attention.in_proj_parts >= 2 and shared.gate_up_proj is not None
    torch.testing.assert_close(fused(fused.new_state(32), ids), apart(apart.new_state(32), ids), atol=1e-4, rtol=1e-4)
