"""The Triton Gated DeltaNet prefill/tree kernels and the causal convolutions (lucebox_cuda.triton_gdn)
against the torch reference ops, run on the CPU by Triton's interpreter. Small shapes: the interpreter is
slow; the 27B shapes are checked on a GPU by `python -m lucebox_cuda.triton_gdn`."""

from __future__ import annotations

import os
import subprocess
import sys

# Triton decides at decoration time whether a kernel is compiled or interpreted: set this before the
# kernels' module is first imported.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")

import torch
import torch.nn.functional as F
from lucebox_cuda import triton_gdn

from lucebox_core.torch_backend import TorchBackend
from lucebox_qwen35.ops import QWEN35_OPS

if not triton_gdn._interpreted():
    pytest.skip("lucebox_cuda.triton_gdn was imported earlier without TRITON_INTERPRET=1", allow_module_level=True)

REFERENCE = QWEN35_OPS.bind(TorchBackend("cpu", torch.float32))  # the torch reference with the qwen35 family's ops
# Relative-error bounds. fp32: the kernels and the reference differ only in summation order. bf16: the
# output is rounded to bf16 (and the interpreter truncates where the GPU rounds); the state stays fp32.
OUT_BOUND = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
STATE_BOUND = {torch.float32: 1e-4, torch.bfloat16: 1e-3}


def relative_error(result: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(result).all(), "the kernel left NaN (an unwritten output) or produced inf"
    return ((result.double() - expected.double()).norm() / expected.double().norm()).item()


def delta_inputs(tokens, key_heads, value_heads, dim, dtype=torch.float32, seed=0):
    """Model-like ranges: unit q and k, g <= 0 in fp32, beta in (0, 1), a non-zero fp32 state."""
    generator = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, tokens, key_heads, dim, generator=generator), dim=-1).to(dtype)
    k = F.normalize(torch.randn(1, tokens, key_heads, dim, generator=generator), dim=-1).to(dtype)
    v = torch.randn(1, tokens, value_heads, dim, generator=generator).to(dtype)
    g = -torch.rand(1, tokens, value_heads, generator=generator)
    beta = torch.rand(1, tokens, value_heads, generator=generator).to(dtype)
    state = torch.randn(1, value_heads, dim, dim, generator=generator)
    return q, k, v, g, beta, state


def upcast(tensors):
    return tuple(t.float() for t in tensors)


# -- chunked prefill -----------------------------------------------------------------------------------

# (tokens, key heads, value heads, dim): one token, less than a chunk, exactly one chunk, a chunk and a
# bit, several chunks; tiled heads (H_v = 2 H_k, 3 H_k) and equal heads.
CHUNKED_CASES = [(1, 2, 4, 16), (5, 2, 6, 32), (64, 2, 4, 16), (70, 2, 6, 16), (130, 2, 4, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "key_heads", "value_heads", "dim"), CHUNKED_CASES)
def test_chunked_matches_reference(tokens, key_heads, value_heads, dim, dtype):
    inputs = delta_inputs(tokens, key_heads, value_heads, dim, dtype, seed=tokens)
    kept = inputs[5].clone()
    expected_out, expected_state = REFERENCE.gated_delta_rule_chunked(*upcast(inputs))
    out, state = triton_gdn.gated_delta_rule_chunked(*inputs)
    assert out.dtype == dtype and out.shape == expected_out.shape and state.dtype == torch.float32
    assert relative_error(out, expected_out) < OUT_BOUND[dtype]
    assert relative_error(state, expected_state) < STATE_BOUND[dtype]
    assert torch.equal(inputs[5], kept)  # the given state is left alone


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunked_other_chunk_sizes_scale_and_zero_state(chunk_size):
    q, k, v, g, beta, _ = delta_inputs(45, 1, 3, 16, seed=chunk_size)
    expected_out, expected_state = REFERENCE.gated_delta_rule_recurrent(q, k, v, g, beta, None, 0.3)
    out, state = triton_gdn.gated_delta_rule_chunked(q, k, v, g, beta, None, chunk_size=chunk_size, scale=0.3)
    assert relative_error(out, expected_out) < 1e-4
    assert relative_error(state, expected_state) < 1e-4


