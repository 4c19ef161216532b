"""The fused decode-step kernels (lucebox_cuda.triton_fused) against the reference compositions in
`TorchBackend`, run on the CPU by Triton's interpreter: random inputs, fp32 and bf16, strided views like
the halves of a stacked projection; then a tiny model decoding through them."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module is first imported

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")

import torch
from lucebox_cuda import triton_fused, triton_ops
from triton.runtime.interpreter import InterpretedFunction

from lucebox_core import OpKernel
from lucebox_core.ops import kernel_table
from lucebox_core.torch_backend import TorchBackend, concat_rows
from lucebox_qwen35.ops import QWEN35_OPS

if not isinstance(triton_fused._gate_kernel, InterpretedFunction):
    pytest.skip("lucebox_cuda.triton_fused was imported earlier without TRITON_INTERPRET=1", allow_module_level=True)

# fp32: the kernels and the reference differ only in summation order. bf16: the kernels round where the
# reference rounds, but Triton's interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest),
# up to 2^-8 relative per rounding, and a composition rounds two or three times.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.5e-2}


def close(result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert result.dtype == expected.dtype and result.shape == expected.shape
    assert torch.isfinite(result).all()
    error = ((result.double() - expected.double()).norm() / expected.double().norm()).item()
    assert error < TOLERANCE[dtype], error


def randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(dtype):
    gen = torch.Generator().manual_seed(1)
    ops = QWEN35_OPS.bind(TorchBackend("cpu", dtype))  # the torch reference with the qwen35 family's ops
    for shape in [(1, 1, 96), (1, 5, 200)]:
        x, residual = randn(*shape, gen=gen, dtype=dtype), randn(*shape, gen=gen, dtype=dtype) * 3
        weight = randn(shape[-1], gen=gen, dtype=dtype)
        normed, summed = triton_fused.add_rms_norm(x, residual, weight, 1e-6)
        ref_normed, ref_summed = ops.add_rms_norm(x, residual, weight, 1e-6)
        # One rounding of an fp32 sum: identical in fp32. (Triton's interpreter casts fp32 to bf16 by
        # truncation where the GPU rounds to nearest, so bf16 is only close here.)
        if dtype == torch.float32:
            assert torch.equal(summed, ref_summed)
        close(summed, ref_summed, dtype)
        close(normed, ref_normed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates_on_stacked_halves(dtype):
    gen = torch.Generator().manual_seed(2)
    ops = QWEN35_OPS.bind(TorchBackend("cpu", dtype))  # the torch reference with the qwen35 family's ops
    stacked = randn(1, 3, 2 * 300, gen=gen, dtype=dtype) * 2
    gate, up = stacked.split([300, 300], dim=-1)  # strided views, as after a fused gate/up product
    close(triton_fused.silu_mul(gate, up), ops.silu_mul(gate, up), dtype)
    per_head = randn(1, 2, 4, 2 * 32, gen=gen, dtype=dtype)  # attention's per-head [query | gate]
    out, gate = randn(1, 2, 4, 32, gen=gen, dtype=dtype), per_head[..., 32:]
    close(triton_fused.sigmoid_mul(out, gate), ops.sigmoid_mul(out, gate), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_sigmoid_gated(dtype):
    """A gated shared expert joining the routed sum (Qwen3.5-MoE): one logit a token, wide rows (two blocks)."""
    gen = torch.Generator().manual_seed(7)
    ops = TorchBackend("cpu", dtype)
    for tokens, n in [(1, 2048), (3, 1500)]:
        base, x = randn(tokens, n, gen=gen, dtype=dtype), randn(tokens, n, gen=gen, dtype=dtype) * 2
        gate = randn(tokens, 1, gen=gen, dtype=dtype) * 3
        result = triton_fused.add_sigmoid_gated(base, x, gate)
        close(result, ops.add_sigmoid_gated(base, x, gate), dtype)
        if dtype == torch.float32:  # a row's own gate: swapping two rows' gates changes them
            swapped = triton_fused.add_sigmoid_gated(base, x, gate.flip(0))
            assert tokens == 1 or not torch.allclose(swapped, result)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(dtype):
    gen = torch.Generator().manual_seed(3)
    ops = QWEN35_OPS.bind(TorchBackend("cpu", dtype))  # the torch reference with the qwen35 family's ops
    heads, dim, conv = 6, 32, 100
    stacked = randn(1, 2, conv + heads * dim, gen=gen, dtype=dtype)
    z = stacked[..., conv:].reshape(1, 2, heads, dim)  # z as a view of a stacked [qkv | z] product
    x = randn(1, 2, heads, dim, gen=gen, dtype=dtype)
    weight = randn(dim, gen=gen, dtype=dtype)
    close(triton_fused.gated_rms_norm(x, z, weight, 1e-6), ops.gated_rms_norm(x, z, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [16, 64])
def test_qk_norm_rope(dtype, rot_dim):
    gen = torch.Generator().manual_seed(4)
    ops = QWEN35_OPS.bind(TorchBackend("cpu", dtype))  # the torch reference with the qwen35 family's ops
    tokens, q_heads, kv_heads, dim = 3, 4, 2, 64
    query_and_gate = randn(1, tokens, q_heads, 2 * dim, gen=gen, dtype=dtype)
    query = query_and_gate[..., :dim]  # strided, as in the model
    key = randn(1, tokens, kv_heads, dim, gen=gen, dtype=dtype)
    q_norm, k_norm = randn(dim, gen=gen, dtype=dtype), randn(dim, gen=gen, dtype=dtype)
    positions = torch.tensor([5, 900, 31000])
    q, k = triton_fused.qk_norm_rope(query, key, q_norm, k_norm, positions, rot_dim, 1e7, 1e-6)
    ref_q, ref_k = ops.qk_norm_rope(query, key, q_norm, k_norm, positions, rot_dim, 1e7, 1e-6)
    close(q, ref_q, dtype)
    close(k, ref_k, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key_heads,value_heads", [(2, 2), (2, 6)])
def test_gated_delta_decode(dtype, key_heads, value_heads):
    gen = torch.Generator().manual_seed(5)
    ops = QWEN35_OPS.bind(TorchBackend("cpu", dtype))  # the torch reference with the qwen35 family's ops
    dk, dv = 16, 48
    channels = 2 * key_heads * dk + value_heads * dv
    stacked = randn(2, channels + 7, gen=gen, dtype=dtype)
    mixed = stacked[:, :channels]  # rows with a stride, as a slice of a stacked product
    ab = randn(2, 2 * value_heads, gen=gen, dtype=dtype) * 3
    b, a = ab.split([value_heads, value_heads], dim=-1)
    ssm_a = -torch.rand(value_heads, generator=gen) * 4
    dt_bias = randn(value_heads, gen=gen)
    state = randn(2, value_heads, dk, dv, gen=gen)
    ref_state = state.clone()
    out = triton_fused.gated_delta_decode_(mixed, a, b, ssm_a, dt_bias, state, key_heads, dk)
    ref = ops.gated_delta_decode_(mixed, a, b, ssm_a, dt_bias, ref_state, key_heads, dk)
    close(out, ref, dtype)
    assert ((state - ref_state).norm() / ref_state.norm()).item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parents", [[-1, 0, 1, 2], [-1, 0, 0, 1, 3, 2, 2], [-1, 0, -1, 2, 1]])
def test_gated_delta_tree(dtype, parents):
    gen = torch.Generator().manual_seed(len(parents))
    ops = QWEN35_OPS.bind(TorchBackend("cpu", dtype))  # the torch reference with the qwen35 family's ops
    key_heads, value_heads, dk, dv = 2, 6, 16, 32
    nodes, channels = len(parents), 2 * key_heads * dk + value_heads * dv
    mixed = randn(1, nodes, channels + 5, gen=gen, dtype=dtype)[..., :channels]  # strided rows
    ab = randn(1, nodes, 2 * value_heads, gen=gen, dtype=dtype) * 3
    b, a = ab.split([value_heads, value_heads], dim=-1)
    ssm_a = -torch.rand(value_heads, generator=gen) * 4
    dt_bias = randn(value_heads, gen=gen)
    state = randn(1, value_heads, dk, dv, gen=gen)
    before = state.clone()
    out, node_states = triton_fused.gated_delta_tree(mixed, a, b, ssm_a, dt_bias, state, torch.tensor(parents),
                                                     key_heads, dk)
    ref_out, ref_states = ops.gated_delta_tree(mixed, a, b, ssm_a, dt_bias, state, torch.tensor(parents),
                                               key_heads, dk)
    assert torch.equal(state, before)
    close(out, ref_out, dtype)
    assert ((node_states - ref_states).norm() / ref_states.norm()).item() < TOLERANCE[dtype]


def tree_path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parents", [[-1, 0, 1, 2, 3], [-1, 0, 0, 1, 3, 2, 2]])
def test_tree_kernels_equal_decoding_each_path_bit_for_bit(dtype, parents):
    """The tree convolution (+SiLU) and the Gated DeltaNet tree walk give each node exactly the bits the
    decode step's kernels give the same token after its path: speculative verification on a GPU then
    reproduces plain decoding even where bf16 logits nearly tie."""
    from lucebox_cuda import triton_gdn

    gen = torch.Generator().manual_seed(len(parents) + 10 * (dtype == torch.bfloat16))
    key_heads, value_heads, dk, dv = 2, 6, 16, 32
    nodes, channels = len(parents), 2 * key_heads * dk + value_heads * dv
    x = randn(1, nodes, channels, gen=gen, dtype=dtype)
    weight = randn(channels, 4, gen=gen, dtype=dtype)
    conv_state = randn(1, 3, channels, gen=gen, dtype=dtype)
    ab = randn(1, nodes, 2 * value_heads, gen=gen, dtype=dtype) * 3
    b, a = ab[..., :value_heads].contiguous(), ab[..., value_heads:].contiguous()
    ssm_a = -torch.rand(value_heads, generator=gen) * 4
    dt_bias = randn(value_heads, gen=gen)
    recurrent = randn(1, value_heads, dk, dv, gen=gen) * 0.3
    index = torch.tensor(parents)
    mixed, node_conv = triton_gdn.causal_conv1d_tree(x, weight, conv_state, index, activation="silu")
    out, node_states = triton_fused.gated_delta_tree(mixed, a, b, ssm_a, dt_bias, recurrent, index, key_heads, dk)
    for node in range(nodes):
        conv, state = conv_state.clone(), recurrent.clone()
        for token in tree_path(parents, node):
            step, _ = triton_ops.causal_conv1d_step(x[:, token], weight, conv, activation="silu", new_state=conv)
            core = triton_fused.gated_delta_decode_(step, a[:, token], b[:, token], ssm_a, dt_bias, state,
                                                    key_heads, dk)
        assert torch.equal(step[0], mixed[0, node]), f"conv output of node {node}"
        assert torch.equal(conv[0], node_conv[node]), f"conv state of node {node}"
        assert torch.equal(core[0, 0], out[0, node]), f"delta output of node {node}"
        assert torch.equal(state[0], node_states[node]), f"delta state of node {node}"


# The Triton kernels of the fused ops (and of the decode step's family ops) under the interpreter, offered
# to a CPU backend through the same mechanism lucebox-cuda uses (`lucebox_op_kernels` records): the model's
# calls, shapes and strides, exercised without a GPU.
FUSED_ON_CPU = [
    OpKernel(op="add_rms_norm", backend="fused-cpu", kernel=lambda ops, *a: triton_fused.add_rms_norm(*a)),
    OpKernel(op="silu_mul", backend="fused-cpu", kernel=lambda ops, *a: triton_fused.silu_mul(*a)),
    OpKernel(op="sigmoid_mul", backend="fused-cpu", kernel=lambda ops, *a: triton_fused.sigmoid_mul(*a)),
    OpKernel(op="gated_rms_norm", backend="fused-cpu", kernel=lambda ops, *a: triton_fused.gated_rms_norm(*a)),
    OpKernel(op="qk_norm_rope", backend="fused-cpu", kernel=lambda ops, *a: triton_fused.qk_norm_rope(*a)),
    OpKernel(op="conv_silu_update_", backend="fused-cpu",
             kernel=lambda ops, x, w, state: triton_ops.causal_conv1d_step(x, w, state, activation="silu",
                                                                          new_state=state)[0]),
    OpKernel(op="gated_delta_decode_", backend="fused-cpu", kernel=lambda ops, *a: triton_fused.gated_delta_decode_(*a)),
    OpKernel(op="gated_delta_tree", backend="fused-cpu", kernel=lambda ops, *a: triton_fused.gated_delta_tree(*a)),
    OpKernel(op="gated_delta_tree_reloaded", backend="fused-cpu",
             kernel=lambda ops, *a: triton_fused.gated_delta_tree(*a, all_states=False)),
    OpKernel(op="gated_delta_path_", backend="fused-cpu", kernel=lambda ops, *a: triton_fused.gated_delta_path_(*a)),
    OpKernel(op="gated_delta_commit_", backend="fused-cpu", kernel="lucebox_cuda.triton_commit:gated_delta_commit_"),
    OpKernel(op="fuse_rows", backend="fused-cpu", kernel=lambda ops, weights: concat_rows(weights)),
]


def fused_kernels_on_cpu() -> TorchBackend:
    return TorchBackend(kernel_table_for=kernel_table("fused-cpu", FUSED_ON_CPU))


def test_tiny_model_decodes_through_the_kernels(tmp_path):
    from lucebox_qwen35 import loader as qwen_model
    from lucebox_qwen35 import synth

    path = tmp_path / "tiny.gguf"
    synth.write(path, size="tiny", type="q8_0", seed=8)
    reference = qwen_model.load(path, TorchBackend())
    fused = qwen_model.load(path, fused_kernels_on_cpu())
    assert fused.ops.gated_delta_decode_.kernels  # the family op is routed through the registered kernel
    prompt = torch.randint(0, reference.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    a, b = reference.new_state(), fused.new_state()
    close(fused.forward(b, prompt)[-1:], reference.forward(a, prompt)[-1:], torch.float32)
    token = int(prompt[-1])
    for _ in range(4):
        expected = reference.decode_step(a, token, graphs=False)
        close(fused.decode_step(b, token, graphs=False), expected, torch.float32)
        token = int(expected.argmax())
    parents, tokens = [-1, 0, 0, 1, 3], torch.randint(0, reference.vocab_size, (5,))
    close(fused.verify(b, tokens, parents, static=True, graphs=False).logits,
          reference.verify(a, tokens, parents, static=True, graphs=False).logits, torch.float32)


def test_tiny_model_commits_replayed_paths_through_the_kernels(tmp_path, monkeypatch):
    """`LUCEBOX_GDN_REPLAY=1` through the kernels: the walk that keeps only reloaded states, then the path replay
    in the commit, leave the live states the full walk's kept states leave, to the bit."""
    from lucebox_qwen35 import loader as qwen_model
    from lucebox_qwen35 import synth
    from lucebox_qwen35.verify import GDN_REPLAY_SWITCH

    path = tmp_path / "tiny.gguf"
    synth.write(path, size="tiny", type="q8_0", seed=9)
    model = qwen_model.load(path, fused_kernels_on_cpu())
    prompt = torch.randint(0, model.vocab_size, (11,), generator=torch.Generator().manual_seed(2))
    parents, tokens = [-1, 0, 0, 1, 3, 2, 4], torch.randint(0, model.vocab_size, (7,))
    states = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(GDN_REPLAY_SWITCH, switch)
        states[switch] = model.new_state(64)
        model.forward(states[switch], prompt)
        model.commit(states[switch], model.verify(states[switch], tokens, parents, static=True, graphs=False),
                     [0, 1, 3, 4, 6])
    for layer, kept in states["0"].linear.items():
        assert torch.equal(states["1"].linear[layer].recurrent, kept.recurrent), f"layer {layer}"
        assert torch.equal(states["1"].linear[layer].conv, kept.conv), f"layer {layer}"


