"""A decode step's Gated DeltaNet mixer as one op (`gated_delta_net_decode_`, the qwen35 family's) and its persistent
CUDA kernel's choice, on the CPU.

The op's reference is held to the mixer written here from its definition (transformers' `Qwen3_5GatedDeltaNet`
for one token, on gguf's numpy dequantisation of the weights, in float64); the kernel itself runs only on a GPU
(tests/test_gdn_persistent_gpu.py): here its source compiles (tests/test_cuda_compile.py), its limits are the
catalogue's, and its choice refuses what it cannot take, by name."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from lucebox_core.kquants import random_blocks
from lucebox_core.quants import QuantTensor
from lucebox_core.static_step import running_static_step
from lucebox_core.torch_backend import TorchBackend, concat_rows

pytestmark = pytest.mark.usefixtures("row_major_weights")  # these kernels read GGUF's rows


def _quant(name, ggml_type, rows, cols, seed):
    raw = random_blocks(ggml_type, rows * cols, 0.05, np.random.default_rng(seed))
    return QuantTensor(name, ggml_type, (rows, cols), torch.from_numpy(raw.copy()))


def _dequant(weight):
    return torch.from_numpy(gguf_quants.dequantize(weight.data.numpy().reshape(weight.shape[0], -1),
                                                   weight.ggml_type)).double()


def _mixer(ops, hidden=256, key_heads=2, value_heads=4, dim=128, qkv_type=T.Q6_K, seed=0):
    from lucebox_qwen35.model import GatedDeltaNet, GatedDeltaNetState

    g = torch.Generator().manual_seed(seed)
    channels, value_channels = (2 * key_heads + value_heads) * dim, value_heads * dim
    mixer = GatedDeltaNet(
        ops,
        in_proj_qkv=_quant("qkv", qkv_type, channels, hidden, seed),
        in_proj_z=_quant("z", T.Q4_K, value_channels, hidden, seed + 1),
        in_proj_b=_quant("b", T.Q4_K, value_heads, hidden, seed + 2),
        in_proj_a=_quant("a", T.Q4_K, value_heads, hidden, seed + 3),
        conv1d=torch.randn(channels, 4, generator=g) * 0.5,
        ssm_a=-torch.rand(value_heads, generator=g) * 4,
        dt_bias=torch.randn(value_heads, generator=g),
        norm=torch.rand(dim, generator=g) + 0.5,
        out_proj=_quant("out", T.Q4_K, hidden, value_channels, seed + 4),
        num_k_heads=key_heads, num_v_heads=value_heads, head_k_dim=dim, head_v_dim=dim, eps=1e-6,
    )
    state = GatedDeltaNetState(conv=torch.randn(1, 3, channels, generator=g),
                               recurrent=torch.randn(1, value_heads, dim, dim, generator=g) * 0.1)
    return mixer, state, torch.randn(1, 1, hidden, generator=g)


def _fuse(mixer):
    """The fused input rows a GPU backend makes (`fuse_rows`; the torch backend keeps them apart)."""
    mixer.in_proj_qkvz = concat_rows([mixer.in_proj_qkv, mixer.in_proj_z])
    mixer.in_proj_ba = concat_rows([mixer.in_proj_b, mixer.in_proj_a])
    assert mixer.in_proj_qkvz is not None and mixer.in_proj_ba is not None


def _by_definition(mixer, state, x):
    """One token of the gated delta rule in float64, from the definition: returns (out, conv state, recurrent)."""
    d, hk, hv = mixer.head_k_dim, mixer.num_k_heads, mixer.num_v_heads
    m = x.double().reshape(-1)
    qkv, z = _dequant(mixer.in_proj_qkv) @ m, _dequant(mixer.in_proj_z) @ m
    b, a = _dequant(mixer.in_proj_b) @ m, _dequant(mixer.in_proj_a) @ m
    window = torch.cat([state.conv[0].double(), qkv[None]])  # [4, C]: the 3 inputs kept, then this token's
    conv = (window * mixer.conv1d.double().T).sum(0)
    conv = conv * torch.sigmoid(conv)
    q, k, v = conv[:hk * d].reshape(hk, d), conv[hk * d:2 * hk * d].reshape(hk, d), conv[2 * hk * d:].reshape(hv, d)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / d ** 0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(b)
    decay = torch.exp(mixer.ssm_a.double() * torch.nn.functional.softplus(a + mixer.dt_bias.double()))
    S = state.recurrent[0].double().clone()
    out = torch.empty(hv, d, dtype=torch.float64)
    for h in range(hv):
        kh = h % hk  # value head h reads key head h % H_k: the GGUF's tiled order
        S[h] = S[h] * decay[h]
        S[h] = S[h] + torch.outer(k[kh], beta[h] * (v[h] - S[h].T @ k[kh]))
        out[h] = S[h].T @ q[kh]
    normed = out / torch.sqrt((out * out).mean(-1, keepdim=True) + mixer.eps) * mixer.norm.double()
    gated = normed * torch.nn.functional.silu(z.reshape(hv, d))
    return _dequant(mixer.out_proj) @ gated.reshape(-1), window[1:], S


@pytest.mark.parametrize("fuse", [False, True])
def test_the_reference_is_the_gated_delta_rule_by_its_definition(fuse):
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.float32, kernel_table_for={}))
    mixer, state, x = _mixer(ops, qkv_type=T.Q4_K if fuse else T.Q6_K)  # rows of one type fuse
    if fuse:
        _fuse(mixer)
    want_out, want_conv, want_recurrent = _by_definition(mixer, state, x)
    out = ops.gated_delta_net_decode_(x, mixer, state)  # the states in place
    torch.testing.assert_close(out.reshape(-1).double(), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.conv[0].double(), want_conv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state.recurrent[0].double(), want_recurrent, rtol=1e-4, atol=1e-5)


def test_the_model_runs_one_token_through_the_op(monkeypatch):
    """A decode token of a GatedDeltaNet goes through `gated_delta_net_decode_` (so that a backend's kernel for it
    runs), and a prompt does not."""
    from lucebox_qwen35.model import GatedDeltaNet
    from lucebox_qwen35.ops import QWEN35_OPS

    seen = []
    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.float32, kernel_table_for={}))
    mixer, state, x = _mixer(ops)
    original = GatedDeltaNet.decode_token
    monkeypatch.setattr(GatedDeltaNet, "decode_token", lambda self, *a: seen.append(a[0].shape) or original(self, *a))
    mixer(x, state)
    mixer(torch.cat([x, x], dim=1), state)
    assert seen == [x.shape]


def test_a_decode_step_runs_each_linear_layer_after_the_first_through_the_add_and_norm_op(tmp_path, monkeypatch):
    """The tiny model's recorded decode step (on the CPU, not recorded): every linear-attention layer but the first
    (which has no MLP output to add yet) goes through `add_rms_norm_gated_delta_net_`, whose reference is the ops
    that ran before, so the logits are still the forward pass's."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_qwen35 import loader, ops as qwen_ops, synth

    path = synth.write(tmp_path / "tiny.gguf", size="tiny", type="q4_k_m", seed=2)
    seen = []
    reference = qwen_ops.QWEN35_OPS.references["add_rms_norm_gated_delta_net_"]
    monkeypatch.setitem(qwen_ops.QWEN35_OPS.references, "add_rms_norm_gated_delta_net_",
                        lambda ops, *a: seen.append(a[4]) or reference(ops, *a))
    model = loader.load(GGUFFile(path), TorchBackend("cpu", torch.float32))  # bound with the recording reference
    prompt = torch.tensor([5, 9, 11, 3])
    state = model.new_state(32)
    model.forward(state, prompt[:-1])
    stepped = model.decode_step(state, int(prompt[-1]), graphs=False)
    whole = model.forward(model.new_state(32), prompt)[-1:]
    linear = [layer.linear_attn for layer in model.layers if layer.is_linear]
    first_is_linear = model.layers[0].is_linear
    assert seen == linear[1:] if first_is_linear else seen == linear
    logits = stepped[0] if isinstance(stepped, tuple) else stepped
    torch.testing.assert_close(logits.reshape(whole.shape), whole, rtol=1e-4, atol=1e-4)


