"""The add + norm + SwiGLU MLP as one op (`add_rms_norm_swiglu`) and its persistent CUDA kernel's choice, on the CPU.

The op's reference is held to a SwiGLU written here from its definition (separate gate and up weights, not the
fused rows); a model whose MLP rows are fused runs through the op and gives the logits of its unfused layers.
The kernel itself runs only on a GPU (tests/test_ffn_persistent_gpu.py); here its source compiles (with every
other source, tests/test_cuda_compile.py) and its choice refuses what the kernel cannot take, naming nothing
it would take by accident."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from lucebox_core.decoder_model import mlp_after_residual
from lucebox_core.kquants import random_blocks
from lucebox_core.quants import QuantTensor
from lucebox_core.static_step import running_static_step
from lucebox_core.torch_backend import TorchBackend, concat_rows

pytestmark = pytest.mark.usefixtures("row_major_weights")  # these kernels read GGUF's rows


def _quant(name: str, ggml_type: T, rows: int, cols: int, seed: int) -> QuantTensor:
    raw = random_blocks(ggml_type, rows * cols, 0.05, np.random.default_rng(seed))
    return QuantTensor(name, ggml_type, (rows, cols), torch.from_numpy(raw.copy()))


def test_the_reference_is_a_swiglu_mlp_after_the_residual_add():
    ops = TorchBackend(dtype=torch.float32)
    hidden, inter = 256, 512
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(1, 3, hidden, generator=g), torch.randn(1, 3, hidden, generator=g)
    norm = torch.rand(hidden, generator=g) + 0.5
    gate, up = _quant("gate", T.Q4_K, inter, hidden, 1), _quant("up", T.Q4_K, inter, hidden, 2)
    down = _quant("down", T.Q6_K, hidden, inter, 3)
    out, summed = ops.add_rms_norm_swiglu(x, residual, norm, 1e-6, concat_rows([gate, up]), down)

    s = x + residual
    m = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    # The weights as gguf's numpy decoder reads them (an implementation apart from the backend's).
    w_gate, w_up, w_down = (torch.from_numpy(gguf_quants.dequantize(w.data.numpy().reshape(w.shape[0], -1),
                                                                    w.ggml_type)).float() for w in (gate, up, down))
    want = (torch.nn.functional.silu(m @ w_gate.T) * (m @ w_up.T)) @ w_down.T
    torch.testing.assert_close(summed, s)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


class _MLP:
    swiglu = True

    def __init__(self, gate_up, down):
        self.gate_up_proj, self.down_proj = gate_up, down

    def __call__(self, x):
        raise AssertionError("a fused SwiGLU MLP goes through the op")


class _Recording(TorchBackend):
    def __init__(self):
        super().__init__(dtype=torch.float32)
        self.calls = []

    def add_rms_norm_swiglu(self, *args):
        self.calls.append("add_rms_norm_swiglu")
        return super().add_rms_norm_swiglu(*args)


def test_only_a_fused_swiglu_mlp_goes_through_the_op():
    ops = _Recording()
    hidden = 256
    x, residual, norm = torch.randn(1, 1, hidden), torch.randn(1, 1, hidden), torch.ones(hidden)
    gate_up = _quant("gate_up", T.Q4_K, 512, hidden, 4)
    down = _quant("down", T.Q4_K, hidden, 256, 5)
    mlp_after_residual(ops, _MLP(gate_up, down), x, residual, norm, 1e-6)
    assert ops.calls == ["add_rms_norm_swiglu"]

    class Unfused:  # rows kept apart (the torch backend's `fuse_rows` gives None): the MLP runs itself
        swiglu, gate_up_proj = True, None

        def __call__(self, m):
            return m * 2

    out, summed = mlp_after_residual(ops, Unfused(), x, residual, norm, 1e-6)
    assert ops.calls == ["add_rms_norm_swiglu"]
    torch.testing.assert_close(out, 2 * ops.rms_norm(x + residual, norm, 1e-6))


def test_a_model_with_fused_mlp_rows_gives_the_logits_of_its_unfused_layers(tmp_path):
    """The tiny Qwen3.5 file on the reference backend, its MLPs' gate and up rows stacked by hand (the reference
    backend does not fuse them): every layer's MLP then goes through `add_rms_norm_swiglu`, with the same
    logits as the unfused model's, prefill and decode."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_qwen35 import loader, synth

    path = synth.write(tmp_path / "tiny.gguf", size="tiny", type="q4_k_m", seed=5)
    plain = loader.load(GGUFFile(path), TorchBackend(dtype=torch.float32))
    fused = loader.load(GGUFFile(path), _Recording())
    for layer in fused.layers:
        layer.mlp.gate_up_proj = concat_rows([layer.mlp.gate_proj, layer.mlp.up_proj])
        assert layer.mlp.gate_up_proj is not None
    tokens = torch.tensor([3, 14, 15, 92, 65])
    runs = []
    for model in (plain, fused):
        state = model.new_state(32)
        logits = [model.forward(state, tokens)[-1]]
        logits.append(model.forward(state, logits[-1].argmax().reshape(1))[-1])
        runs.append(torch.stack(logits))
    assert fused.ops.calls.count("add_rms_norm_swiglu") == 2 * len(fused.layers)
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-5)


class _Device:
    """What `ffn_persistent.takes` reads of a backend: its device (a CPU one here)."""

    device = torch.device("cpu")


