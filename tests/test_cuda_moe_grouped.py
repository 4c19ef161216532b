"""The grouped-GEMM prefill path of the routed experts (lucebox_cuda.triton_moe, and `moe_experts` of
`lucebox_cuda.op_kernels` past its pair limit) against Gemma-4's torch reference `moe_experts`, run on the
CPU by Triton's interpreter: random GGUF expert stacks (Q4_K gate_up, Q8_0 / Q5_0 down), uneven routing
with an expert no token picks; and the block schedule on its own."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module is first imported

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from lucebox_cuda import op_kernels, triton_moe
from triton.runtime.interpreter import InterpretedFunction

from lucebox_core.kquants import random_blocks
from lucebox_core.quants import QuantTensor
from lucebox_core.torch_backend import TorchBackend
from lucebox_gemma4.ops import GEMMA4_OPS

if not isinstance(triton_moe._down_kernel, InterpretedFunction):
    pytest.skip("lucebox_cuda.triton_moe was imported earlier without TRITON_INTERPRET=1", allow_module_level=True)

EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 8, 256, 128, 40, 2
UNPICKED = 5  # the expert no token routes to
# Relative L2 error against the fp32 reference. fp32: summation order only. bf16 (and f16): x, gate, up, GELU,
# GeGLU and the down product are each rounded (and Triton's interpreter casts fp32 to bf16 by truncation,
# where the GPU rounds to nearest: up to 2^-7 relative a rounding, biased).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def reference_moe(x, gate_up, down, weights, ids, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The family's reference on the CPU, in fp32 unless told (a QuantTensor is dequantized by `ops.dense`)."""
    ops = GEMMA4_OPS.bind(TorchBackend("cpu", dtype, kernel_table_for={}))
    return GEMMA4_OPS.references["moe_experts"](ops, x.to(dtype), gate_up, down, weights, ids)


