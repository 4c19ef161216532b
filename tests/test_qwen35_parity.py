"""qwen35 forward pass vs transformers: tiny random Qwen3_5ForCausalLM -> save_pretrained -> convert to an
f32 GGUF -> load -> logits on the prompt and on greedy decode steps agree with transformers."""

from pathlib import Path

import numpy as np
import pytest
import torch

from lucebox_core.errors import GGUFError
from lucebox_core.ggufio import GGUFFile
from lucebox_core.torch_backend import TorchBackend

transformers = pytest.importorskip("transformers")
from lucebox_qwen35.convert import convert
from lucebox_qwen35.loader import load
from lucebox_qwen35.model import GGUF_NAMES, Qwen35Model
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

VOCAB = 320
DECODE_STEPS = 32


def tiny_config(*, tied: bool, key_heads: int, value_heads: int) -> Qwen3_5TextConfig:
    # Eight layers: GDN x3 then full attention, twice. Partial RoPE on 8 of 32 dims, GQA 4/2.
    return Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=tied,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )


def random_model(config: Qwen3_5TextConfig, seed: int) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                # Norm weights start at 0 (zero-centred) or 1, dt_bias at 1: make every +1, -exp(A_log)
                # and per-head transform of the converter visible in the logits.
                param.add_(torch.randn_like(param) * 0.5)
            else:
                param.mul_(3.0)  # larger weights: logits of order 1, so a mistake cannot hide in noise
    return model


def write_byte_tokenizer(path: Path) -> None:
    """A 256-token byte-level BPE tokenizer.json (no merges): the converter needs a vocabulary; the
    converter pads it to the model's 320 rows."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.save(str(path))


CASES = {
    "tied-equal-heads": {"tied": True, "key_heads": 2, "value_heads": 2, "seed": 1},
    "untied-2k-6v-heads": {"tied": False, "key_heads": 2, "value_heads": 6, "seed": 2},  # 27B-like V-head reorder
    "tied-3k-6v-heads": {"tied": True, "key_heads": 3, "value_heads": 6, "seed": 3},
}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    case = CASES[request.param]
    config = tiny_config(tied=case["tied"], key_heads=case["key_heads"], value_heads=case["value_heads"])
    hf_model = random_model(config, case["seed"])
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder / "hf")
    write_byte_tokenizer(folder / "hf" / "tokenizer.json")
    gguf_path = folder / "model.gguf"
    convert(folder / "hf", gguf_path, type="f32")
    return hf_model, gguf_path, case


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def test_prompt_and_greedy_decode_match_transformers(converted):
    hf_model, gguf_path, case = converted
    model = load(gguf_path, TorchBackend())
    assert model.tied_embeddings == case["tied"]
    prompt = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(case["seed"]))

    state = model.new_state(128)
    with torch.no_grad():
        hf_out = hf_model(prompt, use_cache=True)
        logits = model.forward(state, prompt[0])
        assert logits.shape == (21, VOCAB)
        assert relative_error(logits, hf_out.logits[0]) < 1e-4

        cache, hf_tokens, our_tokens = hf_out.cache, [], []
        hf_next, our_next = hf_out.logits[0, -1].argmax(), logits[-1].argmax()
        for _ in range(DECODE_STEPS):
            hf_tokens.append(int(hf_next))
            our_tokens.append(int(our_next))
            # Both sides are fed transformers' token, so one flip would not derail the comparison after it.
            hf_out = hf_model(hf_next.view(1, 1), cache=cache, use_cache=True)
            cache = hf_out.cache
            step_logits = model.forward(state, hf_next.view(1))
            assert relative_error(step_logits[0], hf_out.logits[0, -1]) < 1e-4
            hf_next, our_next = hf_out.logits[0, -1].argmax(), step_logits[0].argmax()
    assert our_tokens == hf_tokens
    assert len(set(hf_tokens)) > 1, "degenerate test model: greedy decode repeats one token"
    assert state.length == 21 + DECODE_STEPS


def test_prefill_in_chunks_and_hidden_state_capture(converted):
    hf_model, gguf_path, _ = converted
    model = load(gguf_path, gdn_chunk_size=8)  # a path, the default backend, several GDN chunks per call
    prompt = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hf_out = hf_model(prompt, output_hidden_states=True)
    state = model.new_state()
    first = model.forward(state, prompt[0, :13], capture=[1, 3])
    second = model.forward(state, prompt[0, 13:], capture=[1, 3])
    assert relative_error(torch.cat([first, second]), hf_out.logits[0]) < 1e-4
    # Layer i's output is transformers' hidden_states[i + 1].
    for layer in (1, 3):
        assert relative_error(state.captured[layer], hf_out.hidden_states[layer + 1][0, 13:]) < 1e-4
    last = model.forward(model.new_state(), prompt[0], last_only=True)
    assert last.shape == (1, VOCAB)
    assert relative_error(last[0], hf_out.logits[0, -1]) < 1e-4


def test_context_overflow_is_a_clear_error(converted):
    from lucebox_core.errors import LuceboxError

    _, gguf_path, _ = converted
    model = load(gguf_path)
    state = model.new_state(8)
    model.forward(state, torch.arange(6))
    with pytest.raises(LuceboxError, match="context overflow"):
        model.forward(state, torch.arange(3))
    assert state.length == 6  # nothing was half-written


# -- load-time checks ------------------------------------------------------------------------------------


def rewrite_gguf(source: Path, target: Path, *, drop: str | None = None, reshape: str | None = None) -> None:
    """Copy a GGUF with its metadata, leaving out tensor `drop` or giving tensor `reshape` one row less."""
    import gguf

    src = GGUFFile(source)
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), src.architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, src.get(key), value_type, sub_type)
    for tensor in reader.tensors:
        if tensor.name == drop:
            continue
        data = np.array(tensor.data, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        if tensor.name == reshape:
            data = data[:-1]
        writer.add_tensor(tensor.name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("converted", ["untied-2k-6v-heads"], indirect=True)
def test_missing_and_misshaped_tensors_are_named(converted, tmp_path):
    _, gguf_path, _ = converted
    missing = GGUF_NAMES["layers.{i}.linear_attn.A_log"].format(i=1)
    rewrite_gguf(gguf_path, tmp_path / "missing.gguf", drop=missing)
    with pytest.raises(GGUFError, match=rf"missing\.gguf.*{missing}"):
        load(tmp_path / "missing.gguf")
    misshaped = GGUF_NAMES["layers.{i}.self_attn.k_proj"].format(i=3)
    rewrite_gguf(gguf_path, tmp_path / "misshaped.gguf", reshape=misshaped)
    with pytest.raises(GGUFError, match=rf"misshaped\.gguf.*{misshaped}.*shape"):
        load(tmp_path / "misshaped.gguf")
    # The untouched copy still loads: the rewrite itself is faithful.
    rewrite_gguf(gguf_path, tmp_path / "copy.gguf")
    assert isinstance(load(tmp_path / "copy.gguf"), Qwen35Model)


def test_wrong_architecture_and_unknown_option(tmp_path):
    import gguf

    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"llama\.gguf.*'llama'.*'qwen35'"):
        load(path)
    from lucebox_core.errors import LuceboxError

    with pytest.raises(LuceboxError, match="unknown qwen35 model option"):
        load(path, context_size=5)