def test_the_persistent_kernel_is_off_unless_asked_and_never_on_the_cpu(monkeypatch):
    from lucebox_cuda import ffn_persistent

    hidden, inter = 1024, 3584
    x = torch.randn(1, 1, hidden, dtype=torch.bfloat16)
    norm = torch.ones(hidden)
    gate_up = _quant("gate_up", T.Q4_K, 2 * inter, hidden, 6)
    down = _quant("down", T.Q6_K, hidden, inter, 7)
    monkeypatch.delenv(ffn_persistent.ENV_SWITCH, raising=False)
    with running_static_step(decode_only=True):
        assert not ffn_persistent.takes(_Device(), x, x, norm, gate_up, down)  # off by default
        monkeypatch.setenv(ffn_persistent.ENV_SWITCH, "1")
        assert not ffn_persistent.takes(_Device(), x, x, norm, gate_up, down)  # a CPU tensor


@pytest.mark.parametrize("case", ["two tokens", "f32", "q8_0 down", "odd rows", "too wide", "short rows", "f64 norm"])
def test_the_persistent_kernel_refuses_what_it_cannot_take(case):
    """Each case breaks one condition of a call the kernel takes (the 0.8B's MLP, which it does take): the
    refusal names what is wrong."""
    from lucebox_cuda import ffn_persistent

    hidden, inter = 1024, 3584
    x = torch.randn(1, 1, hidden, dtype=torch.bfloat16)
    norm = torch.ones(hidden)
    gate_up = _quant("gate_up", T.Q4_K, 2 * inter, hidden, 8)
    down = _quant("down", T.Q6_K, hidden, inter, 9)
    assert ffn_persistent.refusal(x, x, norm, gate_up, down) is None
    expected = {"two tokens": "2 tokens", "f32": "activations", "q8_0 down": "format", "odd rows": "gate | up rows",
                "too wide": "at most", "short rows": "whole 256-value blocks", "f64 norm": "norm weight"}[case]
    if case == "two tokens":
        x = torch.randn(1, 2, hidden, dtype=torch.bfloat16)
    elif case == "f32":
        x = x.float()
    elif case == "q8_0 down":
        down = _quant("down", T.Q8_0, hidden, inter, 9)
    elif case == "odd rows":
        gate_up = _quant("gate_up", T.Q4_K, 2 * inter + 16, hidden, 8)
    elif case == "too wide":
        gate_up, down = _quant("gate_up", T.Q4_K, 2 * 20480, hidden, 10), _quant("down", T.Q4_K, hidden, 20480, 11)
    elif case == "short rows":
        gate_up, down = _quant("gate_up", T.Q8_0, 2 * 3616, hidden, 10), _quant("down", T.Q8_0, hidden, 3616, 11)
    else:
        norm = norm.double()
    reason = ffn_persistent.refusal(x, x if case != "two tokens" else x, norm, gate_up, down)
    assert reason is not None and expected in reason


def test_the_kernels_limits_are_the_catalogues():
    """The limits the Python checks use are the ones compiled into the kernels (each written in both places)."""
    import re

    from lucebox_cuda import catalogue, nvrtc

    sources = nvrtc.kernel_sources()
    ffn = int(re.search(r"constexpr int FFN_STAGE_VALUES = (\d+);", sources["ffn_persistent.cu"]).group(1))
    swiglu = int(re.search(r"constexpr int SWIGLU_MAX_COLS = (\d+);", sources["moe_matvec_mma.cu"]).group(1))
    threads = int(re.search(r"constexpr int FFN_WARPS = (\d+);", sources["ffn_persistent.cu"]).group(1)) * 32
    assert (ffn, swiglu, threads) == (catalogue.FFN_PERSISTENT_MAX_VALUES, catalogue.MOE_SWIGLU_MAX_COLS,
                                      catalogue.FFN_PERSISTENT_THREADS)
    moe = sources["moe_persistent.cu"]
    limits = [int(re.search(rf"constexpr int {name} = (\d+);", moe).group(1))
              for name in ("MOE_STAGE_VALUES", "MOE_MAX_EXPERTS", "MOE_MAX_TOP_K", "MOE_WARPS")]
    assert limits == [catalogue.MOE_PERSISTENT_STAGE_VALUES, catalogue.MOE_PERSISTENT_MAX_EXPERTS,
                      catalogue.MOE_PERSISTENT_MAX_TOP_K, catalogue.MOE_PERSISTENT_THREADS // 32]


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_blocks_per_sm_setting_is_refused_by_name(value, monkeypatch):
    from lucebox_cuda import ffn_persistent

    monkeypatch.setenv(ffn_persistent.BLOCKS_ENV, value)
    with pytest.raises(ValueError, match=ffn_persistent.BLOCKS_ENV):
        ffn_persistent.blocks_per_sm()
    monkeypatch.setenv(ffn_persistent.BLOCKS_ENV, "3")
    assert ffn_persistent.blocks_per_sm() == 3


@pytest.mark.parametrize("value", ["0", "3", "two"])
def test_a_bad_row_tiles_setting_is_refused_by_name(value, monkeypatch):
    from lucebox_cuda import catalogue, ffn_persistent

    monkeypatch.setenv(ffn_persistent.ROW_TILES_ENV, value)
    with pytest.raises(ValueError, match=ffn_persistent.ROW_TILES_ENV):
        ffn_persistent.row_tiles()
    monkeypatch.setenv(ffn_persistent.ROW_TILES_ENV, "2")
    assert ffn_persistent.row_tiles() == 2
    program, name = catalogue.ffn_persistent("q4_k", "q6_k", "bf16", "f32", row_tiles=2)
    assert name == "ffn_persistent_r2_q4_k_q6_k_bf16_f32" and program.instantiations[0].startswith(
        "LUCEBOX_FFN_PERSISTENT_R2(")
