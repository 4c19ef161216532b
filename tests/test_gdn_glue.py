"""The glue of a Gated DeltaNet layer's prefill as the CUDA backend's Triton kernels (lucebox_cuda.triton_gdn_glue
and the in-place forms in lucebox_cuda.triton_gdn) against the qwen35 family's torch references, run on the CPU
by Triton's interpreter on random inputs; then a tiny qwen35 model prefilling through them."""

from __future__ import annotations

import os
import subprocess
import sys

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


# -- gated_delta_rule_chunked_ -------------------------------------------------------------------------------


def delta_inputs(tokens: int, key_heads: int, value_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """Model-like ranges: unit q and k, g <= 0 in fp32, beta in (0, 1), a non-zero fp32 state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, tokens, key_heads, dim, generator=gen), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(1, tokens, key_heads, dim, generator=gen), dim=-1).to(dtype)
    v = torch.randn(1, tokens, value_heads, dim, generator=gen).to(dtype)
    g = -torch.rand(1, tokens, value_heads, generator=gen)
    beta = torch.rand(1, tokens, value_heads, generator=gen).to(dtype)
    state = torch.randn(1, value_heads, dim, dim, generator=gen)
    return q, k, v, g, beta, state


# 300 tokens: past op_kernels.SEQUENTIAL_PREFILL_TOKENS, so the chunk scan; the rest walk token by token.
@pytest.mark.parametrize(("tokens", "dtype"), [(1, torch.float32), (17, torch.float32), (64, torch.bfloat16),
                                               (300, torch.float32)])
def test_gated_delta_rule_chunked_in_place_matches_the_reference(tokens, dtype):
    q, k, v, g, beta, state = delta_inputs(tokens, 2, 6, 16, dtype, seed=tokens)
    expected_out, expected_state = REFERENCE.gated_delta_rule_chunked(q.float(), k.float(), v.float(), g,
                                                                      beta.float(), state)
    separate_out, separate_state = op_kernels.gated_delta_rule_chunked(REFERENCE, q, k, v, g, beta, state)
    address = state.data_ptr()
    out = op_kernels.gated_delta_rule_chunked_(REFERENCE, q, k, v, g, beta, state)
    assert state.data_ptr() == address
    # The same kernels and arithmetic as the out-of-place op: the same bits.
    assert torch.equal(out, separate_out) and torch.equal(state, separate_state)
    assert relative_error(out, expected_out) < (1e-4 if dtype == torch.float32 else 2e-2)
    assert relative_error(state, expected_state) < (1e-4 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("tokens", [17, 70])
def test_both_scans_write_the_state_in_place(tokens):
    """Each scan, whatever the token count (the op picks one by length), over tiled heads (H_v = 3 H_k)."""
    q, k, v, g, beta, state = delta_inputs(tokens, 1, 3, 32, torch.float32, seed=tokens + 5)
    expected_out, expected_state = REFERENCE.gated_delta_rule_chunked(q, k, v, g, beta, state)
    for scan in (triton_gdn.gated_delta_rule_chunked, triton_gdn.gated_delta_rule_sequential):
        written = state.clone()
        out, returned = scan(q, k, v, g, beta, written, new_state=written)
        assert returned is written
        assert relative_error(out, expected_out) < 1e-4 and relative_error(written, expected_state) < 1e-4
    with pytest.raises(ValueError, match="new_state"):
        triton_gdn.gated_delta_rule_sequential(q, k, v, g, beta, state, new_state=state[..., :8])


def test_gated_delta_rule_chunked_in_place_accept_check():
    ops = TorchBackend("cpu", torch.float32, kernel_table_for={})
    q, k, v, g, beta, state = delta_inputs(3, 2, 6, 16, torch.bfloat16, seed=0)
    assert op_kernels.accepts_gated_delta_rule_chunked_(ops, q, k, v, g, beta, state)
    assert not op_kernels.accepts_gated_delta_rule_chunked_(ops, q, k, v, g, beta, state.mT)  # not contiguous
    assert not op_kernels.accepts_gated_delta_rule_chunked_(ops, q, k, v, g, beta, state, chunk_size=48)


# -- a tiny qwen35 model prefilling through the three kernels ------------------------------------------------

GLUE_OPS = ("gdn_gates", "causal_conv1d_silu_", "gated_delta_rule_chunked_")


def glue_on_cpu(ran: set[str]) -> list[OpKernel]:
    """The backend's own kernel and check for each glue op, noting in `ran` which ops they computed."""
    def kernel(op):
        def run(ops, *args, **kwargs):
            ran.add(op)
            return getattr(op_kernels, op)(ops, *args, **kwargs)
        return run

    return [OpKernel(op=op, backend="glue-cpu", kernel=kernel(op), accepts=getattr(op_kernels, f"accepts_{op}"))
            for op in GLUE_OPS]


def test_tiny_model_prefills_through_the_kernels(tmp_path):
    """Two prefill pieces (the second continues from the states the first wrote in place), then a decode
    step from them, on the reference backend and on one whose three glue ops are the Triton kernels."""
    from lucebox_qwen35 import loader, synth

    path = tmp_path / "tiny.gguf"
    synth.write(path, size="tiny", type="q8_0", seed=4)
    ran: set[str] = set()
    reference = loader.load(path, TorchBackend())
    glued = loader.load(path, TorchBackend(kernel_table_for=kernel_table("glue-cpu", glue_on_cpu(ran))))
    # The interpreter walks the delta rule token by token (most of this test's time), so: a first piece
    # of 17 (two token blocks of the gates and convolution kernels), a second of 3 (under the convolution's
    # window of 4, so each of its tokens reads state rows the first piece wrote), and KV caches for these
    # positions only (a full context's take seconds to allocate and are never read past them).
    prompt = torch.randint(0, reference.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    a, b = reference.new_state(len(prompt) + 1), glued.new_state(len(prompt) + 1)
    for piece in (prompt[:17], prompt[17:]):
        expected, result = reference.forward(a, piece), glued.forward(b, piece)
        assert relative_error(result, expected) < 1e-4
    assert ran == set(GLUE_OPS)  # every glue op took the model's tensors
    expected = reference.decode_step(a, int(prompt[-1]), graphs=False)
    assert relative_error(glued.decode_step(b, int(prompt[-1]), graphs=False), expected) < 1e-4


# -- the gates kernel compiles for the GPU (no GPU needed; the scans and the convolution: test_triton_gdn) -----

COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lucebox_cuda import triton_gdn_glue as glue

kernel = glue._gdn_gates_kernel
types = dict(a_ptr="*bf16", b_ptr="*bf16", ssm_a_ptr="*fp32", dt_bias_ptr="*fp32", g_ptr="*fp32", beta_ptr="*bf16",
             threshold="fp32")
constants = dict(BLOCK_T=glue.GATES_BLOCK_TOKENS, BLOCK_H=64)
signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in kernel.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n.endswith("_ptr")}
binary = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32))
assert binary.asm["cubin"][:4] == b"\\x7fELF"
print("compiled")
"""


def test_the_gates_kernel_compiles_for_hopper(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, check=False,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "compiled"
