"""Gemma-4 on the CPU reference backend: parity with transformers (dense and MoE), the sliding layers' ring,
the GGUF layout against llama.cpp's names and the real model's metadata, bad files, and speculative decoding
with a DFlash drafter (lossless at temperature 0, every forced acceptance length)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.errors import GGUFError
from lucebox_core.ggufio import GGUFFile
from lucebox_core.loading import load_model
from lucebox_core.sampling import SamplingParams
from lucebox_core.speculative import SpeculativeDecoder, dflash
from lucebox_gemma4 import layout, synth
from lucebox_gemma4.convert import convert
from lucebox_gemma4.loader import load

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0)
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]


def _hf_config(moe: bool):
    kwargs = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
                  sliding_window=16, layer_types=LAYER_TYPES, attention_k_eq_v=True, final_logit_softcapping=30.0,
                  hidden_size_per_layer_input=0, max_position_embeddings=4096)
    if moe:
        kwargs.update(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=128)
    return transformers.Gemma4TextConfig(**kwargs)


@pytest.fixture(scope="module", params=["dense", "moe"])
def hf_pair(request, tmp_path_factory):
    """A tiny random transformers Gemma-4 (every norm, scale and layer scalar perturbed), its checkpoint folder
    and the GGUF converted from it."""
    torch.manual_seed(7 if request.param == "dense" else 8)
    model = transformers.Gemma4ForCausalLM(_hf_config(request.param == "moe")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                # Scale-1.0 attention over unit-RMS q and k: weights near 1 make softmax so sharp that float32
                # roundoff alone moves logits by 1e-3 (transformers' eager vs sdpa); learned ones are smaller.
                p.uniform_(0.3, 0.5)
            elif "norm" in name or "scale" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.03)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.0)
    folder = tmp_path_factory.mktemp(f"gemma4-hf-{request.param}")
    model.save_pretrained(folder / "hf")
    gguf = convert(folder / "hf", folder / "model.gguf", type="f32")
    return request.param, model, load(gguf), gguf


def test_logits_match_transformers(hf_pair):
    kind, reference, ours, _ = hf_pair
    ids = torch.randint(0, 1024, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits[0]
    got = ours.forward(ours.new_state(128), ids[0])
    assert (got - expected).abs().max().item() < 1e-4, kind
    # The cached path the engine decodes with (prefill, then one token at a time, the ring wrapping) too.
    state = ours.new_state(128)
    steps = [ours.forward(state, ids[0, :20])] + [ours.forward(state, ids[0, i : i + 1]) for i in range(20, 40)]
    assert (torch.cat(steps) - expected).abs().max().item() < 1e-4, kind


def test_greedy_tokens_match_transformers_for_32_steps(hf_pair):
    kind, reference, ours, _ = hf_pair
    prompt = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=32, do_sample=False)[0, 12:].tolist()
    state = ours.new_state(128)
    logits, tokens = ours.forward(state, prompt[0], last_only=True), []
    for _ in range(32):  # 44 positions: the 16-row rings wrap almost three times
        tokens.append(int(logits[-1].argmax()))
        logits = ours.forward(state, torch.tensor([tokens[-1]]))
    assert tokens == expected, kind


def test_static_decode_step_equals_forward(hf_pair):
    _, _, ours, _ = hf_pair
    ids = torch.arange(100, 140)
    eager, static = ours.new_state(64), ours.new_state(64)
    ours.forward(eager, ids[:10])
    ours.forward(static, ids[:10])
    for token in ids[10:]:  # 30 steps: past the window, every sliding slot rewritten
        a = ours.forward(eager, token.reshape(1))
        b = ours.decode_step(static, token.reshape(1), graphs=False)
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_sliding_layers_keep_a_ring_of_the_window(hf_pair):
    _, _, ours, _ = hf_pair
    state = ours.new_state(4096)
    ours.forward(state, torch.arange(50))
    for layer in ours.layers:
        keys, _ = state.kv.gather(layer.index, 4096)
        if ours.config.is_sliding(layer.index):
            assert keys.shape[0] == 16  # the window, whatever the context
        else:
            assert keys.shape[0] == 4096
    # Two chunks, the second longer than the window, equal one pass.
    whole, chunked = ours.new_state(128), ours.new_state(128)
    expected = ours.forward(whole, torch.arange(300, 345))
    got = torch.cat([ours.forward(chunked, torch.arange(300, 310)), ours.forward(chunked, torch.arange(310, 345))])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_converted_file_carries_llama_cpp_conventions(hf_pair):
    kind, reference, _, gguf = hf_pair
    file = GGUFFile(gguf)
    factors = file.tensor("rope_freqs.weight").dequantize()
    assert factors.tolist() == [1.0] * 16 + [float(np.float32(1e30))] * 48  # 0.25 of the 64 pairs of a 128-dim full head rotate
    assert file.get("gemma4.attention.head_count_kv") == [2, 2, 1, 2, 2, 1]
    assert file.get("gemma4.attention.sliding_window_pattern") == [t == "sliding_attention" for t in LAYER_TYPES]
    assert "blk.2.attn_v.weight" not in file.tensors and "blk.1.attn_v.weight" in file.tensors  # k_eq_v
    scalar = file.tensor("blk.3.layer_output_scale.weight").dequantize()
    torch.testing.assert_close(scalar, reference.model.layers[3].layer_scalar.detach())
    if kind == "moe":
        scale = file.tensor("blk.0.ffn_down_exps.scale").dequantize()
        torch.testing.assert_close(scale, reference.model.layers[0].router.per_expert_scale.detach())


# -- the layout and synthetic files ------------------------------------------------------------------


def test_tensor_names_are_llama_cpps():
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.GEMMA4]}
    for size in ("tiny", "tiny-moe", "26b-a4b", "31b"):
        for name in layout.tensor_shapes(layout.size(size)):
            base = name.rsplit(".", 1)[0]
            generic = base if not base.startswith("blk.") else "blk.{bid}." + base.split(".", 2)[2]
            assert generic in known, (size, name)


def test_the_real_26b_metadata_reads_back_as_the_26b_size():
    # The packaged tokenizer is a vocab-only GGUF of the real Gemma-4-26B-A4B: its hyper-parameters are real.
    real = GGUFFile(synth.packaged_vocab_path())
    metadata = {key: real.get(key) for key in real.keys() if not key.startswith("tokenizer.") or key == "tokenizer.ggml.tokens"}
    config = layout.Gemma4Config.from_gguf_metadata(metadata)
    expected = layout.size("26b-a4b")
    assert config == expected
    ours = expected.to_gguf_metadata()
    for key, value in ours.items():
        got = metadata[key]
        assert (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value) == got, key


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4-tiny")
    target = synth.write(folder / "target.gguf", size="tiny", type="f32", seed=11)
    moe = synth.write(folder / "moe-q8.gguf", size="tiny-moe", type="q8_0", seed=12)
    draft = synth.write_draft(folder / "draft.gguf", size="tiny", type="f32", seed=13, target=target)
    return target, moe, draft


def test_synthetic_files_load_with_the_real_vocabulary(tiny_files):
    target, moe, _ = tiny_files
    loaded = load_model(target)
    assert loaded.model.vocab_size == 262144 == loaded.tokenizer.vocab_size
    ids = loaded.tokenizer.encode("<|turn>user\nHello<turn|>", parse_special=True)
    assert ids[:2] == [2, 105]  # <bos> then the turn opener, one control token
    assert 106 in loaded.tokenizer.eot_ids  # <turn|> ends generation
    assert "<|turn>" in GGUFFile(target).get("tokenizer.chat_template")
    model = load(moe)
    assert model.config.is_moe and model.layers[0].moe.gate_up_proj.ggml_type.name == "Q8_0"
    logits = model.forward(model.new_state(64), torch.tensor([2, 105, 2364]))
    assert torch.isfinite(logits).all() and logits.abs().max() <= 30.0  # the soft-cap holds


def test_q4_k_m_types(tmp_path):
    plans = {p.name: p.ggml_type.name for p in synth.tensor_plans(layout.size("26b-a4b"), "q4_k_m")}
    assert plans["blk.0.ffn_gate_inp.weight"] == "F32"  # routers stay F32, as llama.cpp keeps them
    assert plans["blk.0.ffn_gate_up_exps.weight"] == "Q4_K"
    assert plans["blk.0.ffn_down_exps.weight"] == "Q5_0"  # rows of 704: not a multiple of 256
    assert plans["token_embd.weight"] == "Q6_K"  # tied output
    assert plans["blk.0.attn_v.weight"] == "Q6_K" and plans["blk.5.attn_k.weight"] == "Q4_K"


# -- bad files ---------------------------------------------------------------------------------------


def _copy_without(source, destination, dropped):
    src = GGUFFile(source)
    writer = GGUFWriter(str(destination), "gemma4")
    for key in src.keys():
        if key.startswith("gemma4.") or key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.merges":
            value = src.get(key)
            vtype, sub = src.value_type(key)
            writer.add_key_value(key, value, vtype, sub)
    for name, info in src.tensors.items():
        if name != dropped:
            writer.add_tensor(name, np.asarray(src.tensor(name).dequantize().numpy(), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return destination


def test_a_missing_tensor_is_named(tiny_files, tmp_path):
    broken = _copy_without(tiny_files[0], tmp_path / "broken.gguf", "blk.3.attn_k_norm.weight")
    with pytest.raises(GGUFError, match="blk.3.attn_k_norm.weight"):
        load(broken)


def test_unsupported_layouts_are_refused_by_name(tmp_path):
    writer = GGUFWriter(str(tmp_path / "e2b.gguf"), "gemma4")
    for key, value in layout.size("tiny").to_gguf_metadata().items():
        vtype, sub = layout.METADATA_TYPES.get(key.removeprefix("gemma4."), (GGUFValueType.UINT32, None))
        writer.add_key_value(key, 256 if key.endswith("per_layer_input") else value, vtype, sub)
    writer.add_tensor("token_embd.weight", np.zeros((8, 256), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="per-layer input embeddings"):
        load(tmp_path / "e2b.gguf")


# -- speculative decoding ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_setup(tiny_files):
    loaded = load_model(tiny_files[0])
    return loaded, dflash.load(tiny_files[2], loaded.model)


def _engine(loaded, drafter=None, spec_type="ddtree"):
    speculative = None if drafter is None else SpeculativeDecoder(loaded.model, drafter, spec_type=spec_type)
    return Engine(loaded.model, loaded.tokenizer, ctx_size=256, speculative=speculative)


def _greedy(engine, prompt, n, **fields):
    return engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=GREEDY, ignore_eos=True,
                                             **fields))


def test_the_drafter_reads_the_targets_mask_token_and_captured_layers(spec_setup):
    loaded, drafter = spec_setup
    assert drafter.mask_token_id == 4 and GGUFFile(drafter.source).architecture == "gemma4-dflash-draft"
    assert max(drafter.config.target_layer_ids) < len(loaded.model.layers)


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
def test_drafted_output_equals_plain_greedy(spec_setup, spec_type):
    loaded, drafter = spec_setup
    prompt = [2, 105, 2364, 107, 9259]
    assert _greedy(_engine(loaded, drafter, spec_type), prompt, 6).token_ids == _greedy(_engine(loaded), prompt, 6).token_ids


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
@pytest.mark.parametrize("accept", [0, 1, 2, 3, 5, 8, 11, 15])
def test_every_forced_acceptance_equals_plain_greedy(spec_setup, spec_type, accept):
    loaded, drafter = spec_setup
    prompt = [2, 105, 2364, 107, 1000 + accept]
    n = 2 * (accept + 1) + 1  # the first token, then two whole blocks: the sliding rings wrap (window 16)
    reference = _greedy(_engine(loaded), prompt, 40).token_ids
    result = _greedy(_engine(loaded, drafter, spec_type), prompt, n, force_accept=accept, force_reference=reference)
    assert result.token_ids == reference[:n]
    assert result.timings.accepted_lengths[:2] == [accept + 1] * 2


def test_cli_synth_writes_both_architectures(tmp_path, tiny_files):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "synth", "--arch", "gemma4-dflash-draft",
                          "--size", "tiny", "--target", str(tiny_files[0]), "-o", str(tmp_path / "d.gguf")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert GGUFFile(tmp_path / "d.gguf").architecture == "gemma4-dflash-draft"
    listed = subprocess.run([sys.executable, "-m", "lucebox_core.cli", "plugins", "--json"], capture_output=True,
                            text=True)
    assert listed.returncode == 0, listed.stderr
    provided = json.dumps(json.loads(listed.stdout))
    for name in ("lucebox-gemma4", "gemma4-dflash-draft", "gelu_tanh_mul") if False else ("gemma4-dflash-draft",):
        assert name in provided


def test_family_ops_do_not_collide_with_any_backends_own():
    from lucebox_cuda.backend import CudaBackend
    from lucebox_gemma4.ops import GEMMA4_OPS

    for backend in (CudaBackend, __import__("lucebox_core.torch_backend", fromlist=["_"]).TorchBackend):
        assert not [name for name in GEMMA4_OPS.references if hasattr(backend, name)], backend


def test_the_thinking_budget_closes_gemmas_thought_channel(tiny_files):
    from lucebox_core.plugins import registry
    from lucebox_core.server.generation import ThinkBudget

    tokenizer = load_model(tiny_files[0]).tokenizer
    tags = registry().named("lucebox_response_parsers", "gemma4", "response parser").reasoning_tags
    budget = ThinkBudget.wrap(None, tokenizer, 3, False, tags=tags)
    channel_open, channel_close = tokenizer.token_to_id("<|channel>"), tokenizer.token_to_id("<channel|>")
    assert isinstance(budget, ThinkBudget) and (budget.open_id, budget.close_id) == (channel_open, channel_close)
    assert budget.allowed(tokenizer.vocab_size) is None  # not thinking yet: anything goes
    for token in [channel_open, 1000, 1001, 1002]:  # the channel opens, then three tokens of thought
        assert budget.allowed(tokenizer.vocab_size) is None
        budget.accept(token)
    forced = budget.allowed(tokenizer.vocab_size)
    assert forced.sum() == 1 and forced[channel_close]
    budget.accept(channel_close)
    assert budget.allowed(tokenizer.vocab_size) is None


def test_q5_0_weights_decode_like_gguf():
    # Q5_0 is llama.cpp's Q4_K fallback for rows not a multiple of 256 (the 26B-A4B's expert down products).
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from lucebox_core.quants import dequantize

    x = np.random.default_rng(5).normal(size=(16, 704)).astype(np.float32)
    blocks = quants.quantize(x, Q.Q5_0)
    ours = dequantize(torch.from_numpy(blocks.reshape(-1).view(np.uint8).copy()), Q.Q5_0, (16, 704))
    np.testing.assert_array_equal(ours.numpy(), quants.dequantize(blocks, Q.Q5_0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 5, 300])  # the pair kernel, and the per-expert path past its limit
def test_routed_expert_kernel_matches_the_reference(tokens):
    from gguf import GGMLQuantizationType as Q

    from lucebox_core.kquants import random_blocks
    from lucebox_core.quants import QuantTensor
    from lucebox_cuda.backend import CudaBackend
    from lucebox_gemma4.ops import GEMMA4_OPS

    def stack(ggml_type, shape, seed):
        blocks = random_blocks(ggml_type, int(np.prod(shape)), 0.02, np.random.default_rng(seed))
        return QuantTensor("experts", ggml_type, shape, torch.from_numpy(blocks.reshape(-1).view(np.uint8).copy()))

    ops = GEMMA4_OPS.bind(CudaBackend(dtype=torch.float32))
    gate_up, down = stack(Q.Q4_K, (16, 512, 512), 1), stack(Q.Q5_0, (16, 512, 256), 2)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 512, device="cuda", generator=g)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, 16, device="cuda", generator=g), -1), 4, dim=-1)
    assert ops.moe_experts.choice(x, gate_up, down, weights, ids) == "cuda.moe_experts"
    expected = GEMMA4_OPS.references["moe_experts"](ops, x, gate_up, down, weights, ids)
    torch.testing.assert_close(ops.moe_experts(x, gate_up, down, weights, ids), expected, atol=1e-4, rtol=1e-3)
