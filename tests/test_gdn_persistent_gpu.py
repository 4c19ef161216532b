"""The persistent Gated DeltaNet mixer kernel (`lucebox_cuda.gdn_persistent`) on a CUDA device (skipped without
one): against the six kernels it replaces (the whole mixer, then phase by phase), replayed in a graph, launched
hundreds of times in a row, and in a loaded model's decode step."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

pytestmark = [
    pytest.mark.usefixtures("row_major_weights"),  # these kernels read GGUF's rows
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton runs interpreted in this process"),
]

# (hidden, key heads, value heads): Qwen3.5-0.8B's mixer, the 9B's, the 27B's.
SHAPES = [(1024, 16, 16), (4096, 16, 32), (5120, 16, 48)]


@pytest.fixture
def ops():
    from lucebox_cuda.backend import CudaBackend
    from lucebox_qwen35.ops import QWEN35_OPS

    return QWEN35_OPS.bind(CudaBackend(dtype=torch.bfloat16))


def _mixer(ops, hidden, key_heads, value_heads, qkv_type, seed, norm_dtype=torch.bfloat16, fuse=True):
    """test_gdn_persistent's random mixer and state (a sequence some tokens in), with a loaded model's tensor
    types on the GPU: bf16 activations, conv weights and conv state, fp32 gates and recurrent state."""
    from test_gdn_persistent import _mixer as cpu_mixer  # tests/ is on the path (pytest's rootdir import)

    mixer, state, x = cpu_mixer(ops, hidden, key_heads, value_heads, qkv_type=qkv_type, seed=seed)
    mixer.conv1d = mixer.conv1d.to("cuda", torch.bfloat16)
    mixer.ssm_a, mixer.dt_bias = mixer.ssm_a.cuda(), mixer.dt_bias.cuda()
    mixer.norm = mixer.norm.to("cuda", norm_dtype)
    if fuse:
        mixer.fuse_projections()
    state.conv, state.recurrent = state.conv.to("cuda", torch.bfloat16), state.recurrent.cuda()
    return mixer, state, x.to("cuda", torch.bfloat16)


def _copy(state):
    from lucebox_qwen35.model import GatedDeltaNetState

    return GatedDeltaNetState(conv=state.conv.clone(), recurrent=state.recurrent.clone())


def _both(ops, monkeypatch, mixer, state, x):
    """The op with the persistent kernel and with the six kernels, each from a copy of `state`, inside a static
    step (where it is taken): [(out, state after)] for on, off."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import gdn_persistent

    assert gdn_persistent.refusal(x, mixer, state) is None
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(gdn_persistent.ENV_SWITCH, switch)
        after = _copy(state)
        with running_static_step(decode_only=True):
            assert gdn_persistent.takes(ops, x, mixer, after) == (switch == "1")
            results.append((ops.gated_delta_net_decode_(x, mixer, after), after))
    return results


def _close(got, want, rtol=3e-2):
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qkv_type", [T.Q6_K, T.Q4_K])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_persistent_mixer_equals_the_six_kernels(shape, qkv_type, norm_dtype, ops, monkeypatch):
    mixer, state, x = _mixer(ops, *shape, qkv_type, 1, norm_dtype)
    (out, after), (want, want_after) = _both(ops, monkeypatch, mixer, state, x)
    # The conv state holds the new qkv inputs: products of one arithmetic class, within a rounding of the unfused
    # kernel's (another variant of the body may add a row's blocks in another order).
    _close(after.conv, want_after.conv)
    assert torch.equal(after.conv[:, :2], state.conv[:, 1:])  # the shift itself is exact
    _close(after.recurrent, want_after.recurrent)
    _close(out, want)
    assert (out == want).float().mean() > 0.3  # most outputs to the bit: a rounding apart, not a different sum


