"""The static-shape decode step (what a CUDA graph records) equals the dynamic forward on the CPU.

The static step reads its token and position from device tensors, writes K/V at that position and attends
over a fixed window of the cache masked on the device, updates the Gated DeltaNet state in place and
leaves logits in a buffer: the same function as the one-token `forward`, checked here on a tiny synthetic
model in f32 (logits within 1e-5, greedy tokens identical), across KV window changes, and after a
speculative verify/commit.
"""

from __future__ import annotations

import pytest
import torch

from lucebox_core.static_step import graphs_enabled, kv_window
from lucebox_core.loading import load_model
from lucebox_core.torch_backend import TorchBackend
from lucebox_qwen35 import synth

STEPS = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("graph") / "tiny-f32.gguf"
    synth.write(path, size="tiny", type="f32", seed=21)
    return load_model(path).model


def _prompt(model, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_kv_window_rounds_up_within_a_quarter_octave():
    assert kv_window(1, 4096) == 256 and kv_window(256, 4096) == 256
    assert kv_window(257, 4096) == 320 and kv_window(8193, 65536) == 10240
    assert kv_window(5000, 4100) == 4100  # capped at the context
    for length in range(1, 70000, 97):
        window = kv_window(length, 1 << 20)
        assert length <= window <= max(256, length * 1.25 + 1)
    assert kv_window(9, 64, minimum=8) == 10


def test_graphs_only_on_cuda(monkeypatch):
    assert not graphs_enabled("cpu")
    assert graphs_enabled("cuda")
    monkeypatch.setenv("LUCEBOX_CUDA_GRAPHS", "0")
    assert not graphs_enabled("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_masked_attention(dtype):
    gen = torch.Generator().manual_seed(3)
    ops = TorchBackend()
    rows, kv_heads, group, head_dim = 40, 2, 3, 16
    q = torch.randn(1, 1, kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=gen).to(dtype)
    for position in (0, 17, rows - 1):
        ours = ops.decode_attention(q, k, v, torch.tensor([position]), scale=0.25)
        reference = ops.attention(q, k[None, : position + 1], v[None, : position + 1], scale=0.25)
        tolerance = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ours, reference, atol=tolerance, rtol=tolerance)
    # Rows past the position do not matter, whatever finite values they hold (the cache starts zeroed and
    # later holds rolled-back rows; a NaN would leak through 0 * NaN in the second product).
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[18:], poisoned_v[18:] = 1e4, -3e4
    torch.testing.assert_close(ops.decode_attention(q, poisoned_k, poisoned_v, torch.tensor([17]), scale=0.25),
                               ops.decode_attention(q, k, v, torch.tensor([17]), scale=0.25))


@pytest.mark.parametrize("min_window", [8])  # the window changes during the run (8, 10, 12, ..., 48)
def test_static_decode_equals_dynamic_forward(tiny, min_window):
    tiny.decode_min_window = min_window
    try:
        dynamic, static = tiny.new_state(128), tiny.new_state(128)
        prompt = _prompt(tiny, 7, seed=min_window)
        dyn_logits = tiny.forward(dynamic, prompt)[-1:]
        stat_logits = tiny.forward(static, prompt)[-1:]
        for _ in range(STEPS):
            torch.testing.assert_close(stat_logits, dyn_logits, atol=1e-5, rtol=1e-5)
            token = int(dyn_logits[-1].argmax())
            assert int(stat_logits[-1].argmax()) == token  # greedy tokens identical
            dyn_logits = tiny.forward(dynamic, torch.tensor([token]))
            stat_logits = tiny.decode_step(static, token, graphs=False)
        assert static.length == dynamic.length == 7 + STEPS and static.kv.length == dynamic.kv.length
        for layer, linear in static.linear.items():
            torch.testing.assert_close(linear.recurrent, dynamic.linear[layer].recurrent, atol=1e-5, rtol=1e-5)
    finally:
        tiny.decode_min_window = 256


def test_static_decode_after_verify_and_commit(tiny):
    """Speculative decoding moves the KV fill pointer back and rewrites the Gated DeltaNet state in place;
    the static step (whose buffers a graph holds) continues from there like the dynamic forward."""
    dynamic, static = tiny.new_state(128), tiny.new_state(128)
    prompt = _prompt(tiny, 9, seed=5)
    tiny.forward(dynamic, prompt)
    tiny.forward(static, prompt)
    conv_buffers = {layer: linear.conv for layer, linear in static.linear.items()}
    tiny.decode_step(static, 11, graphs=False)  # allocates the static inputs, then is rolled back below
    static.kv.rollback(9)
    static.length = 9
    for layer, linear in dynamic.linear.items():
        static.linear[layer].conv.copy_(linear.conv)
        static.linear[layer].recurrent.copy_(linear.recurrent)
    tokens, parents = [11, 12, 13, 14], [-1, 0, 1, 1]
    for state in (dynamic, static):
        verification = tiny.verify(state, tokens, parents)
        tiny.commit(state, verification, [0, 1, 3])
    assert all(static.linear[layer].conv is buffer for layer, buffer in conv_buffers.items())
    for token in (20, 21, 22):
        torch.testing.assert_close(tiny.decode_step(static, token, graphs=False),
                                   tiny.forward(dynamic, torch.tensor([token])), atol=1e-5, rtol=1e-5)


def test_static_decode_captures_the_drafters_features(tiny):
    """With feature capture on (a speculative sequence), the static step writes each position's features
    into the ring as the dynamic forward does, so plain steps of such a sequence stay on the decode step."""
    dynamic, static = tiny.new_state(64), tiny.new_state(64)
    layers = [0, len(tiny.layers) - 1]
    for state in (dynamic, static):
        tiny.enable_capture(state, layers, 16)  # a ring shorter than the sequence: slots wrap
        tiny.forward(state, _prompt(tiny, 13, seed=3))
    for token in (5, 6, 7, 8):
        torch.testing.assert_close(tiny.decode_step(static, token, graphs=False),
                                   tiny.forward(dynamic, torch.tensor([token])), atol=1e-5, rtol=1e-5)
    assert static.length == dynamic.length == 17
    torch.testing.assert_close(tiny.read_features(static, 2, 17), tiny.read_features(dynamic, 2, 17),
                               atol=1e-5, rtol=1e-5)


def test_forward_takes_the_static_step_when_graphs_are_on(tiny, monkeypatch):
    """With decode graphs switched on (as on CUDA) one-token `forward` calls go through `decode_step`; on
    the CPU no graph is recorded and the result is the dynamic one."""
    calls = []
    original = type(tiny).decode_step

    def counting(self, state, token, *, graphs=None):
        calls.append(token)
        return original(self, state, token, graphs=False)

    monkeypatch.setattr(type(tiny), "decode_step", counting)
    monkeypatch.setattr(tiny, "decode_graphs", True)
    graphed, plain = tiny.new_state(64), tiny.new_state(64)
    prompt = _prompt(tiny, 5, seed=9)
    tiny.forward(graphed, prompt)
    monkeypatch.setattr(tiny, "decode_graphs", False)
    tiny.forward(plain, prompt)
    for token in (3, 4):
        monkeypatch.setattr(tiny, "decode_graphs", True)
        ours = tiny.forward(graphed, torch.tensor([token]))
        monkeypatch.setattr(tiny, "decode_graphs", False)
        torch.testing.assert_close(ours, tiny.forward(plain, torch.tensor([token])), atol=1e-5, rtol=1e-5)
    assert len(calls) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_equals_eager_on_cuda(tmp_path):
    from lucebox_core.torch_backend import TorchBackend as Backend

    path = tmp_path / "tiny-f32.gguf"
    synth.write(path, size="tiny", type="f32", seed=21)
    from lucebox_qwen35.loader import load

    model = load(path, Backend("cuda"))
    graphed, eager = model.new_state(128), model.new_state(128)
    prompt = _prompt(model, 7, seed=1)
    a, b = model.forward(graphed, prompt)[-1:], model.forward(eager, prompt)[-1:]
    for _ in range(STEPS):
        token = int(b[-1].argmax())
        a = model.decode_step(graphed, token, graphs=True)
        b = model.decode_step(eager, token, graphs=False)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert graphed.decode is not None and len(graphed.decode) >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend_name", ["torch", "cuda"])
def test_engine_feeding_ahead_equals_token_by_token_greedy_on_cuda(tmp_path, backend_name):
    """The engine feeds each sampled token to the graph-replayed step before the host reads it (pinned copy,
    event): the tokens must be those of a plain host loop of forward + argmax."""
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams

    path = tmp_path / "tiny-f32.gguf"
    synth.write(path, size="tiny", type="f32", seed=22)
    loaded = load_model(path, backend=backend_name, device="cuda")
    model = loaded.model
    prompt = _prompt(model, 9, seed=2)
    engine = Engine(model, loaded.tokenizer, ctx_size=256)
    result = engine.generate(GenerationRequest(prompt_ids=prompt.tolist(), max_tokens=STEPS,
                                               sampling=SamplingParams(temperature=0), ignore_eos=True))
    state = model.new_state(256)
    logits = model.forward(state, prompt)[-1]
    # The engine never samples the vocabulary's padding placeholders; nor does this loop.
    unused = torch.tensor(loaded.tokenizer.unused_ids(), dtype=torch.long, device=logits.device)
    expected = []
    for _ in range(STEPS):
        expected.append(int(logits.index_fill(-1, unused, float("-inf")).argmax()))
        logits = model.forward(state, torch.tensor([expected[-1]]))[-1]
    assert result.token_ids == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend_name", ["torch", "cuda"])
def test_sampling_recorded_with_the_decode_step_on_cuda(tmp_path, backend_name):
    """Sampled decoding through the engine on CUDA: each plain step's graph ends with the draw (penalties
    from the device window, Gumbel-max from the hashed counter), so no logits reach the host. A seed replays
    (the second round replays the first round's graphs, on the recycled sequence), and the tokens equal a
    loop of eager static steps followed by eager device draws."""
    from lucebox_core.device_sampling import DeviceSampler, SamplerBuffers
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams

    path = tmp_path / "tiny-f32.gguf"
    synth.write(path, size="tiny", type="f32", seed=23)
    loaded = load_model(path, backend=backend_name, device="cuda")
    model = loaded.model
    prompt = _prompt(model, 9, seed=3).tolist()
    engine = Engine(model, loaded.tokenizer, ctx_size=256)
    settings = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repeat_penalty=1.3, repeat_last_n=8,
                       presence_penalty=0.2, logit_bias={3: 2.0}, seed=5),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.7, min_p=0.05, repeat_penalty=0.8, repeat_last_n=8,
                       frequency_penalty=0.3, logit_bias={4: -1.0}, seed=6),
        SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7),
        SamplingParams(temperature=0, repeat_penalty=1.6, repeat_last_n=-1),
    ]

    def generate(params):
        request = GenerationRequest(prompt_ids=prompt, max_tokens=STEPS, sampling=params, ignore_eos=True)
        return engine.generate(request).token_ids

    first = [generate(params) for params in settings]
    (kept,) = engine._idle
    assert kept.state.decode is not None and kept.state.decode.failure is None
    recorded = len(kept.state.decode)
    assert recorded >= 1 and all(isinstance(out, tuple) for _, out in kept.state.decode._recorded.values())
    assert [generate(params) for params in settings] == first
    assert len(kept.state.decode) == recorded  # the second round only replayed
    assert first[0] != first[1]

    suppressed = engine.suppressed.to("cuda") if engine.suppressed is not None else None
    for params, tokens in zip(settings, first):
        state = model.new_state(256)
        logits = model.forward(state, torch.tensor(prompt))[-1]
        sampler = DeviceSampler(params, SamplerBuffers("cuda"), logits.shape[-1], suppressed, prompt)
        history, expected = list(prompt), []
        for _ in range(STEPS):
            expected.append(int(sampler.sample(logits, history)))
            history.append(expected[-1])
            logits = model.decode_step(state, expected[-1], graphs=False)[-1]
        assert tokens == expected, params
