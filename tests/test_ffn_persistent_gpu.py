"""The persistent add + norm + SwiGLU MLP kernel (`lucebox_cuda.ffn_persistent`) on a CUDA device (skipped
without one): against the four kernels it replaces, replayed in a graph (its barrier's counter needs no reset),
launched hundreds of times in a row (a barrier that let a block through early would show as a wrong row now and
then), and in a loaded model's decode step."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

pytestmark = [
    pytest.mark.usefixtures("row_major_weights"),  # these kernels read GGUF's rows
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton runs interpreted in this process"),
]

# (hidden, intermediate): Qwen3.5-0.8B's MLP, Laguna-XS.2's leading dense one, the 27B's.
SHAPES = [(1024, 3584), (2048, 8192), (5120, 17408)]


def _quant(name, ggml_type, rows, cols, seed):
    from lucebox_core.kquants import random_blocks
    from lucebox_core.quants import QuantTensor

    raw = random_blocks(ggml_type, rows * cols, 0.05, np.random.default_rng(seed))
    return QuantTensor(name, ggml_type, (rows, cols), torch.from_numpy(raw.copy()))


def _operands(hidden, inter, down_type, seed, norm_dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, 1, hidden, device="cuda", generator=g).to(torch.bfloat16)
    residual = (torch.randn(1, 1, hidden, device="cuda", generator=g) * 4).to(torch.bfloat16)
    norm = (torch.rand(hidden, device="cuda", generator=g) + 0.5).to(norm_dtype)  # bf16: a loaded model's
    gate_up = _quant("gate_up", T.Q4_K, 2 * inter, hidden, seed)
    down = _quant("down", down_type, hidden, inter, seed + 1)
    return x, residual, norm, gate_up, down


@pytest.fixture
def backend():
    from lucebox_cuda.backend import CudaBackend

    return CudaBackend(dtype=torch.bfloat16)


def _both(backend, monkeypatch, *operands):
    """The op with the persistent kernel and with the four kernels, inside a static step (where it is taken)."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import ffn_persistent

    x, residual, norm, gate_up, down = operands
    assert ffn_persistent.refusal(x, residual, norm, gate_up, down) is None
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(ffn_persistent.ENV_SWITCH, switch)
        with running_static_step(decode_only=True):
            assert ffn_persistent.takes(backend, x, residual, norm, gate_up, down) == (switch == "1")
            results.append(backend.add_rms_norm_swiglu(x, residual, norm, 1e-6, gate_up, down))
    return results


@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("down_type", [T.Q6_K, T.Q4_K])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_persistent_block_equals_the_four_kernels(shape, down_type, norm_dtype, backend, monkeypatch):
    (out, summed), (want_out, want_summed) = _both(backend, monkeypatch, *_operands(*shape, down_type, 1, norm_dtype))
    assert torch.equal(summed, want_summed)  # the add rounds as the Triton add + norm does
    # The products are the `mma` body's; the norm's sum of squares adds in another order, so a normed value may
    # differ in its last bit and move the outputs by a rounding or two.
    scale = want_out.float().abs().max()
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2 * float(scale))
    assert (out == want_out).float().mean() > 0.5


@pytest.mark.parametrize("shape", SHAPES[::2])
def test_32_row_tiles_give_the_16_row_tiles_bits(shape, backend, monkeypatch):
    """LUCEBOX_PERSISTENT_FFN_ROW_TILES=2 (session 26's A/B of the tile loop): the same body with two row tiles a
    step, so every output to the bit, at one block an SM (its default) and at two."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import ffn_persistent

    operands = _operands(*shape, T.Q6_K, 5)
    monkeypatch.setenv(ffn_persistent.ENV_SWITCH, "1")
    results = []
    for tiles, blocks in (("1", "2"), ("2", "1"), ("2", "2")):
        monkeypatch.setenv(ffn_persistent.ROW_TILES_ENV, tiles)
        monkeypatch.setenv(ffn_persistent.BLOCKS_ENV, blocks)
        with running_static_step(decode_only=True):
            assert ffn_persistent.takes(backend, *operands)
            results.append(backend.add_rms_norm_swiglu(*operands[:3], 1e-6, *operands[3:]))
    for out, summed in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(summed, results[0][1])


def test_the_persistent_blocks_first_phase_is_the_unfused_products_and_swiglu(backend, monkeypatch):
    """Phase 1 alone, against the unfused kernels on the unfused norm's output: the gate | up products within a
    rounding (the norm may differ in a last bit), and the SwiGLU row of the kernel's own products to the bit where
    the Triton SwiGLU kernel rounds alike (most of it)."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import ffn_persistent

    x, residual, norm, gate_up, down = _operands(1024, 3584, T.Q6_K, 4)
    monkeypatch.setenv(ffn_persistent.ENV_SWITCH, "1")
    trace = {}
    with running_static_step(decode_only=True):
        assert ffn_persistent.takes(backend, x, residual, norm, gate_up, down)  # makes the barrier's counter
        ffn_persistent.run(backend, x, residual, norm, 1e-6, gate_up, down, trace=trace)
    normed, _ = backend.add_rms_norm(x, residual, norm, 1e-6)
    products = backend.linear(normed.reshape(1, -1), gate_up)[0]
    torch.testing.assert_close(trace["products"].float(), products.float(), rtol=2e-2, atol=2e-2)
    gate, up = trace["products"].chunk(2)
    swiglu = backend.silu_mul(gate[None], up[None])[0]
    assert (trace["act"] == swiglu).float().mean() > 0.99