@pytest.mark.parametrize("shape", SHAPES[::2])
def test_the_persistent_mixer_with_the_input_add_and_norm(shape, ops, monkeypatch):
    """`add_rms_norm_gated_delta_net_`: the layer's input add + norm in the kernel's first phase; the sum to the bit
    (rounded as the Triton add), the output within a rounding of the seven kernels'."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import gdn_persistent

    mixer, state, x = _mixer(ops, *shape, T.Q6_K, 8)
    g = torch.Generator(device="cuda").manual_seed(8)
    residual = (torch.randn(x.shape, device="cuda", generator=g) * 4).to(torch.bfloat16)
    norm = (torch.rand(shape[0], device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    assert gdn_persistent.residual_refusal(x, residual, norm, mixer) is None
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(gdn_persistent.ENV_SWITCH, switch)
        after = _copy(state)
        with running_static_step(decode_only=True):
            assert gdn_persistent.takes(ops, x, mixer, after, residual, norm) == (switch == "1")
            results.append((*ops.add_rms_norm_gated_delta_net_(x, residual, norm, 1e-6, mixer, after), after))
    (out, summed, after), (want, want_summed, want_after) = results
    assert torch.equal(summed, want_summed)
    _close(out, want)
    _close(after.recurrent, want_after.recurrent)


def test_the_persistent_mixers_phases_are_the_unfused_ops(ops, monkeypatch):
    """Phase by phase against the unfused ops fed the kernel's own intermediate rows: the products against the
    `linear` kernel's, then the delta step's readout against conv_silu_update_ + gated_delta_decode_ on the
    kernel's products (near the bit: only the sums' order differs)."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import gdn_persistent

    mixer, state, x = _mixer(ops, 1024, 16, 16, T.Q6_K, 4, fuse=False)
    monkeypatch.setenv(gdn_persistent.ENV_SWITCH, "1")
    trace = {}
    with running_static_step(decode_only=True):
        assert gdn_persistent.takes(ops, x, mixer, state)  # makes the barrier's counter
        gdn_persistent.run(ops, x, mixer, _copy(state), trace=trace)
    products = trace["products"]
    channels, value_channels, heads = mixer.conv1d.shape[0], 16 * 128, 16
    for part, (start, rows) in {"in_proj_qkv": (0, channels), "in_proj_z": (channels, value_channels),
                                "in_proj_b": (channels + value_channels, heads),
                                "in_proj_a": (channels + value_channels + heads, heads)}.items():
        want = ops.linear(x.reshape(1, -1), getattr(mixer, part))[0]
        _close(products[start:start + rows], want)
    conv = state.conv.clone()
    mixed = ops.conv_silu_update_(products[None, :channels], mixer.conv1d, conv)
    recurrent = state.recurrent.clone()
    b = products[None, channels + value_channels:channels + value_channels + heads]
    a = products[None, channels + value_channels + heads:]
    core = ops.gated_delta_decode_(mixed, a, b, mixer.ssm_a, mixer.dt_bias, recurrent, 16, 128)
    _close(trace["core"], core.reshape(-1), rtol=1e-2)
    assert (trace["core"] == core.reshape(-1)).float().mean() > 0.5


def test_the_persistent_mixer_replays_in_a_graph(ops, monkeypatch):
    """Recorded once (its counter made by an eager call before), replayed from a fresh copy of the state each
    time: each replay gives the eager launch's output and states to the bit."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import gdn_persistent

    monkeypatch.setenv(gdn_persistent.ENV_SWITCH, "1")
    mixer, state, x = _mixer(ops, 1024, 16, 16, T.Q4_K, 2)
    static_x, static_state = x.clone(), _copy(state)
    with running_static_step(decode_only=True):
        ops.gated_delta_net_decode_(static_x, mixer, _copy(state))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.gated_delta_net_decode_(static_x, mixer, static_state)
        for seed in range(6):
            _, fresh_state, fresh_x = _mixer(ops, 1024, 16, 16, T.Q4_K, 100 + seed)
            static_x.copy_(fresh_x)
            static_state.conv.copy_(fresh_state.conv)
            static_state.recurrent.copy_(fresh_state.recurrent)
            graph.replay()
            eager_state = _copy(fresh_state)
            eager = ops.gated_delta_net_decode_(fresh_x, mixer, eager_state)
            assert torch.equal(out, eager), f"replay {seed}"
            assert torch.equal(static_state.conv, eager_state.conv)
            assert torch.equal(static_state.recurrent, eager_state.recurrent)


def test_hundreds_of_launches_in_a_row_give_one_answer(ops, monkeypatch):
    """200 launches back to back on one stream, each from a copy of one state: a barrier that let a block read
    rows before they were all stored would give another output now and then."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import gdn_persistent

    monkeypatch.setenv(gdn_persistent.ENV_SWITCH, "1")
    mixer, state, x = _mixer(ops, 5120, 16, 48, T.Q6_K, 3)
    copies = [_copy(state) for _ in range(201)]
    with running_static_step(decode_only=True):
        outs = [ops.gated_delta_net_decode_(x, mixer, copy) for copy in copies]
    torch.cuda.synchronize()
    assert all(torch.equal(outs[0], out) for out in outs)
    assert all(torch.equal(copies[0].recurrent, copy.recurrent) for copy in copies)


def test_a_loaded_models_decode_step_runs_the_persistent_mixer(tmp_path, monkeypatch):
    """A small Qwen3.5 file with 16 value heads of 128 dims (the kernel's shapes): with LUCEBOX_PERSISTENT_GDN=1
    every linear-attention layer's mixer in the recorded decode step is the persistent kernel (with its input add +
    norm after the first layer), and 16 greedy steps give the tokens of the six kernels (the logits within a
    rounding: near-tie equal)."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_cuda import gdn_persistent
    from lucebox_cuda.backend import CudaBackend
    from lucebox_qwen35 import layout, loader, synth
    from test_ffn_persistent_gpu import compare_switched_decode

    monkeypatch.setitem(layout.SIZES, "gdn16", layout.Qwen35Config(
        n_layer=4, hidden=256, ffn=768, n_head=2, n_head_kv=1, head_dim=256,
        ssm_d_state=128, ssm_n_group=4, ssm_dt_rank=16, ssm_d_inner=2048, tied_output=True))
    path = synth.write(tmp_path / "gdn16.gguf", size="gdn16", type="q4_k_m", seed=5)
    model = loader.load(GGUFFile(path), CudaBackend(dtype=torch.bfloat16))
    calls = []
    run = gdn_persistent.run
    monkeypatch.setattr(gdn_persistent, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    compare_switched_decode(model, gdn_persistent.ENV_SWITCH, calls, monkeypatch)
    assert len(calls) >= sum(layer.is_linear for layer in model.layers)
