"""The Triton decode kernels (lucebox_cuda.triton_ops) against the torch reference ops, run on the CPU by
Triton's interpreter. Shapes include the 27B ones, scaled down where the interpreter would be slow."""

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
from lucebox_cuda import triton_attention, triton_ops
from triton.runtime.interpreter import InterpretedFunction

from lucebox_core.torch_backend import TorchBackend
from lucebox_qwen35.ops import QWEN35_OPS

if not isinstance(triton_ops._causal_conv1d_step_kernel, InterpretedFunction):
    pytest.skip("lucebox_cuda.triton_ops was imported earlier without TRITON_INTERPRET=1", allow_module_level=True)

REFERENCE = QWEN35_OPS.bind(TorchBackend("cpu", torch.float32))  # the torch reference with the qwen35 family's ops


def relative_error(result: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(result).all(), "the kernel left NaN (an unwritten output) or produced inf"
    return ((result.double() - expected.double()).norm() / expected.double().norm()).item()


def nan_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full_like(tensor, float("nan"))


# -- decode attention (a one-node `triton_attention.tree_attention`) ----------------------------------------------------------------------------------

# (query heads, KV heads, head dim, value dim, window rows, position): GQA ratios 1, 3 and 6 (27B: 24/4
# heads of 256 dims), windows that are not whole blocks, positions inside, at the end of and past the window.
ATTENTION_CASES = [
    (4, 4, 64, 64, 130, 100),
    (6, 2, 32, 48, 77, 76),
    (24, 4, 256, 256, 200, 137),
    (12, 2, 80, 80, 150, 0),  # only row 0 is visible; head dim not a power of two
    (3, 1, 16, 16, 65, 500),  # position past the window: every row visible
]


@pytest.mark.parametrize("blocks_per_split", [1, 3, 8])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "value_dim", "rows", "position"), ATTENTION_CASES)
def test_decode_attention_matches_reference(q_heads, kv_heads, head_dim, value_dim, rows, position,
                                            blocks_per_split):
    torch.manual_seed(rows + q_heads)
    q = torch.randn(1, 1, q_heads, head_dim)
    k = torch.randn(rows, kv_heads, head_dim) * 2
    v = torch.randn(rows, kv_heads, value_dim)
    pos = torch.tensor([position])
    scale = head_dim**-0.5
    expected = REFERENCE.decode_attention(q, k, v, pos, scale=scale)
    out = nan_like(expected)
    result = triton_attention.decode_attention(q, k, v, pos, scale=scale, block_n=32,
                                               blocks_per_split=blocks_per_split, narrow_splits=2, out=out)
    assert result is out
    assert relative_error(out, expected) < 1e-5


def test_decode_attention_ignores_rows_past_the_position():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 1, 6, 32), torch.randn(100, 2, 32), torch.randn(100, 2, 32)
    before = triton_attention.decode_attention(q, k, v, torch.tensor([40]), scale=0.2, block_n=16,
                                               blocks_per_split=2, narrow_splits=2)
    k[41:], v[41:] = float("nan"), float("nan")  # garbage past the position must not reach the output
    after = triton_attention.decode_attention(q, k, v, torch.tensor([40]), scale=0.2, block_n=16,
                                               blocks_per_split=2, narrow_splits=2)
    assert torch.equal(before, after)


def test_decode_attention_strided_window_and_half_precision():
    """A window sliced out of a bigger cache (row stride > heads * dim), f16 cache read into an f16 query.
    (Not bf16: Triton 3.6's interpreter multiplies bf16 tl.dot operands as their raw 16-bit integers; the
    GPU check, `python -m lucebox_cuda.triton_ops`, covers bf16.)"""
    torch.manual_seed(2)
    cache_k = torch.randn(256, 2, 64, dtype=torch.float16)
    cache_v = torch.randn(256, 2, 64, dtype=torch.float16)
    k, v = cache_k[:, :, :32], cache_v[:, :, 32:]  # not contiguous: stride(0) = 128
    q = torch.randn(1, 1, 6, 32, dtype=torch.float16)
    pos = torch.tensor([190])
    result = triton_attention.decode_attention(q, k, v, pos, scale=32**-0.5, block_n=32, blocks_per_split=2, narrow_splits=2)
    expected = REFERENCE.decode_attention(q.float(), k.float(), v.float(), pos, scale=32**-0.5)
    assert result.dtype == torch.float16
    assert relative_error(result, expected) < 5e-3


