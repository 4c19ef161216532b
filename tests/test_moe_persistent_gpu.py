"""The persistent add + norm + MoE kernel (`lucebox_cuda.moe_persistent`) on a CUDA device (skipped without one):
its choice, SwiGLU rows and output against the unfused kernels on Laguna-XS.2's and Qwen3.5-35B-A3B's block
shapes, replayed in a graph, hundreds of launches in a row, and in loaded models' decode steps."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from test_ffn_persistent_gpu import compare_switched_decode  # tests/ is on the path (pytest's rootdir import)

pytestmark = [
    pytest.mark.usefixtures("row_major_weights"),  # these kernels read GGUF's rows
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton runs interpreted in this process"),
]

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 512, 256, 8  # both families' decode shapes


def _quant(ggml_type, shape, seed):
    from lucebox_core.kquants import random_blocks
    from lucebox_core.quants import QuantTensor

    raw = random_blocks(ggml_type, int(np.prod(shape)), 0.05, np.random.default_rng(seed))
    return QuantTensor(f"w{seed}", ggml_type, shape, torch.from_numpy(raw.copy()))


def _block(ops, arch, seed=0):
    """A random MoE block of the family's class on the CUDA backend, its shared expert's rows fused."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    router = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g) * HIDDEN**-0.5
    stacks = (_quant(T.Q4_K, (EXPERTS, INTER, HIDDEN), seed + 1), _quant(T.Q4_K, (EXPERTS, INTER, HIDDEN), seed + 2),
              _quant(T.Q6_K, (EXPERTS, HIDDEN, INTER), seed + 3))
    shared = (_quant(T.Q4_K, (INTER, HIDDEN), seed + 4), _quant(T.Q4_K, (INTER, HIDDEN), seed + 5),
              _quant(T.Q6_K, (HIDDEN, INTER), seed + 6))
    if arch == "laguna":
        from lucebox_laguna.model import LagunaMLP, LagunaMoE
        from lucebox_laguna.ops import LAGUNA_OPS

        family = LAGUNA_OPS.bind(ops)  # the block calls its family's router op
        bias = torch.randn(EXPERTS, device="cuda", generator=g) * 0.05
        block = LagunaMoE(family, router, bias, *stacks, LagunaMLP(family, *shared), TOP_K, 2.5)
    else:
        from lucebox_qwen35.model import MLP
        from lucebox_qwen35.moe import SparseMoeBlock
        from lucebox_qwen35.ops import QWEN35_OPS

        family = QWEN35_OPS.bind(ops)
        gate = torch.randn(1, HIDDEN, device="cuda", generator=g) * HIDDEN**-0.5
        block = SparseMoeBlock(family, router, *stacks, MLP(family, *shared), gate, TOP_K)
    block.shared_expert.fuse_projections()
    assert block.routing() is not None
    return block


