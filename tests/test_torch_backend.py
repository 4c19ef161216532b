"""Each reference op against an independent computation (numpy, torch.nn.functional, or a plain loop)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from lucebox_core.quants import QuantTensor
from lucebox_core.torch_backend import TorchBackend
from lucebox_qwen35.ops import QWEN35_OPS

backend = QWEN35_OPS.bind(TorchBackend())  # the torch reference with the qwen35 family's ops


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def q8_0_tensor(rows, cols, seed=0):
    """A real Q8_0 QuantTensor and gguf's own numpy dequantization of it."""
    values = rand(rows, cols, seed=seed).numpy()
    raw = gguf_quants.quantize(values, GGMLQuantizationType.Q8_0)
    reference = gguf_quants.dequantize(raw, GGMLQuantizationType.Q8_0)
    data = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8).copy())
    return QuantTensor("w", GGMLQuantizationType.Q8_0, (rows, cols), data), torch.from_numpy(reference.copy())


# -- weights ---------------------------------------------------------------------------------------------


def test_linear_dense_weight():
    x, w = rand(3, 5, 32, seed=1), rand(20, 32, seed=2)
    expected = np.einsum("abi,oi->abo", x.numpy().astype(np.float64), w.numpy().astype(np.float64))
    np.testing.assert_allclose(backend.linear(x, w).numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [None, 0])
def test_linear_quantized_weight(budget, monkeypatch):
    ops = TorchBackend(weight_cache_bytes=budget)
    if budget == 0:  # force the streaming path through several row blocks
        monkeypatch.setattr("lucebox_core.torch_backend.STREAM_BLOCK_BYTES", 7 * 64 * 4)
    weight, reference = q8_0_tensor(50, 64, seed=3)
    x = rand(4, 64, seed=4)
    expected = x.double().numpy() @ reference.double().numpy().T
    np.testing.assert_allclose(ops.linear(x, weight).numpy(), expected, rtol=1e-5, atol=1e-4)
    assert ops.cached_weight_bytes == (0 if budget == 0 else 50 * 64 * 4)


def test_weight_cache_keeps_within_budget():
    first, _ = q8_0_tensor(32, 64, seed=5)
    second, _ = q8_0_tensor(32, 64, seed=6)
    one_matrix = 32 * 64 * 4
    ops = TorchBackend(weight_cache_bytes=one_matrix + 100)
    x = rand(2, 64)
    a1 = ops.linear(x, first)
    assert ops.cached_weight_bytes == one_matrix
    b1 = ops.linear(x, second)  # does not fit: computed, not kept
    assert ops.cached_weight_bytes == one_matrix
    torch.testing.assert_close(ops.linear(x, first), a1)
    torch.testing.assert_close(ops.linear(x, second), b1)
    ops.clear_weight_cache()
    assert ops.cached_weight_bytes == 0


def test_embedding_quantized_and_dense():
    weight, reference = q8_0_tensor(40, 32, seed=7)
    ids = torch.tensor([[3, 39, 3], [0, 17, 5]])
    np.testing.assert_array_equal(backend.embedding(ids, weight).numpy(), reference.numpy()[ids.numpy()])
    dense = rand(40, 32, seed=8)
    np.testing.assert_array_equal(backend.embedding(ids, dense).numpy(), dense.numpy()[ids.numpy()])


# -- pointwise and norms ----------------------------------------------------------------------------------


