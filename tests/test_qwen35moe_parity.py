"""qwen35moe forward pass vs transformers: a tiny random Qwen3_5MoeForCausalLM -> save_pretrained -> `lucebox
convert` to an f32 GGUF -> load -> logits on the prompt and on 32 greedy decode steps agree with transformers
(the routed experts, the softmax top-k router and the gated shared expert included)."""

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from lucebox_core.errors import GGUFError, LuceboxError
from lucebox_core.ggufio import GGUFFile
from lucebox_core.plugins import registry
from lucebox_core.torch_backend import TorchBackend

transformers = pytest.importorskip("transformers")
from lucebox_qwen35.convert import convert, convert_moe
from lucebox_qwen35.layout_moe import Qwen35MoeConfig
from lucebox_qwen35.loader import load, load_moe
from lucebox_qwen35.moe import SparseMoeBlock
from test_qwen35_parity import relative_error, rewrite_gguf, write_byte_tokenizer
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

VOCAB = 320
DECODE_STEPS = 32
EXPERTS, TOP_K = 6, 2


def tiny_config(*, tied: bool) -> Qwen3_5MoeTextConfig:
    # Four layers: GDN x3 then full attention; 2 GDN key heads / 4 value heads (the V-head reorder); 6 experts,
    # top-2, expert and shared-expert widths that differ so a swapped stack cannot load.
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, tie_word_embeddings=tied,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )


def random_model(config: Qwen3_5MoeTextConfig, seed: int) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                # Zero-centred norms, dt_bias, A_log: moved off their init so every transform shows.
                param.add_(torch.randn_like(param) * 0.5)
            elif name.endswith("mlp.gate.weight"):
                # The router starts at zero (every expert tied): spread it so the top-k choice is clear-cut.
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.15)  # logits of order 1, so a mistake cannot hide in noise
    return model


CASES = {"untied": {"tied": False, "seed": 11}, "tied": {"tied": True, "seed": 12}}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    case = CASES[request.param]
    hf_model = random_model(tiny_config(tied=case["tied"]), case["seed"])
    folder = tmp_path_factory.mktemp(f"moe-{request.param}")
    hf_model.save_pretrained(folder / "hf")
    write_byte_tokenizer(folder / "hf" / "tokenizer.json")
    gguf_path = folder / "model.gguf"
    # The user's way in: `lucebox convert` picks the qwen35moe converter by the checkpoint's model_type.
    done = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "convert", str(folder / "hf"), "-o",
                           str(gguf_path), "--type", "f32"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return hf_model, gguf_path, case


def test_converted_file_has_llama_cpp_moe_layout(converted):
    _, gguf_path, case = converted
    file = GGUFFile(gguf_path)
    assert file.architecture == "qwen35moe"
    assert file.get("qwen35moe.expert_count") == EXPERTS
    assert file.get("qwen35moe.expert_used_count") == TOP_K
    assert file.get("qwen35moe.expert_feed_forward_length") == 32
    assert file.get("qwen35moe.expert_shared_feed_forward_length") == 48
    assert "qwen35moe.feed_forward_length" not in file.keys()
    assert "blk.0.ffn_gate.weight" not in file.tensors
    assert ("output.weight" in file.tensors) == (not case["tied"])


def test_prompt_and_greedy_decode_match_transformers(converted):
    hf_model, gguf_path, case = converted
    model = load_moe(gguf_path, TorchBackend())
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    assert isinstance(model.config, Qwen35MoeConfig) and model.tied_embeddings == case["tied"]
    prompt = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(case["seed"]))

    state = model.new_state(128)
    errors = []
    with torch.no_grad():
        hf_out = hf_model(prompt, use_cache=True)
        logits = model.forward(state, prompt[0])
        assert logits.shape == (21, VOCAB)
        errors.append(relative_error(logits, hf_out.logits[0]))

        cache, hf_tokens, our_tokens = hf_out.cache, [], []
        hf_next, our_next = hf_out.logits[0, -1].argmax(), logits[-1].argmax()
        for _ in range(DECODE_STEPS):
            hf_tokens.append(int(hf_next))
            our_tokens.append(int(our_next))
            # Both sides are fed transformers' token, so one flip would not derail the comparison after it.
            hf_out = hf_model(hf_next.view(1, 1), cache=cache, use_cache=True)
            cache = hf_out.cache
            step_logits = model.forward(state, hf_next.view(1))
            errors.append(relative_error(step_logits[0], hf_out.logits[0, -1]))
            hf_next, our_next = hf_out.logits[0, -1].argmax(), step_logits[0].argmax()
    assert max(errors) < 1e-4, errors
    assert our_tokens == hf_tokens
    assert len(set(hf_tokens)) > 1, "degenerate test model: greedy decode repeats one token"


def test_routing_is_not_degenerate(converted):
    """The test model uses its experts: every one is some token's choice, and a token's top-k weights differ."""
    hf_model, _, case = converted
    prompt = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(case["seed"]))
    with torch.no_grad():
        out = hf_model(prompt, output_router_logits=True)
    chosen = torch.cat([logits.topk(TOP_K, dim=-1).indices.reshape(-1) for logits in out.router_logits])
    assert set(chosen.tolist()) == set(range(EXPERTS))


def test_load_model_dispatches_and_chunked_prefill_matches(converted):
    hf_model, gguf_path, _ = converted
    family = registry().family_for("qwen35moe", gguf_path)  # what `lucebox serve` picks by the architecture
    assert family.name == "qwen35moe"
    model = family.load(GGUFFile(gguf_path), TorchBackend(), gdn_chunk_size=8)  # several GDN chunks per call
    prompt = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hf_out = hf_model(prompt)
    state = model.new_state()
    first = model.forward(state, prompt[0, :13])
    second = model.forward(state, prompt[0, 13:])
    assert relative_error(torch.cat([first, second]), hf_out.logits[0]) < 1e-4


@pytest.mark.parametrize("converted", ["untied"], indirect=True)
def test_wrong_family_and_broken_files_are_named(converted, tmp_path):
    hf_model, gguf_path, _ = converted
    with pytest.raises(GGUFError, match=r"'qwen35moe'.*expected 'qwen35'"):
        load(gguf_path)
    # The dense converter refuses a MoE checkpoint by its model_type, naming both.
    with pytest.raises(LuceboxError, match=r"qwen3_5_moe_text.*dense Qwen3\.5"):
        convert(gguf_path.parent / "hf", tmp_path / "x.gguf")
    stack = "blk.2.ffn_up_exps.weight"
    rewrite_gguf(gguf_path, tmp_path / "misshaped.gguf", reshape=stack)
    with pytest.raises(GGUFError, match=rf"misshaped\.gguf.*{stack}.*shape"):
        load_moe(tmp_path / "misshaped.gguf")
    missing = "blk.1.ffn_gate_inp_shexp.weight"
    rewrite_gguf(gguf_path, tmp_path / "missing.gguf", drop=missing)
    with pytest.raises(GGUFError, match=rf"missing\.gguf.*{missing}"):
        load_moe(tmp_path / "missing.gguf")
    # A checkpoint without one expert's weights is refused before anything is written.
    hf_dir = tmp_path / "hf"
    shutil.copytree(gguf_path.parent / "hf", hf_dir)
    weights = load_file(hf_dir / "model.safetensors")
    del weights["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(weights, hf_dir / "model.safetensors")
    with pytest.raises(LuceboxError, match=r"experts\.3\.down_proj"):
        convert_moe(hf_dir, tmp_path / "y.gguf")
    assert not (tmp_path / "y.gguf").exists()
