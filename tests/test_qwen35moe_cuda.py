"""qwen35moe on the CUDA backend (skipped without a CUDA device): the tiny file's greedy tokens against the torch
reference backend, through the router kernel, the routed SwiGLU expert products and the shared expert's one-row
gate product. Kept apart from test_qwen35moe.py, whose speculative tests run on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

NEAR_TIE = 0.05  # logits: bf16 rounding over the tiny model's layers stays well below this

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_cuda_backend_decodes_like_the_reference(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import llamacpp_crosscheck as crosscheck

    from lucebox_core.loading import load_model
    from lucebox_core.plugins import registry

    synth = registry().named("lucebox_synthesizers", "qwen35moe", "synth")
    path = synth.write(tmp_path / "tiny-f32.gguf", size="tiny", type="f32", seed=3)
    model = load_model(path, device="cuda").model
    block = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "shared_expert_gate"))
    x = torch.randn(1, block.shared_expert_gate.shape[1], dtype=model.ops.dtype, device="cuda")
    assert model.ops.linear.choice(x, block.shared_expert_gate) != "reference"  # the gate on the matvec kernels
    del model
    prompts = crosscheck.PROMPTS_BY_ARCH["qwen35moe"]
    ours, _ = crosscheck.argmax_tokens(path, prompts, "cuda")
    reference, gaps = crosscheck.argmax_tokens(path, prompts, "cpu")
    # bf16 on the GPU against the fp32 reference: greedy paths part only where the reference's top two logits are
    # nearly tied (the near-tie rule of scripts/cuda_check.py).
    agreed = []
    for prompt, (a, b, gap) in enumerate(zip(ours, reference, gaps)):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        if first < len(a):
            assert gap[first] < NEAR_TIE, (prompt, first, gap[first], a, b)
        agreed.append(first)
    assert max(agreed) >= 8, agreed  # not every prompt starts on a tie
