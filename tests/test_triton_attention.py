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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 21, 40])
def test_attention_reads_its_causal_offset_from_the_device(offset, dtype):
    """A recorded prefill piece's attention: the offset a `[1]` tensor read by the kernel, the keys a window longer
    than offset + tokens whose later rows hold garbage (another piece's padding, never seen). The bits are those
    of the offset passed by value over exactly the keys the piece sees."""
    torch.manual_seed(14 + offset)
    tokens, window = 27, 96
    q = torch.randn(1, tokens, 6, 32).to(dtype)
    k, v = (torch.randn(1, window, 2, 32) * 2).to(dtype), torch.randn(1, window, 2, 32).to(dtype)
    k[:, offset + tokens:], v[:, offset + tokens:] = float("nan"), float("nan")
    seen = offset + tokens
    by_value = triton_attention.attention(q, k[:, :seen], v[:, :seen], scale=0.2, causal_offset=offset,
                                          config=SMALL_TILES)
    on_device = triton_attention.attention(q, k, v, scale=0.2, causal_offset=torch.tensor([offset]),
                                           config=SMALL_TILES)
    assert torch.equal(on_device, by_value)
    expected = REFERENCE.attention(q.float(), k[:, :seen].float(), v[:, :seen].float(), scale=0.2,
                                   causal_offset=offset)
    assert relative_error(on_device, expected) < BOUNDS[dtype]
    with pytest.raises(ValueError, match="one integer"):
        triton_attention.attention(q, k, v, scale=0.2, causal_offset=torch.tensor([1.0]))


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
# these short windows several blocks per split and several splits (after two narrow splits of one block).
PARTITIONS = [(None, None), (16, 1), (16, 3)]


def partition(block_n, blocks_per_split):
    return {} if block_n is None else {"block_n": block_n, "blocks_per_split": blocks_per_split, "narrow_splits": 2}


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
    result = triton_attention.tree_attention(q, k, v, pos, visible, scale=0.125, block_n=16, blocks_per_split=2, narrow_splits=2)
    assert result.dtype == torch.bfloat16
    assert relative_error(result, expected) < BOUNDS[torch.bfloat16]
    k8, v8 = quantize_q8_0(k.float().clamp(-50, 50)), quantize_q8_0(v.float().clamp(-50, 50))
    expected = REFERENCE.tree_attention(q.float(), k8, v8, pos, visible, scale=0.125)
    result = triton_attention.tree_attention(q.float(), k8, v8, pos, visible, scale=0.125, block_n=16,
                                             blocks_per_split=2, narrow_splits=2)
    assert relative_error(result, expected) < BOUNDS[torch.float32]


def test_tree_attention_never_reads_rows_past_the_tree():
    """NaN in every row from position + N on (rows the reference masks but still multiplies) leaves the
    output as it was with clean rows: the kernel never loads them."""
    torch.manual_seed(22)
    parents = TREES[3]
    q, k, v = tree_inputs(len(parents), 50, 128, 6, 2, 16)
    visible = TreeIndex.build(parents).visibility()
    pos = torch.tensor([50])
    clean = triton_attention.tree_attention(q, k, v, pos, visible, scale=0.25, block_n=16, blocks_per_split=2, narrow_splits=2)
    k[50 + len(parents) :], v[50 + len(parents) :] = float("nan"), float("nan")
    poisoned = triton_attention.tree_attention(q, k, v, pos, visible, scale=0.25, block_n=16, blocks_per_split=2, narrow_splits=2)
    assert torch.equal(clean, poisoned)


@pytest.mark.parametrize("position", [0, 40, 99, 300])
def test_decode_attention_sees_rows_up_to_its_position(position):
    """One node that sees itself: rows 0 .. position, as the reference decode step (300: past the window,
    every row)."""
    torch.manual_seed(position)
    q, k, v = torch.randn(1, 1, 6, 32), torch.randn(100, 2, 32), torch.randn(100, 2, 32)
    pos = torch.tensor([position])
    result = triton_attention.decode_attention(q, k, v, pos, scale=0.2, block_n=16, blocks_per_split=2, narrow_splits=2)
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
                                               block_n=16, blocks_per_split=2, narrow_splits=2)
    for node in range(nodes):
        path = [i for i in range(nodes) if visible[node, i]]
        decode_rows = 130  # a larger window: more splits, past the path all noise
        k_decode, v_decode = (torch.randn(decode_rows, 2, dim).to(dtype) for _ in range(2))
        k_decode[:position], v_decode[:position] = k[:position], v[:position]
        for depth, index in enumerate(path):
            k_decode[position + depth], v_decode[position + depth] = k[position + index], v[position + index]
        decoded = triton_attention.decode_attention(
            q[:, node : node + 1], k_decode, v_decode, torch.tensor([position + len(path) - 1]), scale=0.2,
            block_n=16, blocks_per_split=2, narrow_splits=2)
        assert torch.equal(decoded[0, 0], verified[0, node]), f"node {node}, path {path}"