def relative_error(result: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(result).all()
    return ((result.double() - expected.double()).norm() / expected.double().norm()).item()


def expert_stack(ggml_type, shape, seed: int) -> QuantTensor:
    blocks = random_blocks(ggml_type, int(np.prod(shape)), 0.1, np.random.default_rng(seed))
    return QuantTensor("experts", ggml_type, shape, torch.from_numpy(blocks.reshape(-1).view(np.uint8).copy()))


def routing(tokens: int, experts: int, top_k: int, gen: torch.Generator, unpicked: int | None = UNPICKED):
    """Top-k routing with uneven groups: expert 0 favoured (more than one 16-slot block of pairs), expert
    `unpicked` never chosen; weights renormalised as the router's are, in fp32."""
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] += 1.5
    if unpicked is not None:
        logits[:, unpicked] = -float("inf")
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def grouped_inputs(dtype: torch.dtype, down_type=Q.Q8_0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = expert_stack(Q.Q4_K, (EXPERTS, 2 * INTER, HIDDEN), seed + 1)
    down = expert_stack(down_type, (EXPERTS, HIDDEN, INTER), seed + 2)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
    weights, ids = routing(TOKENS, EXPERTS, TOP_K, gen)
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize(("dtype", "down_type", "block_m"),
                         [(torch.float32, Q.Q8_0, 64), (torch.bfloat16, Q.Q8_0, 16), (torch.bfloat16, Q.Q5_0, 64),
                          (torch.float16, Q.Q5_0, 16)])
def test_grouped_moe_matches_the_reference(dtype, down_type, block_m):
    x, gate_up, down, weights, ids = grouped_inputs(dtype, down_type)
    counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    assert counts[UNPICKED] == 0 and counts[0] > 16 and len(set(counts.tolist())) > 2  # uneven, one unpicked
    out = triton_moe.moe_grouped(x, gate_up.dequantize(dtype), down.dequantize(dtype), weights, ids, block_m=block_m)
    assert out.dtype == dtype and out.shape == (TOKENS, HIDDEN)
    error = relative_error(out, reference_moe(x, gate_up, down, weights, ids))
    assert error < TOLERANCE[dtype], error
    if dtype == torch.float16:
        # The interpreter rounds f16 to nearest, as the GPU does: against the reference run in f16, the
        # roundings must sit where the reference's are (the f16 reference itself is 6e-4 off fp32).
        error = relative_error(out, reference_moe(x, gate_up, down, weights, ids, dtype))
        assert error < 1e-4, error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_moe_ragged_tiles(dtype):
    """Dims that fill no whole tile (the masked K steps and column tails) and a single token."""
    gen = torch.Generator().manual_seed(7)
    experts, hidden, inter = 4, 96, 40
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    for tokens in (1, 9):
        x = torch.randn(tokens, hidden, generator=gen)
        weights, ids = routing(tokens, experts, 3, gen, unpicked=None)
        expected = reference_moe(x, gate_up, down, weights, ids)
        out = triton_moe.moe_grouped(x.to(dtype), gate_up.to(dtype), down.to(dtype), weights, ids, block_m=16)
        error = relative_error(out, expected)
        assert error < TOLERANCE[dtype], (tokens, error)


class _DequantizingOps:
    """The two services `op_kernels.moe_experts`' grouped path takes from the backend, on the CPU: decoding
    into one reused buffer as the backend's scratch does, so a gate_up read after the down stack was
    decoded would show."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.scratch = torch.empty(0)

    def dequantize_experts(self, experts: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize_expert_stacks([experts], dtype)[0]

    def dequantize_expert_stacks(self, stacks: list[QuantTensor], dtype: torch.dtype) -> list[torch.Tensor]:
        dense = [stack.dequantize(dtype) for stack in stacks]
        need = sum(d.numel() for d in dense)
        if self.scratch.numel() < need or self.scratch.dtype != dtype:
            self.scratch = torch.empty(need, dtype=dtype)
        views, start = [], 0
        for d in dense:
            views.append(self.scratch[start : start + d.numel()].view(d.shape).copy_(d))
            start += d.numel()
        return views


def test_op_routes_prefill_to_the_grouped_product(monkeypatch):
    """Past the pair limit the op runs the grouped product, decoding both stacks into one scratch buffer."""
    monkeypatch.setattr(op_kernels, "EXPERT_PAIR_LIMIT", TOKENS * TOP_K - 1)
    calls = []
    monkeypatch.setattr(op_kernels, "_moe_by_expert", lambda *args: calls.append(args))
    x, gate_up, down, weights, ids = grouped_inputs(torch.bfloat16, Q.Q5_0, seed=3)
    out = op_kernels.moe_experts(_DequantizingOps(), x, gate_up, down, weights, ids)
    assert not calls
    error = relative_error(out, reference_moe(x, gate_up, down, weights, ids))
    assert error < TOLERANCE[torch.bfloat16], error


def swiglu_reference(x, gate, up, down, weights, ids) -> torch.Tensor:
    """The core's generic `moe_experts_swiglu` (Laguna's and Qwen3.5-MoE's experts) in fp32 on the CPU."""
    ops = TorchBackend("cpu", torch.float32, kernel_table_for={})
    return TorchBackend.moe_experts_swiglu(ops, x.float(), gate, up, down, weights, ids)


def swiglu_inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate = expert_stack(Q.Q4_K, (EXPERTS, INTER, HIDDEN), seed + 1)
    up = expert_stack(Q.Q8_0, (EXPERTS, INTER, HIDDEN), seed + 2)
    down = expert_stack(Q.Q5_0, (EXPERTS, HIDDEN, INTER), seed + 3)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
    weights, ids = routing(TOKENS, EXPERTS, TOP_K, gen)
    return x, gate, up, down, weights, ids


@pytest.mark.parametrize(("dtype", "block_m"), [(torch.float32, 64), (torch.bfloat16, 16), (torch.float16, 64)])
def test_grouped_swiglu_matches_the_reference(dtype, block_m):
    """SwiGLU experts over separate gate and up stacks (SiLU in the first product's epilogue)."""
    x, gate, up, down, weights, ids = swiglu_inputs(dtype, seed=5)
    out = triton_moe.moe_grouped(x, gate.dequantize(dtype), down.dequantize(dtype), weights, ids,
                                 up=up.dequantize(dtype), block_m=block_m)
    assert out.dtype == dtype and out.shape == (TOKENS, HIDDEN)
    expected = swiglu_reference(x, gate, up, down, weights, ids)
    error = relative_error(out, expected)
    assert error < TOLERANCE[dtype], error
    # GeGLU's product of the same weights is far off: the activation is the kernel's choice, not a fixed one.
    fused = torch.cat([gate.dequantize(dtype), up.dequantize(dtype)], dim=1)
    geglu = triton_moe.moe_grouped(x, fused, down.dequantize(dtype), weights, ids, block_m=block_m)
    assert relative_error(geglu, expected) > max(0.05, 3 * error)


def test_swiglu_op_routes_prefill_to_the_grouped_product(monkeypatch):
    """Past the pair limit the generic SwiGLU op runs the grouped product: gate and up decoded side by side,
    the down stack over them afterwards; the per-expert loop is not taken."""
    monkeypatch.setattr(op_kernels, "EXPERT_PAIR_LIMIT", TOKENS * TOP_K - 1)
    calls = []
    monkeypatch.setattr(op_kernels, "_moe_by_expert", lambda *args, **kwargs: calls.append(args))
    x, gate, up, down, weights, ids = swiglu_inputs(torch.bfloat16, seed=6)
    out = op_kernels.moe_experts_swiglu(_DequantizingOps(), x, gate, up, down, weights, ids)
    assert not calls
    error = relative_error(out, swiglu_reference(x, gate, up, down, weights, ids))
    assert error < TOLERANCE[torch.bfloat16], error


def test_swiglu_prefill_without_room_for_the_grouped_product_runs_expert_by_expert(monkeypatch):
    """Out of GPU memory for the decoded stacks: a warning, and the chunk runs expert by expert (no crash)."""
    monkeypatch.setattr(op_kernels, "EXPERT_PAIR_LIMIT", TOKENS * TOP_K - 1)

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(op_kernels, "_moe_grouped_swiglu", out_of_memory)
    by_expert = []
    monkeypatch.setattr(op_kernels, "_moe_by_expert", lambda *args, **kwargs: by_expert.append(args) or "ran")
    op_kernels._warn_grouped_memory.cache_clear()
    x, gate, up, down, weights, ids = swiglu_inputs(torch.bfloat16, seed=7)
    ops = _DequantizingOps()
    ops.silu_mul = None  # the per-expert path's activation, handed over (the stand-in above never calls it)
    with pytest.warns(UserWarning, match="expert by expert"):
        assert op_kernels.moe_experts_swiglu(ops, x, gate, up, down, weights, ids) == "ran"
    assert len(by_expert) == 1


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"),
                         [(40, 8, 2, 16), (40, 8, 2, 64), (1, 8, 2, 16), (300, 128, 8, 64), (7, 4, 3, 4)])