def test_chunked_reads_strided_views_as_the_model_passes_them():
    """q, k, v as column slices of one projection, g and beta as slices of wider tensors."""
    torch.manual_seed(3)
    tokens, key_heads, value_heads, dim = 70, 2, 4, 16
    mixed = torch.randn(1, tokens, 2 * key_heads * dim + value_heads * dim)
    q, k, v = mixed.split([key_heads * dim, key_heads * dim, value_heads * dim], dim=-1)
    q = F.normalize(q.reshape(1, tokens, key_heads, dim), dim=-1)
    k = k.reshape(1, tokens, key_heads, dim) * 0.2  # a view, not contiguous
    v = v.reshape(1, tokens, value_heads, dim)
    g = -torch.rand(1, tokens, 2 * value_heads)[..., ::2]
    beta = torch.rand(1, tokens, value_heads + 3)[..., 3:]
    state = torch.randn(1, value_heads, dim, dim)
    expected = REFERENCE.gated_delta_rule_chunked(q, k, v, g, beta, state)
    for result, reference in zip(triton_gdn.gated_delta_rule_chunked(q, k, v, g, beta, state), expected):
        assert relative_error(result, reference) < 1e-4


def test_chunked_rejects_an_unsupported_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        triton_gdn.gated_delta_rule_chunked(*delta_inputs(5, 1, 1, 16), chunk_size=48)


# -- token-sequential walk (fallback and second oracle) ------------------------------------------------


@pytest.mark.parametrize(("tokens", "dtype"), [(1, torch.float32), (37, torch.float32), (20, torch.bfloat16)])
def test_sequential_matches_the_recurrence(tokens, dtype):
    inputs = delta_inputs(tokens, 2, 6, 16, dtype, seed=tokens + 1)
    expected_out, expected_state = REFERENCE.gated_delta_rule_recurrent(*upcast(inputs))
    out, state = triton_gdn.gated_delta_rule_sequential(*inputs)
    assert relative_error(out, expected_out) < OUT_BOUND[dtype]
    assert relative_error(state, expected_state) < 1e-5  # fp32 arithmetic on the same rounded inputs


# -- tree verification ---------------------------------------------------------------------------------

