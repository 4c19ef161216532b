"""qwen35moe (Qwen3.5 / Qwen3.6 MoE): the layout of the real 35B-A3B and of the synthetic tiny size, files written by
`lucebox synth --arch qwen35moe`, and speculative decoding on such a target (a synthesized DFlash drafter, chain
and DDTree verification) giving exactly plain greedy's tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.errors import LuceboxError
from lucebox_core.filetypes import stays_f32
from lucebox_core.ggufio import GGUFFile
from lucebox_core.loading import load_model
from lucebox_core.sampling import SamplingParams
from lucebox_core.speculative import SpeculativeDecoder, dflash
from lucebox_qwen35 import layout, layout_moe
from lucebox_qwen35.layout_moe import MOE_SIZES, Qwen35MoeConfig
from lucebox_qwen35.moe import SparseMoeBlock

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5], [9000, 17, 42], [151644, 872, 198, 3838, 374, 220]]


def _params(shapes: dict[str, tuple[int, ...]], keep=lambda name: True) -> int:
    return sum(int(np.prod(shape)) for name, shape in shapes.items() if keep(name))


# -- layout -----------------------------------------------------------------------------------------


def test_35b_a3b_shapes_match_llama_cpp():
    # models.md 1.2 and llama.cpp's qwen35moe loader (numpy order: rows = out, cols = in).
    cfg = layout_moe.size("35b-a3b")
    s = layout.tensor_shapes(cfg)
    assert s["blk.0.ffn_gate_inp.weight"] == (256, 2048)
    assert s["blk.0.ffn_gate_exps.weight"] == s["blk.0.ffn_up_exps.weight"] == (256, 512, 2048)
    assert s["blk.39.ffn_down_exps.weight"] == (256, 2048, 512)
    assert s["blk.3.ffn_gate_inp_shexp.weight"] == (2048,)
    assert s["blk.3.ffn_gate_shexp.weight"] == s["blk.3.ffn_up_shexp.weight"] == (512, 2048)
    assert s["blk.3.ffn_down_shexp.weight"] == (2048, 512)
    assert s["blk.0.attn_qkv.weight"] == (2 * 16 * 128 + 32 * 128, 2048)  # 16 key / 32 value GDN heads
    assert s["blk.3.attn_q.weight"] == (2 * 16 * 256, 2048)
    assert s["output.weight"] == (248320, 2048)
    assert not any(name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")) for name in s)
    assert cfg.full_layers == list(range(3, 40, 4))
    assert len(s) == 3 + 10 * 16 + 30 * 19  # the dense counts (11, 14) with 8 MoE tensors for the 3 FFN ones
    # 35B parameters in all, about 3B active per token (top-8 of 256 experts, the shared one, the rest).
    total = _params(s)
    routed = _params(s, lambda name: "_exps." in name)
    active = total - routed + routed * cfg.n_expert_used // cfg.n_expert
    assert 34e9 < total < 36e9 and 2.5e9 < active < 3.5e9
    metadata = cfg.to_gguf_metadata()
    assert metadata["qwen35moe.expert_count"] == 256 and metadata["qwen35moe.expert_used_count"] == 8
    assert metadata["qwen35moe.expert_feed_forward_length"] == 512
    assert metadata["qwen35moe.expert_shared_feed_forward_length"] == 512
    assert "qwen35moe.feed_forward_length" not in metadata


def test_configs_round_trip_through_metadata_and_bad_ones_are_refused():
    for cfg in MOE_SIZES.values():
        names = layout.tensor_shapes(cfg)
        assert Qwen35MoeConfig.from_gguf_metadata(cfg.to_gguf_metadata(), tensor_names=names) == cfg
    with pytest.raises(ValueError, match="top-9 of 8 experts"):
        Qwen35MoeConfig(n_layer=4, hidden=64, n_head=2, n_head_kv=1, head_dim=32, ssm_n_group=1, ssm_dt_rank=1,
                        ssm_d_inner=128, n_expert=8, n_expert_used=9, expert_ffn=32, shared_expert_ffn=32)


def test_tiny_size_is_k_quant_friendly():
    tiny = layout_moe.size("tiny")
    assert tiny.n_expert_used < tiny.n_expert and tiny.full_layers and tiny.ssm_n_group < tiny.ssm_dt_rank
    for name, shape in layout.tensor_shapes(tiny).items():
        assert stays_f32(name, shape) or shape[-1] % 256 == 0, name


def test_unknown_size_is_a_user_error(tmp_path):
    from lucebox_qwen35 import synth

    with pytest.raises(LuceboxError, match="35b-a3b"):
        synth.write_moe(tmp_path / "x.gguf", size="27b")


# -- synthesized files, and speculative decoding on them ---------------------------------------------


def _lucebox(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "lucebox_core.cli", *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-spec")
    target, draft = folder / "tiny-moe.gguf", folder / "draft.gguf"
    _lucebox("synth", "--arch", "qwen35moe", "--size", "tiny", "--seed", "3", "-o", str(target))
    _lucebox("synth", "--arch", "qwen35-dflash-draft", "--target", str(target), "--seed", "4", "-o", str(draft))
    return target, draft


@pytest.fixture(scope="module")
def loaded(files):
    return load_model(files[0])


@pytest.fixture(scope="module")
def drafter(files, loaded):
    return dflash.load(files[1], loaded.model)


def test_synthesized_file_loads_as_the_moe_family(files, loaded):
    file = GGUFFile(files[0])
    assert file.architecture == "qwen35moe" and file.get("qwen35moe.expert_count") == 8
    assert loaded.family.name == "qwen35moe"
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in loaded.model.layers)
    logits = loaded.model.forward(loaded.model.new_state(32), torch.tensor(PROMPTS[0]))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_one_token_steps_equal_a_prefill(loaded):
    """The decode step (the routed experts on one token) gives the prefill's logits position by position."""
    model, prompt = loaded.model, torch.tensor(PROMPTS[2])
    full = model.forward(model.new_state(32), prompt)
    state = model.new_state(32)
    steps = torch.stack([model.forward(state, token.view(1))[0] for token in prompt])
    torch.testing.assert_close(steps, full, atol=2e-4, rtol=1e-4)