def test_pointwise():
    x = rand(100, seed=9) * 5
    xs = x.double().numpy()
    np.testing.assert_allclose(backend.silu(x).numpy(), xs / (1 + np.exp(-xs)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(backend.sigmoid(x).numpy(), 1 / (1 + np.exp(-xs)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(backend.softplus(x).numpy(), np.log1p(np.exp(xs)), rtol=1e-5, atol=1e-6)


def test_rms_norm():
    x, w = rand(3, 7, 48, seed=10), rand(48, seed=11) + 1
    xs = x.double().numpy()
    expected = xs / np.sqrt((xs**2).mean(-1, keepdims=True) + 1e-6) * w.double().numpy()
    np.testing.assert_allclose(backend.rms_norm(x, w, 1e-6).numpy(), expected, rtol=1e-5, atol=1e-6)
    half = backend.rms_norm(x.half(), w, 1e-6)
    assert half.dtype == torch.float16


def test_l2norm():
    x = rand(4, 6, 32, seed=12)
    xs = x.double().numpy()
    expected = xs / np.sqrt((xs**2).sum(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(backend.l2norm(x).numpy(), expected, rtol=1e-5, atol=1e-6)


# -- RoPE -------------------------------------------------------------------------------------------------


def test_rope_neox_partial():
    batch, tokens, heads, head_dim, rot_dim, theta = 2, 5, 3, 24, 8, 10000.0
    x = rand(batch, tokens, heads, head_dim, seed=13)
    positions = torch.tensor([0, 1, 7, 100, 4096])
    got = backend.rope_neox(x, positions, rot_dim, theta).numpy()
    # As complex numbers: pair (i, i + rot_dim/2) is the complex x_i + i*x_{i+half}, multiplied by e^{i*angle}.
    xs, half = x.double().numpy(), rot_dim // 2
    expected = xs.copy()
    for t, pos in enumerate(positions.tolist()):
        for i in range(half):
            angle = pos * theta ** (-2 * i / rot_dim)
            z = (xs[:, t, :, i] + 1j * xs[:, t, :, i + half]) * np.exp(1j * angle)
            expected[:, t, :, i], expected[:, t, :, i + half] = z.real, z.imag
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[..., rot_dim:], xs[..., rot_dim:].astype(np.float32))


def test_rope_per_batch_positions():
    x = rand(2, 3, 2, 8, seed=14)
    positions = torch.tensor([[0, 1, 2], [10, 11, 12]])
    got = backend.rope_neox(x, positions, 8, 1e4)
    for b in range(2):
        torch.testing.assert_close(got[b : b + 1], backend.rope_neox(x[b : b + 1], positions[b], 8, 1e4))


# -- attention --------------------------------------------------------------------------------------------


def sdpa_reference(q, k, v, scale, mask):
    """torch's fused attention with repeated KV heads (head h reads KV head h // group)."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def test_attention_gqa_causal_with_offset():
    q, k, v = rand(2, 5, 6, 16, seed=15), rand(2, 12, 2, 16, seed=16), rand(2, 12, 2, 10, seed=17)
    offset = 7  # the 5 queries sit at positions 7..11 of 12 keys
    mask = torch.arange(12)[None, :] <= (torch.arange(5)[:, None] + offset)
    expected = sdpa_reference(q, k, v, 0.3, mask)
    got = backend.attention(q, k, v, scale=0.3, causal_offset=offset)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_attention_explicit_mask_and_no_mask():
    q, k, v = rand(1, 4, 4, 8, seed=18), rand(1, 6, 4, 8, seed=19), rand(1, 6, 4, 8, seed=20)
    mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(21)) > 0.4
    mask[:, 0] = True  # every query sees at least one key
    torch.testing.assert_close(
        backend.attention(q, k, v, scale=1 / math.sqrt(8), mask=mask),
        sdpa_reference(q, k, v, 1 / math.sqrt(8), mask), atol=1e-5, rtol=1e-5,
    )
    torch.testing.assert_close(
        backend.attention(q, k, v, scale=0.5), sdpa_reference(q, k, v, 0.5, None), atol=1e-5, rtol=1e-5
    )


# -- causal conv1d ----------------------------------------------------------------------------------------


def test_causal_conv1d_matches_grouped_conv():
    batch, tokens, channels, kernel = 2, 9, 12, 4
    x, weight, state = rand(batch, tokens, channels, seed=22), rand(channels, kernel, seed=23), rand(batch, kernel - 1, channels, seed=24)
    # Independent: torch's grouped conv1d over [state, x] with no padding, channels first.
    window = torch.cat([state, x], dim=1).transpose(1, 2)
    expected = F.conv1d(window, weight[:, None, :], groups=channels).transpose(1, 2)
    y, new_state = backend.causal_conv1d(x, weight, state)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, x[:, -(kernel - 1):])


def test_causal_conv1d_short_input_and_step():
    batch, channels, kernel = 1, 6, 4
    x, weight, state = rand(batch, 5, channels, seed=25), rand(channels, kernel, seed=26), rand(batch, kernel - 1, channels, seed=27)
    whole, whole_state = backend.causal_conv1d(x, weight, state)
    # Token by token through the one-token update, and in pieces shorter than the kernel.
    s, outs = state, []
    for t in range(5):
        y, s = backend.causal_conv1d_step(x[:, t], weight, s)
        outs.append(y)
    torch.testing.assert_close(torch.stack(outs, dim=1), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s, whole_state)
    first, mid = backend.causal_conv1d(x[:, :2], weight, state)
    assert mid.shape == state.shape
    second, end = backend.causal_conv1d(x[:, 2:], weight, mid)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(end, whole_state)


# -- the full KV policy (what attention reads back) ------------------------------------------------------


def test_full_kv_cache_append_rollback_overflow():
    from lucebox_core.errors import LuceboxError
    from lucebox_core.kv import FullKVCache, KVLayerShape

    cache = FullKVCache({3: KVLayerShape(2, 8, 6), 7: KVLayerShape(1, 4, 4)}, max_context=10)
    k1, v1 = rand(4, 2, 8, seed=30), rand(4, 2, 6, seed=31)
    k_all, v_all = cache.append(3, k1, v1)
    torch.testing.assert_close(k_all, k1)
    cache.append(7, rand(4, 1, 4), rand(4, 1, 4))
    assert cache.length == 4
    k2, v2 = rand(3, 2, 8, seed=32), rand(3, 2, 6, seed=33)
    k_all, v_all = cache.append(3, k2, v2)
    torch.testing.assert_close(k_all, torch.cat([k1, k2]))
    torch.testing.assert_close(v_all, torch.cat([v1, v2]))
    cache.rollback(2)
    assert cache.length == 2
    k_all, _ = cache.append(3, k2, v2)
    torch.testing.assert_close(k_all, torch.cat([k1[:2], k2]))
    cache.rollback(5)
    cache.ensure_room(5)
    with pytest.raises(LuceboxError, match="context overflow"):
        cache.ensure_room(6)
    with pytest.raises(LuceboxError, match="context size 10"):
        cache.append(3, rand(6, 2, 8), rand(6, 2, 6))
    with pytest.raises(ValueError, match="do not match"):
        cache.append(7, rand(1, 2, 4), rand(1, 2, 4))


def test_full_kv_cache_stores_in_its_dtype():
    from lucebox_core.kv import FullKVCache, KVLayerShape

    cache = FullKVCache({0: KVLayerShape(1, 4, 4)}, max_context=4, dtype=torch.float16)
    k, v = cache.append(0, rand(2, 1, 4), rand(2, 1, 4))
    assert k.dtype == v.dtype == torch.float16 and cache.nbytes == 2 * 4 * 4 * 2
