"""KV cache types `q4_0` (GGUF's block) and `tq3_0` (Lucebox's TurboQuant blocks).

- The quantizers, byte for byte: Q4_0 against gguf's numpy reference (which mirrors ggml's
  `quantize_row_q4_0_ref`); TQ3_0 against an independent numpy implementation written here from the format
  description (docs/reference/lucebox.md section 7 and Lucebox's `ggml-common.h` / `tq3-quant.cuh`:
  butterflies instead of a matrix, a comparison chain instead of a bucket search, bit loops for the packing).
- Round-trip error on random heads, and attention over each K/V pair against float attention, within stated
  bounds; the Triton kernels (interpreted on the CPU) read the blocks in place and agree with the reference.
- The cache: the pair rule and the head-dim rule are errors that say what is allowed; a tiny qwen35 model
  decodes with q4_0 and tq3_0 caches (dynamic, static step, speculative verify) and the CLI takes the flags.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from lucebox_core import quants as lucebox_quants
from lucebox_core.errors import LuceboxError
from lucebox_core.kv import KV_CACHE_TYPES, FullKVCache, KVLayerShape, kv_bytes_per_token
from lucebox_core.kv_quant import (
    decode_stored,
    dequantize_q4_0,
    dequantize_tq3_0,
    quantize_q4_0,
    quantize_tq3_0,
    rotate_tq3,
    stored_format,
)
from lucebox_core.torch_backend import TorchBackend

REFERENCE = TorchBackend("cpu", torch.float32)

# -- an independent TQ3_0 in numpy, from the format description ------------------------------------------

# Lucebox's sign diagonals as 128-bit masks (bit i set: entry i is -1), read off `tq3-quant.cuh`'s
# d_tq3_wht_signs1 / d_tq3_wht_signs2: a different spelling of the same facts than the module's strings.
NP_SIGNS_1 = 0x49F250A9A4C63BBB42F85949E46A0359
NP_SIGNS_2 = 0xBEA56562B7A5357A3F628FDC16ACEE90
NP_CENTROIDS = np.array([-0.190685, -0.117832, -0.065717, -0.021460, 0.021460, 0.065717, 0.117832, 0.190685],
                        dtype=np.float32)
NP_MIDPOINTS = np.array([-0.154259, -0.091775, -0.043589, 0.0, 0.043589, 0.091775, 0.154259], dtype=np.float32)


def _np_signs(mask: int) -> np.ndarray:
    return np.array([-1.0 if mask >> i & 1 else 1.0 for i in range(128)])


def _np_fwht(x: np.ndarray) -> np.ndarray:
    """The in-place butterflies over the last dim (strides 1, 2, 4, ... 64), then 1/sqrt(128)."""
    x = x.copy()
    h = 1
    while h < 128:
        for start in range(0, 128, 2 * h):
            a, b = x[..., start : start + h].copy(), x[..., start + h : start + 2 * h].copy()
            x[..., start : start + h], x[..., start + h : start + 2 * h] = a + b, a - b
        h *= 2
    return x / np.sqrt(128.0)


def np_rotate(x: np.ndarray) -> np.ndarray:
    return _np_fwht(x * _np_signs(NP_SIGNS_1)) * _np_signs(NP_SIGNS_2)


def np_unrotate(y: np.ndarray) -> np.ndarray:
    return _np_fwht(y * _np_signs(NP_SIGNS_2)) * _np_signs(NP_SIGNS_1)


def np_quantize_tq3_0(x: np.ndarray) -> np.ndarray:
    """float32 `[..., D]` -> uint8 `[..., D / 32 * 14]`, one 128-value group at a time."""
    rows = x.astype(np.float32).astype(np.float64).reshape(-1, 128)
    out = np.zeros((rows.shape[0], 4, 14), dtype=np.uint8)
    for g, group in enumerate(rows):
        norm = np.sqrt(np.sum(group * group))
        unit = group * (1.0 / norm if norm > 1e-10 else 0.0)
        rotated = np_rotate(unit)
        index = np.zeros(128, dtype=np.uint8)
        for i, value in enumerate(rotated):
            k = 0
            while k < 7 and not value < float(NP_MIDPOINTS[k]):  # Lucebox's `if (val < mids[k]) return k` chain
                k += 1
            index[i] = k
        recon = np.sqrt(np.sum(NP_CENTROIDS[index].astype(np.float64) ** 2))
        stored = np.float16(np.float32(norm / recon if recon > 1e-10 else norm))
        for b in range(4):
            block = out[g, b]
            block[0:2] = np.frombuffer(stored.tobytes(), dtype=np.uint8)
            for j in range(32):
                idx = int(index[b * 32 + j])
                block[2 + j // 4] |= (idx & 3) << (2 * (j % 4))
                block[10 + j // 8] |= (idx >> 2) << (j % 8)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 14)


def np_dequantize_tq3_0(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 blocks -> (rotated-domain values `centroid * norm` in fp32, values rotated back)."""
    blocks = data.reshape(-1, 14)
    values = np.zeros((blocks.shape[0], 32), dtype=np.float32)
    for n, block in enumerate(blocks):
        norm = np.float32(block[0:2].view(np.float16)[0])
        for j in range(32):
            idx = (block[2 + j // 4] >> (2 * (j % 4)) & 3) | ((block[10 + j // 8] >> (j % 8) & 1) << 2)
            values[n, j] = NP_CENTROIDS[idx] * norm
    dim = data.shape[-1] // 14 * 32
    rotated = values.reshape(*data.shape[:-1], dim)
    plain = np_unrotate(rotated.astype(np.float64).reshape(-1, 128)).reshape(rotated.shape)
    return rotated, plain.astype(np.float32)


def _heads(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Normal heads with per-row scales over four orders of magnitude, an all-zero group and a group that
    is a single spike."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, (*shape[:-1], 1))).astype(np.float32)
    groups = x.reshape(-1, 128)
    groups[0] = 0
    groups[1] = 0
    groups[1, 5] = -3.0
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tq3_0_matches_the_independent_numpy_quantizer_byte_for_byte(seed):
    x = _heads((6, 2, 256), seed)  # 24 groups, 96 blocks
    ours = quantize_tq3_0(torch.from_numpy(x))
    assert ours.dtype == torch.uint8 and tuple(ours.shape) == (6, 2, 8 * 14)
    np.testing.assert_array_equal(ours.numpy(), np_quantize_tq3_0(x))
    rotated, plain = np_dequantize_tq3_0(ours.numpy())
    # The rotated domain is a product per value: equal. Rotated back: the same up to float rounding.
    np.testing.assert_array_equal(dequantize_tq3_0(ours, rotated=True).numpy(), rotated)
    np.testing.assert_allclose(dequantize_tq3_0(ours).numpy(), plain, rtol=1e-5, atol=1e-6 * float(np.abs(x).max()))
    # All four blocks of a group carry the group's norm; an all-zero group stores norm 0 and decodes to 0.
    norms = ours.reshape(-1, 4, 14)[:, :, :2]
    assert (norms == norms[:, :1]).all()
    assert not dequantize_tq3_0(ours).reshape(-1, 128)[0].any()


def test_tq3_0_values_next_to_each_threshold_take_the_right_code():
    """Rotated-domain values 1e-6 either side of each of the 7 thresholds (and exactly on 0, which goes up):
    built in the rotated domain and rotated back, so the quantizer's rotation puts them there again. The
    margin is well above what the fp32 input and the float64 rotation move them (~1e-8), well below a step."""
    rng = np.random.default_rng(7)
    thresholds = NP_MIDPOINTS.astype(np.float64)
    groups, expected = [], []
    for trial in range(4):
        y = rng.choice(NP_CENTROIDS.astype(np.float64), 128)  # ordinary values elsewhere
        chosen = rng.choice(128, 14, replace=False)
        for n, slot in enumerate(chosen):
            y[slot] = thresholds[n // 2] + (1e-6 if n % 2 else -1e-6)
        scale = np.linalg.norm(y)
        groups.append(np_unrotate(y / scale) * 10.0 ** (trial - 2))  # unit norm, then scaled
        expected.append(np.searchsorted(thresholds, y / scale, side="right"))  # ties and above go up
    x = np.stack(groups).astype(np.float32)
    ours = quantize_tq3_0(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(ours, np_quantize_tq3_0(x))
    codes = [(block[2 + j // 4] >> (2 * (j % 4)) & 3) | ((block[10 + j // 8] >> (j % 8) & 1) << 2)
             for block in ours.reshape(-1, 14) for j in range(32)]
    np.testing.assert_array_equal(np.array(codes).reshape(4, 128), np.stack(expected))
    # Zero sits on the middle threshold: index 4 (+0.021460), as `val < 0` is false.
    assert quantize_tq3_0(torch.zeros(1, 128))[0, 2:10].tolist() == [0] * 8
    assert quantize_tq3_0(torch.zeros(1, 128))[0, 10:14].tolist() == [0xFF] * 4


def test_tq3_0_rotation_is_orthogonal_and_lucebox_s():
    x = torch.randn(3, 256, dtype=torch.float64)
    y = rotate_tq3(x)
    np.testing.assert_allclose(y.numpy(), np_rotate(x.numpy().reshape(-1, 128)).reshape(3, 256), atol=1e-12)
    torch.testing.assert_close(rotate_tq3(y, inverse=True), x, atol=1e-12, rtol=0)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_q4_0_matches_gguf_byte_for_byte():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((200, 4, 128)) * 10.0 ** rng.uniform(-2, 2, (200, 4, 1))).astype(np.float32)
    blocks = x.reshape(-1, 32)
    blocks[0] = 0  # scale 0
    blocks[1] = np.arange(32) - 16.0  # the extreme is negative: d > 0
    blocks[2] = -blocks[1]  # ... and positive, with ties between +16 and -16 (the first wins)
    blocks[3] = (np.arange(32) - 16) * 0.5  # x / d lands on halves: truncation after + 8.5
    ours = quantize_q4_0(torch.from_numpy(x))
    reference = quants.quantize(x, GGMLQuantizationType.Q4_0)
    assert ours.dtype == torch.uint8 and tuple(ours.shape) == reference.shape == (200, 4, 4 * 18)
    np.testing.assert_array_equal(ours.numpy(), reference)
    decoded = dequantize_q4_0(ours)
    np.testing.assert_array_equal(decoded.numpy(), quants.dequantize(reference, GGMLQuantizationType.Q4_0))
    weights = lucebox_quants.dequantize(ours.reshape(-1), GGMLQuantizationType.Q4_0, tuple(x.shape))
    assert torch.equal(decoded, weights)
    # Re-storing what was read back (speculative commit) gives the same bytes, but an all-zero block's scale,
    # -0 from ggml's `0 / -8`, which comes back +0: the same values.
    again = quantize_q4_0(decoded)
    assert torch.equal(dequantize_q4_0(again), decoded)
    differ = (again != ours).reshape(-1, 18).any(-1)
    assert differ.nonzero().flatten().tolist() == [0]


# -- error bounds ---------------------------------------------------------------------------------------

# Relative L2 error of a round trip over many N(0, 1) heads. TQ3_0: the rotated coordinates of a unit vector
# are ~N(0, 1/128), where the 8-level Lloyd-Max quantizer's distortion is 0.0345 of the variance, so
# sqrt(0.0345) = 0.186 (measured 0.185). Q4_0: a step of max|block| / 8, ~2.1 sigma / 8 for 32 normals,
# gives sqrt(step^2 / 12) ~ 0.08 (measured 0.086).
ROUND_TRIP_BOUND = {"q4_0": 0.1, "tq3_0": 0.2}


@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_error_on_random_heads(seed):
    generator = torch.Generator().manual_seed(seed)
    heads = torch.randn(256, 4, 256, generator=generator)
    scaled = heads * torch.exp(torch.randn(256, 4, 1, generator=generator))  # per-row scales: no effect
    for name, quantize, dequantize in (("q4_0", quantize_q4_0, dequantize_q4_0),
                                       ("tq3_0", quantize_tq3_0, dequantize_tq3_0)):
        for x in (heads, scaled):
            error = float((dequantize(quantize(x)) - x).norm() / x.norm())
            assert error <= ROUND_TRIP_BOUND[name], (name, error)
    # An outlier channel (a few dims 20x the rest, as real K caches have): TQ3_0's rotation spreads it
    # over the group, so its error stays where it was; Q4_0's block scale follows the outlier.
    outliers = heads.clone()
    outliers[..., 7] *= 20
    tq3 = float((dequantize_tq3_0(quantize_tq3_0(outliers)) - outliers).norm() / outliers.norm())
    q4 = float((dequantize_q4_0(quantize_q4_0(outliers)) - outliers).norm() / outliers.norm())
    assert tq3 <= ROUND_TRIP_BOUND["tq3_0"] and q4 > ROUND_TRIP_BOUND["q4_0"]


# Attention over a type pair against float attention on the same random inputs: the K error perturbs the
# scores and the V error the values, about independently, so their relative errors add in quadrature.
# Per type (measured alone on 256-dim heads: f16 2e-4, bf16 1.7e-3, q8_0 5.3e-3, q4_0 0.086, tq3_0 0.184).
ATTENTION_BOUND = {"f32": 0.0, "f16": 1e-3, "bf16": 5e-3, "q8_0": 1e-2, "q4_0": 0.1, "tq3_0": 0.2}
ALLOWED_PAIRS = [(k, v) for k, v in itertools.product(KV_CACHE_TYPES, repeat=2) if not (k == "tq3_0" and v == "f32")]


def _window(k_type: str, v_type: str, seed: int, rows: int = 64, heads: int = 2, dim: int = 256):
    generator = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(rows, heads, dim, generator=generator) for _ in range(2))
    q = torch.randn(1, 1, 4 * heads, dim, generator=generator)
    cache = FullKVCache({0: KVLayerShape(heads, dim, dim)}, rows, k_type=k_type, v_type=v_type)
    cache.append(0, k, v)
    return q, k, v, cache


@pytest.mark.parametrize(("k_type", "v_type"), ALLOWED_PAIRS)
def test_attention_over_each_pair_is_within_its_bound_of_float(k_type, v_type):
    bound = (ATTENTION_BOUND[k_type] ** 2 + ATTENTION_BOUND[v_type] ** 2) ** 0.5
    for seed in range(3):
        q, k, v, cache = _window(k_type, v_type, seed)
        keys, values = cache.gather(0, 64)
        assert stored_format(keys) == (k_type if KV_CACHE_TYPES[k_type] is None else None)
        got = REFERENCE.decode_attention(q, keys, values, torch.tensor([63]), scale=256**-0.5)
        expected = REFERENCE.attention(q, k[None], v[None], scale=256**-0.5)
        error = float((got - expected).norm() / expected.norm())
        assert error <= bound + 1e-6, (seed, error, bound)
        # The eager path (append's decoded rows, TQ3_0 rotated back) is the same attention.
        eager_k, eager_v = cache.read(0)
        eager = REFERENCE.attention(q, eager_k[None].float(), eager_v[None].float(), scale=256**-0.5)
        torch.testing.assert_close(eager, got, atol=1e-5, rtol=1e-4)


# -- the Triton kernels read the blocks in place ----------------------------------------------------------

KERNEL_PAIRS = [("q4_0", "q4_0"), ("tq3_0", "tq3_0"), ("tq3_0", "q8_0"), ("tq3_0", "bf16"), ("f16", "tq3_0"),
                ("q4_0", "tq3_0"), ("tq3_0", "q4_0"), ("q8_0", "q4_0")]


@pytest.fixture(scope="module")
def triton_attention():
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from lucebox_cuda import triton_attention

    if not isinstance(triton_attention._attention_kernel, InterpretedFunction):
        pytest.skip("lucebox_cuda.triton_attention was imported earlier without TRITON_INTERPRET=1")
    return triton_attention


@pytest.mark.parametrize(("k_type", "v_type"), KERNEL_PAIRS)
def test_decode_kernel_reads_the_blocks_as_the_reference_decodes_them(triton_attention, k_type, v_type):
    """Rows decoded in registers (TQ3_0 K scored against the forward-rotated query, a TQ3_0 V's output
    rotated back) against the reference on the decoded window: the same attention to float rounding."""
    q, _, _, cache = _window(k_type, v_type, seed=5, rows=48)
    keys, values = cache.gather(0, 48)
    position = torch.tensor([40])  # rows past it hold data the kernel must not see
    out = torch.full((1, 1, 8, 256), float("nan"))
    result = triton_attention.decode_attention(q, keys, values, position, scale=256**-0.5, out=out, block_n=16,
                                               blocks_per_split=2, narrow_splits=2)
    expected = REFERENCE.decode_attention(q, keys, values, position, scale=256**-0.5)
    assert result is out
    torch.testing.assert_close(result, expected, atol=2e-6, rtol=1e-5)


def test_tree_kernel_with_tq3_0_node_rows_over_a_ring(triton_attention):
    """Gemma-4's sliding layers: node rows apart from the cache, re-stored in its format by the kernel's
    wrapper, over a ring; TQ3_0 K and Q4_0 V."""
    from lucebox_core.speculative.trees import TreeIndex

    q, _, _, cache = _window("tq3_0", "q4_0", seed=6, rows=32, dim=128)
    keys, values = cache.gather(0, 32)
    parents = [-1, 0, 0, 1]
    visible = TreeIndex.build(parents).visibility()
    generator = torch.Generator().manual_seed(8)
    node_k, node_v = cache.as_stored(torch.randn(4, 2, 128, generator=generator),
                                     torch.randn(4, 2, 128, generator=generator))
    q = torch.randn(1, 4, 8, 128, generator=generator)
    position = torch.tensor([40])
    extra = {"node_k": node_k, "node_v": node_v, "ring": 32}
    result = triton_attention.tree_attention(q, keys, values, position, visible, scale=128**-0.5, block_n=16,
                                             blocks_per_split=2, narrow_splits=2, **extra)
    expected = REFERENCE.tree_attention(q, keys, values, position, visible, scale=128**-0.5, **extra)
    torch.testing.assert_close(result, expected, atol=2e-6, rtol=1e-5)


# -- the cache's rules ------------------------------------------------------------------------------------


def test_bytes_per_token_of_the_new_types():
    shape = KVLayerShape(4, 256, 256)  # Qwen3.5-27B's attention layers
    assert kv_bytes_per_token(shape, "q4_0", "q4_0") == 2 * 4 * 8 * 18  # 1152: 4.5 bits a value
    assert kv_bytes_per_token(shape, "tq3_0", "tq3_0") == 2 * 4 * 8 * 14  # 896: 3.5 bits a value
    assert kv_bytes_per_token(shape, "tq3_0", "q8_0") == 4 * 8 * 14 + 4 * 8 * 34
    cache = FullKVCache({3: shape}, max_context=10, k_type="tq3_0", v_type="q4_0")
    assert cache.nbytes == 10 * cache.bytes_per_token == 10 * (448 + 576)
    keys, values = cache.gather(3, 10)
    assert tuple(keys.shape) == (10, 4, 8, 14) and tuple(values.shape) == (10, 4, 8, 18)
    # Lucebox's figures for Qwen3.5-27B at 128K (its PR #21): KV 1792 MiB in TQ3_0, 2304 MiB in Q4_0.
    from lucebox_qwen35 import layout
    from lucebox_qwen35.memory import estimate_memory

    config = layout.size("27b")
    for kind, mib in (("tq3_0", 1792), ("q4_0", 2304)):
        assert estimate_memory(config, 131072, weight_bytes=0, cache_type_k=kind, cache_type_v=kind).kv == mib * 2**20


def test_tq3_0_k_with_f32_v_is_refused_with_the_allowed_pairs():
    with pytest.raises(LuceboxError) as refused:
        FullKVCache({0: KVLayerShape(1, 128, 128)}, 4, k_type="tq3_0", v_type="f32")
    assert str(refused.value) == (
        "-ctk tq3_0 with -ctv f32 is not a supported KV pair; allowed pairs: K in {f32, f16, bf16, q8_0, q4_0} "
        "with any V (f32, f16, bf16, q8_0, q4_0, tq3_0), or K tq3_0 with V in {f16, bf16, q4_0, q8_0, tq3_0}"
    )
    FullKVCache({0: KVLayerShape(1, 128, 128)}, 4, k_type="f32", v_type="tq3_0")  # the other way round is fine


def test_head_dims_that_do_not_fit_the_type_are_named():
    with pytest.raises(LuceboxError, match=r"-ctk/--cache-type-k tq3_0: quantizes rotation groups of 128 along "
                                           r"the head dim, but layer 5's K head dim is 96; .*q8_0 or q4_0"):
        FullKVCache({5: KVLayerShape(1, 96, 128)}, 4, k_type="tq3_0", v_type="tq3_0")
    with pytest.raises(LuceboxError, match=r"-ctv/--cache-type-v q4_0: quantizes blocks of 32.*layer 2's V head "
                                           r"dim is 40"):
        FullKVCache({2: KVLayerShape(1, 32, 40)}, 4, v_type="q4_0")


def test_tq3_0_rows_read_back_and_restore():
    """Reads are un-rotated floats; storing what was read stores the same bytes (what speculative commit
    does with verified rows) but where float rounding moves a value across a threshold."""
    cache = FullKVCache({0: KVLayerShape(2, 256, 256)}, 16, k_type="tq3_0", v_type="tq3_0")
    x = torch.from_numpy(_heads((8, 2, 256), 11))
    all_k, _ = cache.append(0, x, x)
    keys, _ = cache.gather(0, 8)
    assert torch.equal(decode_stored(keys, torch.float32), all_k)
    again = quantize_tq3_0(all_k).reshape(keys.shape)
    assert (again != keys).float().mean() < 1e-3


# -- a tiny model ------------------------------------------------------------------------------------------

MODEL_PAIRS = [("q4_0", "q4_0"), ("tq3_0", "tq3_0"), ("tq3_0", "q8_0"), ("f16", "tq3_0")]
STEPS = 8
# Largest |logit difference| from an f32 cache over the run, relative to the largest |logit|, per type; a
# pair's bound adds its two in quadrature, as for attention. Measured on this model, one role quantized and
# the other f32: K q4_0 0.050, V q4_0 0.084; K tq3_0 0.126, V tq3_0 0.158 (pairs: q4_0/q4_0 0.096, tq3_0/tq3_0
# 0.203, tq3_0/q8_0 0.128, f16/tq3_0 0.158). A random tiny model's attention is far from peaked, which makes
# these larger than on a trained one.
MODEL_BOUND = {"q4_0": 0.1, "tq3_0": 0.18, "q8_0": 0.01, "f16": 5e-3}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from lucebox_qwen35 import synth

    return synth.write(tmp_path_factory.mktemp("kvq") / "tiny-f32.gguf", size="tiny", type="f32", seed=17)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 248320, (9,), generator=torch.Generator().manual_seed(4))


def _decode(model, prompt, tokens):
    state = model.new_state(64)
    logits = [model.forward(state, prompt)[-1]]
    for token in tokens:
        logits.append(model.forward(state, torch.tensor([token]))[0])
    return torch.stack(logits), state


@pytest.fixture(scope="module")
def f32_run(tiny_path, prompt):
    from lucebox_qwen35.loader import load

    tokens = [int(t) for t in torch.randint(0, 248320, (STEPS,), generator=torch.Generator().manual_seed(5))]
    logits, _ = _decode(load(tiny_path, cache_type_k="f32", cache_type_v="f32"), prompt, tokens)
    return logits, tokens


@pytest.mark.slow
@pytest.mark.parametrize(("k_type", "v_type"), MODEL_PAIRS)
def test_tiny_model_decodes_with_the_new_types(tiny_path, prompt, f32_run, k_type, v_type):
    from lucebox_qwen35.loader import load

    reference, tokens = f32_run
    model = load(tiny_path, cache_type_k=k_type, cache_type_v=v_type)
    ours, state = _decode(model, prompt, tokens)
    assert (state.kv.k_type, state.kv.v_type) == (k_type, v_type)
    error = float((ours - reference).abs().max() / reference.abs().max())
    assert 0 < error <= (MODEL_BOUND[k_type] ** 2 + MODEL_BOUND[v_type] ** 2) ** 0.5, error
    # The static decode step (the attention op over the stored window) agrees with the dynamic forward.
    static = model.new_state(64)
    model.forward(static, prompt)
    model.decode_min_window = 8
    try:
        steps = [model.decode_step(static, token, graphs=False)[0] for token in tokens[:3]]
    finally:
        model.decode_min_window = 256
    torch.testing.assert_close(torch.cat([s.reshape(1, -1) for s in steps]), ours[1:4], atol=2e-3, rtol=1e-3)


@pytest.mark.slow
def test_speculative_verify_and_commit_with_tq3_0(tiny_path, prompt):
    from lucebox_qwen35.loader import load

    model = load(tiny_path, cache_type_k="tq3_0", cache_type_v="tq3_0")
    tree_state, plain_state = model.new_state(64), model.new_state(64)
    for state in (tree_state, plain_state):
        model.forward(state, prompt)
    tokens, parents, path = [100, 21, 11, 22, 12, 13], [-1, 0, 0, 1, 2, 4], [0, 2, 4, 5]
    verification = model.verify(tree_state, tokens, parents)
    model.commit(tree_state, verification, path)
    plain = torch.stack([model.forward(plain_state, torch.tensor([tokens[i]]))[0] for i in path])
    torch.testing.assert_close(verification.logits[path], plain, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(model.decode_step(tree_state, 7, graphs=False),
                               model.forward(plain_state, torch.tensor([7])), atol=2e-3, rtol=1e-3)


def test_load_refuses_a_pair_before_any_request(tiny_path):
    from lucebox_qwen35.loader import load

    with pytest.raises(LuceboxError, match=r"-ctk tq3_0 with -ctv f32 is not a supported KV pair; allowed pairs"):
        load(tiny_path, cache_type_k="tq3_0", cache_type_v="f32")


def _lucebox(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lucebox_core.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_generate_takes_the_new_cache_types(tiny_path):
    base = ["generate", "-m", str(tiny_path), "--prompt-ids", "1,2,3,4", "-n", "3", "--temp", "0", "--json",
            "--ignore-eos", "-c", "64"]
    result = _lucebox(*base, "-ctk", "tq3_0", "-ctv", "q4_0")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]) == 3
    bad = _lucebox(*base, "-ctk", "tq3_0", "-ctv", "f32")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "allowed pairs: K in {f32, f16, bf16, q8_0, q4_0} with any V" in bad.stderr