@pytest.mark.parametrize(("k_q8", "v_q8"), [(True, True), (True, False), (False, True)])
def test_decode_attention_reads_q8_0_rows(k_q8, v_q8):
    """A Q8_0 cache's raw rows (K, V or both) decoded in the kernel equal the reference decoding them
    first; rows past the position hold garbage bytes."""
    from lucebox_core.kv import quantize_q8_0

    torch.manual_seed(5)
    rows, kv_heads, dim = 70, 2, 64
    q = torch.randn(1, 1, 6, dim)
    k, v = torch.randn(rows, kv_heads, dim) * 3, torch.randn(rows, kv_heads, dim)
    k_in = quantize_q8_0(k) if k_q8 else k
    v_in = quantize_q8_0(v) if v_q8 else v
    pos = torch.tensor([50])
    expected = REFERENCE.decode_attention(q, k_in, v_in, pos, scale=dim**-0.5)
    if k_q8:
        k_in[51:] = torch.randint(0, 256, k_in[51:].shape, dtype=torch.uint8)
    result = triton_attention.decode_attention(q, k_in, v_in, pos, scale=dim**-0.5, block_n=16, blocks_per_split=2, narrow_splits=2)
    assert relative_error(result, expected) < 1e-5


# -- Gated DeltaNet ------------------------------------------------------------------------------------

# (batch, key heads, value heads, key dim, value dim): ratios 1, 3 and 6 (27B: 16/48 heads of 128 dims,
# scaled to 4/24); value dims that are not whole blocks of 32.
DELTA_CASES = [
    (1, 2, 2, 16, 16),
    (2, 2, 6, 32, 48),
    (1, 4, 24, 128, 128),
    (3, 1, 6, 24, 20),
]


def delta_inputs(batch, key_heads, value_heads, key_dim, value_dim, dtype=torch.float32):
    q = F.normalize(torch.randn(batch, 1, key_heads, key_dim), dim=-1).to(dtype)
    k = F.normalize(torch.randn(batch, 1, key_heads, key_dim), dim=-1).to(dtype)
    v = torch.randn(batch, 1, value_heads, value_dim).to(dtype)
    g = -torch.rand(batch, 1, value_heads) * 2  # log decay <= 0, in fp32 as the model makes it
    beta = torch.rand(batch, 1, value_heads).to(dtype)
    state = torch.randn(batch, value_heads, key_dim, value_dim)
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("batch", "key_heads", "value_heads", "key_dim", "value_dim"), DELTA_CASES)
def test_gated_delta_step_matches_reference(batch, key_heads, value_heads, key_dim, value_dim):
    torch.manual_seed(value_heads * key_dim)
    q, k, v, g, beta, state = delta_inputs(batch, key_heads, value_heads, key_dim, value_dim)
    kept = state.clone()
    expected_out, expected_state = REFERENCE.gated_delta_rule_recurrent(q, k, v, g, beta, state, 0.3)
    new_state, out = nan_like(state), nan_like(v)
    result_out, result_state = triton_ops.gated_delta_rule_step(
        q, k, v, g, beta, state, 0.3, new_state=new_state, out=out
    )
    assert result_out is out and result_state is new_state
    assert relative_error(out, expected_out) < 1e-5
    assert relative_error(new_state, expected_state) < 1e-5
    assert torch.equal(state, kept)  # functional by default: the given state is left alone


