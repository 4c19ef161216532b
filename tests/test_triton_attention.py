"""The Triton attention kernels (lucebox_cuda.triton_attention) against the torch reference ops, run on the
CPU by Triton's interpreter: prefill attention (causal, offset, masked, GQA) and static tree verification.
Shapes are small (the interpreter is slow); `python -m lucebox_cuda.triton_attention` covers the 27B
shapes, bf16 tensor cores and timing on a GPU.

Tolerances are relative errors over the whole output: 1e-5 for fp32 (the reference also runs in fp32),
1e-2 for bf16 (the kernel rounds its products' operands and its output to bf16; the reference of prefill
runs in fp32).
"""

from __future__ import annotations

import os

# Triton decides at decoration time whether a kernel is compiled or interpreted: set this before the
# kernels' module is first imported.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")

import torch
import triton
from lucebox_cuda import triton_attention
from triton.runtime.interpreter import InterpretedFunction

from lucebox_core.speculative.trees import TreeIndex
from lucebox_core.torch_backend import TorchBackend

if not isinstance(triton_attention._attention_kernel, InterpretedFunction):
    pytest.skip("lucebox_cuda.triton_attention was imported earlier without TRITON_INTERPRET=1",
                allow_module_level=True)

REFERENCE = TorchBackend("cpu", torch.float32)
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# Small tiles: several query and key blocks even at these sizes, so both key loops (whole blocks below
# the diagonal, edge blocks) and the packing of (token, head) rows across blocks are exercised.
SMALL_TILES = triton_attention.BlockConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def relative_error(result: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(result).all(), "the kernel left NaN (an unwritten output) or produced inf"
    return ((result.double() - expected.double()).norm() / expected.double().norm()).item()


def nan_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.full_like(tensor, float("nan"))


# -- prefill attention ---------------------------------------------------------------------------------

# (batch, query heads, KV heads, head dim, value dim, query tokens, causal offset or None, dtype): GQA
# groups 1, 2 and 3; offsets 0 and > 0 and no causal rule; token counts that are not whole blocks; a head
# dim that is not a power of two; value dim != head dim; two sequences in a batch.
PREFILL_CASES = [
    (1, 4, 4, 32, 32, 37, 0, torch.float32),
    (1, 4, 2, 16, 16, 45, 70, torch.float32),
    (1, 6, 2, 64, 64, 29, None, torch.float32),
    (2, 6, 2, 24, 24, 21, 9, torch.float32),
    (1, 6, 2, 32, 48, 50, 0, torch.bfloat16),
    (1, 4, 2, 64, 64, 19, 40, torch.bfloat16),
]


@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["default-tiles", "small-tiles"])
@pytest.mark.parametrize(("batch", "q_heads", "kv_heads", "head_dim", "value_dim", "tokens", "offset", "dtype"),
                         PREFILL_CASES)
def test_attention_matches_reference(batch, q_heads, kv_heads, head_dim, value_dim, tokens, offset, dtype, config):
    torch.manual_seed(tokens * 7 + q_heads)
    keys = tokens + (offset or 0) + (0 if offset is not None else 24)  # non-causal: more keys than queries
    q = torch.randn(batch, tokens, q_heads, head_dim).to(dtype)
    k = (torch.randn(batch, keys, kv_heads, head_dim) * 2).to(dtype)
    v = torch.randn(batch, keys, kv_heads, value_dim).to(dtype)
    scale = head_dim**-0.5
    expected = REFERENCE.attention(q.float(), k.float(), v.float(), scale=scale, causal_offset=offset)
    out = nan_like(torch.empty(batch, tokens, q_heads, value_dim, dtype=dtype))
    result = triton_attention.attention(q, k, v, scale=scale, causal_offset=offset, out=out, config=config)
    assert result is out and result.dtype == dtype
    assert relative_error(result, expected) < BOUNDS[dtype]


@pytest.mark.parametrize("offset", [None, 6])
@pytest.mark.parametrize("batched_mask", [False, True])
def test_attention_with_mask(offset, batched_mask):
    """A random bool mask (each query keeps at least its own diagonal key), alone or with the causal rule."""
    torch.manual_seed(11)
    batch, tokens, keys = 2, 27, 33
    q = torch.randn(batch, tokens, 6, 32)
    k, v = torch.randn(batch, keys, 2, 32), torch.randn(batch, keys, 2, 32)
    mask = torch.rand(batch if batched_mask else 1, tokens, keys) < 0.5
    mask[:, torch.arange(tokens), torch.arange(tokens) + 6] = True
    mask = mask if batched_mask else mask[0]
    expected = REFERENCE.attention(q, k, v, scale=0.2, causal_offset=offset, mask=mask)
    result = triton_attention.attention(q, k, v, scale=0.2, causal_offset=offset, mask=mask, config=SMALL_TILES)
    assert relative_error(result, expected) < BOUNDS[torch.float32]