# The trees of tests/test_tree_ops.py, a bushy one, and a padded one: padding nodes after the real ones
# point at arbitrary earlier nodes, one of them a second root.
TREES = [
    [-1],
    [-1, 0, 1, 2],
    [-1, 0, 0, 1, 3, 2, 2],
    [-1, 0, 1, 0, 3, 3, 5, 1],
    [-1, 0, 1, 2, 3, 1, 5, 0, 7, 2, 9, 4],
    [-1, 0, 1, 0, 2, 4, -1, 6, 3, 0],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parents", TREES)
def test_tree_matches_reference(parents, dtype):
    nodes = len(parents)
    inputs = delta_inputs(nodes, 2, 6, 16, dtype, seed=nodes)
    kept = inputs[5].clone()
    parent_tensor = torch.tensor(parents)
    expected_out, expected_states = REFERENCE.gated_delta_rule_tree(*upcast(inputs), parent_tensor)
    out, node_states = triton_gdn.gated_delta_rule_tree(*inputs, parent_tensor)
    assert out.dtype == dtype and node_states.shape == (nodes, 6, 16, 16)
    assert relative_error(out, expected_out) < OUT_BOUND[dtype]
    assert relative_error(node_states, expected_states) < 1e-5
    assert torch.equal(inputs[5], kept)


def test_tree_chain_equals_the_sequential_kernel():
    inputs = delta_inputs(9, 1, 2, 32, seed=11)
    out, node_states = triton_gdn.gated_delta_rule_tree(*inputs, torch.arange(-1, 8))
    chain_out, chain_state = triton_gdn.gated_delta_rule_sequential(*inputs)
    assert relative_error(out, chain_out) < 1e-6
    assert relative_error(node_states[-1:], chain_state) < 1e-6


# -- causal convolution --------------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "kernel"), [(1, 4), (2, 4), (3, 4), (40, 4), (5, 2), (7, 3)])
def test_causal_conv1d_matches_reference(tokens, kernel):
    torch.manual_seed(tokens * 10 + kernel)
    channels = 300  # not a whole block of channels
    x, weight, state = torch.randn(1, tokens, channels), torch.randn(channels, kernel), torch.randn(1, kernel - 1, channels)
    expected_y, expected_state = REFERENCE.causal_conv1d(x, weight, state)
    y, new_state = triton_gdn.causal_conv1d(x, weight, state)
    assert relative_error(y, expected_y) < 1e-6
    assert torch.equal(new_state, expected_state)  # a copy of window rows: exact


def test_causal_conv1d_strided_input_and_bf16_with_fp32_state():
    torch.manual_seed(12)
    wide = torch.randn(1, 20, 700).to(torch.bfloat16)
    x = wide[..., 100:600]
    weight, state = torch.randn(500, 4).to(torch.bfloat16), torch.randn(1, 3, 500)
    expected_y, expected_state = REFERENCE.causal_conv1d(x, weight, state)
    y, new_state = triton_gdn.causal_conv1d(x, weight, state)
    assert y.dtype == new_state.dtype == torch.bfloat16
    assert relative_error(y, expected_y) < 1e-2  # the reference sums in bf16, the kernel in fp32
    assert torch.equal(new_state, expected_state)


@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("parents", TREES[:5])
def test_causal_conv1d_tree_matches_the_reference(parents, kernel):
    torch.manual_seed(len(parents) + kernel)
    nodes, channels = len(parents), 300
    x, weight = torch.randn(1, nodes, channels), torch.randn(channels, kernel)
    state = torch.randn(1, kernel - 1, channels)
    parent_tensor = torch.tensor(parents)
    expected_y, expected_states = REFERENCE.causal_conv1d_tree(x, weight, state, parent_tensor)
    y, node_states = triton_gdn.causal_conv1d_tree(x, weight, state, parent_tensor)
    assert torch.equal(node_states, expected_states)
    assert relative_error(y, expected_y) < 1e-6


def test_causal_conv1d_tree_padded_nodes_and_bf16():
    """Padding nodes (a second root, parents anywhere earlier) get their own ancestry's window too."""
    torch.manual_seed(13)
    parents = TREES[5]
    x, weight = torch.randn(1, len(parents), 64).to(torch.bfloat16), torch.randn(64, 4).to(torch.bfloat16)
    state = torch.randn(1, 3, 64).to(torch.bfloat16)  # the model keeps the conv state in the activation dtype
    expected_y, expected_states = REFERENCE.causal_conv1d_tree(x, weight, state, torch.tensor(parents))
    y, node_states = triton_gdn.causal_conv1d_tree(x, weight, state, torch.tensor(parents))
    assert torch.equal(node_states, expected_states)
    assert relative_error(y, expected_y) < 1e-2
    # Node 7's window: committed row 2, then nodes 6 (a root), 7.
    assert torch.equal(node_states[7, 0], state[0, 2])
    assert torch.equal(node_states[7, 1:], x[0, 6:8])


# -- every kernel compiles for the GPU (no GPU needed) ------------------------------------------------

# Run in a child process: this module's kernels are interpreted, and the compiler needs the jitted ones.
# The constants are the 27B shapes; pointers and strides are marked 16-divisible as a launch specialises them.
COMPILE_SCRIPT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lucebox_cuda import triton_gdn as gdn

def compile_kernel(kernel, types, constants, **options):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr") or n.startswith("stride")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    binary = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert binary.asm["cubin"][:4] == b"\\x7fELF", kernel.__name__
    print("compiled", kernel.__name__, constants.get("DOT_PRECISION", ""), constants.get("TREE", ""))

for act in ("bf16", "fp32"):
    p, precision = "*" + act, "ieee" if act == "fp32" else "tf32"
    compile_kernel(gdn._chunk_inverse_kernel, dict(k_ptr=p, g_ptr="*fp32", beta_ptr=p, inverse_ptr="*fp32"),
                   dict(KEY_DIM=128, CHUNK=64, BLOCK_K=128, DOT_PRECISION=precision))
    compile_kernel(gdn._chunk_scan_kernel,
                   dict(q_ptr=p, k_ptr=p, v_ptr=p, g_ptr="*fp32", beta_ptr=p, inverse_ptr="*fp32", state_ptr="*fp32",
                        out_ptr=p, new_state_ptr="*fp32", scale="fp32"),
                   dict(KEY_DIM=128, VALUE_DIM=128, CHUNK=64, BLOCK_K=128, BLOCK_V=32, DOT_PRECISION=precision,
                        SPLIT_BF16=act == "bf16", INTERPRETED=False), num_warps=gdn.SCAN_WARPS)
if True:
    p = "*bf16"
    for tree in (True, False):
        compile_kernel(gdn._walk_kernel,
                       dict(q_ptr=p, k_ptr=p, v_ptr=p, g_ptr="*fp32", beta_ptr=p, state_ptr="*fp32", parents_ptr="*i64",
                            out_ptr=p, states_out_ptr="*fp32", scale="fp32"),
                       dict(KEY_DIM=128, VALUE_DIM=128, BLOCK_K=128, BLOCK_V=16, TREE=tree), num_warps=gdn.WALK_WARPS)
    compile_kernel(gdn._causal_conv1d_kernel, dict(x_ptr=p, weight_ptr=p, state_ptr="*fp32", y_ptr=p, new_state_ptr=p),
                   dict(KERNEL=4, BLOCK_T=16, BLOCK_C=256, BLOCK_K=4, SILU=True))
    compile_kernel(gdn._causal_conv1d_tree_kernel,
                   dict(x_ptr=p, weight_ptr=p, state_ptr="*fp32", parents_ptr="*i64", y_ptr=p, node_states_ptr=p),
                   dict(KERNEL=4, BLOCK_K=4, BLOCK_C=256, SILU=True))
"""


def test_kernels_compile_for_hopper(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, check=False,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == 8
