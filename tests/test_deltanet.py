"""Gated DeltaNet: chunked vs recurrent form, and both against transformers' pure-torch reference."""

import pytest
import torch

from lucebox_core.torch_backend import TorchBackend
from lucebox_qwen35.ops import QWEN35_OPS

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

backend = QWEN35_OPS.bind(TorchBackend())  # the torch reference with the qwen35 family's ops


def random_inputs(seed, *, batch=2, tokens=37, key_heads=2, value_heads=6, key_dim=16, value_dim=12, with_state=True):
    gen = torch.Generator().manual_seed(seed)
    q = backend.l2norm(torch.randn(batch, tokens, key_heads, key_dim, generator=gen))
    k = backend.l2norm(torch.randn(batch, tokens, key_heads, key_dim, generator=gen))
    v = torch.randn(batch, tokens, value_heads, value_dim, generator=gen)
    # Realistic ranges: decays from ~0 to strong (g = -exp(A_log) * softplus(...)), beta in (0, 1).
    g = -torch.rand(batch, tokens, value_heads, generator=gen) * 2.0
    beta = torch.rand(batch, tokens, value_heads, generator=gen)
    state = torch.randn(batch, value_heads, key_dim, value_dim, generator=gen) if with_state else None
    return q, k, v, g, beta, state


def grouped_to_tiled(key_heads, value_heads):
    """Index list p with tiled[:, i] = grouped[:, p[i]]: tiled head j*H_k + h is grouped head h*r + j."""
    repeats = value_heads // key_heads
    return [h * repeats + j for j in range(repeats) for h in range(key_heads)]


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
@pytest.mark.parametrize("with_state", [True, False])
def test_chunked_matches_recurrent(chunk_size, with_state):
    q, k, v, g, beta, state = random_inputs(chunk_size, with_state=with_state)
    out_rec, state_rec = backend.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    out_chunk, state_chunk = backend.gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert out_rec.shape == v.shape and state_rec.dtype == torch.float32
    torch.testing.assert_close(out_chunk, out_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state_chunk, state_rec, atol=1e-5, rtol=1e-5)


def test_state_carries_across_calls():
    """Two halves with the state handed over equal one pass over the whole sequence."""
    q, k, v, g, beta, state = random_inputs(3, tokens=50)
    whole, whole_state = backend.gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=16)
    first, mid_state = backend.gated_delta_rule_chunked(q[:, :21], k[:, :21], v[:, :21], g[:, :21], beta[:, :21], state, chunk_size=16)
    second, end_state = backend.gated_delta_rule_recurrent(q[:, 21:], k[:, 21:], v[:, 21:], g[:, 21:], beta[:, 21:], mid_state)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end_state, whole_state, atol=1e-5, rtol=1e-5)


def test_the_state_matters():
    """A carried-in state changes the output (guards against a test that would pass with state ignored)."""
    q, k, v, g, beta, state = random_inputs(4)
    with_state, _ = backend.gated_delta_rule_chunked(q, k, v, g, beta, state)
    without, _ = backend.gated_delta_rule_chunked(q, k, v, g, beta, None)
    assert (with_state - without).abs().max() > 1e-2


@pytest.mark.parametrize("key_heads,value_heads", [(3, 3), (2, 6)])
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_matches_transformers(key_heads, value_heads, form):
    q, k, v, g, beta, state = random_inputs(11, key_heads=key_heads, value_heads=value_heads, tokens=45)
    # transformers maps value heads to key heads in consecutive groups; ours is tiled (the GGUF order).
    order = grouped_to_tiled(key_heads, value_heads)
    if form == "chunked":
        ref_out, ref_state = qwen3_5.torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, chunk_size=64, initial_state=state, output_final_state=True
        )
        out, new_state = backend.gated_delta_rule_chunked(
            q, k, v[:, :, order], g[:, :, order], beta[:, :, order], state[:, order], chunk_size=16
        )
    else:
        ref_out, ref_state = qwen3_5.torch_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True
        )
        out, new_state = backend.gated_delta_rule_recurrent(
            q, k, v[:, :, order], g[:, :, order], beta[:, :, order], state[:, order]
        )
    torch.testing.assert_close(out, ref_out[:, :, order], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, ref_state[:, order], atol=1e-5, rtol=1e-5)


def test_scale_is_applied_to_queries():
    q, k, v, g, beta, state = random_inputs(5)
    out_default, _ = backend.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    out_explicit, _ = backend.gated_delta_rule_recurrent(q * 2, k, v, g, beta, state, scale=q.shape[-1] ** -0.5 / 2)
    torch.testing.assert_close(out_explicit, out_default, atol=1e-6, rtol=1e-5)
