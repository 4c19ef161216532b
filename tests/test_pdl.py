"""Programmatic dependent launch (lucebox_cuda.pdl), without a GPU: off on the CPU whatever the switch, the
driver's launch configuration carries the attribute, and the kernels compiled for sm_90 with their `PDL`
constexpr wait for the kernel ahead (griddepcontrol) where a plain build has no such instruction. The timing
is the GPU session's (`scripts/gpu_session_more.sh s21-fusion`, PDL against LUCEBOX_PDL=0)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")
pytest.importorskip("cuda.bindings.driver", reason="lucebox-cuda's dependencies (cuda-bindings) are not installed")


def test_off_on_the_cpu_even_when_switched_on(monkeypatch):
    from lucebox_cuda import pdl

    monkeypatch.setenv(pdl.ENV_SWITCH, "1")
    assert pdl.triton_options(torch.zeros(1)) == {"PDL": False}
    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setenv(pdl.ENV_SWITCH, "0")
    assert not pdl.enabled(torch.device("cuda", 0))  # switched off: no device query at all


def test_the_launch_configuration_allows_programmatic_serialisation():
    from cuda.bindings import driver
    from lucebox_cuda import nvrtc

    config = nvrtc._pdl_config((4, 2, 1), (128, 1, 1), 1024, 0)
    assert (config.gridDimX, config.gridDimY, config.blockDimX, config.sharedMemBytes) == (4, 2, 128, 1024)
    assert config.numAttrs == 1
    attribute = config.attrs[0]
    assert attribute.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attribute.value.programmaticStreamSerializationAllowed == 1


COMPILE_SCRIPT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lucebox_cuda import triton_fused, triton_moe, triton_norms, triton_ops, triton_path_combine, triton_router

def ptx(kernel, types, constants, pdl):
    constants = {**constants, "PDL": pdl}
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in kernel.arg_names}
    options = {"launch_pdl": True} if pdl else None
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

kernels = [
    (triton_fused._add_rms_norm_kernel, dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", normed_ptr="*bf16",
                                             sum_ptr="*bf16", eps="fp32"), dict(BLOCK=2048)),
    (triton_path_combine._path_attention_combine_kernel,
     dict(max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", gate_ptr="*bf16", out_ptr="*bf16", threshold="fp32"),
     dict(Q_HEADS=64, VALUE_DIM=128, CHUNK=16, BLOCK_DV=64, GATED=True)),
    (triton_router._route_kernel,
     dict(x_ptr="*bf16", w_ptr="*fp32", extra_ptr="*fp32", gate_w_ptr="*fp32", gate_out_ptr="*bf16",
          logits_ptr="*fp32", counter_ptr="*i32", weights_ptr="*fp32", ids_ptr="*i64", scale="fp32"),
     dict(HIDDEN=2048, BLOCK_E=4, BLOCK_H=256, BLOCK_ALL=256, TOP_K=8, SIGMOID=True, GATE=False)),
    (triton_moe._combine_pairs_kernel, dict(rows_ptr="*bf16", weights_ptr="*fp32", out_ptr="*bf16",
                                            logit_ptr="*bf16"), dict(TOP_K=8, BLOCK=1024, SHARED=True, GATED=True)),
    (triton_ops._write_kv_rows_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", keys_ptr="*bf16", values_ptr="*bf16",
                                            positions_ptr="*i64"),
     dict(K_DIM=128, V_DIM=128, BLOCK_K=128, BLOCK_V=128, RING=True)),
    (triton_fused._gate_kernel, dict(a_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16"), dict(SIGMOID=False, BLOCK=1024)),
    # Gemma-4's sandwich norms and its q/k/v norm + RoPE.
    (triton_norms._post_norm_residual_kernel,
     dict(x_ptr="*bf16", res_ptr="*bf16", post_w_ptr="*bf16", scalar_ptr="*bf16", next_w_ptr="*bf16",
          hidden_ptr="*bf16", normed_ptr="*bf16", eps="fp32"), dict(HAS_SCALAR=True, HAS_NEXT=True, BLOCK=8192)),
    (triton_norms._qkv_norm_rope_kernel,
     dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", qw_ptr="*bf16", kw_ptr="*bf16", vw_ptr="*bf16",
          inv_freq_ptr="*fp32", pos_ptr="*i64", q_out_ptr="*bf16", k_out_ptr="*bf16", v_out_ptr="*bf16",
          eps="fp32"), dict(BLOCK_D=512)),
]
for kernel, types, constants in kernels:
    with_pdl, plain = ptx(kernel, types, constants, True), ptx(kernel, types, constants, False)
    assert "griddepcontrol.wait" in with_pdl and "griddepcontrol.launch_dependents" in with_pdl, kernel.__name__
    assert "griddepcontrol" not in plain, kernel.__name__
    print("waits", kernel.__name__)
"""


def test_the_kernels_wait_for_the_kernel_ahead_only_when_launched_so(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, check=False,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("waits") == 8


def _braced(text: str, start: int) -> str:
    """The text from `start` through the brace that closes the first `{` after it."""
    opening = text.index("{", start)
    depth = 0
    for end in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start : end + 1]
    raise AssertionError("unbalanced braces")


def test_every_nvrtc_kernel_source_waits_for_the_kernel_ahead():
    """Every NVRTC launch may carry the attribute, so every kernel entry point reaches the wait: in its own
    body, or through a body function whose definition waits (a kernel without it would race the kernel
    ahead once PDL is on)."""
    import re

    from lucebox_cuda import nvrtc

    sources = nvrtc.kernel_sources()
    everything = "\n".join(sources.values())
    waiting_bodies = set()
    bodies = {"matvec_body", "matvec_mma_rows", "matvec_pipe_body", "rms_norm_body", "dequant_body",
              "ffn_persistent_body", "moe_persistent_body", "gdn_persistent_body",
              "attention_persistent_body", "tiled_accumulate", "megakernel_body", "bulk_accumulate", "given_sums"}
    for body in bodies:
        definition = re.search(rf"void {body}\(", everything)
        assert definition, body
        if "lucebox_wait_prior_grid();" in _braced(everything, definition.start()):
            waiting_bodies.add(body)
    assert waiting_bodies == bodies
    # matvec_mma_rows with the block's own row tile, and for one pair (moe_matvec_mma.cu): both wait through it.
    mma_body = _braced(everything, re.search(r"void matvec_mma_body\(", everything).start())
    assert "matvec_mma_rows<" in mma_body
    waiting_bodies |= {"matvec_mma_body", "expert_rows"}
    entries = 0
    for name, text in sources.items():
        for entry in re.finditer(r'extern "C" __global__', text):
            kernel = _braced(text, entry.start())
            entries += 1
            assert "lucebox_wait_prior_grid();" in kernel or any(f"{b}<" in kernel for b in waiting_bodies), (
                name, kernel[:200])
    assert entries >= 14
    assert "griddepcontrol.wait" in sources["portable.cuh"]