def test_the_persistent_block_replays_in_a_graph(backend, monkeypatch):
    """Recorded once (its counter made by the eager call before), replayed over new inputs: each replay gives the
    eager launch's output to the bit (the grid, so every sum's order, is the same)."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import ffn_persistent

    monkeypatch.setenv(ffn_persistent.ENV_SWITCH, "1")
    x, residual, norm, gate_up, down = _operands(1024, 3584, T.Q6_K, 2)
    static_x, static_r = x.clone(), residual.clone()
    with running_static_step(decode_only=True):
        backend.add_rms_norm_swiglu(static_x, static_r, norm, 1e-6, gate_up, down)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, summed = backend.add_rms_norm_swiglu(static_x, static_r, norm, 1e-6, gate_up, down)
        for seed in range(8):
            fresh_x, fresh_r, *_ = _operands(1024, 3584, T.Q6_K, 100 + seed)
            static_x.copy_(fresh_x)
            static_r.copy_(fresh_r)
            graph.replay()
            eager_out, eager_summed = backend.add_rms_norm_swiglu(fresh_x, fresh_r, norm, 1e-6, gate_up, down)
            assert torch.equal(out, eager_out) and torch.equal(summed, eager_summed), f"replay {seed}"


def test_hundreds_of_launches_in_a_row_give_one_answer(backend, monkeypatch):
    """300 launches back to back on one stream, each of the same operands: a barrier that let a block into the
    down product before every SwiGLU row was stored would give another output now and then."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import ffn_persistent

    monkeypatch.setenv(ffn_persistent.ENV_SWITCH, "1")
    operands = _operands(2048, 8192, T.Q4_K, 3)
    with running_static_step(decode_only=True):
        first, _ = backend.add_rms_norm_swiglu(*operands[:3], 1e-6, *operands[3:])
        outs = [backend.add_rms_norm_swiglu(*operands[:3], 1e-6, *operands[3:])[0] for _ in range(300)]
    torch.cuda.synchronize()
    assert all(torch.equal(first, out) for out in outs)


def test_a_loaded_models_decode_step_runs_the_persistent_block(tmp_path, monkeypatch):
    """The tiny Qwen3.5 file on the CUDA backend: with LUCEBOX_PERSISTENT_FFN=1 every layer's MLP in the recorded
    decode step is the persistent kernel, and 16 greedy steps give the tokens of the four kernels (the logits
    within a rounding: near-tie equal)."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_cuda import ffn_persistent
    from lucebox_cuda.backend import CudaBackend
    from lucebox_qwen35 import loader, synth

    path = synth.write(tmp_path / "tiny.gguf", size="tiny", type="q4_k_m", seed=3)
    model = loader.load(GGUFFile(path), CudaBackend(dtype=torch.bfloat16))
    calls = []
    run = ffn_persistent.run
    monkeypatch.setattr(ffn_persistent, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    compare_switched_decode(model, ffn_persistent.ENV_SWITCH, calls, monkeypatch)
    assert len(calls) >= len(model.layers)  # the warm-up's launches and the recording's


def compare_switched_decode(model, switch_name, calls, monkeypatch):
    """16 recorded decode steps of `model` with the switch `switch_name` off, then on fed the same tokens: `calls`
    (what the switched kernel appends to) stays empty while off, and the logits agree within a rounding (the same
    greedy token wherever it is not a near tie). Shared with test_moe_persistent_gpu."""
    prompt = torch.randint(0, 200, (5,), generator=torch.Generator().manual_seed(1)).cuda()

    def generate(switch, tokens=None):
        """16 decode steps: greedy, or feeding `tokens` (the other run's, so that both see the same inputs)."""
        monkeypatch.setenv(switch_name, switch)
        state = model.new_state(64)
        logits = model.forward(state, prompt)[-1:]
        steps, fed = [], []
        for step in range(16):
            token = logits.argmax(-1).reshape(1) if tokens is None else tokens[step]
            fed.append(token)
            logits = model.decode_step(state, token)
            steps.append(logits.clone())
        torch.cuda.synchronize()
        assert state.decode is not None and state.decode.failure is None and state.decode._recorded
        return steps, fed

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns
        plain, tokens = generate("0")
        assert not calls
        switched, _ = generate("1", tokens)
    for step, (a, b) in enumerate(zip(plain, switched)):
        top = a.float().topk(2, dim=-1).values[0]
        if top[0] - top[1] > 0.05:  # not a near tie: the same token
            assert a.argmax() == b.argmax(), f"step {step}"
        torch.testing.assert_close(b.float(), a.float(), rtol=5e-2, atol=5e-2)
