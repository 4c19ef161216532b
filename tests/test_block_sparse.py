"""Block-sparse prefill attention (FlashPrefill's selection): the core's selection rules and torch reference
against dense attention restricted to the same block mask, the cuda backend's Triton kernel in the
interpreter, the op's routing, and bad input. Tiny shapes (blocks of 16-32 tokens) keep the interpreter fast."""

from __future__ import annotations

import math
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is first imported

import pytest
import torch

from lucebox_core import block_sparse as bs
from lucebox_core.block_sparse import BlockSparseConfig
from lucebox_core.torch_backend import TorchBackend

REFERENCE = TorchBackend("cpu", torch.float32)

# (tokens, query heads, KV heads, head dim, value dim, block): lengths off the block grid, GQA, MHA, MQA.
SHAPES = [
    (150, 4, 2, 16, 24, 16),
    (96, 2, 2, 32, 32, 32),
    (77, 3, 1, 16, 16, 16),
    (16, 2, 1, 16, 16, 16),  # a single block
    (200, 4, 4, 16, 16, 16),
]


def structured(tokens: int, q_heads: int, kv_heads: int, head_dim: int, value_dim: int, block: int, seed: int):
    """Random q/k/v (never zeros) where key blocks differ in strength along a direction the queries share,
    so the score rule keeps some blocks and drops others (on plain noise every block scores alike)."""
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(head_dim, generator=generator)
    direction = direction / direction.norm() * head_dim ** 0.5
    strength = torch.randn(-(-tokens // block), kv_heads, generator=generator).repeat_interleave(block, dim=0)[:tokens]
    q = torch.randn(tokens, q_heads, head_dim, generator=generator) + direction
    k = torch.randn(tokens, kv_heads, head_dim, generator=generator) + 2 * strength[..., None] * direction
    v = torch.randn(tokens, kv_heads, value_dim, generator=generator)
    return q, k, v


def independent_scores(q: torch.Tensor, k: torch.Tensor, block: int) -> torch.Tensor:
    """The block scores by the definition, one (head, query block, key block) at a time in float64."""
    tokens, q_heads, head_dim = q.shape
    group = q_heads // k.shape[1]
    blocks = -(-tokens // block)
    scores = torch.zeros(q_heads, blocks, blocks, dtype=torch.float64)
    for h in range(q_heads):
        for m in range(blocks):
            queries = q[m * block:(m + 1) * block, h].double()
            logits = []
            for n in range(m + 1):
                mean_k = k[n * block:(n + 1) * block, h // group].double().mean(dim=0)
                logits.append((queries @ mean_k).max() / math.sqrt(head_dim))
            scores[h, m, :m + 1] = torch.softmax(torch.stack(logits), dim=0)
    return scores


def relative_error(result: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(result).all()
    return ((result.double() - expected.double()).norm() / expected.double().norm()).item()


# -- (a) the selection rules ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES[:3] + SHAPES[4:])
@pytest.mark.parametrize("alpha", [0.3, 0.9])
def test_selection_rules_each_hold(shape, alpha):
    tokens, q_heads, kv_heads, head_dim, value_dim, block = shape
    q, k, _ = structured(*shape, seed=tokens)
    config = BlockSparseConfig(block=block, sink=1, window=2, last_full=1, alpha=alpha)
    mask = bs.block_mask(q, k, config)
    blocks = -(-tokens // block)
    assert mask.shape == (q_heads, blocks, blocks) and mask.dtype == torch.bool
    m, n = torch.meshgrid(torch.arange(blocks), torch.arange(blocks), indexing="ij")
    causal = n <= m
    assert not mask[:, ~causal].any(), "a key block above the diagonal was kept"
    assert mask[:, causal & (n < config.sink)].all(), "a sink block was dropped"
    assert mask[:, causal & (m - n < config.window)].all(), "a block of the local window was dropped"
    assert mask[:, causal & (m >= blocks - config.last_full)].all(), "a last row is not fully dense"
    # The score rule, against scores computed by the definition: every block outside the structural ones is
    # kept exactly when its score is >= alpha * its row's max (a hair's tolerance at the threshold itself).
    scores = independent_scores(q, k, block)
    threshold = alpha * scores.amax(dim=-1, keepdim=True)
    structural = (n < config.sink) | (m - n < config.window) | (m >= blocks - config.last_full)
    free = (causal & ~structural).expand(q_heads, blocks, blocks)
    clear = (scores - threshold).abs() > 1e-9
    assert torch.equal(mask[free & clear], (scores >= threshold)[free & clear])
    if blocks >= 8:  # the data are built so that the score rule decides something both ways
        assert (mask[free]).any() and not (mask[free]).all()
    assert torch.allclose(bs.block_scores(q, k, config).double(), scores, atol=1e-6)


def test_alpha_zero_keeps_every_causal_block_and_alpha_one_only_the_maxima():
    q, k, _ = structured(200, 4, 2, 16, 16, 16, seed=3)
    blocks = 13
    everything = bs.block_mask(q, k, BlockSparseConfig(block=16, alpha=0.0))
    assert torch.equal(everything, bs.causal_blocks(blocks)[None].expand(4, blocks, blocks))
    config = BlockSparseConfig(block=16, sink=0, window=1, last_full=0, alpha=1.0)
    maxima = bs.block_mask(q, k, config)
    scores = bs.block_scores(q, k, config)
    # Each row keeps its diagonal and its best block(s), nothing else.
    best = scores == scores.amax(dim=-1, keepdim=True)
    assert torch.equal(maxima, best | torch.eye(blocks, dtype=torch.bool)[None])


def test_block_mean_k_averages_only_the_valid_rows_of_the_last_block():
    k = torch.randn(37, 2, 8) + 1.0
    mean_k = bs.block_mean_k(k, BlockSparseConfig(block=16))
    assert mean_k.shape == (3, 2, 8)
    assert torch.allclose(mean_k[2], k[32:].mean(dim=0))
    assert torch.allclose(mean_k[0], k[:16].mean(dim=0))


def test_block_logits_work_a_slab_at_a_time(monkeypatch):
    q, k, _ = structured(150, 4, 2, 16, 16, 16, seed=5)
    config = BlockSparseConfig(block=16)
    whole = bs.block_logits(q, k, config)
    monkeypatch.setattr(bs, "_LOGIT_SLAB", 1)  # one query block per slab
    assert torch.equal(bs.block_logits(q, k, config), whole)


# -- (b) the reference against dense attention under the same mask -------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_dense_attention_restricted_to_the_mask(shape):
    q, k, v = structured(*shape, seed=11)
    config = BlockSparseConfig(block=shape[-1], sink=1, window=2, last_full=1, alpha=0.8)
    mask = bs.block_mask(q, k, config)
    expected = bs.dense_attention_with_block_mask(q, k, v, mask, block=config.block)
    result = bs.block_sparse_attention(q, k, v, config)
    assert (result - expected).abs().max().item() < 1e-5
    # A random mask (with its diagonal) too: the reference follows any mask, not only the selection's.
    blocks = mask.shape[-1]
    generator = torch.Generator().manual_seed(1)
    random_mask = (torch.rand(mask.shape, generator=generator) < 0.4) | torch.eye(blocks, dtype=torch.bool)
    random_mask &= bs.causal_blocks(blocks)
    expected = bs.dense_attention_with_block_mask(q, k, v, random_mask, block=config.block)
    assert (bs.block_sparse_attention(q, k, v, config, random_mask) - expected).abs().max().item() < 1e-5


def test_sparse_output_differs_from_dense_where_blocks_are_dropped():
    """The mask is really applied: dropping blocks changes the rows that lost them."""
    q, k, v = structured(150, 4, 2, 16, 16, 16, seed=2)
    config = BlockSparseConfig(block=16, sink=0, window=1, last_full=0, alpha=1.0)
    sparse = bs.block_sparse_attention(q, k, v, config)
    dense = REFERENCE.attention(q[None], k[None], v[None], scale=16 ** -0.5, causal_offset=0)[0]
    assert (sparse[16:] - dense[16:]).abs().max() > 1e-2
    assert torch.allclose(sparse[:16], dense[:16], atol=1e-6)  # the first block only ever sees itself


# -- (c) alpha 0 is plain causal attention -------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_alpha_zero_equals_causal_attention(shape):
    q, k, v = structured(*shape, seed=17)
    config = BlockSparseConfig(block=shape[-1], alpha=0.0)
    expected = REFERENCE.attention(q[None], k[None], v[None], scale=shape[3] ** -0.5, causal_offset=0)[0]
    assert (bs.block_sparse_attention(q, k, v, config) - expected).abs().max().item() < 1e-5
    assert (REFERENCE.block_sparse_attention(q, k, v, config=config) - expected).abs().max().item() < 1e-5


# -- the Triton kernel in the interpreter -----------------------------------------------------------------

triton_block_sparse = pytest.importorskip("lucebox_cuda.triton_block_sparse",
                                          reason="lucebox-cuda or Triton is not installed")

# fp32 in the interpreter: the kernel's online softmax against the reference's one-pass softmax.
KERNEL_BOUND = 2e-5


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernel_equals_dense_attention_restricted_to_the_mask(shape):
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton_block_sparse._block_sparse_kernel, InterpretedFunction):
        pytest.skip("lucebox_cuda was imported earlier without TRITON_INTERPRET=1")
    q, k, v = structured(*shape, seed=23)
    config = BlockSparseConfig(block=shape[-1], sink=1, window=2, last_full=1, alpha=0.8)
    mask = bs.block_mask(q, k, config)
    expected = bs.dense_attention_with_block_mask(q, k, v, mask, block=config.block)
    result = triton_block_sparse.block_sparse_attention(q, k, v, config)
    assert (result - expected).abs().max().item() < KERNEL_BOUND
    everything = triton_block_sparse.block_sparse_attention(q, k, v, BlockSparseConfig(block=shape[-1], alpha=0.0))
    causal = REFERENCE.attention(q[None], k[None], v[None], scale=shape[3] ** -0.5, causal_offset=0)[0]
    assert (everything - causal).abs().max().item() < KERNEL_BOUND


def test_triton_kernel_reads_strided_inputs_and_a_mask_without_its_diagonal():
    q, k, v = structured(100, 4, 2, 16, 16, 16, seed=29)
    fused = torch.cat([q, torch.cat([k, v], dim=1)], dim=1)  # [T, 8, 16]: q, k, v as strided views of one
    q_view, k_view, v_view = fused[:, :4], fused[:, 4:6], fused[:, 6:]
    config = BlockSparseConfig(block=16)
    blocks = 7
    generator = torch.Generator().manual_seed(4)
    mask = torch.rand(4, blocks, blocks, generator=generator) < 0.5  # diagonal and above-diagonal random
    completed = (mask & bs.causal_blocks(blocks)) | torch.eye(blocks, dtype=torch.bool)
    expected = bs.dense_attention_with_block_mask(q, k, v, completed, block=16)
    result = triton_block_sparse.block_sparse_attention(q_view, k_view, v_view, config, mask)
    assert (result - expected).abs().max().item() < KERNEL_BOUND


def test_triton_kernel_in_bf16_with_a_scale_of_its_own():
    """bf16 inputs (products of bf16 operands, fp32 softmax) against the fp32 dense oracle, and a scale other
    than 1/sqrt(d) used alike by the selection and the attention."""
    q, k, v = structured(150, 4, 2, 32, 32, 16, seed=41)
    config = BlockSparseConfig(block=16, sink=1, window=2, last_full=1, alpha=0.8)
    mask = bs.block_mask(q, k, config, scale=0.02)
    assert not torch.equal(mask, bs.block_mask(q, k, config))  # the scale changes which blocks score high
    expected = bs.dense_attention_with_block_mask(q, k, v, mask, block=16, scale=0.02)
    result = triton_block_sparse.block_sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), config,
                                                        mask, scale=0.02)
    assert result.dtype == torch.bfloat16
    assert relative_error(result.float(), expected) < 1e-2  # bf16 rounding of inputs, p and the output
    assert relative_error(bs.block_sparse_attention(q, k, v, config, scale=0.02), expected) < 1e-6


def test_kept_block_lists_are_ascending_and_below_the_diagonal():
    mask = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 1], [0, 1, 1, 0], [1, 0, 1, 1]]], dtype=torch.bool)
    kept, counts = triton_block_sparse.kept_block_lists(mask)
    assert counts.tolist() == [[0, 1, 1, 2]]
    assert kept[0, 1, :1].tolist() == [0] and kept[0, 2, :1].tolist() == [1] and kept[0, 3, :2].tolist() == [0, 2]