def test_gated_delta_step_in_place_over_several_tokens_matches_the_recurrence():
    """Three steps updating one state buffer in place equal the reference over three tokens, from zeros."""
    torch.manual_seed(3)
    tokens = [delta_inputs(1, 2, 6, 32, 32) for _ in range(3)]
    q, k, v, g, beta = (torch.cat([step[i] for step in tokens], dim=1) for i in range(5))
    expected_out, expected_state = REFERENCE.gated_delta_rule_recurrent(q, k, v, g, beta, None)
    state = torch.zeros(1, 6, 32, 32)
    outputs = []
    for t in range(3):
        token = (q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1])
        out, returned = triton_ops.gated_delta_rule_step(*token, state if t else None, new_state=state)
        assert returned is state
        outputs.append(out)
    assert relative_error(torch.cat(outputs, dim=1), expected_out) < 1e-5
    assert relative_error(state, expected_state) < 1e-5


def test_gated_delta_step_half_precision_inputs():
    torch.manual_seed(4)
    q, k, v, g, beta, state = delta_inputs(1, 2, 6, 64, 64, torch.bfloat16)
    expected_out, expected_state = REFERENCE.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    out, new_state = triton_ops.gated_delta_rule_step(q, k, v, g, beta, state)
    assert out.dtype == torch.bfloat16 and new_state.dtype == torch.float32
    assert relative_error(out, expected_out) < 1e-2
    assert relative_error(new_state, expected_state) < 1e-5  # fp32 state from the same bf16 inputs


# -- causal conv1d step --------------------------------------------------------------------------------

# (batch, channels, kernel): 27B's 10240 channels and kernel 4; channels that are not whole blocks; a
# kernel that is not a power of two; the shortest kernel (one row of state).
CONV_CASES = [(1, 10240, 4), (3, 300, 4), (2, 50, 3), (1, 40, 2)]


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize(("batch", "channels", "kernel"), CONV_CASES)
def test_causal_conv1d_step_matches_reference(batch, channels, kernel, activation):
    torch.manual_seed(channels + kernel)
    x, weight = torch.randn(batch, channels), torch.randn(channels, kernel)
    state = torch.randn(batch, kernel - 1, channels)
    kept = state.clone()
    expected_y, expected_state = REFERENCE.causal_conv1d_step(x, weight, state)
    if activation == "silu":
        expected_y = F.silu(expected_y)
    out, new_state = nan_like(x), nan_like(state)
    y, returned = triton_ops.causal_conv1d_step(x, weight, state, activation=activation, new_state=new_state, out=out)
    assert y is out and returned is new_state
    assert relative_error(y, expected_y) < 1e-6
    assert torch.equal(new_state, expected_state)  # a shift and a copy: exact
    assert torch.equal(state, kept)


def test_causal_conv1d_step_in_place_and_strided_input():
    """x as a column slice of a wider projection (as the model's split gives), the state shifted in place."""
    torch.manual_seed(5)
    wide = torch.randn(2, 700)
    x = wide[:, 100:600]
    weight, state = torch.randn(500, 4), torch.randn(2, 3, 500)
    expected_y, expected_state = REFERENCE.causal_conv1d_step(x, weight, state.clone())
    y, returned = triton_ops.causal_conv1d_step(x, weight, state, new_state=state)
    assert returned is state
    assert relative_error(y, expected_y) < 1e-6
    assert torch.equal(state, expected_state)


def test_causal_conv1d_step_casts_the_state_to_the_input_dtype():
    torch.manual_seed(6)
    x, weight = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(64, 4, dtype=torch.bfloat16)
    state = torch.randn(1, 3, 64)  # fp32 state, bf16 activations
    expected_y, expected_state = REFERENCE.causal_conv1d_step(x, weight, state)
    y, new_state = triton_ops.causal_conv1d_step(x, weight, state)
    assert y.dtype == new_state.dtype == torch.bfloat16
    assert relative_error(y, expected_y) < 1e-2  # the reference sums in bf16, the kernel in fp32
    # Within one bf16 step: Triton's interpreter truncates fp32 to bf16 where torch (and the GPU) round.
    torch.testing.assert_close(new_state.float(), expected_state.float(), rtol=2**-7, atol=0)


# -- KV rows stored at device positions (`write_kv_rows`) ----------------------------------------------