def test_merge_in_chunks_keeps_the_bits_across_split_counts():
    """Past 16 splits the merge takes them a chunk at a time (`triton_path_combine`): a node in a 2-chunk
    verify window (its second chunk partly empty) still equals the decode step in a 4-chunk window (two more
    chunks of empty splits), bit for bit, and both match the reference."""
    from lucebox_cuda.triton_path_combine import SPLIT_CHUNK

    torch.manual_seed(11)
    parents, position, dim = TREES[2], 300, 32
    nodes = len(parents)
    rows = position + nodes + 10
    q, k, v = tree_inputs(nodes, position, rows, 6, 2, dim, torch.float16)
    visible = TreeIndex.build(parents).visibility()
    split = {"block_n": 16, "blocks_per_split": 1}
    assert SPLIT_CHUNK < triton.cdiv(rows, 16) <= 2 * SPLIT_CHUNK
    verified = triton_attention.tree_attention(q, k, v, torch.tensor([position]), visible, scale=0.2, **split)
    expected = REFERENCE.tree_attention(q.float(), k.float(), v.float(), torch.tensor([position]), visible,
                                        scale=0.2)
    assert relative_error(verified.float(), expected) < 2e-3
    for node in (0, nodes - 1):
        path = [i for i in range(nodes) if visible[node, i]]
        decode_rows = 4 * SPLIT_CHUNK * 16 - 5
        k_decode, v_decode = (torch.randn(decode_rows, 2, dim).to(torch.float16) for _ in range(2))
        k_decode[:position], v_decode[:position] = k[:position], v[:position]
        for depth, index in enumerate(path):
            k_decode[position + depth], v_decode[position + depth] = k[position + index], v[position + index]
        decoded = triton_attention.decode_attention(q[:, node : node + 1], k_decode, v_decode,
                                                    torch.tensor([position + len(path) - 1]), scale=0.2, **split)
        assert torch.equal(decoded[0, 0], verified[0, node]), f"node {node}, path {path}"


# -- node rows apart from the cache, and sliding-window rings (Gemma-4's verify pass and decode step) ---------


def ring_sequence(length, ring, kv_heads, dim, dtype=torch.float32):
    """Random K/V for positions 0 .. length-1 and the ring of `ring` slots they leave (position p in slot
    p % ring, the latest one per slot; slots never written hold noise)."""
    keys, values = torch.randn(length, kv_heads, dim) * 2, torch.randn(length, kv_heads, dim)
    ring_k, ring_v = torch.randn(ring, kv_heads, dim) * 50, torch.randn(ring, kv_heads, dim) * 50
    for p in range(length):
        ring_k[p % ring], ring_v[p % ring] = keys[p], values[p]
    return keys.to(dtype), values.to(dtype), ring_k.to(dtype), ring_v.to(dtype)


def expected_window_attention(q, keys, values, node_k, node_v, start, visible, window, scale):
    """An independent formulation: every committed position and every node in one sequence, each node seeing
    the committed positions and ancestors no more than `window - 1` before it (0: no window)."""
    nodes = q.shape[1]
    depth = visible.sum(dim=1) - 1
    positions = torch.cat([torch.arange(start), start + depth])
    node_positions = start + depth
    age = node_positions[:, None] - positions[None, :]
    seen = torch.cat([torch.ones(nodes, start, dtype=torch.bool), visible], dim=1) & (age >= 0)
    if window:
        seen &= age < window
    all_k, all_v = torch.cat([keys[:start], node_k])[None], torch.cat([values[:start], node_v])[None]
    return REFERENCE.attention(q.float(), all_k.float(), all_v.float(), scale=scale, mask=seen)


@pytest.mark.parametrize(("parents", "start", "rows"), [
    (TREES[2], 37, 64), (TREES[3], 0, 16), (TREES[1], 60, 96), (TREES[0], 45, 64)])