def test_block_schedule(tokens, experts, top_k, block_m):
    gen = torch.Generator().manual_seed(tokens + experts)
    _, ids = routing(tokens, experts, top_k, gen, unpicked=experts - 1)
    slot_pair, block_expert = triton_moe.block_schedule(ids, experts, block_m)
    blocks = triton_moe.max_blocks(tokens * top_k, experts, block_m)
    assert slot_pair.dtype == block_expert.dtype == torch.int32
    assert slot_pair.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    flat = ids.reshape(-1)
    # Every pair exactly once.
    placed = slot_pair[slot_pair >= 0].long()
    assert torch.equal(placed.sort().values, torch.arange(tokens * top_k))
    slots = slot_pair.view(blocks, block_m).long()
    filled = int((block_expert >= 0).sum())
    # Filled blocks first, then only empty ones (their programs exit); each filled block one expert's.
    assert (block_expert[:filled] >= 0).all() and (slots[filled:] < 0).all()
    for block in range(filled):
        pairs = slots[block][slots[block] >= 0]
        assert pairs.numel() > 0 and (flat[pairs] == block_expert[block]).all()
        # Padding only at a block's end; pairs in expert order, and stable (ascending) within an expert.
        assert (slots[block][: pairs.numel()] >= 0).all()
        assert (pairs.diff() > 0).all()
    # Each expert's pairs in ceil(count / block_m) consecutive blocks, experts in ascending order.
    counts = torch.bincount(flat, minlength=experts)
    expected_experts = torch.repeat_interleave(torch.arange(experts), (counts + block_m - 1) // block_m)
    assert torch.equal(block_expert[:filled].long(), expected_experts)
    assert (block_expert[filled:] == -1).all()


def test_block_schedule_without_pairs():
    slot_pair, block_expert = triton_moe.block_schedule(torch.empty(0, 2, dtype=torch.long), 8)
    assert slot_pair.numel() == block_expert.numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_pairs_weights_and_sums_each_tokens_rows(dtype):
    """The few-pair path's combine: the reference's `(rows * weights).sum(k)` in fp32, in one launch."""
    gen = torch.Generator().manual_seed(11)
    tokens, top_k, hidden = 3, 8, 1500  # more than one column block
    rows = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen)
    want = (rows.float().reshape(tokens, top_k, hidden) * weights[..., None]).sum(1).to(dtype)
    got = triton_moe.combine_pairs(rows, weights)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 3e-2,
                               rtol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("gated", [False, True])