# (ring, cache dtype, activation dtype): bf16 rows into an fp32 cache are cast (exactly: the interpreter's
# narrowing casts truncate where the GPU rounds, so none is tested here).
@pytest.mark.parametrize("ring, cache_dtype, dtype", [(0, torch.float32, torch.float32),
                                                      (16, torch.float32, torch.bfloat16),
                                                      (16, torch.bfloat16, torch.bfloat16)])
def test_write_kv_rows_matches_the_reference_store(ring, cache_dtype, dtype):
    """The kernel stores what the reference's index copies store, at slot = position or position % ring;
    rows of other slots keep what they held."""
    torch.manual_seed(11)
    slots, heads, k_dim, v_dim = 40, 3, 48, 20  # neither dim a power of two
    keys, values = torch.randn(slots, heads, k_dim).to(cache_dtype), torch.randn(slots, heads, v_dim).to(cache_dtype)
    expected_keys, expected_values = keys.clone(), values.clone()
    # k and v as strided views of one projection's output, as the models pass them
    projected = torch.randn(3, heads * (k_dim + v_dim)).to(dtype)
    k = projected[:, : heads * k_dim].unflatten(-1, (heads, k_dim))
    v = projected[:, heads * k_dim :].unflatten(-1, (heads, v_dim))
    positions = torch.tensor([5, 22, 39]) if not ring else torch.tensor([17, 18, 35])  # a ring wraps them
    REFERENCE.write_kv_rows(expected_keys, expected_values, positions, ring, k, v)
    triton_ops.write_kv_rows(keys, values, positions, ring, k, v)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    written = (positions % ring if ring else positions).tolist()
    assert torch.equal(keys[written].float(), k.to(cache_dtype).float())  # the rows landed, not only agree


def test_a_full_cache_stores_static_rows_through_the_backend(backend_on_cpu, monkeypatch):
    """`kv.write_rows` hands a plain cache's buffers to the backend's one-launch store (a ring layer with its
    size) and leaves a quantized cache to its own `write`; both end as the cache's `write` would."""
    from lucebox_core.kv import FullKVCache, KVLayerShape, write_rows

    calls = []
    kernel = triton_ops.write_kv_rows
    monkeypatch.setattr(triton_ops, "write_kv_rows", lambda *a: calls.append(a[3]) or kernel(*a))
    torch.manual_seed(12)
    shapes = {0: KVLayerShape(2, 32, 32), 1: KVLayerShape(2, 32, 32, window=8)}
    for k_type, expect_kernel in ((None, True), ("q8_0", False)):
        through, direct = (FullKVCache(shapes, 64, k_type=k_type, v_type=k_type) for _ in range(2))
        for layer in shapes:
            k, v = torch.randn(1, 2, 32), torch.randn(1, 2, 32)
            position = torch.tensor([13])
            write_rows(through, backend_on_cpu, layer, position, k, v)
            direct.write(layer, position, k, v)
            for mine, theirs in zip(through.gather(layer, 64), direct.gather(layer, 64)):
                assert torch.equal(mine, theirs)
        assert calls == ([0, 8] if expect_kernel else [])
        calls.clear()


# -- the CudaBackend's registered kernels dispatch here -------------------------------------------------


