"""A split model's static steps recorded one graph per part (issue #19), under the graph contract emulated on
the CPU (`test_static_step.GraphStandIn`: recording runs nothing, a replay re-runs the recorded function into
the recording's output buffers, so a part that read anything but its own static buffers would replay stale
data). The parts are `cpu,cpu`: the very path of two GPUs (a recording per part, the hand-over copied into
the next part's static buffers between replays), held to the one-device eager run's greedy tokens, bit for
bit, at two split points, plain and speculative."""

from __future__ import annotations

import attrs
import pytest
import torch
from test_static_step import GraphStandIn

from lucebox_core.device_map import DeviceMap
from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.sampling import SamplingParams
from lucebox_core.split_step import SplitStaticStep
from lucebox_core.torch_backend import TorchBackend

# Longer than engine.STEPPED_PIECE_TOKENS: the prompt is one eager forward call (the eager hand-overs counted below).
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14]


def _load(target, backend, counts=None, part_backends=None):
    from lucebox_qwen35.loader import load

    if counts is None:
        model = load(target, backend)
    else:
        model = load(target, backend, device_map=DeviceMap.from_split(["cpu"] * len(counts), counts),
                     part_backends=part_backends or [backend] * len(counts))
    model.decode_min_window = 8  # windows change during the run: several recordings per part
    return model


TOKENS = 24


def _generate(model, draft=None, *, force_reference=None, max_tokens=TOKENS, again=True):
    from lucebox_core.assembly import load_drafter
    from lucebox_core.speculative import SpeculativeDecoder
    from lucebox_core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(model.source)
    speculative = None
    if draft is not None:
        speculative = SpeculativeDecoder(model, load_drafter(str(draft), model, model.ops), "ddtree", budget=6)
    engine = Engine(model, tokenizer, ctx_size=96, speculative=speculative)
    request = GenerationRequest(prompt_ids=PROMPT, max_tokens=max_tokens, sampling=SamplingParams(temperature=0),
                                ignore_eos=True)
    if force_reference is not None:  # every block accepts 3 tokens: verify passes at many windows and lengths
        request = attrs.evolve(request, force_accept=3, force_reference=force_reference)
    result = engine.generate(request)
    if again:  # on the released sequence: its recordings are replayed
        assert engine.generate(request).token_ids == result.token_ids
    (kept,) = engine._idle
    return result.token_ids, kept.state


@pytest.fixture(scope="module")
def eager_reference(tiny_target_and_draft):
    """The one-device eager run's greedy tokens (long enough for the speculative runs' forced reference)."""
    model = _load(tiny_target_and_draft[0], TorchBackend(kernel_table_for={}))
    tokens, _ = _generate(model, max_tokens=TOKENS + 16, again=False)
    return tokens


@pytest.mark.parametrize("counts", [(3, 5), (6, 2)])
def test_split_decode_step_recorded_per_part_matches_one_device(tiny_target_and_draft, eager_reference, counts,
                                                                 monkeypatch):
    import lucebox_qwen35.model as qwen35_model

    hand_overs = []
    real = qwen35_model.hand_over
    monkeypatch.setattr(qwen35_model, "hand_over", lambda t, d: hand_overs.append(d) or real(t, d))
    model = _load(tiny_target_and_draft[0], GraphStandIn(kernel_table_for={}), list(counts))
    assert model.step_mode() == "graph per part"
    tokens, state = _generate(model)
    assert tokens == eager_reference[:TOKENS]
    # Each part recorded each KV window once and replayed it; the hand-over between them went through the
    # parts' static buffers, not the eager hand-over (which only the two prompts' prefills took).
    assert isinstance(state.decode, SplitStaticStep) and state.decode.parts == 2
    assert state.decode.graphed_parts == [True, True]
    for step in state.decode.steps:
        assert len(step) >= 2 and sum(graph.replays for graph in step.recordings()) > TOKENS
    assert len(hand_overs) == 2 * 2
    second = state.decode.steps[1]
    hidden = next(buffer for (name, *_), buffer in second._buffers.items() if name == "hidden")
    assert hidden.abs().sum() > 0  # the second part's residual stream came in through its own buffer


@pytest.mark.slow
@pytest.mark.parametrize("counts", [(3, 5), (6, 2), (2, 3, 3)])
def test_split_verify_pass_recorded_per_part_matches_one_device(tiny_target_and_draft, eager_reference, counts):
    target, draft = tiny_target_and_draft
    model = _load(target, GraphStandIn(kernel_table_for={}), list(counts))
    tokens, state = _generate(model, draft, force_reference=eager_reference)
    assert tokens == eager_reference[:TOKENS]
    assert isinstance(state.verify, SplitStaticStep)
    for step in state.verify.steps:
        assert len(step) >= 2 and any(graph.replays for graph in step.recordings())
    # The drafter's taps of the first part reached the last part's buffers (the ring is filled from them),
    # through the middle part where there are three.
    taps = {name for name, *_ in state.verify.steps[-1]._buffers if name.startswith("tap.")}
    first_part = {f"tap.{i}" for i in state.capture_layers if i < counts[0]}
    assert first_part and first_part <= taps


@pytest.mark.slow
def test_a_part_that_fails_to_record_runs_eagerly_and_the_rest_replay(tiny_target_and_draft, eager_reference):
    first, second = GraphStandIn(kernel_table_for={}), GraphStandIn(kernel_table_for={})
    second.fail_recording = True  # the second part's device cannot record
    model = _load(tiny_target_and_draft[0], first, [4, 4], part_backends=[first, second])
    with pytest.warns(RuntimeWarning, match=r"graph capture of the decode step \(part 1\) failed"):
        tokens, state = _generate(model)
    assert tokens == eager_reference[:TOKENS]
    assert state.decode.graphed_parts == [True, False] and len(state.decode.steps[1]) == 0
    assert model.step_mode() == "graph per part, eager on part 1 (cpu)"  # what /props reports


def test_split_step_hands_over_to_every_later_part():
    """Three parts: what the first hands over reaches the third through its own buffer, even where the
    second hands on other values; each part's result comes back in order."""
    backend = GraphStandIn(kernel_table_for={})
    step = SplitStaticStep([backend] * 3, "test step")

    def part_step(part, inputs):
        if part == 0:
            return {"x": inputs.seed * 2, "early": inputs.seed + 100}, None
        if part == 1:
            return {"x": inputs.x + 1}, inputs.x.clone()
        return {}, inputs.x * inputs.early

    for seed in (1.0, 2.0, 3.0):
        inputs = [step.inputs(0, seed=torch.tensor([seed])), step.inputs(1), step.inputs(2)]
        results = step.run("key", part_step, inputs)
        assert results[0] is None and results[1].item() == seed * 2
        assert results[2].item() == (seed * 2 + 1) * (seed + 100)
    assert len(step) == 1 and all(graph.replays == 2 for graph in step.recordings())
