"""Prefill attention with the keys cut into spans (lucebox_cuda.triton_attention_split) against the torch
reference, run on the CPU by Triton's interpreter: causal with an offset, a bool mask, no causal rule, GQA,
spans that end inside the causal edge and spans no row of a block sees; and when the split is chosen.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules are first imported

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")

import torch
from lucebox_cuda import triton_attention, triton_attention_split
from triton.runtime.interpreter import InterpretedFunction

from lucebox_core.torch_backend import TorchBackend

if not isinstance(triton_attention_split._span_kernel, InterpretedFunction):
    pytest.skip("lucebox_cuda.triton_attention_split was imported earlier without TRITON_INTERPRET=1",
                allow_module_level=True)

REFERENCE = TorchBackend("cpu", torch.float32)
SMALL_TILES = triton_attention.BlockConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def relative_error(result: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(result).all(), "the split kernel left NaN (an unwritten row) or produced inf"
    return ((result.double() - expected.double()).norm() / expected.double().norm()).item()


# (batch, query heads, KV heads, head dim, query tokens, keys, causal offset or None, splits): a few tokens
# over many keys (what the split is for), spans shorter than a query block's causal edge, more spans than
# some blocks see (their spans are empty), GQA groups 1-4, two sequences.
CASES = [
    (1, 4, 1, 32, 3, 150, 147, 4),
    (1, 6, 2, 16, 20, 130, 110, 5),
    (2, 4, 2, 32, 9, 97, 88, 3),
    (1, 4, 4, 16, 33, 80, 47, 7),
    (1, 6, 2, 32, 5, 120, None, 4),
]


@pytest.mark.parametrize(("batch", "q_heads", "kv_heads", "dim", "tokens", "keys", "offset", "splits"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_attention_matches_reference(batch, q_heads, kv_heads, dim, tokens, keys, offset, splits, dtype):
    torch.manual_seed(keys * 3 + tokens)
    q = torch.randn(batch, tokens, q_heads, dim).to(dtype)
    k = (torch.randn(batch, keys, kv_heads, dim) * 2).to(dtype)
    v = torch.randn(batch, keys, kv_heads, dim).to(dtype)
    scale = dim**-0.5
    expected = REFERENCE.attention(q.float(), k.float(), v.float(), scale=scale, causal_offset=offset)
    result = triton_attention_split.attention(q, k, v, scale=scale, causal_offset=offset, splits=splits,
                                              config=SMALL_TILES)
    assert result.dtype == dtype and result.shape == expected.shape
    assert relative_error(result, expected) < (1e-5 if dtype == torch.float32 else 1e-2)
    # The plain kernel over the same tiles: the same result up to the order of the additions.
    plain = triton_attention.attention(q, k, v, scale=scale, causal_offset=offset, config=SMALL_TILES)
    assert relative_error(result, plain) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(("tokens", "offset", "splits"), [(3, 147, 4), (20, 40, 5), (9, 0, 3)])
def test_split_attention_reads_its_causal_offset_from_the_device(tokens, offset, splits):
    """A recorded prefill piece at depth: the offset a `[1]` tensor, the keys its KV window (longer than offset +
    tokens, the rows after holding NaN: another piece's leftovers, never seen), spans cut over the window (some
    wholly past the keys the rows see): the result is the reference's over the keys seen."""
    torch.manual_seed(tokens + offset)
    window = 192
    q = torch.randn(1, tokens, 6, 32)
    k, v = torch.randn(1, window, 2, 32) * 2, torch.randn(1, window, 2, 32)
    seen = offset + tokens
    k[:, seen:], v[:, seen:] = float("nan"), float("nan")
    expected = REFERENCE.attention(q, k[:, :seen], v[:, :seen], scale=0.2, causal_offset=offset)
    result = triton_attention_split.attention(q, k, v, scale=0.2, causal_offset=torch.tensor([offset]), splits=splits,
                                              config=SMALL_TILES)
    assert relative_error(result, expected) < 1e-5
    with pytest.raises(ValueError, match="one integer"):
        triton_attention_split.attention(q, k, v, scale=0.2, causal_offset=torch.tensor([[1, 2]]), splits=2)


def test_split_attention_with_a_mask():
    torch.manual_seed(5)
    tokens, keys, offset = 6, 90, 84
    q, k, v = torch.randn(1, tokens, 4, 16), torch.randn(1, keys, 2, 16), torch.randn(1, keys, 2, 16)
    mask = torch.rand(tokens, keys) < 0.6
    mask[:, 0] = True  # every row sees a key
    expected = REFERENCE.attention(q, k, v, scale=0.25, causal_offset=offset, mask=mask)
    result = triton_attention_split.attention(q, k, v, scale=0.25, causal_offset=offset, mask=mask, splits=3,
                                              config=SMALL_TILES)
    assert relative_error(result, expected) < 1e-5


def test_the_split_is_chosen_for_short_chunks_over_long_caches_only():
    """The 27B's heads (24 query, 4 KV, dim 256) on 132 SMs: a 3- or 256-token piece at depth 32K is split, a
    512- or 4096-token chunk (96, 768 programs) and a short cache are not, and the CPU never is."""
    def splits(tokens: int, keys: int, device: str = "meta") -> int:
        q = torch.empty(1, tokens, 24, 256, dtype=torch.bfloat16, device=device)
        k = torch.empty(1, keys, 4, 256, dtype=torch.bfloat16, device=device)
        return triton_attention_split.key_splits(q, k, multiprocessors=132 if device == "meta" else None)

    assert splits(3, 32768) == 32768 // triton_attention_split.MIN_SPAN_KEYS  # 4 programs: as many spans as allowed
    assert splits(256, 33024) == 6  # 48 programs -> 6 spans, 288 programs
    assert splits(512, 33280) == 1  # 96 programs: split, slower on the H200
    assert splits(4096, 36864) == 1
    assert splits(3, 1500) == 1
    assert splits(3, 32768, device="cpu") == 1
