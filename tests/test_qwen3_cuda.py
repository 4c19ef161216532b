"""Qwen3 on the CUDA backend (skipped without a CUDA device): the tiny file's greedy tokens against the torch
reference backend, through the CUDA kernels and the decode step recorded as a graph, with an f16 and a Q8_0 KV
cache. Kept apart from test_qwen3.py, whose fixtures need transformers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lucebox_qwen35 import synth

NEAR_TIE = 0.05  # logits: bf16 rounding over the tiny model's layers stays well below this

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("type_", ["f32", "q8_0"])
def test_the_cuda_backend_decodes_like_the_reference(tmp_path, type_):
    """The tiny file on the CUDA backend (its kernels, the fused q/k/v and gate/up products, the decode step
    recorded as a graph) gives the torch reference's greedy tokens, but where the reference's top two logits
    are nearly tied."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import llamacpp_crosscheck as crosscheck

    path = synth.write_qwen3(tmp_path / f"tiny-{type_}.gguf", size="tiny", type=type_, seed=1)
    prompts = crosscheck.PROMPTS_BY_ARCH["qwen3"]
    ours, _ = crosscheck.argmax_tokens(path, prompts, "cuda")
    reference, gaps = crosscheck.argmax_tokens(path, prompts, "cpu")
    agreed = []
    for prompt, (a, b, gap) in enumerate(zip(ours, reference, gaps)):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        if first < len(a):
            assert gap[first] < NEAR_TIE, (prompt, first, gap[first], a, b)
        agreed.append(first)
    assert max(agreed) >= 8, agreed  # not every prompt starts on a tie


@pytest.mark.parametrize("cache_k, cache_v", [("f16", "f16"), ("q8_0", "q8_0")])
def test_quantized_kv_caches_on_the_gpu(tmp_path, cache_k, cache_v):
    """Prefill then graph-recorded decode steps with a stored KV cache track the bf16 cache's logits."""
    from lucebox_core.loading import load_model

    path = synth.write_qwen3(tmp_path / "tiny.gguf", size="tiny", type="q8_0", seed=2)
    ids = torch.randint(0, 151643, (40,), generator=torch.Generator().manual_seed(3)).cuda()
    plain = load_model(path, device="cuda").model
    stored = load_model(path, device="cuda", cache_type_k=cache_k, cache_type_v=cache_v).model
    expected = plain.forward(plain.new_state(256), ids)
    state = stored.new_state(256)
    steps = [stored.forward(state, ids[:8])] + [stored.forward(state, ids[i : i + 1]) for i in range(8, len(ids))]
    got = torch.cat(steps).float()
    assert torch.isfinite(got).all() and (got - expected.float()).abs().max().item() < 0.1
