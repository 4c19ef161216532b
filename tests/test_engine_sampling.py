"""Sampling through the engine's plain decode loop, which draws on the device (`device_sampling`).

On a tiny synthetic qwen35 model: a seed replays the same tokens and another seed gives others; greedy
decoding with penalties and biases gives exactly the tokens of the host reference (a loop of forward and
`Sampler.sample`, which builds the penalties from a host list of the history); a sequence continued over
calls draws as a fresh one over the same history would.
"""

from __future__ import annotations

import pytest

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.sampling import Sampler, SamplingParams

PROMPT = [7, 8, 9, 10, 11, 7, 8]


@pytest.fixture(scope="module")
def engine(tiny_target_and_draft):
    from lucebox_core.loading import load_model

    target, _ = tiny_target_and_draft
    loaded = load_model(target)
    return Engine(loaded.model, loaded.tokenizer, ctx_size=128)


def _generate(engine: Engine, params: SamplingParams, max_tokens: int = 12) -> list[int]:
    request = GenerationRequest(prompt_ids=PROMPT, max_tokens=max_tokens, sampling=params, ignore_eos=True)
    return engine.generate(request).token_ids


def _host_reference(engine: Engine, params: SamplingParams, max_tokens: int) -> list[int]:
    """What the engine drew before sampling moved to the device: forward, then `Sampler.sample` with the
    history as a host list."""
    import torch

    model = engine.model
    sampler = Sampler(params, suppressed=engine.suppressed)
    state = model.new_state(128)
    logits = model.forward(state, torch.tensor(PROMPT))[-1]
    history, tokens = list(PROMPT), []
    for _ in range(max_tokens):
        token = sampler.sample(logits, history)
        tokens.append(token)
        history.append(token)
        logits = model.forward(state, torch.tensor([token]))[-1]
    return tokens


def test_a_seed_replays_through_the_engine_and_another_differs(engine):
    params = SamplingParams(temperature=1.1, top_k=30, top_p=0.95, min_p=0.02, repeat_penalty=1.2, seed=11)
    tokens = _generate(engine, params)
    assert len(tokens) == 12 and _generate(engine, params) == tokens
    import attrs

    assert _generate(engine, attrs.evolve(params, seed=12)) != tokens


def test_greedy_with_penalties_equals_the_host_samplers_tokens(engine):
    """Windows of the whole history and of a few tokens (the ring wraps); without the penalties the answer
    differs, so the test would see them missing."""
    answers = []
    for window in (-1, 3):
        params = SamplingParams(temperature=0, repeat_penalty=1.8, repeat_last_n=window, presence_penalty=0.6,
                                frequency_penalty=0.3, logit_bias={5: 0.5, 6: -2.0})
        answers.append(_generate(engine, params))
        assert answers[-1] == _host_reference(engine, params, 12)
    assert _generate(engine, SamplingParams(temperature=0, logit_bias={5: 0.5, 6: -2.0})) not in answers


def test_a_continued_sequence_draws_as_a_fresh_one_over_the_same_history(engine):
    """The second call's sampler loads its window from the whole history (the first answer included)."""
    params = SamplingParams(temperature=0, repeat_penalty=1.8, repeat_last_n=9, frequency_penalty=0.4)
    sequence = engine.new_sequence()
    first = [s.token_id for s in engine.stream(sequence, GenerationRequest(
        prompt_ids=PROMPT, max_tokens=6, sampling=params, ignore_eos=True))]
    second = [s.token_id for s in engine.stream(sequence, GenerationRequest(
        prompt_ids=[], max_tokens=6, sampling=params, ignore_eos=True))]
    assert first + second == _host_reference(engine, params, 12)
