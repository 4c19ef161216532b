"""Every type `lucebox synth` writes loads and generates; quantized files match transformers run on the
same (dequantized) weights, logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.loading import load_model
from lucebox_core.sampling import SamplingParams
from lucebox_qwen35 import layout, synth

from test_qwen35_synth import to_transformers

PROMPT = [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198]


@pytest.fixture(scope="module", params=["f32", "f16", "q8_0", "q4_k_m"])
def written(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / f"tiny-{request.param}.gguf"
    synth.write(path, size="tiny", type=request.param, seed=11)
    return request.param, path


def test_every_synth_type_loads_and_generates(written):
    type_name, path = written
    loaded = load_model(path)
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=256)
    request = GenerationRequest(prompt_ids=PROMPT, max_tokens=6, sampling=SamplingParams(temperature=0), ignore_eos=True)
    first = engine.generate(request)
    assert len(first.token_ids) == 6 and all(0 <= t < loaded.model.vocab_size for t in first.token_ids)
    assert engine.generate(request).token_ids == first.token_ids  # greedy is deterministic
    sampled = GenerationRequest(prompt_ids=PROMPT, max_tokens=6, sampling=SamplingParams(temperature=1.0, seed=5))
    assert engine.generate(sampled).token_ids == engine.generate(sampled).token_ids


@pytest.mark.parametrize("type_name", ["q8_0", "q4_k_m"])
def test_quantized_files_match_transformers_on_the_same_weights(type_name, tmp_path):
    path = tmp_path / f"tiny-{type_name}.gguf"
    synth.write(path, size="tiny", type=type_name, seed=12)
    reference = to_transformers(GGUFReader(path), layout.size("tiny"))
    loaded = load_model(path)
    state = loaded.model.new_state(64)
    tokens = list(PROMPT)
    ours = loaded.model.forward(state, torch.tensor(tokens))
    with torch.no_grad():
        theirs = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))
    for _ in range(8):  # greedy decode, one token at a time against the full-sequence reference
        token = int(ours[-1].argmax())
        tokens.append(token)
        ours = loaded.model.forward(state, torch.tensor([token]))
        with torch.no_grad():
            theirs = reference(torch.tensor([tokens])).logits[0, -1:]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))
