"""Recorded prefill pieces (`static_step.run_prefill_piece`, qwen35's `prefill.py`): a piece padded to a bucket
length, its start and real token count read from device buffers, recorded once per (bucket, KV window).

On the CPU the graph contract is emulated (`test_static_step.GraphStandIn`: a replay re-runs the step over the
static buffers only), so a step that read the start or the count from the host would replay the recording's
values here, as on a GPU. The reference is the eager forward call of the same tokens on the plain torch backend.
"""

from __future__ import annotations

import pytest
import torch

from lucebox_core import static_step
from lucebox_core.static_step import MAX_RECORDED_PIECE, MIN_RECORDED_PIECE, prefill_bucket
from lucebox_core.torch_backend import TorchBackend
from test_static_step import GraphStandIn

CONTEXT = 256


def _models(target, **options):
    from lucebox_qwen35.loader import load

    eager = load(target, TorchBackend(kernel_table_for={}), **options)
    recorded = load(target, GraphStandIn(kernel_table_for={}), **options)
    return eager, recorded


# The products run over a piece's rows eagerly and over its bucket's recorded: a CPU BLAS may block (and round)
# them differently by row count and by thread count, so f32 results agree to rounding, not to the bit.
CLOSE = {"rtol": 1e-3, "atol": 1e-4}


def _assert_states_match(model, eager_state, recorded_state):
    assert recorded_state.length == eager_state.length == recorded_state.kv.length
    for index, linear in eager_state.linear.items():
        other = recorded_state.linear[index]
        torch.testing.assert_close(other.conv, linear.conv, **CLOSE)
        torch.testing.assert_close(other.recurrent, linear.recurrent, **CLOSE)
    for layer in model.layers:
        if layer.self_attn is not None:
            for mine, theirs in zip(recorded_state.kv.read(layer.index), eager_state.kv.read(layer.index)):
                torch.testing.assert_close(mine, theirs, **CLOSE)


def test_prefill_buckets_pad_at_most_a_quarter():
    assert [prefill_bucket(n) for n in (8, 16, 17, 37, 64, 65, 300, 512, 513)] == [16, 16, 20, 40, 64, 80, 320, 512,
                                                                                  640]
    for n in range(MIN_RECORDED_PIECE, MAX_RECORDED_PIECE + 1):
        bucket = prefill_bucket(n)
        assert n <= bucket and (bucket <= 16 or (bucket - n) * 4 < bucket)


def test_recorded_pieces_give_the_eager_forward_logits_and_state(tiny_target_and_draft):
    """Pieces of several buckets at several depths (8, 13 and 15 share bucket 16: the later two replay the first's
    recording with other starts and counts): the last token's logits, the Gated DeltaNet states, the KV rows
    and the greedy tokens after them are those of eager forward calls of the same pieces."""
    target, _ = tiny_target_and_draft
    eager, recorded = _models(target)
    assert recorded.recorded_prefill and not eager.recorded_prefill
    eager_state, recorded_state = eager.new_state(CONTEXT), recorded.new_state(CONTEXT)
    ids = torch.randint(0, recorded.vocab_size, (160,), generator=torch.Generator().manual_seed(3))
    begin = 0
    for piece in (37, 8, 64, 13, 15):
        chunk = ids[begin:begin + piece]
        expected = eager.forward(eager_state, chunk, last_only=True)
        got = recorded.forward(recorded_state, chunk, last_only=True)
        assert got.shape == expected.shape == (1, recorded.vocab_size)
        torch.testing.assert_close(got, expected, **CLOSE)
        begin += piece
    _assert_states_match(recorded, eager_state, recorded_state)
    runner = recorded_state.prefill
    assert sorted(key[0][0] for key in runner._recorded) == [16, 40, 64]  # one recording a bucket (one window)
    assert sum(graph.replays for graph in runner.recordings()) == 2  # the 13- and 15-token pieces
    # Decoding goes on from the same state.
    generated = []
    for model, state in ((eager, eager_state), (recorded, recorded_state)):
        token, tokens = int(ids[begin]), []
        for _ in range(6):
            token = int(model.forward(state, torch.tensor([token]))[-1].argmax())
            tokens.append(token)
        generated.append(tokens)
    assert generated[1] == generated[0]


def test_a_released_state_replays_its_recorded_pieces(tiny_target_and_draft):
    """The engine's released sequences keep their recordings: a second prompt of another length in the same
    bucket is one replay, and generates what the eager engine generates."""
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams
    from lucebox_core.tokenizer import Tokenizer

    target, _ = tiny_target_and_draft
    eager, recorded = _models(target)
    tokenizer = Tokenizer.from_gguf(target)
    engines = [Engine(model, tokenizer, ctx_size=CONTEXT, prefill_chunk=64) for model in (eager, recorded)]
    for length in (50, 53):  # both in bucket 56 (49 .. 56)
        prompt = [(7 * i + length) % 200 + 3 for i in range(length)]
        request = GenerationRequest(prompt_ids=prompt, max_tokens=8, sampling=SamplingParams(temperature=0),
                                    ignore_eos=True)
        tokens = [engine.generate(request).token_ids for engine in engines]
        assert tokens[1] == tokens[0]
    (kept,) = engines[1]._idle
    assert len(kept.state.prefill) == 1 and sum(g.replays for g in kept.state.prefill.recordings()) == 1