@pytest.fixture
def backend_on_cpu():
    """A CudaBackend whose device is the CPU (made without its constructor, which wants CUDA), so the op
    routes to the Triton kernel in the interpreter (as in test_cuda_triton)."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="lucebox-cuda's dependencies (cuda-bindings) are not installed")
    from lucebox_cuda.backend import CudaBackend

    backend = CudaBackend.__new__(CudaBackend)
    TorchBackend.__init__(backend, "cpu", torch.float32)
    return backend


def test_the_op_runs_the_kernel_and_falls_back_for_shapes_it_does_not_take(backend_on_cpu, monkeypatch):
    calls = []
    kernel = triton_block_sparse.block_sparse_attention
    monkeypatch.setattr(triton_block_sparse, "block_sparse_attention",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    q, k, v = structured(80, 4, 2, 16, 16, 16, seed=31)
    config = BlockSparseConfig(block=16, alpha=0.7)
    op = backend_on_cpu.block_sparse_attention
    assert op.choice(q, k, v, config=config) == "cuda.block_sparse_attention"
    expected = bs.block_sparse_attention(q, k, v, config)
    assert (op(q, k, v, config=config) - expected).abs().max().item() < KERNEL_BOUND
    assert calls == [1]
    # Blocks of 8 tokens are below tl.dot's 16: the reference runs, and gives the same attention.
    small = BlockSparseConfig(block=8, alpha=0.7)
    assert op.choice(q, k, v, config=small) == "reference"
    assert (op(q, k, v, config=small) - bs.block_sparse_attention(q, k, v, small)).abs().max() == 0
    assert calls == [1]


# -- (d) bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, words", [
    ("block", 48, "block must be a power of two"),
    ("block", 0, "block must be a power of two"),
    ("alpha", 1.5, "alpha must be a number in [0, 1]"),
    ("alpha", -0.1, "alpha must be a number in [0, 1]"),
    ("window", 0, "window must be an integer >= 1"),
    ("sink", -1, "sink must be an integer >= 0"),
])
def test_bad_config_is_refused_by_name(field, value, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        BlockSparseConfig(**{field: value})


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_bad_shapes_raise_clear_errors(implementation):
    attend = bs.block_sparse_attention if implementation == "reference" else triton_block_sparse.block_sparse_attention
    config = BlockSparseConfig(block=16)
    q, k, v = torch.randn(40, 4, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    with pytest.raises(ValueError, match="3 query heads cannot share 2 KV heads"):
        attend(q[:, :3], k, v, config)
    with pytest.raises(ValueError, match="q's head dim 16 differs from k's 8"):
        attend(q, k[..., :8], v, config)
    with pytest.raises(ValueError, match="k has 2 heads and v 1"):
        attend(q, k, v[:, :1], config)
    with pytest.raises(ValueError, match="one length each"):
        attend(q, k[:30], v[:30], config)
    with pytest.raises(ValueError, match=r"must be \[tokens, heads, dim\]"):
        attend(q[None], k[None], v[None], config)
    with pytest.raises(ValueError, match=r"mask must be bool \[4, 3, 3\]"):
        attend(q, k, v, config, torch.ones(4, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="no tokens"):
        attend(q[:0], k[:0], v[:0], config)


# -- the micro-benchmark's entry point -------------------------------------------------------------------


def test_bench_entry_point_parses_its_arguments_without_a_gpu():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    shown = subprocess.run([sys.executable, "-m", "lucebox_cuda.triton_block_sparse", "--help"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "--bench" in shown.stdout and "--lengths" in shown.stdout and "--alpha" in shown.stdout
    refused = subprocess.run([sys.executable, "-m", "lucebox_cuda.triton_block_sparse", "--bench", "--lengths", "x"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 2 and "invalid int value" in refused.stderr


def test_triton_kernel_walks_a_block_in_several_key_tiles():
    """Blocks of 32 tokens read as two tiles of 16 keys (the GPU's 128-token blocks are two tiles of 64)."""
    q, k, v = structured(150, 4, 2, 16, 16, 32, seed=37)
    config = BlockSparseConfig(block=32, sink=1, window=1, last_full=0, alpha=0.8)
    mask = bs.block_mask(q, k, config)
    expected = bs.dense_attention_with_block_mask(q, k, v, mask, block=32)
    result = triton_block_sparse.block_sparse_attention(q, k, v, config, block_n=16)
    assert (result - expected).abs().max().item() < KERNEL_BOUND
    with pytest.raises(ValueError, match="block_n must be a power of two from 16 up to the block"):
        triton_block_sparse.block_sparse_attention(q, k, v, config, block_n=64)


# Compiled for real GPUs in a child process (this module's kernels are interpreted; the compiler needs the
# jitted ones): Qwen3-0.6B's shape in bf16 with 128-token blocks, the 256-dim tile, and fp32. Each variant
# compiles single-threaded (LLVM, then ptxas), so the variants are spread over the machine's cores.
COMPILE_SCRIPT = """
import concurrent.futures
import multiprocessing
import os
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lucebox_cuda import triton_block_sparse as module

kernel = module._block_sparse_kernel
VARIANTS = (("bf16", 128, 64, 128, 8, 3), ("bf16", 128, 32, 256, 8, 2), ("fp32", 64, 64, 128, 4, 1))

def compile_variant(job):
    capability, (act, block, block_n, dim, warps, stages) = job
    pointer = "*" + act
    types = dict(q_ptr=pointer, k_ptr=pointer, v_ptr=pointer, out_ptr=pointer, kept_ptr="*i32",
                 count_ptr="*i32", qk_scale="fp32")
    constants = dict(GROUP=2, HEAD_DIM=dim, VALUE_DIM=dim, BLOCK=block, BLOCK_N=block_n, BLOCK_D=dim,
                     BLOCK_DV=dim, DOT_PRECISION="ieee" if act == "fp32" else "tf32", UPCAST_DOT=False,
                     STATIC_TRIPS=0)
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
    binary = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                            target=GPUTarget("cuda", capability, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    assert binary.asm["cubin"][:4] == b"\\x7fELF"
    assert binary.metadata.shared <= 227 * 1024, binary.metadata.shared
    return f"compiled {act} {dim} sm_{capability}"

jobs = [(capability, variant) for capability in map(int, sys.argv[1:]) for variant in VARIANTS]
workers = min(len(os.sched_getaffinity(0)), len(jobs))
with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
    for line in pool.map(compile_variant, jobs):  # a variant that fails raises here, with its traceback
        print(line)
"""


@pytest.mark.slow
def test_kernel_compiles_for_each_gpu_architecture(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, "86", "90"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == 2 * 3