def test_tree_attention_node_rows_apart_from_the_cache(parents, start, rows):
    """Nodes' K/V passed beside a cache that holds committed rows only: the reference and the kernel against
    attention over the whole sequence."""
    torch.manual_seed(start + len(parents))
    nodes, dim = len(parents), 32
    keys, values = torch.randn(start + 1, 2, dim), torch.randn(start + 1, 2, dim)
    cache_k, cache_v = torch.randn(rows, 2, dim) * 1e3, torch.randn(rows, 2, dim) * 1e3  # noise past start
    cache_k[:start], cache_v[:start] = keys[:start], values[:start]
    q, node_k, node_v = torch.randn(1, nodes, 6, dim), torch.randn(nodes, 2, dim), torch.randn(nodes, 2, dim)
    visible = TreeIndex.build(parents).visibility()
    pos = torch.tensor([start])
    expected = expected_window_attention(q, keys, values, node_k, node_v, start, visible, 0, 0.2)
    reference = REFERENCE.tree_attention(q, cache_k, cache_v, pos, visible, scale=0.2, node_k=node_k, node_v=node_v)
    assert relative_error(reference, expected) < BOUNDS[torch.float32]
    result = triton_attention.tree_attention(q, cache_k, cache_v, pos, visible, scale=0.2, node_k=node_k,
                                             node_v=node_v, block_n=16, blocks_per_split=2, narrow_splits=2)
    assert relative_error(result, expected) < BOUNDS[torch.float32]


# (tree, committed positions, ring slots, window rows): a ring not yet full, one the tree wraps, one long
# wrapped (the committed rows' slots past the tree's), a window shorter than the ring (a short context).
RING_CASES = [(TREES[2], 9, 32, 32), (TREES[3], 28, 32, 32), (TREES[2], 150, 32, 32), (TREES[1], 5, 32, 16),
              (TREES[4], 40, 96, 96)]


@pytest.mark.parametrize(("parents", "start", "ring", "rows"), RING_CASES)
def test_tree_attention_over_a_ring(parents, start, ring, rows):
    torch.manual_seed(start * 7 + ring)
    nodes, dim = len(parents), 32
    keys, values, ring_k, ring_v = ring_sequence(start, ring, 2, dim)
    q, node_k, node_v = torch.randn(1, nodes, 4, dim), torch.randn(nodes, 2, dim), torch.randn(nodes, 2, dim)
    visible = TreeIndex.build(parents).visibility()
    pos = torch.tensor([start])
    expected = expected_window_attention(q, keys, values, node_k, node_v, start, visible, ring, 0.2)
    extra = {"node_k": node_k, "node_v": node_v, "ring": ring}
    reference = REFERENCE.tree_attention(q, ring_k[:rows], ring_v[:rows], pos, visible, scale=0.2, **extra)
    assert relative_error(reference, expected) < BOUNDS[torch.float32]
    result = triton_attention.tree_attention(q, ring_k[:rows], ring_v[:rows], pos, visible, scale=0.2, **extra,
                                             block_n=16, blocks_per_split=1)
    assert relative_error(result, expected) < BOUNDS[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("parents", "start", "ring"), [(TREES[2], 9, 32), (TREES[3], 28, 32), (TREES[2], 150, 32),
                                                        (TREES[1], 40, 16)])
def test_ring_tree_node_equals_decoding_its_path_bit_for_bit(parents, start, ring, dtype):
    """Gemma-4's exactness: a verified node over a ring equals, to the bit, the one-node decode step over the
    ring once its path is committed (ancestors written into their slots, its own row passed as the node row),
    with the decode step's window (more rows, another split count for a ring not yet full)."""
    torch.manual_seed(start + ring + (dtype == torch.bfloat16))
    nodes, dim = len(parents), 32
    _, _, ring_k, ring_v = ring_sequence(start, ring, 2, dim, dtype)
    q = torch.randn(1, nodes, 4, dim).to(dtype)
    node_k, node_v = torch.randn(nodes, 2, dim).to(dtype), torch.randn(nodes, 2, dim).to(dtype)
    visible = TreeIndex.build(parents).visibility()
    rows = min(ring, start + 4) if start < ring else ring  # the verify's window: the committed rows
    verified = triton_attention.tree_attention(
        q, ring_k[:rows], ring_v[:rows], torch.tensor([start]), visible, scale=0.2, node_k=node_k, node_v=node_v,
        ring=ring, block_n=8, blocks_per_split=2, narrow_splits=2)
    one = torch.ones(1, 1, dtype=torch.bool)
    for node in range(nodes):
        path = [i for i in range(nodes) if visible[node, i]]
        decode_k, decode_v = ring_k.clone(), ring_v.clone()
        for depth, index in enumerate(path[:-1]):  # the ancestors, committed in their slots
            decode_k[(start + depth) % ring], decode_v[(start + depth) % ring] = node_k[index], node_v[index]
        position = start + len(path) - 1
        decode_k[position % ring], decode_v[position % ring] = node_k[node], node_v[node]  # written, then read
        decode_rows = ring  # the decode step's window of a ring: all of it
        decoded = triton_attention.tree_attention(
            q[:, node : node + 1], decode_k[:decode_rows], decode_v[:decode_rows], torch.tensor([position]), one,
            scale=0.2, node_k=node_k[node : node + 1], node_v=node_v[node : node + 1], ring=ring, block_n=8,
            blocks_per_split=2, narrow_splits=2)
        assert torch.equal(decoded[0, 0], verified[0, node]), f"node {node}, path {path}"


