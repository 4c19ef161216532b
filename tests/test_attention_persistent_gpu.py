"""The persistent gated attention kernel (`lucebox_cuda.attention_persistent`) on a CUDA device (skipped without one):
against the kernels it replaces (the whole attention at several depths, then phase by phase), replayed in a graph at
moving positions, launched hundreds of times in a row, and in a loaded model's decode step."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

pytestmark = [
    pytest.mark.usefixtures("row_major_weights"),  # these kernels read GGUF's rows
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton runs interpreted in this process"),
]

# (hidden, query heads, KV heads): Qwen3.5-0.8B's full-attention layers, the 35B-A3B's, the 27B's.
SHAPES = [(1024, 8, 2), (2048, 16, 2), (5120, 24, 4)]
LAYER = 3
ROWS = 4096  # the cache's positions


@pytest.fixture
def ops():
    from lucebox_cuda.backend import CudaBackend
    from lucebox_qwen35.ops import QWEN35_OPS

    return QWEN35_OPS.bind(CudaBackend(dtype=torch.bfloat16))


def _attention(ops, hidden, heads, kv_heads, past, seed, v_type=T.Q6_K, norm_dtype=torch.bfloat16, fuse=True):
    """test_attention_persistent's random attention on the GPU with a loaded model's types (bf16 activations and
    cache), a cache of ROWS positions whose first `past` hold random rows, the input and the position `past`."""
    from test_attention_persistent import _attention as cpu_attention  # tests/ is on the path

    attention, _, x, _ = cpu_attention(ops, hidden, heads, kv_heads, v_type=v_type, past=0, seed=seed)
    attention.q_norm, attention.k_norm = (t.to("cuda", norm_dtype) for t in (attention.q_norm, attention.k_norm))
    if fuse:
        attention.fuse_projections()
    return attention, _cache(kv_heads, past, seed), x.to("cuda", torch.bfloat16), torch.tensor([past], device="cuda")


def _cache(kv_heads, past, seed):
    from lucebox_core.kv import FullKVCache, KVLayerShape

    kv = FullKVCache({LAYER: KVLayerShape(kv_heads, 256, 256)}, ROWS, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    if past:
        kv.write(LAYER, torch.arange(past, device="cuda"),
                 torch.randn(past, kv_heads, 256, device="cuda", generator=g).to(torch.bfloat16),
                 torch.randn(past, kv_heads, 256, device="cuda", generator=g).to(torch.bfloat16))
    return kv


def _both(ops, monkeypatch, attention, kv_heads, past, seed, x, position, window):
    """The op with the persistent kernel and with the unfused kernels, each on its own copy of the cache, inside a
    static step (where it is taken): [(out, the cache's keys, values)] for on, off."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import attention_persistent

    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(attention_persistent.ENV_SWITCH, switch)
        kv = _cache(kv_heads, past, seed)
        assert attention_persistent.refusal(x, attention, kv, position, window) is None
        with running_static_step(decode_only=True):
            assert attention_persistent.takes(ops, x, attention, kv, position, window) == (switch == "1")
            results.append((ops.gated_attention_decode_(x, attention, kv, position, window),
                            *kv.gather(LAYER, window)))
    return results


def _close(got, want, rtol=3e-2):
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("past", [0, 37, 700, 3000])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_persistent_attention_equals_the_unfused_kernels(shape, past, norm_dtype, ops, monkeypatch):
    attention, _, x, position = _attention(ops, *shape, past, 1, norm_dtype=norm_dtype)
    window = min(ROWS, (past // 256 + 1) * 256)
    (out, keys, values), (want, want_keys, want_values) = _both(ops, monkeypatch, attention, shape[2], past, 1, x,
                                                                position, window)
    assert torch.equal(keys[:past], want_keys[:past]) and torch.equal(values[:past], want_values[:past])
    assert torch.equal(keys[past + 1:], want_keys[past + 1:])  # nothing written past the token's row
    _close(keys[past], want_keys[past])  # normed and rotated: cos / sin are CUDA's
    _close(values[past], want_values[past])
    _close(out, want)
    assert (out == want).float().mean() > 0.2  # many outputs to the bit: a rounding apart, not another sum


@pytest.mark.parametrize("shape", SHAPES[::2])
def test_the_persistent_attention_with_the_input_add_and_norm(shape, ops, monkeypatch):
    """`add_rms_norm_gated_attention_`: the layer's input add + norm in the kernel's first phase; the sum to the bit
    (rounded as the Triton add), the output within a rounding of the unfused kernels'."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import attention_persistent

    attention, _, x, position = _attention(ops, *shape, 100, 8)
    g = torch.Generator(device="cuda").manual_seed(8)
    residual = (torch.randn(x.shape, device="cuda", generator=g) * 4).to(torch.bfloat16)
    norm = (torch.rand(shape[0], device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    assert attention_persistent.residual_refusal(x, residual, norm, attention) is None
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(attention_persistent.ENV_SWITCH, switch)
        kv = _cache(shape[2], 100, 8)
        with running_static_step(decode_only=True):
            assert attention_persistent.takes(ops, x, attention, kv, position, 256, residual, norm) == (switch == "1")
            results.append(ops.add_rms_norm_gated_attention_(x, residual, norm, 1e-6, attention, kv, position, 256))
    (out, summed), (want, want_summed) = results
    assert torch.equal(summed, want_summed)
    _close(out, want)


def test_the_persistent_attentions_phases_are_the_unfused_ops(ops, monkeypatch):
    """Phase by phase against the unfused ops fed the kernel's own intermediate rows: the products against the
    `linear` kernel's, then the gated attention (before the output product) against qk_norm_rope, decode_attention
    and sigmoid_mul on the kernel's products (near the bit: the sums' order and cos / sin differ)."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import attention_persistent

    heads, kv_heads, past = 8, 2, 300
    attention, _, x, position = _attention(ops, 1024, heads, kv_heads, past, 4, fuse=False)
    kv = _cache(kv_heads, past, 4)
    monkeypatch.setenv(attention_persistent.ENV_SWITCH, "1")
    trace = {}
    with running_static_step(decode_only=True):
        assert attention_persistent.takes(ops, x, attention, kv, position, 512)  # the counter, the frequencies
        attention_persistent.run(ops, x, attention, kv, position, 512, trace=trace)
    products = trace["products"]
    q_rows, kv_rows = heads * 512, kv_heads * 256
    for part, (start, rows) in {"q_proj": (0, q_rows), "k_proj": (q_rows, kv_rows),
                                "v_proj": (q_rows + kv_rows, kv_rows)}.items():
        _close(products[start:start + rows], ops.linear(x.reshape(1, -1), getattr(attention, part))[0])
    query_gate = products[:q_rows].reshape(1, 1, heads, 512)
    key = products[q_rows:q_rows + kv_rows].reshape(1, 1, kv_heads, 256)
    query, key = ops.qk_norm_rope(query_gate[..., :256], key, attention.q_norm, attention.k_norm, position,
                                  attention.rope_dim, attention.rope_theta, attention.eps)
    keys, values = kv.gather(LAYER, 512)  # the kernel stored the token's row: the unfused op reads it there
    _close(keys[past], key[0, 0])
    out = ops.decode_attention(query, keys, values, position, scale=256 ** -0.5)
    gated = ops.sigmoid_mul(out, query_gate[..., 256:])
    _close(trace["core"], gated.reshape(-1), rtol=2e-2)
    assert (trace["core"] == gated.reshape(-1)).float().mean() > 0.3


def test_the_persistent_attention_replays_in_a_graph_at_moving_positions(ops, monkeypatch):
    """Recorded once at a window of 1024 rows (its counter and frequencies made by an eager call before), replayed
    for a new input at a new position each time: each replay gives the eager launch's output and cache row to the
    bit."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import attention_persistent

    monkeypatch.setenv(attention_persistent.ENV_SWITCH, "1")
    attention, _, x, position = _attention(ops, 1024, 8, 2, 900, 2)
    recorded, eager_kv = _cache(2, 900, 2), _cache(2, 900, 2)
    static_x, static_position = x.clone(), position.clone()
    with running_static_step(decode_only=True):
        ops.gated_attention_decode_(static_x, attention, _cache(2, 900, 2), static_position, 1024)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.gated_attention_decode_(static_x, attention, recorded, static_position, 1024)
        for step, at in enumerate((0, 5, 63, 64, 511, 900, 1023)):
            fresh_x = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(step))
            static_x.copy_(fresh_x.to(torch.bfloat16))
            static_position.fill_(at)
            graph.replay()
            eager = ops.gated_attention_decode_(static_x.clone(), attention, eager_kv, static_position.clone(), 1024)
            assert torch.equal(out, eager), f"position {at}"
            assert torch.equal(recorded.gather(LAYER, 1024)[0][at], eager_kv.gather(LAYER, 1024)[0][at])


def test_hundreds_of_launches_in_a_row_give_one_answer(ops, monkeypatch):
    """200 launches back to back on one stream over one cache at one position (each rewrites the same row with the
    same values): a barrier that let a block read rows before they were all stored would give another output now
    and then."""
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import attention_persistent

    monkeypatch.setenv(attention_persistent.ENV_SWITCH, "1")
    attention, _, x, position = _attention(ops, 5120, 24, 4, 2000, 3)
    kv = _cache(4, 2000, 3)
    with running_static_step(decode_only=True):
        outs = [ops.gated_attention_decode_(x, attention, kv, position, 2048) for _ in range(201)]
    torch.cuda.synchronize()
    assert all(torch.equal(outs[0], out) for out in outs)


def test_a_loaded_models_decode_step_runs_the_persistent_attention(tmp_path, monkeypatch):
    """A small Qwen3.5 file with attention heads of 256 dims (the kernel's): with LUCEBOX_PERSISTENT_ATTENTION=1
    every full-attention layer in the recorded decode step is the persistent kernel with its input add + norm, and
    16 greedy steps give the tokens of the unfused kernels (the logits within a rounding: near-tie equal)."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_cuda import attention_persistent
    from lucebox_cuda.backend import CudaBackend
    from lucebox_qwen35 import layout, loader, synth
    from test_ffn_persistent_gpu import compare_switched_decode

    monkeypatch.setitem(layout.SIZES, "attn256", layout.Qwen35Config(
        n_layer=4, hidden=256, ffn=768, n_head=4, n_head_kv=1, head_dim=256,
        ssm_d_state=128, ssm_n_group=4, ssm_dt_rank=16, ssm_d_inner=2048, tied_output=True))
    path = synth.write(tmp_path / "attn256.gguf", size="attn256", type="q4_k_m", seed=6)
    model = loader.load(GGUFFile(path), CudaBackend(dtype=torch.bfloat16))
    calls = []
    run = attention_persistent.run
    monkeypatch.setattr(attention_persistent, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    compare_switched_decode(model, attention_persistent.ENV_SWITCH, calls, monkeypatch)
    assert len(calls) >= sum(not layer.is_linear for layer in model.layers)
