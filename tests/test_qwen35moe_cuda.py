"""qwen35moe on the CUDA backend (skipped without a CUDA device): the tiny file in fp32 on the CUDA backend's
kernels (the router, the routed SwiGLU expert products, the shared expert's one-row gate product, the recorded
decode step) against the torch reference backend in fp32. Kept apart from test_qwen35moe.py, whose speculative
tests run on the CPU.

fp32 on both sides: bf16 against the fp32 reference parts at the tiny random model's many near-ties within a few
tokens (session 17: 7 tokens at most over 4 prompts), which would leave the greedy comparison nearly empty."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 24
NEAR_TIE = 1e-3  # fp32 logits: the kernels' summation order moves them by ~1e-5 on this model


def _greedy(model, prompt):
    state = model.new_state(256)
    logits = model.forward(state, torch.tensor(prompt, device=model.ops.device))[-1].float()
    prefill, tokens, gaps = logits.cpu(), [], []
    for _ in range(STEPS):
        top = torch.topk(logits, 2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        logits = model.forward(state, top.indices[:1])[-1].float()
    return prefill, tokens, gaps


def test_the_cuda_backend_decodes_like_the_reference(tmp_path):
    from lucebox_core.plugins import registry
    from lucebox_core.torch_backend import TorchBackend
    from lucebox_cuda.backend import CudaBackend
    from lucebox_qwen35.loader import load_moe

    synth = registry().named("lucebox_synthesizers", "qwen35moe", "synth")
    path = synth.write(tmp_path / "tiny-f32.gguf", size="tiny", type="f32", seed=3)
    cuda = load_moe(path, CudaBackend("cuda", torch.float32))
    block = next(layer.mlp for layer in cuda.layers if hasattr(layer.mlp, "shared_expert_gate"))
    x = torch.randn(1, block.shared_expert_gate.shape[1], device="cuda")
    assert cuda.ops.linear.choice(x, block.shared_expert_gate) != "reference"  # the gate on the matvec kernels
    # The gated shared expert joins the routed sum in one launch (not sigmoid, product and sum apart).
    assert cuda.ops.add_sigmoid_gated.choice(x, x, x[:, :1]) == "cuda.add_sigmoid_gated"
    reference = load_moe(path, TorchBackend("cpu", torch.float32))
    prompts = [[1, 2, 3, 4, 5], list(range(500, 540)), [9000, 17, 42, 151644, 872, 198]]
    for prompt in prompts:
        (got_prefill, got, _), (want_prefill, want, gaps) = _greedy(cuda, prompt), _greedy(reference, prompt)
        error = float((got_prefill - want_prefill).norm() / want_prefill.norm())
        assert error < 1e-4, (prompt, error)
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), STEPS)
        assert first == STEPS or gaps[first] < NEAR_TIE, (prompt, first, got, want)