def test_the_persistent_kernel_is_off_unless_asked_and_never_on_the_cpu(monkeypatch):
    from lucebox_cuda import gdn_persistent
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.bfloat16, kernel_table_for={}))
    mixer, state, x = _mixer(ops, key_heads=4, value_heads=16)
    mixer.conv1d, mixer.norm = mixer.conv1d.bfloat16(), mixer.norm.bfloat16()
    state.conv = state.conv.bfloat16()
    x = x.bfloat16()
    assert gdn_persistent.refusal(x, mixer, state) is None  # the shapes it takes
    monkeypatch.delenv(gdn_persistent.ENV_SWITCH, raising=False)
    with running_static_step(decode_only=True):
        assert not gdn_persistent.takes(ops, x, mixer, state)
        monkeypatch.setenv(gdn_persistent.ENV_SWITCH, "1")
        assert not gdn_persistent.takes(ops, x, mixer, state)  # a CPU tensor
    assert not gdn_persistent.takes(ops, x, mixer, state)  # outside a static step


CASES = {
    "two tokens": "2 tokens",
    "f32": "activations torch.float32",
    "64 dims": "head dims 64",
    "8 value heads": "8 value heads",
    "conv1d f32": "conv1d",
    "conv state f32": "conv state",
    "recurrent bf16": "recurrent state",
    "ssm_a bf16": "ssm_a",
    "norm f64": "norm weight",
    "q8_0 qkv": "tensor-core K-quant",
    "q6_k out": "tensor-core K-quant",
    "short z": "z rows 2032",
    "no key heads": "value heads over 0 key heads",
}


