"""The expert products on tensor cores (moe_matvec_mma.cu) on the GPU (skipped without a CUDA device): against a
float64 product of gguf's own dequantization and against the CUDA-core kernel (moe_matvec.cu), on the two
shapes of Laguna-XS.2's and Qwen3.5-35B-A3B's experts, Q4_K and Q6_K, bf16 and f32 activations; the pair
kernel bit-equal to two single launches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EXPERTS = 12


def _stack(ggml_type, shape, seed):
    from lucebox_core.kquants import random_blocks
    from lucebox_core.quants import QuantTensor

    blocks = random_blocks(ggml_type, int(np.prod(shape)), 0.02, np.random.default_rng(seed))
    stack = QuantTensor("experts", ggml_type, shape, torch.from_numpy(blocks.reshape(-1).view(np.uint8).copy()))
    dense = quants.dequantize(blocks.reshape(-1).view(np.uint8), ggml_type).reshape(shape).astype(np.float64)
    return stack, dense


def _weight(ggml_type, shape, seed):
    """A 2-D weight of random blocks (a shared expert's gate, up or down)."""
    import attrs

    stack, _ = _stack(ggml_type, (1, *shape), seed)
    return attrs.evolve(stack, name="shared", shape=shape)


def _products(ops, x, stack, ids, x_group, variant, monkeypatch):
    monkeypatch.setenv("LUCEBOX_MOE_MATVEC", variant)
    return ops.expert_matvec(x, stack, ids, x_group)


@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q6_K])  # (no random Q5_K block maker)
@pytest.mark.parametrize(("rows", "cols", "x_group"), [(512, 2048, 4), (2048, 512, 1)])  # gate/up, down
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tensor_core_experts_match_the_reference(ggml_type, rows, cols, x_group, dtype, monkeypatch):
    from lucebox_cuda.backend import CudaBackend

    ops = CudaBackend(dtype=dtype)
    stack, dense = _stack(ggml_type, (EXPERTS, rows, cols), seed=rows + int(ggml_type))
    g = torch.Generator(device="cuda").manual_seed(cols)
    pairs = 8
    ids = torch.randint(0, EXPERTS, (pairs,), device="cuda", generator=g)
    x = torch.randn(pairs // x_group, cols, device="cuda", generator=g).to(dtype)
    expected = np.einsum("sk,snk->sn", x.double().cpu().numpy().repeat(x_group, axis=0), dense[ids.cpu().numpy()])
    scale = np.abs(expected).max()
    for variant in ("mma", "simt"):
        variant = {"mma": "mma2" if cols == 512 else "mma4"}.get(variant, variant)
        got = _products(ops, x, stack, ids, x_group, variant, monkeypatch).double().cpu().numpy()
        # f32: fp32 sums of exact products; bf16: the output's rounding (8 bits) dominates.
        tolerance = 1e-5 if dtype == torch.float32 else 8e-3
        assert np.abs(got - expected).max() <= tolerance * scale, (variant, np.abs(got - expected).max() / scale)
    # The launch the backend picks by itself is the tensor-core one (the rule's warps for the row length).
    monkeypatch.delenv("LUCEBOX_MOE_MATVEC")
    assert torch.equal(ops.expert_matvec(x, stack, ids, x_group),
                       _products(ops, x, stack, ids, x_group, "mma2" if cols == 512 else "mma4", monkeypatch))


@pytest.mark.parametrize("warps", ["mma1", "mma2", "mma4", "mma8"])
def test_pair_kernel_equals_two_single_launches(warps, monkeypatch):
    from lucebox_cuda.backend import CudaBackend

    monkeypatch.setenv("LUCEBOX_MOE_MATVEC", warps)
    ops = CudaBackend(dtype=torch.bfloat16)
    gate, _ = _stack(Q.Q4_K, (EXPERTS, 512, 2048), seed=1)
    up, _ = _stack(Q.Q4_K, (EXPERTS, 512, 2048), seed=2)
    g = torch.Generator(device="cuda").manual_seed(3)
    ids = torch.randint(0, EXPERTS, (3 * 8,), device="cuda", generator=g)  # three tokens (a short verify)
    x = torch.randn(3, 2048, device="cuda", generator=g).to(torch.bfloat16)
    first, second = ops.expert_matvec_pair(x, gate, up, ids, 8)
    assert torch.equal(first, ops.expert_matvec(x, gate, ids, 8))
    assert torch.equal(second, ops.expert_matvec(x, up, ids, 8))
    assert first.abs().sum() > 0 and not torch.equal(first, second)


@pytest.mark.parametrize("gated", [False, True])  # Laguna's shared expert, Qwen3.5-MoE's gated one
@pytest.mark.parametrize("tokens", [1, 3])
def test_shared_expert_folded_into_the_expert_launches(gated, tokens):
    """The shared expert as extra pairs of the routed experts' launches: the op's result against the core's
    reference (routed sum, then the shared expert apart and added), and the extra rows of a launch against the
    shared weight's own product."""
    from lucebox_core.torch_backend import TorchBackend
    from lucebox_cuda import op_kernels
    from lucebox_cuda.backend import CudaBackend
    from lucebox_laguna.model import LagunaMLP

    ops = CudaBackend(dtype=torch.float32)
    gate, _ = _stack(Q.Q4_K, (EXPERTS, 256, 512), seed=11)
    up, _ = _stack(Q.Q4_K, (EXPERTS, 256, 512), seed=12)
    down, _ = _stack(Q.Q4_K, (EXPERTS, 512, 256), seed=13)
    shared_parts = [_weight(Q.Q4_K, shape, seed) for shape, seed in (((256, 512), 14), ((256, 512), 15),
                                                                    ((512, 256), 16))]
    shared = LagunaMLP(ops, *shared_parts)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 512, device="cuda", generator=g)
    weights, ids = torch.topk(torch.sigmoid(torch.randn(tokens, EXPERTS, device="cuda", generator=g)), 4, dim=-1)
    logit = torch.randn(tokens, 1, device="cuda", generator=g) if gated else None
    assert op_kernels._foldable(ops, x, (gate, up, down), shared)
    got = ops.moe_experts_swiglu(x, gate, up, down, weights, ids, shared=shared, shared_logit=logit)
    want = TorchBackend.moe_experts_swiglu(ops, x, gate, up, down, weights, ids, shared=shared, shared_logit=logit)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
    # The extra rows are the shared weight's products (pairs after the routed ones, their own activation rows).
    rows = ops.expert_matvec(x, gate, ids.reshape(-1), 4, extra=shared_parts[0], extra_pairs=tokens)
    assert rows.shape == (tokens * 4 + tokens, 256)
    torch.testing.assert_close(rows[tokens * 4 :], x @ ops.dense(shared_parts[0]).T.float(), atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(rows[: tokens * 4], ops.expert_matvec(x, gate, ids.reshape(-1), 4))


@pytest.mark.parametrize("cols", [512, 2048])  # the down rows of Laguna-XS.2's / Qwen3.5-35B-A3B's experts; longer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_swiglu_down_kernel_equals_silu_mul_then_the_product(cols, dtype):
    """`expert_matvec(gate, down, ..., up=up)` (the kernel computing silu(gate) * up in each block) against the
    separate SwiGLU kernel and then the product: silu's exp may differ from Triton's in a last bit, so the rows
    agree within a rounding, and most to the bit; the shared expert's extra pairs ride as in the plain kind."""
    from lucebox_cuda.backend import CudaBackend

    ops = CudaBackend(dtype=dtype)
    down, _ = _stack(Q.Q4_K, (EXPERTS, 2048, cols), seed=21)
    shared_down = _weight(Q.Q4_K, (2048, cols), 22)
    g = torch.Generator(device="cuda").manual_seed(cols)
    tokens, k = 3, 8
    ids = torch.randint(0, EXPERTS, (tokens * k,), device="cuda", generator=g)
    gate = (torch.randn(tokens * k + tokens, cols, device="cuda", generator=g) * 2).to(dtype)
    up = torch.randn(tokens * k + tokens, cols, device="cuda", generator=g).to(dtype)
    extra = {"extra": shared_down, "extra_pairs": tokens, "extra_x": tokens * k}
    fused = ops.expert_matvec(gate, down, ids, 1, up=up, **extra)
    want = ops.expert_matvec(ops.silu_mul(gate, up), down, ids, 1, **extra)
    scale = want.float().abs().max()
    torch.testing.assert_close(fused.float(), want.float(), rtol=1e-2, atol=1e-2 * float(scale))
    assert (fused == want).float().mean() > 0.9


def test_the_paged_swiglu_down_kernel_equals_the_stacked_one():
    """Spark's paged stack (some experts in device slots, the rest read from pinned host memory) through the
    SwiGLU kind: the stacked kind's rows to the bit (one body, the same arithmetic)."""
    from lucebox_core.quants import QuantTensor
    from lucebox_core.spark import ExpertPages, ExpertSlots
    from lucebox_cuda.backend import CudaBackend

    ops = CudaBackend(dtype=torch.bfloat16)
    down, _ = _stack(Q.Q4_K, (EXPERTS, 2048, 512), seed=31)
    host = down.data.reshape(EXPERTS, -1).pin_memory()
    slots = ExpertSlots(host, 4, torch.device("cuda"), initial=[0, 3, 5, 7])
    pool = QuantTensor("pool", Q.Q4_K, (4, 2048, 512), slots.stack.reshape(-1))
    pages = ExpertPages(pool=pool, host=host, where=slots.slot_of, pinned=True)
    assert int((slots.slot_of >= 0).sum()) == 4  # four experts in slots, eight read from the host
    g = torch.Generator(device="cuda").manual_seed(5)
    ids = torch.randint(0, EXPERTS, (16,), device="cuda", generator=g)
    gate = torch.randn(16, 512, device="cuda", generator=g).to(torch.bfloat16)
    up = torch.randn(16, 512, device="cuda", generator=g).to(torch.bfloat16)
    assert torch.equal(ops.expert_matvec(gate, pages, ids, 1, up=up), ops.expert_matvec(gate, down, ids, 1, up=up))


def test_the_swiglu_pairs_take_the_swiglu_down_kernel_when_switched_on(monkeypatch):
    """`moe_experts_swiglu` for a few tokens with LUCEBOX_MOE_SWIGLU_DOWN=1: the down launch computes the SwiGLU
    (no `silu_mul` call), within a rounding of the op with it off."""
    from lucebox_cuda import op_kernels
    from lucebox_cuda.backend import CudaBackend

    ops = CudaBackend(dtype=torch.bfloat16)
    gate, _ = _stack(Q.Q4_K, (EXPERTS, 512, 2048), seed=41)
    up, _ = _stack(Q.Q4_K, (EXPERTS, 512, 2048), seed=42)
    down, _ = _stack(Q.Q4_K, (EXPERTS, 2048, 512), seed=43)
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(2, 2048, device="cuda", generator=g).to(torch.bfloat16)
    weights, ids = torch.topk(torch.sigmoid(torch.randn(2, EXPERTS, device="cuda", generator=g)), 8, dim=-1)
    monkeypatch.setenv("LUCEBOX_MOE_SWIGLU_DOWN", "0")
    want = op_kernels.moe_experts_swiglu(ops, x, gate, up, down, weights, ids)
    monkeypatch.setenv("LUCEBOX_MOE_SWIGLU_DOWN", "1")
    assert ops.takes_swiglu(down, torch.bfloat16)
    calls = []
    silu = ops.silu_mul
    monkeypatch.setattr(ops, "silu_mul", lambda *a: calls.append(1) or silu(*a))
    got = op_kernels.moe_experts_swiglu(ops, x, gate, up, down, weights, ids)
    assert not calls
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.float().abs().max()))