def _inputs(seed, norm_dtype=torch.float32):
    """x, residual (bf16) and a norm weight (fp32, or bf16 as a loaded model on the bf16 backend has it)."""
    g = torch.Generator(device="cuda").manual_seed(100 + seed)
    x = torch.randn(1, 1, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    residual = (torch.randn(1, 1, HIDDEN, device="cuda", generator=g) * 4).to(torch.bfloat16)
    norm = (torch.rand(HIDDEN, device="cuda", generator=g) + 0.5).to(norm_dtype)
    return x, residual, norm


@pytest.fixture
def backend():
    from lucebox_cuda.backend import CudaBackend

    return CudaBackend(dtype=torch.bfloat16)


@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["laguna", "qwen35moe"])
def test_the_persistent_block_chooses_and_computes_as_the_unfused_kernels(arch, norm_dtype, backend, monkeypatch):
    """Phase by phase against the unfused kernels on the same inputs: the sum to the bit, the experts chosen (the
    same set unless two scores are within a rounding), their weights, each pair's SwiGLU row, and the output."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import moe_persistent

    block = _block(backend, arch, seed=1)
    x, residual, norm = _inputs(1, norm_dtype)
    monkeypatch.setenv(moe_persistent.ENV_SWITCH, "1")
    trace = {}
    with running_static_step(decode_only=True):
        assert moe_persistent.takes(backend, x, residual, norm, block)
        out, summed = moe_persistent.run(backend, x, residual, norm, 1e-6, block, trace=trace)
    monkeypatch.setenv(moe_persistent.ENV_SWITCH, "0")
    want_out, want_summed = backend.add_rms_norm_moe(x, residual, norm, 1e-6, block)
    assert torch.equal(summed, want_summed)
    normed, _ = backend.add_rms_norm(x, residual, norm, 1e-6)
    flat = normed.reshape(1, HIDDEN)
    if arch == "laguna":
        weights, ids = block.ops.sigmoid_route(flat, block.router, block.selection_bias, TOP_K, block.routed_scale)
    else:
        weights, ids, _ = block.ops.softmax_topk_route_gated(flat, block.router, block.shared_expert_gate, TOP_K)
    assert set(trace["ids"].tolist()) == set(ids[0].tolist()), (trace["ids"], ids)
    same = trace["ids"] == ids[0]
    torch.testing.assert_close(trace["weights"][same], weights[0][same], rtol=1e-4, atol=1e-6)
    gate = backend.expert_matvec(flat, block.gate_exps, trace["ids"], TOP_K)
    up = backend.expert_matvec(flat, block.up_exps, trace["ids"], TOP_K)
    torch.testing.assert_close(trace["act"][:TOP_K].float(), backend.silu_mul(gate, up).float(), rtol=2e-2, atol=2e-2)
    scale = want_out.float().abs().max()
    torch.testing.assert_close(out.float(), want_out.float(), rtol=3e-2, atol=3e-2 * float(scale))


def test_the_persistent_block_replays_in_a_graph_and_launches_hundreds_of_times(backend, monkeypatch):
    """Recorded once (the counter made by the eager call before), replayed over new inputs: each replay gives the
    eager launch's output to the bit; then 200 launches in a row of the same inputs give one answer."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import moe_persistent

    block = _block(backend, "laguna", seed=2)
    monkeypatch.setenv(moe_persistent.ENV_SWITCH, "1")
    x, residual, norm = _inputs(2)
    static_x, static_r = x.clone(), residual.clone()
    with running_static_step(decode_only=True):
        backend.add_rms_norm_moe(static_x, static_r, norm, 1e-6, block)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, summed = backend.add_rms_norm_moe(static_x, static_r, norm, 1e-6, block)
        for seed in range(6):
            fresh_x, fresh_r, _ = _inputs(10 + seed)
            static_x.copy_(fresh_x)
            static_r.copy_(fresh_r)
            graph.replay()
            eager = backend.add_rms_norm_moe(fresh_x, fresh_r, norm, 1e-6, block)
            assert torch.equal(out, eager[0]) and torch.equal(summed, eager[1]), f"replay {seed}"
        first = backend.add_rms_norm_moe(x, residual, norm, 1e-6, block)[0]
        outs = [backend.add_rms_norm_moe(x, residual, norm, 1e-6, block)[0] for _ in range(200)]
    torch.cuda.synchronize()
    assert all(torch.equal(first, o) for o in outs)


@pytest.mark.parametrize("arch", ["laguna", "qwen35moe"])
def test_a_loaded_models_decode_step_runs_the_persistent_block(arch, tmp_path, monkeypatch):
    """The tiny file of each MoE family on the CUDA backend: with LUCEBOX_PERSISTENT_MOE=1 every MoE layer of the
    recorded decode step is the persistent kernel, and 16 steps fed the same tokens give the unfused step's logits
    within a rounding (the same greedy token wherever it is not a near tie)."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_cuda import moe_persistent
    from lucebox_cuda.backend import CudaBackend

    if arch == "laguna":
        from lucebox_laguna import loader, synth

        path, load = synth.write(tmp_path / "t.gguf", size="tiny", type="q4_k_m", seed=3), loader.load
    else:
        from lucebox_qwen35 import loader, synth

        path, load = synth.write_moe(tmp_path / "t.gguf", size="tiny", type="q4_k_m", seed=3), loader.load_moe
    model = load(GGUFFile(path), CudaBackend(dtype=torch.bfloat16))
    calls = []
    run = moe_persistent.run
    monkeypatch.setattr(moe_persistent, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    compare_switched_decode(model, moe_persistent.ENV_SWITCH, calls, monkeypatch)
    moe_layers = sum(1 for layer in model.layers if callable(getattr(layer.mlp, "routing", None)))
    assert moe_layers and len(calls) >= moe_layers