def test_combine_pairs_adds_the_shared_rows(gated):
    """A shared expert folded into the launches leaves its rows after the routed ones: added with weight 1
    (Laguna), or behind the sigmoid of its gate's logit (Qwen3.5-MoE)."""
    gen = torch.Generator().manual_seed(12)
    tokens, top_k, hidden = 3, 4, 1500
    rows = torch.randn(tokens * top_k + tokens, hidden, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    logit = torch.randn(tokens, 1, generator=gen) * 3 if gated else None
    routed = (rows[: tokens * top_k].reshape(tokens, top_k, hidden) * weights[..., None]).sum(1)
    shared = rows[tokens * top_k :] * (torch.sigmoid(logit) if gated else 1)
    got = triton_moe.combine_pairs(rows, weights, shared=True, shared_logit=logit)
    torch.testing.assert_close(got, routed + shared, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, triton_moe.combine_pairs(rows[: tokens * top_k], weights), atol=1e-3)


# -- the SwiGLU product compiles for the H200 with its timed tiles (no GPU needed) ---------------------------

COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lucebox_cuda import triton_moe as moe

kernel = moe._gate_up_kernel
config = moe.grouped_configs(__import__("torch").bfloat16)[0]
types = dict(x_ptr="*bf16", gate_ptr="*bf16", up_ptr="*bf16", act_ptr="*bf16", slot_pair_ptr="*i32",
             block_expert_ptr="*i32", coeff="fp32")
constants = dict(HIDDEN=2048, INTER=512, BLOCK_M=moe.BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 EVEN_K=True, EVEN_N=True, DOT_PRECISION="tf32", UPCAST_DOT=False, SILU=True)
signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in kernel.arg_names}
options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
binary = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                        target=GPUTarget("cuda", 90, 32), options=options)
assert binary.asm["cubin"][:4] == b"\\x7fELF"
print("compiled")
"""


def test_the_swiglu_product_compiles_for_hopper(tmp_path):
    """Laguna-XS.2's expert shape (2048 -> 512) with the sm_90 tiles of `grouped_configs`."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, check=False,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "compiled"
