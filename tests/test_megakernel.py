"""The Qwen3.5 megakernel's host side (`lucebox_cuda.megakernel`), no GPU needed: the table's slots are the kernel's,
a Q4_K_M model's layers pick the bodies its formats need, the layouts it refuses say why, and the program compiles
(test_cuda_compile.py compiles it for every architecture; test_megakernel_gpu.py runs it)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("cuda.bindings.nvrtc", reason="lucebox-cuda's dependencies (cuda-bindings) are not installed")

from lucebox_cuda import catalogue, megakernel, nvrtc  # noqa: E402


def test_the_tables_slots_are_the_kernels():
    """`megakernel.FIELDS` in the order of the kernel's `MegaField`: its named slots, then the prefetch's ranges."""
    source = nvrtc.kernel_sources()["qwen35_megakernel.cu"]
    enum = re.search(r"enum MegaField \{(.*?)\};", source, re.S).group(1)
    names = [line.split(",")[0].split("//")[0].strip() for line in enum.splitlines()]
    names = [name for name in names if name.startswith("MEGA_")]
    slots = names[:names.index("MEGA_PREFETCH")]
    assert [name.removeprefix("MEGA_").lower() for name in slots] == list(megakernel.FIELDS[:len(slots)])
    ranges = int(re.search(r"MEGA_PREFETCH_RANGES = (\d+)", enum).group(1))
    assert len(megakernel.FIELDS) == len(slots) + 2 * ranges
    assert megakernel.FIELDS[len(slots)::2] == tuple(f"prefetch{i}_address" for i in range(ranges))


@pytest.fixture
def model(tmp_path, monkeypatch):
    """test_megakernel_gpu's file (8 layers, 6 linear and 2 attention, a Q4_K_M mix) on the CPU with bf16
    activations, the MLPs' gate and up rows fused as the CUDA backend fuses them; the switch on (the layers'
    weights not tiled)."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_core.torch_backend import TorchBackend, concat_rows
    from lucebox_qwen35 import layout, loader, synth

    monkeypatch.setenv(megakernel.ENV_SWITCH, "1")
    monkeypatch.setitem(layout.SIZES, "mega8", layout.Qwen35Config(
        n_layer=8, hidden=256, ffn=768, n_head=4, n_head_kv=1, head_dim=256,
        ssm_d_state=128, ssm_n_group=4, ssm_dt_rank=16, ssm_d_inner=2048, tied_output=True))
    path = synth.write(tmp_path / "mega8.gguf", size="mega8", type="q4_k_m", seed=7)
    model = loader.load(GGUFFile(path), TorchBackend(dtype=torch.bfloat16))
    for layer in model.layers:
        layer.mlp.gate_up_proj = concat_rows([layer.mlp.gate_proj, layer.mlp.up_proj])
    return model


def test_a_q4_k_m_models_layers_pick_the_bodies_of_their_formats(model):
    """Each distinct formats tuple is one body (Q6_K on some layers' qkv, v and down products), numbered in order of
    first use; each layer names its kind and its bodies."""
    from gguf import GGMLQuantizationType as T

    state = model.new_state(64)
    x = torch.zeros(1, 1, 256, dtype=torch.bfloat16)
    position = torch.zeros(1, dtype=torch.int64)
    assert megakernel.refusal(model, state, x, position, 64) is None
    gdn, attention, ffn, rows = megakernel._variants(model, 256)
    name = {T.Q4_K: "q4_k", T.Q6_K: "q6_k"}
    for layer, (kind, mixer, mlp) in zip(model.layers, rows):
        assert kind == (megakernel.LINEAR if layer.linear_attn is not None else megakernel.ATTENTION)
        assert ffn[mlp] == (name[layer.mlp.gate_proj.ggml_type], name[layer.mlp.down_proj.ggml_type])
        if kind == megakernel.LINEAR:
            assert gdn[mixer] == (name[layer.linear_attn.in_proj_qkv.ggml_type], "q4_k")
        else:
            assert attention[mixer][1] == name[layer.self_attn.v_proj.ggml_type]
    assert {"q4_k", "q6_k"} <= {formats[1] for formats in ffn}  # a mix, or the test proves nothing
    program, kernel = catalogue.qwen35_megakernel(gdn, attention, ffn, "bf16", "f32", 4)
    assert program.instantiations[-1] == f"LUCEBOX_QWEN35_MEGAKERNEL({kernel}, bf16, f32, 4)"
    assert all(f"MEGA_FFN_CASE({i}, {g}, {d})" in program.instantiations[2] for i, (g, d) in enumerate(ffn))


def test_the_layouts_it_refuses_say_why(model):
    state = model.new_state(64)
    x = torch.zeros(1, 1, 256, dtype=torch.bfloat16)
    position = torch.zeros(1, dtype=torch.int64)
    assert "window 100000" in megakernel.refusal(model, state, x, position, 100000)
    assert "layer 0's MLP: activations torch.float32" in megakernel.refusal(model, state, x.float(), position, 64)
    model.layers[2].mlp.gate_up_proj = None
    assert megakernel.refusal(model, state, x, position, 64) == "layer 2: an MLP that is not a fused SwiGLU"