def test_attention_strided_operands():
    """The model's layout: the query a column slice of the [query | gate] projection, K/V the first rows
    of a bigger cache whose rows hold more than one tensor (row stride > heads * dim)."""
    torch.manual_seed(12)
    query_and_gate = torch.randn(1, 40, 6, 64)
    q = query_and_gate[..., :32]
    cache = torch.randn(1, 100, 2, 80)
    k, v = cache[:, :55, :, :32], cache[:, :55, :, 40:72]
    expected = REFERENCE.attention(q, k, v, scale=0.3, causal_offset=15)
    result = triton_attention.attention(q, k, v, scale=0.3, causal_offset=15, config=SMALL_TILES)
    assert relative_error(result, expected) < BOUNDS[torch.float32]


def test_attention_never_reads_key_blocks_above_the_diagonal():
    """With 16-token query blocks and 16-key blocks, queries 0..31 never load values past key 31: NaN
    there must not reach their outputs (a masked-but-visited block would give 0 * NaN = NaN)."""
    torch.manual_seed(13)
    q, k, v = torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
    expected = REFERENCE.attention(q, k, v, scale=0.25, causal_offset=0)
    poisoned_v = v.clone()
    poisoned_v[:, 32:] = float("nan")
    result = triton_attention.attention(q, k, poisoned_v, scale=0.25, causal_offset=0, config=SMALL_TILES)
    assert relative_error(result[:, :32], expected[:, :32]) < BOUNDS[torch.float32]


def test_attention_rejects_what_it_does_not_take():
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 8, 4, 16)  # 6 query heads over 4 KV heads
    with pytest.raises(ValueError):
        triton_attention.attention(q, k, k, scale=0.25)
    with pytest.raises(ValueError):
        triton_attention.attention(q, k[:, :, :2], k[:, :, :2], scale=0.25, causal_offset=-1)


# -- tree verification ---------------------------------------------------------------------------------

# Parents of each node (-1: the root, which follows the committed prefix): a lone root (the decode case),
# a chain, two bushy trees, and a 65-node chain-of-branches (the largest tree the engine builds).
TREES = [[-1], [-1, 0, 1, 2], [-1, 0, 0, 1, 3, 2, 2], [-1, 0, 1, 0, 3, 3, 5, 1],
         [-1] + [max(0, i - 1 - i % 3) for i in range(1, 65)]]


def tree_inputs(nodes, position, rows, q_heads, kv_heads, dim, dtype=torch.float32, garbage=1e4):
    """Random q, K/V window; rows from position + nodes on hold `garbage` (never a key any node sees)."""
    q = torch.randn(1, nodes, q_heads, dim)
    k, v = torch.randn(rows, kv_heads, dim) * 2, torch.randn(rows, kv_heads, dim)
    k[position + nodes :], v[position + nodes :] = garbage, garbage
    return q.to(dtype), k.to(dtype), v.to(dtype)


# Key partitions (rows per block, blocks per split): the kernel's default, and small ones that give
# these short windows several blocks per split and several splits.
PARTITIONS = [(None, None), (16, 1), (16, 3)]


def partition(block_n, blocks_per_split):
    return {} if block_n is None else {"block_n": block_n, "blocks_per_split": blocks_per_split}


@pytest.mark.parametrize(("block_n", "blocks_per_split"), PARTITIONS)
@pytest.mark.parametrize(("parents", "position", "rows", "q_heads", "kv_heads"), [
    (TREES[0], 37, 100, 6, 2),
    (TREES[1], 0, 30, 4, 2),
    (TREES[2], 7, 150, 6, 2),
    (TREES[3], 90, 160, 3, 1),
    (TREES[3], 60, 64, 4, 4),  # the last nodes' rows fall past the window: no node sees them
    (TREES[4], 20, 128, 3, 1),
])
def test_tree_attention_matches_reference(parents, position, rows, q_heads, kv_heads, block_n, blocks_per_split):
    torch.manual_seed(len(parents) * 31 + position)
    nodes, dim = len(parents), 32
    q, k, v = tree_inputs(nodes, position, rows, q_heads, kv_heads, dim)
    visible = TreeIndex.build(parents).visibility()
    pos = torch.tensor([position])
    expected = REFERENCE.tree_attention(q, k, v, pos, visible, scale=dim**-0.5)
    out = nan_like(expected)
    result = triton_attention.tree_attention(q, k, v, pos, visible, scale=dim**-0.5, out=out,
                                             **partition(block_n, blocks_per_split))
    assert result is out
    assert relative_error(out, expected) < BOUNDS[torch.float32]


def test_tree_attention_bf16_and_q8_0_cache():
    """bf16 q and cache against the fp32 reference on the same (rounded) values; then a Q8_0 cache's raw
    rows, decoded in registers, against the reference on the same rows."""
    from lucebox_core.kv import quantize_q8_0

    torch.manual_seed(21)
    parents = TREES[2]
    nodes = len(parents)
    q, k, v = tree_inputs(nodes, 45, 96, 6, 2, 64, torch.bfloat16)
    visible = TreeIndex.build(parents).visibility()
    pos = torch.tensor([45])
    expected = REFERENCE.tree_attention(q.float(), k.float(), v.float(), pos, visible, scale=0.125)
    result = triton_attention.tree_attention(q, k, v, pos, visible, scale=0.125, block_n=16, blocks_per_split=2)
    assert result.dtype == torch.bfloat16
    assert relative_error(result, expected) < BOUNDS[torch.bfloat16]
    k8, v8 = quantize_q8_0(k.float().clamp(-50, 50)), quantize_q8_0(v.float().clamp(-50, 50))
    expected = REFERENCE.tree_attention(q.float(), k8, v8, pos, visible, scale=0.125)
    result = triton_attention.tree_attention(q.float(), k8, v8, pos, visible, scale=0.125, block_n=16,
                                             blocks_per_split=2)
    assert relative_error(result, expected) < BOUNDS[torch.float32]