def _engine(loaded, drafter=None, spec_type="ddtree"):
    speculative = None if drafter is None else SpeculativeDecoder(loaded.model, drafter, spec_type=spec_type)
    return Engine(loaded.model, loaded.tokenizer, ctx_size=256, speculative=speculative)


def _greedy(engine, prompt, n, **fields):
    return engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=GREEDY, ignore_eos=True,
                                             **fields))


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
def test_speculative_greedy_equals_plain_greedy(loaded, drafter, spec_type):
    plain, spec = _engine(loaded), _engine(loaded, drafter, spec_type)
    for prompt in PROMPTS[:2]:
        expected = _greedy(plain, prompt, 6)
        result = _greedy(spec, prompt, 6)
        assert result.token_ids == expected.token_ids
        assert len(result.timings.accepted_lengths) >= 1


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
def test_forced_acceptance_equals_plain_greedy(loaded, drafter, spec_type):
    """Whole accepted blocks (forced: a random drafter accepts almost nothing) commit exactly plain greedy's path
    through the verifier: the routed experts of a verify pass match the decode step's."""
    accept, prompt = 5, PROMPTS[2]
    n = 2 * (accept + 1) + 1  # the first token, then two whole blocks
    reference = _greedy(_engine(loaded), prompt, 24).token_ids
    result = _greedy(_engine(loaded, drafter, spec_type), prompt, n, force_accept=accept, force_reference=reference)
    assert result.token_ids == reference[:n]
    assert result.timings.accepted_lengths[:2] == [accept + 1] * 2


LLAMA_SERVER = os.environ.get("LUCEBOX_LLAMA_SERVER", "")


@pytest.mark.slow
@pytest.mark.skipif(not os.access(LLAMA_SERVER, os.X_OK), reason="set LUCEBOX_LLAMA_SERVER to a llama-server binary "
                    "(a CPU build of the llama.cpp in ../shared/tools/llamacpp) to compare with llama.cpp")
def test_greedy_tokens_match_llama_cpp_on_the_cpu(files):
    """llama.cpp on the CPU (f32 KV, flash attention off) and Lucebox give the same 24 greedy tokens (argmax over
    every row, as llama.cpp's greedy is) on the synthesized tiny f32 qwen35moe file."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import llamacpp_crosscheck as crosscheck

    prompts = crosscheck.PROMPTS_BY_ARCH["qwen35moe"][:3]
    theirs = crosscheck.llama_tokens(LLAMA_SERVER, files[0], prompts, port=8959, ngl=0)
    ours, _ = crosscheck.argmax_tokens(files[0], prompts, "cpu")
    assert ours == theirs