@pytest.mark.parametrize("case", CASES)
def test_the_persistent_kernel_refuses_what_it_cannot_take(case):
    from lucebox_cuda import gdn_persistent
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.bfloat16, kernel_table_for={}))
    dim = 64 if case == "64 dims" else 128
    value_heads = 8 if case == "8 value heads" else 16
    mixer, state, x = _mixer(ops, key_heads=4, value_heads=value_heads, dim=dim,
                             qkv_type=T.Q8_0 if case == "q8_0 qkv" else T.Q6_K)
    mixer.conv1d, mixer.norm = mixer.conv1d.bfloat16(), mixer.norm.bfloat16()
    state.conv, x = state.conv.bfloat16(), x.bfloat16()
    if case == "two tokens":
        x = torch.cat([x, x], dim=1)
    elif case == "f32":
        x = x.float()
    elif case == "conv1d f32":
        mixer.conv1d = mixer.conv1d.float()
    elif case == "conv state f32":
        state.conv = state.conv.float()
    elif case == "recurrent bf16":
        state.recurrent = state.recurrent.bfloat16()
    elif case == "ssm_a bf16":
        mixer.ssm_a = mixer.ssm_a.bfloat16()
    elif case == "norm f64":
        mixer.norm = mixer.norm.double()
    elif case == "short z":
        mixer.in_proj_z = _quant("z", T.Q4_K, value_heads * dim - 16, 256, 9)
    elif case == "no key heads":
        mixer.num_k_heads = 0
    elif case == "q6_k out":
        mixer.out_proj = _quant("out", T.Q6_K, 256, value_heads * dim, 9)
    reason = gdn_persistent.refusal(x, mixer, state)
    assert reason is not None and CASES[case] in reason


def test_the_input_add_and_norm_is_refused_by_name_where_the_kernel_cannot_take_it():
    from lucebox_cuda import gdn_persistent
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.bfloat16, kernel_table_for={}))
    mixer, _, x = _mixer(ops, key_heads=4, value_heads=16)
    mixer.norm, x = mixer.norm.bfloat16(), x.bfloat16()
    residual = torch.randn_like(x)
    assert gdn_persistent.residual_refusal(x, residual, torch.ones(256, dtype=torch.bfloat16), mixer) is None
    assert "input norm torch.float32" in gdn_persistent.residual_refusal(x, residual, torch.ones(256), mixer)
    assert "residual torch.float32" in gdn_persistent.residual_refusal(x, residual.float(), mixer.norm, mixer)


def test_a_fused_weights_rows_are_addressed_where_they_start():
    """The kernel reads z's rows inside the fused qkv | z weight (and a's inside b | a): the pointer is the weight's
    start plus the rows before it, whole GGUF rows."""
    from lucebox_cuda import ffn_persistent, gdn_persistent
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.float32, kernel_table_for={}))
    mixer, _, _ = _mixer(ops, qkv_type=T.Q4_K)
    _fuse(mixer)
    rows = gdn_persistent._rows(mixer)
    assert rows["z"] == (mixer.in_proj_qkvz, mixer.conv1d.shape[0]) and rows["a"] == (mixer.in_proj_ba, 4)

    class _Device:
        def device_weight(self, weight):
            return weight

    fused = mixer.in_proj_qkvz
    pointer = ffn_persistent.row_pointer(_Device(), fused, mixer.conv1d.shape[0])
    row_bytes = fused.data.numel() // fused.shape[0]
    z_bytes = fused.data[mixer.conv1d.shape[0] * row_bytes:]
    assert torch.equal(z_bytes, mixer.in_proj_z.data)
    assert pointer.value == fused.data.data_ptr() + mixer.conv1d.shape[0] * row_bytes


def test_the_kernels_limits_are_the_catalogues():
    from lucebox_cuda import catalogue, gdn_persistent, nvrtc

    source = nvrtc.kernel_sources()["gdn_persistent.cu"]

    def constant(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", source).group(1))

    assert constant("GDN_STAGE_VALUES") == catalogue.GDN_PERSISTENT_STAGE_VALUES
    assert constant("GDN_WARPS") * 32 == catalogue.GDN_PERSISTENT_THREADS
    assert (constant("GDN_HEAD_DIM"), constant("GDN_CHUNK"), constant("GDN_TAPS"), constant("GDN_TILE")) == (
        gdn_persistent.HEAD_DIM, gdn_persistent.CHUNK, gdn_persistent.TAPS, gdn_persistent.TILE)