@pytest.fixture
def backend_on_cpu():
    """A CudaBackend whose device is the CPU: its constructor refuses one without CUDA, so the object is
    made without it (the base constructor installs the kernels lucebox-cuda registers for "cuda"); only
    the Triton kernels (which need no compiled CUDA module) are called."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="lucebox-cuda's dependencies (cuda-bindings) are not installed")
    from lucebox_cuda.backend import CudaBackend

    backend = CudaBackend.__new__(CudaBackend)
    TorchBackend.__init__(backend, "cpu", torch.float32)
    return backend


def test_registered_kernels_match_the_reference(backend_on_cpu, monkeypatch):
    calls = []
    for module, name in ((triton_attention, "decode_attention"), (triton_ops, "gated_delta_rule_step"),
                         (triton_ops, "causal_conv1d_step")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    family = QWEN35_OPS.bind(backend_on_cpu)  # the family's ops, routed to the backend's kernels for them
    torch.manual_seed(7)
    q, k, v = torch.randn(1, 1, 6, 32), torch.randn(90, 2, 32), torch.randn(90, 2, 32)
    pos = torch.tensor([70])
    assert backend_on_cpu.decode_attention.choice(q, k, v, pos, scale=0.3) == "cuda.decode_attention"
    assert relative_error(backend_on_cpu.decode_attention(q, k, v, pos, scale=0.3),
                          REFERENCE.decode_attention(q, k, v, pos, scale=0.3)) < 1e-5
    inputs = delta_inputs(1, 2, 6, 16, 16)
    for result, expected in zip(family.gated_delta_rule_recurrent(*inputs, 0.5),
                                REFERENCE.gated_delta_rule_recurrent(*inputs, 0.5)):
        assert relative_error(result, expected) < 1e-5
    x, weight, state = torch.randn(1, 48), torch.randn(48, 4), torch.randn(1, 3, 48)
    for result, expected in zip(family.causal_conv1d_step(x, weight, state),
                                REFERENCE.causal_conv1d_step(x, weight, state)):
        assert relative_error(result, expected) < 1e-6
    assert calls == ["decode_attention", "gated_delta_rule_step", "causal_conv1d_step"]
    # Two tokens are the chunked/prefill case: the recurrent kernel's check leaves them to the reference.
    two = [torch.cat([t, t], dim=1) for t in inputs[:5]]
    assert family.gated_delta_rule_recurrent.choice(*two, inputs[5]) == "reference"
    family.gated_delta_rule_recurrent(*two, inputs[5])
    assert calls.count("gated_delta_rule_step") == 1
    # A bf16 window on an fp32 backend is still the kernel's; a GGUF weight's product is the NVRTC kernel's
    # only on the device (here the CPU is not the backend's kind of device, and the check says so).
    assert backend_on_cpu.linear.choice(torch.randn(2, 32), torch.randn(4, 32)) == "reference"


# -- every kernel compiles for the GPUs (no GPU needed) -----------------------------------------------

# Run in a child process: this module's kernels are interpreted, and the compiler needs the jitted ones.
# The constants are the 27B decode shapes; pointers are bf16 and fp32 activations. Each variant compiles
# single-threaded (LLVM, then ptxas), so the variants are spread over the machine's cores: on CI's two the
# slowest parametrization takes half the time.
COMPILE_SCRIPT = """
import concurrent.futures
import multiprocessing
import os
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lucebox_cuda import triton_attention as attention
from lucebox_cuda import triton_ops as ops
from lucebox_cuda import triton_path_combine as combine
from lucebox_cuda import triton_router as router

def signature(kernel, types, constants):
    names = kernel.arg_names
    return {name: "constexpr" if name in constants else types.get(name, "i32") for name in names}

capability = int(sys.argv[1])
target = GPUTarget("cuda", capability, 32)

