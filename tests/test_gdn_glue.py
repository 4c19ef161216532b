"""The glue of a Gated DeltaNet layer's prefill as the CUDA backend's Triton kernels (lucebox_cuda.triton_gdn_glue
and the in-place forms in lucebox_cuda.triton_gdn) against the qwen35 family's torch references, run on the CPU
by Triton's interpreter on random inputs; then a tiny qwen35 model prefilling through them."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules are first imported

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")

import torch
from lucebox_cuda import op_kernels, triton_gdn, triton_gdn_glue
from triton.runtime.interpreter import InterpretedFunction

from lucebox_core import OpKernel
from lucebox_core.ops import kernel_table
from lucebox_core.torch_backend import TorchBackend
from lucebox_qwen35.ops import QWEN35_OPS

if not isinstance(triton_gdn_glue._gdn_gates_kernel, InterpretedFunction) or not triton_gdn._interpreted():
    pytest.skip("the Triton kernels were imported earlier without TRITON_INTERPRET=1", allow_module_level=True)

REFERENCE = QWEN35_OPS.bind(TorchBackend("cpu", torch.float32, kernel_table_for={}))
TOKEN_COUNTS = [1, 17, 64, 300]


def relative_error(result: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(result).all(), "the kernel left NaN (an unwritten output) or produced inf"
    return ((result.double() - expected.double()).norm() / expected.double().norm()).item()


# -- gdn_gates -------------------------------------------------------------------------------------------


def gate_inputs(tokens: int, heads: int, dtype: torch.dtype, seed: int):
    """a and b as the halves of one projection's output `[1, T, 2 H]` (strided views, as the model splits
    them); a spread over softplus's regimes (very negative, around 0, past the threshold of 20);
    model-like ssm_a = -exp(A_log) and dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    projected = (torch.randn(1, tokens, 2 * heads, generator=gen) * 8).to(dtype)
    b, a = projected.split([heads, heads], dim=-1)
    a[0, 0, 0], a[0, -1, -1] = 30.0, -40.0  # past the threshold; exp underflows to a tiny softplus
    ssm_a = -torch.exp(torch.rand(heads, generator=gen) * 3)
    dt_bias = torch.randn(heads, generator=gen)
    return a, b, ssm_a, dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("heads", [6, 48])
def test_gdn_gates_match_the_reference(tokens, heads, dtype):
    a, b, ssm_a, dt_bias = gate_inputs(tokens, heads, dtype, seed=tokens + heads)
    expected_g, expected_beta = REFERENCE.gdn_gates(a, b, ssm_a, dt_bias)
    g, beta = triton_gdn_glue.gdn_gates(a, b, ssm_a, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == beta.shape == a.shape
    assert g.is_contiguous() and beta.is_contiguous()
    # g: the same fp32 add and product; softplus's log1p within an ulp or two of torch's.
    torch.testing.assert_close(g, expected_g, rtol=2e-6, atol=1e-7)
    assert (g <= 0).all()
    # beta: fp32 sigmoid rounded once (bf16: the interpreter truncates where torch rounds, one ulp).
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.0)
    torch.testing.assert_close(beta, expected_beta, **tol)


def test_gdn_gates_take_a_batch_and_one_token_decode_rows():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 5, 12, generator=gen), torch.randn(2, 5, 12, generator=gen)
    ssm_a, dt_bias = -torch.rand(12, generator=gen), torch.randn(12, generator=gen)
    for args in ((a, b), (a[:, 0], b[:, 0]), (a.transpose(0, 1), b.transpose(0, 1))):  # last: leading dims copied
        expected = REFERENCE.gdn_gates(*args, ssm_a, dt_bias)
        for result, want in zip(triton_gdn_glue.gdn_gates(*args, ssm_a, dt_bias), expected):
            torch.testing.assert_close(result, want, rtol=2e-6, atol=1e-7)


def test_the_backend_takes_the_gates_at_the_models_shapes():
    ops = TorchBackend("cpu", torch.float32, kernel_table_for={})
    a, b, ssm_a, dt_bias = gate_inputs(4, 48, torch.bfloat16, seed=1)
    assert op_kernels.accepts_gdn_gates(ops, a, b, ssm_a, dt_bias)
    assert op_kernels.accepts_gdn_gates(ops, a[:, 0], b[:, 0], ssm_a, dt_bias)
    assert not op_kernels.accepts_gdn_gates(ops, a, b, ssm_a.double(), dt_bias)
    assert not op_kernels.accepts_gdn_gates(ops, a, b[..., :47], ssm_a, dt_bias)
    with pytest.raises(ValueError, match="gdn_gates"):
        triton_gdn_glue.gdn_gates(a, b, ssm_a[:47], dt_bias)


# -- causal_conv1d_silu_ ------------------------------------------------------------------------------------


def conv_inputs(tokens: int, channels: int, kernel: int, dtype: torch.dtype, seed: int, batch: int = 1):
    """x as the first channels of a wider projection's output (a strided view, as the model's split of
    [qkv | z] gives it), a non-zero state in x's dtype (the model keeps it so)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, tokens, channels + 40, generator=gen).to(dtype)
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    state = torch.randn(batch, kernel - 1, channels, generator=gen).to(dtype)
    return wide[..., :channels], weight, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 17, 64, 300])
def test_causal_conv1d_silu_matches_the_reference_and_updates_the_state(tokens, dtype):
    x, weight, state = conv_inputs(tokens, 600, 4, dtype, seed=tokens)  # 600: not a whole channel block
    original, expected_state = state.clone(), state.clone()
    expected = REFERENCE.causal_conv1d_silu_(x, weight, expected_state)
    address = state.data_ptr()
    y = op_kernels.causal_conv1d_silu_(REFERENCE, x, weight, state)
    assert state.data_ptr() == address and y.shape == x.shape and y.dtype == dtype
    assert torch.equal(state, expected_state)  # the window's last rows, copied: exact
    # fp32: summation order only; bf16: the reference sums in bf16, the kernel in fp32.
    assert relative_error(y, expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    # And the SiLU is the one the unfused kernel's output would get, rounded first (as the tree kernel does).
    plain, _ = triton_gdn.causal_conv1d(x, weight, original)
    assert relative_error(y, torch.nn.functional.silu(plain)) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(("tokens", "kernel"), [(1, 2), (5, 3), (40, 3), (2, 4)])
def test_causal_conv1d_silu_other_kernels_and_a_batch(tokens, kernel):
    x, weight, state = conv_inputs(tokens, 300, kernel, torch.float32, seed=10 * tokens + kernel, batch=2)
    expected_state = state.clone()
    expected = REFERENCE.causal_conv1d_silu_(x, weight, expected_state)
    y, _ = triton_gdn.causal_conv1d(x, weight, state, activation="silu", new_state=state)
    assert torch.equal(state, expected_state)
    assert relative_error(y, expected) < 1e-6


def test_causal_conv1d_silu_accept_check():
    ops = TorchBackend("cpu", torch.float32, kernel_table_for={})
    x, weight, state = conv_inputs(5, 64, 4, torch.bfloat16, seed=2)
    assert op_kernels.accepts_causal_conv1d_silu_(ops, x, weight, state)
    assert not op_kernels.accepts_causal_conv1d_silu_(ops, x, weight, state.float())  # written in x's dtype
    assert not op_kernels.accepts_causal_conv1d_silu_(ops, x, weight, state.transpose(1, 2).contiguous().mT)
    with pytest.raises(ValueError, match="new_state"):
        triton_gdn.causal_conv1d(x, weight, state, new_state=state.float())