def test_ring_tree_attention_q8_0_cache():
    """A Q8_0 ring's raw rows (decoded in registers) with the nodes' rows as values: the kernel against the
    reference on the same rows."""
    from lucebox_core.kv import dequantize_q8_0, quantize_q8_0

    torch.manual_seed(31)
    parents, start, ring, dim = TREES[3], 50, 32, 64
    _, _, ring_k, ring_v = ring_sequence(start, ring, 2, dim)
    k8, v8 = quantize_q8_0(ring_k.clamp(-60, 60)), quantize_q8_0(ring_v.clamp(-60, 60))
    q = torch.randn(1, len(parents), 4, dim)
    # The nodes' rows as the cache would read them back (what the model passes): Q8_0's values.
    node_k, node_v = (dequantize_q8_0(quantize_q8_0(torch.randn(len(parents), 2, dim))) for _ in range(2))
    visible = TreeIndex.build(parents).visibility()
    extra = {"node_k": node_k, "node_v": node_v, "ring": ring}
    pos = torch.tensor([start])
    expected = REFERENCE.tree_attention(q, k8, v8, pos, visible, scale=0.125, **extra)
    result = triton_attention.tree_attention(q, k8, v8, pos, visible, scale=0.125, **extra, block_n=16,
                                             blocks_per_split=1)
    assert relative_error(result, expected) < BOUNDS[torch.float32]


def test_tree_attention_rejects_bad_node_rows():
    q, k = torch.randn(1, 2, 4, 16), torch.randn(20, 2, 16)
    visible = TreeIndex.build([-1, 0]).visibility()
    pos = torch.tensor([5])
    with pytest.raises(ValueError, match="node rows"):
        triton_attention.tree_attention(q, k, k, pos, visible, scale=0.25, ring=8)
    with pytest.raises(ValueError, match="node rows"):
        triton_attention.tree_attention(q, k, k, pos, visible, scale=0.25, node_k=k[:3], node_v=k[:3])
    with pytest.raises(ValueError, match="node_k and node_v"):
        REFERENCE.tree_attention(q, k, k, pos, visible, scale=0.25, node_k=k[:2])


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


def test_a_bad_partition_is_refused_by_name():
    q, k, v = tree_inputs(1, 3, 16, 2, 1, 32)
    with pytest.raises(ValueError, match="narrow_splits -1"):
        triton_attention.decode_attention(q, k, v, torch.tensor([3]), scale=0.2, narrow_splits=-1)
    with pytest.raises(ValueError, match="blocks_per_split 0"):
        triton_attention.decode_attention(q, k, v, torch.tensor([3]), scale=0.2, blocks_per_split=0)


@pytest.mark.parametrize("name", ["LUCEBOX_PATH_NARROW_SPLITS", "LUCEBOX_PATH_BLOCKS_PER_SPLIT"])
def test_a_partition_override_that_is_no_number_is_refused_by_name(name):
    """The overrides are read when the module is imported: a value that is no whole number stops the import
    with the variable's name, not int()'s bare complaint."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", name: "four"}
    result = subprocess.run([sys.executable, "-c", "import lucebox_cuda.triton_path_combine"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and f"{name}='four': expected a whole number" in result.stderr
    env[name] = " 8 "
    assert subprocess.run([sys.executable, "-c", "import lucebox_cuda.triton_path_combine"], env=env,
                          capture_output=True, text=True, timeout=120).returncode == 0