def variants(act):
    pointer = "*" + act
    kernels = [
        (attention._path_attention_split_kernel,
         dict(q_ptr=pointer, k_ptr=pointer, v_ptr=pointer, position_ptr="*i64", visible_ptr="*u8",
              max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", scale="fp32"),
         dict(Q_HEADS=24, GROUP=6, HEAD_DIM=256, VALUE_DIM=256, BLOCKS_PER_SPLIT=4, BLOCK_G=16, BLOCK_N=64,
              BLOCK_D=256, BLOCK_DV=256, BLOCK_NODES=32, DOT_PRECISION="ieee" if act == "fp32" else "tf32",
              UPCAST_DOT=False, K_FORMAT=0, V_FORMAT=0, NODE_ROWS=False, RING=0, STATIC_TRIPS=0)),
        # A Q8_0 cache: K and V as raw blocks, decoded in the kernel.
        (attention._path_attention_split_kernel,
         dict(q_ptr=pointer, k_ptr="*u8", v_ptr="*u8", position_ptr="*i64", visible_ptr="*u8",
              max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", scale="fp32"),
         dict(Q_HEADS=24, GROUP=6, HEAD_DIM=256, VALUE_DIM=256, BLOCKS_PER_SPLIT=4, BLOCK_G=16, BLOCK_N=64,
              BLOCK_D=256, BLOCK_DV=256, BLOCK_NODES=16, DOT_PRECISION="ieee" if act == "fp32" else "tf32",
              UPCAST_DOT=False, K_FORMAT=1, V_FORMAT=1, NODE_ROWS=False, RING=0, STATIC_TRIPS=0)),
        # Q4_0 K and TQ3_0 V blocks, decoded in registers.
        (attention._path_attention_split_kernel,
         dict(q_ptr=pointer, k_ptr="*u8", v_ptr="*u8", position_ptr="*i64", visible_ptr="*u8",
              max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", scale="fp32"),
         dict(Q_HEADS=24, GROUP=6, HEAD_DIM=256, VALUE_DIM=256, BLOCKS_PER_SPLIT=4, BLOCK_G=16, BLOCK_N=64,
              BLOCK_D=256, BLOCK_DV=256, BLOCK_NODES=16, DOT_PRECISION="ieee" if act == "fp32" else "tf32",
              UPCAST_DOT=False, K_FORMAT=2, V_FORMAT=3, NODE_ROWS=False, RING=0, STATIC_TRIPS=0)),
        # Gemma-4: the nodes' rows beside the cache; a full layer's 512-dim heads, a sliding layer's ring
        # of 1024 slots over a Q8_0 cache (the node rows in its storage format).
        (attention._path_attention_split_kernel,
         dict(q_ptr=pointer, k_ptr=pointer, v_ptr=pointer, node_k_ptr=pointer, node_v_ptr=pointer,
              position_ptr="*i64", visible_ptr="*u8", max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32",
              scale="fp32"),
         dict(Q_HEADS=32, GROUP=8, HEAD_DIM=512, VALUE_DIM=512, BLOCKS_PER_SPLIT=4, BLOCK_G=16, BLOCK_N=64,
              BLOCK_D=512, BLOCK_DV=512, BLOCK_NODES=32, DOT_PRECISION="ieee" if act == "fp32" else "tf32",
              UPCAST_DOT=False, K_FORMAT=0, V_FORMAT=0, NODE_ROWS=True, RING=0, STATIC_TRIPS=0)),
        (attention._path_attention_split_kernel,
         dict(q_ptr=pointer, k_ptr="*u8", v_ptr="*u8", node_k_ptr="*u8", node_v_ptr="*u8",
              position_ptr="*i64", visible_ptr="*u8", max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32",
              scale="fp32"),
         dict(Q_HEADS=32, GROUP=2, HEAD_DIM=256, VALUE_DIM=256, BLOCKS_PER_SPLIT=4, BLOCK_G=16, BLOCK_N=64,
              BLOCK_D=256, BLOCK_DV=256, BLOCK_NODES=32, DOT_PRECISION="ieee" if act == "fp32" else "tf32",
              UPCAST_DOT=False, K_FORMAT=1, V_FORMAT=1, NODE_ROWS=True, RING=1024, STATIC_TRIPS=0)),
        (combine._path_attention_combine_kernel,
         dict(max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", gate_ptr="*fp32", out_ptr=pointer,
              threshold="fp32"),
         dict(Q_HEADS=24, VALUE_DIM=256, CHUNK=16, BLOCK_DV=64, GATED=False)),
        # One split (a window of 64 keys or fewer) as a constant: what Triton's specialisation of a 1 gave
        # before `do_not_specialize`, which its loop passes once failed to compile.
        (combine._path_attention_combine_kernel,
         dict(max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", gate_ptr="*fp32", out_ptr=pointer,
              threshold="fp32"),
         dict(Q_HEADS=8, VALUE_DIM=128, CHUNK=16, BLOCK_DV=64, GATED=False, splits=1)),
        # Laguna's per-head softplus gate in the merge (the gate a slice of the projection's output).
        (combine._path_attention_combine_kernel,
         dict(max_ptr="*fp32", sum_ptr="*fp32", acc_ptr="*fp32", gate_ptr=pointer, out_ptr=pointer,
              threshold="fp32"),
         dict(Q_HEADS=64, VALUE_DIM=128, CHUNK=16, BLOCK_DV=64, GATED=True)),
        # The one-launch router: Laguna-XS.2's (sigmoid, selection bias) and Qwen3.5-35B-A3B's (softmax, with its
        # shared expert's gate as one more row).
        (router._route_kernel,
         dict(x_ptr=pointer, w_ptr="*fp32", extra_ptr="*fp32", gate_w_ptr="*fp32", gate_out_ptr=pointer,
              logits_ptr="*fp32", counter_ptr="*i32", weights_ptr="*fp32", ids_ptr="*i64", scale="fp32"),
         dict(HIDDEN=2048, BLOCK_E=4, BLOCK_H=256, BLOCK_ALL=256, TOP_K=8, SIGMOID=True, GATE=False)),
        (router._route_kernel,
         dict(x_ptr=pointer, w_ptr="*fp32", extra_ptr="*fp32", gate_w_ptr="*fp32", gate_out_ptr=pointer,
              logits_ptr="*fp32", counter_ptr="*i32", weights_ptr="*fp32", ids_ptr="*i64", scale="fp32"),
         dict(HIDDEN=2048, BLOCK_E=4, BLOCK_H=256, BLOCK_ALL=256, TOP_K=8, SIGMOID=False, GATE=True)),
        (ops._gated_delta_step_kernel,
         dict(q_ptr=pointer, k_ptr=pointer, v_ptr=pointer, g_ptr="*fp32", beta_ptr=pointer, state_ptr="*fp32",
              new_state_ptr="*fp32", out_ptr=pointer, scale="fp32"),
         dict(KEY_DIM=128, VALUE_DIM=128, BLOCK_K=128, BLOCK_V=32)),
        (ops._causal_conv1d_step_kernel,
         dict(x_ptr=pointer, weight_ptr=pointer, state_ptr=pointer, y_ptr=pointer, new_state_ptr=pointer),
         dict(KERNEL=4, BLOCK_K=4, BLOCK_C=256, SILU=True)),
        (ops._write_kv_rows_kernel,
         dict(k_ptr=pointer, v_ptr=pointer, keys_ptr=pointer, values_ptr=pointer, positions_ptr="*i64"),
         dict(K_DIM=128, V_DIM=128, BLOCK_K=128, BLOCK_V=128, RING=True)),
    ]
    return kernels

def compile_variant(job):
    act, index = job
    kernel, types, constants = variants(act)[index]
    if "PDL" in kernel.arg_names:  # a plain launch's build (test_pdl compiles the PDL one)
        constants = {**constants, "PDL": False}
    source = ASTSource(fn=kernel, signature=signature(kernel, types, constants), constexprs=constants)
    binary = triton.compile(source, target=target)
    assert binary.asm["cubin"][:4] == b"\\x7fELF", kernel.__name__
    return f"compiled {kernel.__name__} {act} sm_{capability}"

jobs = [(act, index) for act in sys.argv[2:] for index in range(len(variants(act)))]
workers = min(len(os.sched_getaffinity(0)), len(jobs))
with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
    for line in pool.map(compile_variant, jobs):  # a variant that fails raises here, with its traceback
        print(line)
"""


# bf16 (what the engine runs) on each architecture; the fp32 variants once, on the H200's: each compile of the
# 512-dim attention kernels takes several seconds on a 2-core CPU.
@pytest.mark.parametrize("capability, activations", [(86, ["bf16"]), (90, ["bf16", "fp32"]), (120, ["bf16"])])
def test_kernels_compile_for_each_gpu_architecture(tmp_path, capability, activations):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(capability), *activations], env=env,
                            capture_output=True, check=False, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == len(activations) * 13  # 13 kernel variants per activation type
