"""The Qwen3.5 megakernel (`lucebox_cuda.megakernel`: a decode step's whole decoder stack in one launch) on a CUDA
device (skipped without one): a loaded model's recorded decode steps against the recorded step of ~11 kernels a
layer, launch after launch alike, and the layouts it refuses."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.usefixtures("row_major_weights"),  # one layout for the runs with the switch on and off
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton runs interpreted in this process"),
]


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A small Qwen3.5 file of the kernel's shapes (16 value heads of 128 dims, 256-dim attention heads), 8 layers (6
    linear, 2 attention) of a Q4_K_M mix, loaded with the megakernel's switch on (so its weights stay row-major but
    the head)."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_cuda.backend import CudaBackend
    from lucebox_qwen35 import layout, loader, synth

    monkeypatch.setenv("LUCEBOX_MEGAKERNEL", "1")
    monkeypatch.setitem(layout.SIZES, "mega8", layout.Qwen35Config(
        n_layer=8, hidden=256, ffn=768, n_head=4, n_head_kv=1, head_dim=256,
        ssm_d_state=128, ssm_n_group=4, ssm_dt_rank=16, ssm_d_inner=2048, tied_output=True))
    path = synth.write(tmp_path / "mega8.gguf", size="mega8", type="q4_k_m", seed=7)
    return loader.load(GGUFFile(path), CudaBackend(dtype=torch.bfloat16))


def _generate(model, monkeypatch, switch, tokens=None, steps=16):
    """`steps` recorded decode steps after a 5-token prompt: greedy, or feeding `tokens`; (logits, tokens fed, the
    sequence's state)."""
    from lucebox_cuda import megakernel

    monkeypatch.setenv(megakernel.ENV_SWITCH, switch)
    prompt = torch.randint(0, 200, (5,), generator=torch.Generator().manual_seed(1)).cuda()
    state = model.new_state(64)
    logits = model.forward(state, prompt)[-1:]
    out, fed = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns
        for step in range(steps):
            token = logits.argmax(-1).reshape(1) if tokens is None else tokens[step]
            fed.append(token)
            logits = model.decode_step(state, token)
            out.append(logits.clone())
    torch.cuda.synchronize()
    assert state.decode is not None and state.decode.failure is None and state.decode._recorded
    return out, fed, state


def _has_table(model, state) -> bool:
    """Whether the megakernel made `state`'s table (its `takes` accepted a step of it); kept while the state lives."""
    return any(key[0] == id(state) for key in model.ops.backend.__dict__.get("_megakernel_tables", {}))


def test_the_megakernel_runs_every_decode_step_and_agrees_with_the_recorded_step(model, monkeypatch):
    """With the switch on, the recorded decode steps take the megakernel (its table made at the warm-up: `takes`
    accepted), and 16 greedy steps give the tokens of the unfused step wherever they are not a near tie, the logits
    within a rounding."""
    plain, tokens, state = _generate(model, monkeypatch, "0")
    assert not _has_table(model, state)
    switched, _, state = _generate(model, monkeypatch, "1", tokens)
    assert _has_table(model, state)
    for step, (a, b) in enumerate(zip(plain, switched)):
        top = a.float().topk(2, dim=-1).values[0]
        if top[0] - top[1] > 0.05:  # not a near tie: the same token
            assert a.argmax() == b.argmax(), f"step {step}"
        torch.testing.assert_close(b.float(), a.float(), rtol=5e-2, atol=5e-2)


def test_the_megakernel_gives_one_answer_run_after_run(model, monkeypatch):
    """Two sequences fed the same tokens through the megakernel give the same logits to the bit: a barrier that let a
    block read a row before it was stored, or a stale line of another layer's output, would differ now and then. With
    the L2 prefetch a layer ahead (off by default): it asks for lines, never changes what is read."""
    monkeypatch.setenv("LUCEBOX_MEGAKERNEL_PREFETCH", "1")
    first, tokens, state = _generate(model, monkeypatch, "1", steps=24)
    assert _has_table(model, state)
    second, _, _ = _generate(model, monkeypatch, "1", tokens, steps=24)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_the_megakernel_refuses_what_its_pieces_refuse(model):
    """`refusal` names the layer and the reason: a window past the attention kernel's, activations of fp32."""
    from lucebox_cuda import megakernel

    state = model.new_state(64)
    x = torch.zeros(1, 1, model.embed_tokens.shape[1], dtype=torch.bfloat16, device="cuda")
    position = torch.zeros(1, dtype=torch.int64, device="cuda")
    assert megakernel.refusal(model, state, x, position, 64) is None
    assert "window 100000" in megakernel.refusal(model, state, x, position, 100000)
    assert "layer 0" in megakernel.refusal(model, state, x.float(), position, 64)


def test_weights_tiled_before_the_switch_keep_the_recorded_step(model, monkeypatch):
    """Weights first used with the switch off are held tiled (the Q6_K ones): with it on after, the megakernel refuses
    the model (no table made) and the step runs its own kernels, no error."""
    monkeypatch.setenv("LUCEBOX_TILED_WEIGHTS", "1")
    plain, tokens, _ = _generate(model, monkeypatch, "0", steps=4)
    switched, _, state = _generate(model, monkeypatch, "1", tokens, steps=4)
    assert not _has_table(model, state)
    assert all(torch.equal(a, b) for a, b in zip(plain, switched))