def test_tree_attention_never_reads_rows_past_the_tree():
    """NaN in every row from position + N on (rows the reference masks but still multiplies) leaves the
    output as it was with clean rows: the kernel never loads them."""
    torch.manual_seed(22)
    parents = TREES[3]
    q, k, v = tree_inputs(len(parents), 50, 128, 6, 2, 16)
    visible = TreeIndex.build(parents).visibility()
    pos = torch.tensor([50])
    clean = triton_attention.tree_attention(q, k, v, pos, visible, scale=0.25, block_n=16, blocks_per_split=2)
    k[50 + len(parents) :], v[50 + len(parents) :] = float("nan"), float("nan")
    poisoned = triton_attention.tree_attention(q, k, v, pos, visible, scale=0.25, block_n=16, blocks_per_split=2)
    assert torch.equal(clean, poisoned)


@pytest.mark.parametrize("position", [0, 40, 99, 300])
def test_decode_attention_sees_rows_up_to_its_position(position):
    """One node that sees itself: rows 0 .. position, as the reference decode step (300: past the window,
    every row)."""
    torch.manual_seed(position)
    q, k, v = torch.randn(1, 1, 6, 32), torch.randn(100, 2, 32), torch.randn(100, 2, 32)
    pos = torch.tensor([position])
    result = triton_attention.decode_attention(q, k, v, pos, scale=0.2, block_n=16, blocks_per_split=2)
    assert relative_error(result, REFERENCE.decode_attention(q, k, v, pos, scale=0.2)) < BOUNDS[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parents", [TREES[1], TREES[3], TREES[2]])
def test_tree_node_equals_decoding_its_path_bit_for_bit(parents, dtype):
    """What lets speculative decoding reproduce plain decoding on a GPU even at near-ties: each node's
    output equals, to the bit, the decode step's for the same query once its path is committed (the path's
    K/V rows moved to follow the prefix, as commit leaves them), in a window of another size (another
    split count) with other rows past the path."""
    torch.manual_seed(len(parents) + (dtype == torch.bfloat16))
    nodes, position, rows, dim = len(parents), 37, 80, 32
    q, k, v = tree_inputs(nodes, position, rows, 6, 2, dim, dtype)
    visible = TreeIndex.build(parents).visibility()
    verified = triton_attention.tree_attention(q, k, v, torch.tensor([position]), visible, scale=0.2,
                                               block_n=16, blocks_per_split=2)
    for node in range(nodes):
        path = [i for i in range(nodes) if visible[node, i]]
        decode_rows = 130  # a larger window: more splits, past the path all noise
        k_decode, v_decode = (torch.randn(decode_rows, 2, dim).to(dtype) for _ in range(2))
        k_decode[:position], v_decode[:position] = k[:position], v[:position]
        for depth, index in enumerate(path):
            k_decode[position + depth], v_decode[position + depth] = k[position + index], v[position + index]
        decoded = triton_attention.decode_attention(
            q[:, node : node + 1], k_decode, v_decode, torch.tensor([position + len(path) - 1]), scale=0.2,
            block_n=16, blocks_per_split=2)
        assert torch.equal(decoded[0, 0], verified[0, node]), f"node {node}, path {path}"


def test_tree_attention_strided_window():
    """K/V as the kv cache's window gives them: the first W rows of a buffer whose rows hold K and V side by
    side; 80 value dims (more than one combine program, the last one partly masked)."""
    torch.manual_seed(23)
    parents = TREES[1]
    cache = torch.randn(200, 2, 112)
    k, v = cache[:120, :, :32], cache[:120, :, 32:]
    q = torch.randn(1, len(parents), 6, 32)
    visible = TreeIndex.build(parents).visibility()
    pos = torch.tensor([70])
    expected = REFERENCE.tree_attention(q, k, v, pos, visible, scale=0.2)
    result = triton_attention.tree_attention(q, k, v, pos, visible, scale=0.2)
    assert relative_error(result, expected) < BOUNDS[torch.float32]


# -- tiles ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [16, 64, 128, 256])
def test_tiles_suit_tensor_cores(dim, dtype):
    """tl.dot needs power-of-two tiles of at least 16 on every side, whatever the model's shapes."""
    configs = [triton_attention.prefill_config(dim, dim, dtype)]
    for config in configs:
        for side in (config.block_m, config.block_n):
            assert side >= 16 and side == triton.next_power_of_2(side), config
