"""Laguna on the CUDA backend (skipped without a CUDA device): the routed-expert kernel over separate gate and up
stacks against the op's reference, and the tiny file's greedy tokens against the torch reference backend. Kept
apart from test_laguna.py, which needs transformers (not on the GPU machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lucebox_laguna import synth

NEAR_TIE = 0.05  # logits: bf16 rounding over the tiny model's layers stays well below this

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("tokens", [1, 5, 300])  # the pair kernels, and the per-expert path past their limit
def test_routed_expert_kernel_matches_the_reference(tokens):
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from lucebox_core.kquants import random_blocks
    from lucebox_core.quants import QuantTensor
    from lucebox_cuda.backend import CudaBackend
    from lucebox_core.torch_backend import TorchBackend

    def stack(ggml_type, shape, seed):
        blocks = random_blocks(ggml_type, int(np.prod(shape)), 0.02, np.random.default_rng(seed))
        return QuantTensor("experts", ggml_type, shape, torch.from_numpy(blocks.reshape(-1).view(np.uint8).copy()))

    ops = CudaBackend(dtype=torch.float32)  # the routed SwiGLU experts are a generic op of the backend
    gate, up = stack(Q.Q4_K, (16, 256, 512), 1), stack(Q.Q8_0, (16, 256, 512), 2)
    down = stack(Q.Q6_K, (16, 512, 256), 3)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 512, device="cuda", generator=g)
    weights, ids = torch.topk(torch.sigmoid(torch.randn(tokens, 16, device="cuda", generator=g)), 4, dim=-1)
    assert ops.moe_experts_swiglu.choice(x, gate, up, down, weights, ids) == "cuda.moe_experts_swiglu"
    expected = TorchBackend.moe_experts_swiglu(ops, x, gate, up, down, weights, ids)
    torch.testing.assert_close(ops.moe_experts_swiglu(x, gate, up, down, weights, ids), expected, atol=1e-4, rtol=1e-3)


def test_the_cuda_backend_decodes_like_the_reference(tmp_path):
    """The tiny f32 file on the CUDA backend (its kernels, the routed-expert products, the decode step recorded
    as a graph) gives the torch reference's greedy tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import llamacpp_crosscheck as crosscheck

    path = synth.write(tmp_path / "tiny-f32.gguf", size="tiny", type="f32", seed=1)
    prompts = crosscheck.PROMPTS_BY_ARCH["laguna"]
    ours, _ = crosscheck.argmax_tokens(path, prompts, "cuda")
    reference, gaps = crosscheck.argmax_tokens(path, prompts, "cpu")
    # The CUDA backend computes in bf16, the reference in fp32: the random weights' greedy paths may part only
    # where the reference's top two logits are nearly tied (the near-tie rule of scripts/cuda_check.py).
    agreed = []
    for prompt, (a, b, gap) in enumerate(zip(ours, reference, gaps)):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        if first < len(a):
            assert gap[first] < NEAR_TIE, (prompt, first, gap[first], a, b)
        agreed.append(first)
    assert max(agreed) >= 8, agreed  # not every prompt starts on a tie