COMPILE_SCRIPT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lucebox_cuda import triton_commit, triton_fused as ops
import triton.language as tl

def signature(kernel, types, constants):
    return {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}

for capability in map(int, sys.argv[1:]):
    target = GPUTarget("cuda", capability, 32)
    for act in ("bf16", "fp32"):
        p = "*" + act
        kernels = [
            (ops._add_rms_norm_kernel, dict(x_ptr=p, res_ptr=p, w_ptr=p, normed_ptr=p, sum_ptr=p, eps="fp32"),
             dict(BLOCK=8192)),
            (ops._gate_kernel, dict(a_ptr=p, b_ptr=p, out_ptr=p), dict(SIGMOID=False, BLOCK=1024)),
            (ops._gate_kernel, dict(a_ptr=p, b_ptr=p, out_ptr=p), dict(SIGMOID=True, BLOCK=256)),
            (ops._gated_rms_norm_kernel, dict(x_ptr=p, z_ptr=p, w_ptr=p, out_ptr=p, eps="fp32"), dict(BLOCK=128)),
            (ops._qk_norm_rope_kernel,
             dict(q_ptr=p, k_ptr=p, qw_ptr=p, kw_ptr=p, inv_freq_ptr="*fp32", pos_ptr="*i64", q_out_ptr=p,
                  k_out_ptr=p, eps="fp32"), dict(BLOCK_D=256)),
            (ops._gated_delta_decode_kernel,
             dict(mixed_ptr=p, a_ptr=p, b_ptr=p, ssm_a_ptr="*fp32", dt_bias_ptr="*fp32", state_ptr="*fp32",
                  out_ptr=p, scale="fp32"), dict(KEY_DIM=128, VALUE_DIM=128, BLOCK_K=128, BLOCK_V=32)),
            (ops._gated_delta_tree_kernel,
             dict(mixed_ptr=p, a_ptr=p, b_ptr=p, ssm_a_ptr="*fp32", dt_bias_ptr="*fp32", state_ptr="*fp32",
                  parents_ptr="*i64", out_ptr=p, states_ptr="*fp32", scale="fp32"),
             dict(KEY_DIM=128, VALUE_DIM=128, BLOCK_K=128, BLOCK_V=32, ALL_STATES=True, BLOCK_N=16)),
            (ops._gated_delta_tree_kernel,
             dict(mixed_ptr=p, a_ptr=p, b_ptr=p, ssm_a_ptr="*fp32", dt_bias_ptr="*fp32", state_ptr="*fp32",
                  parents_ptr="*i64", out_ptr=p, states_ptr="*fp32", scale="fp32"),
             dict(KEY_DIM=128, VALUE_DIM=128, BLOCK_K=128, BLOCK_V=32, ALL_STATES=False, BLOCK_N=32)),
            (ops._gated_delta_path_kernel,
             dict(mixed_ptr=p, a_ptr=p, b_ptr=p, ssm_a_ptr="*fp32", dt_bias_ptr="*fp32", state_ptr="*fp32",
                  path_ptr="*i64", scale="fp32"), dict(KEY_DIM=128, VALUE_DIM=128, BLOCK_K=128, BLOCK_V=32)),
            (triton_commit._gated_delta_paths_kernel,
             dict(offsets_ptr="*i64", mixed_ptr=p, a_ptr=p, b_ptr=p, ssm_a_ptr="*fp32", dt_bias_ptr="*fp32",
                  state_ptr="*fp32", path_ptr="*i64", scale="fp32"),
             dict(KEY_DIM=128, VALUE_DIM=128, BLOCK_K=128, BLOCK_V=32)),
            (triton_commit._copy_node_rows_kernel, dict(table_ptr="*i64", node_ptr="*i64"),
             dict(DTYPE=tl.bfloat16 if act == "bf16" else tl.float32, BLOCK=1024)),
        ]
        for kernel, types, constants in kernels:
            if "PDL" in kernel.arg_names:  # a plain launch's build (test_pdl compiles the PDL one)
                constants = {**constants, "PDL": False}
            source = ASTSource(fn=kernel, signature=signature(kernel, types, constants), constexprs=constants)
            binary = triton.compile(source, target=target)
            assert binary.asm["cubin"][:4] == b"\\x7fELF", kernel.__name__
            print("compiled", kernel.__name__, act, f"sm_{capability}")
"""


def test_fused_kernels_compile_for_gpu_architectures(tmp_path):
    """Every fused kernel compiles to a cubin for Ampere, Hopper and Blackwell (the interpreter runs none
    of the GPU compiler's checks: return types, bit casts, register limits)."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, "86", "90", "120"], env=env,
                            capture_output=True, check=False, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == 3 * 2 * 11