def test_a_drafters_feature_ring_is_filled_as_by_eager_pieces(tiny_target_and_draft):
    """A speculative sequence's pieces are recorded too: the drafter's features of their positions land in the
    ring (a padding token's slot untouched), so drafting, verification and the accepted lengths are those of
    eager pieces."""
    from lucebox_core.assembly import load_drafter
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams
    from lucebox_core.speculative import SpeculativeDecoder
    from lucebox_core.tokenizer import Tokenizer

    target, draft = tiny_target_and_draft
    tokenizer = Tokenizer.from_gguf(target)
    prompt = [(5 * i) % 300 + 3 for i in range(100)]  # pieces of 44, 44 (bucket 48) and 12 (bucket 16)
    outcomes, rings = [], []
    for model in _models(target):
        drafter = load_drafter(str(draft), model, model.ops)
        engine = Engine(model, tokenizer, ctx_size=CONTEXT, prefill_chunk=44,
                        speculative=SpeculativeDecoder(model, drafter, "ddtree", budget=6))
        sequence = engine.new_sequence()
        engine.prefill(sequence, prompt)
        rings.append(sequence.state.features.clone())
        if model.recorded_prefill:
            assert {key[0][:2] for key in sequence.state.prefill._recorded} == {(48, 256), (16, 256)}
        engine.release(sequence)
        request = GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=SamplingParams(temperature=0),
                                    ignore_eos=True)
        result = engine.generate(request)
        outcomes.append((result.token_ids, result.timings.accepted_lengths))
    torch.testing.assert_close(rings[1], rings[0], **CLOSE)
    assert outcomes[1] == outcomes[0]


def test_pieces_that_keep_the_eager_forward(tiny_target_and_draft, monkeypatch):
    """A piece too short or too long, one whose padding would pass the context, a quantized KV cache, a drafter's
    feature ring of fewer rows than the padded piece and the switch off all keep the eager forward call."""
    from lucebox_qwen35 import prefill

    target, _ = tiny_target_and_draft
    _, recorded = _models(target)
    state = recorded.new_state(CONTEXT)
    assert prefill.takes(recorded, state, MIN_RECORDED_PIECE)
    assert prefill.takes(recorded, state, MAX_RECORDED_PIECE // 4)
    assert not prefill.takes(recorded, state, MIN_RECORDED_PIECE - 1)
    assert not prefill.takes(recorded, recorded.new_state(4096), MAX_RECORDED_PIECE + 1)
    state.length = CONTEXT - 22
    state.kv.commit(state.length)
    assert prefill.takes(recorded, state, 20) and not prefill.takes(recorded, state, 21)  # bucket 24 > 22 left
    fresh = recorded.new_state(CONTEXT)
    fresh.features = torch.zeros(4, 8)
    assert not prefill.takes(recorded, fresh, 32)
    assert static_step.prefill_mode(recorded).startswith("recorded pieces of 8-1024 tokens")
    monkeypatch.setenv(static_step.PREFILL_SWITCH, "0")
    assert not prefill.takes(recorded, recorded.new_state(CONTEXT), 32)
    assert static_step.prefill_mode(recorded) == "eager"
    monkeypatch.delenv(static_step.PREFILL_SWITCH)
    _, quantized = _models(target, cache_type_k="q8_0", cache_type_v="q8_0")
    assert not prefill.takes(quantized, quantized.new_state(CONTEXT), 32)
    calls = []
    monkeypatch.setattr(prefill, "prefill_piece", lambda *args: calls.append(args))
    quantized.forward(quantized.new_state(CONTEXT), torch.arange(3, 35), last_only=True)
    recorded.forward(recorded.new_state(CONTEXT), torch.arange(3, 35))  # every position's logits: eager
    assert calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("backend_name", "type_"), [("torch", "f32"), ("cuda", "f32"), ("cuda", "q4_k_m")])
def test_recorded_pieces_on_cuda_equal_eager_pieces(tmp_path, backend_name, type_):
    """On the GPU, with real graphs: pieces of three buckets at three depths (a replay among them) give the eager
    pieces' last logits, drafter features and greedy continuation, and their recording did not fail."""
    from lucebox_core.loading import load_model
    from lucebox_qwen35 import synth

    path = synth.write(tmp_path / f"tiny-{type_}.gguf", size="tiny", type=type_, seed=23)
    model = load_model(path, backend=backend_name, device="cuda").model
    assert model.recorded_prefill
    states = [model.new_state(CONTEXT), model.new_state(CONTEXT)]
    for state in states:
        model.enable_capture(state, (1, 5), CONTEXT)
    ids = torch.randint(0, model.vocab_size, (200,), generator=torch.Generator().manual_seed(5))
    begin = 0
    for piece in (64, 37, 40, 13):
        chunk = ids[begin:begin + piece].to("cuda")
        logits = []
        for recorded, state in zip((False, True), states):
            model.recorded_prefill = recorded
            logits.append(model.forward(state, chunk, last_only=True).float())
        model.recorded_prefill = True
        torch.testing.assert_close(logits[1], logits[0], rtol=2e-3, atol=2e-3)
        begin += piece
    runner = states[1].prefill
    assert runner.failure is None and len(runner) == 3
    torch.testing.assert_close(states[1].features.float(), states[0].features.float(), rtol=2e-3, atol=2e-3)
    generated = []
    for state in states:
        token, tokens = int(ids[begin]), []
        for _ in range(8):
            token = int(model.forward(state, torch.tensor([token], device="cuda"))[-1].argmax())
            tokens.append(token)
        generated.append(tokens)
    assert generated[1] == generated[0]
