"""The speculation governor (--tree-budget auto): drafting only while it is faster than plain decoding.

The decision logic is driven with step costs chosen to put drafting behind or ahead of plain decoding;
the engine's path is driven through a tiny synthetic target and drafter, where every answer must equal
plain greedy decoding whatever the governor decided.
"""

from __future__ import annotations

import pytest
import torch

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.loading import load_model
from lucebox_core.sampling import SamplingParams
from lucebox_core.speculative import SpeculativeDecoder, dflash
from lucebox_core.speculative.governor import SpeculationGovernor

GREEDY = SamplingParams(temperature=0)


def _simulate(governor: SpeculationGovernor, steps: int, drafted_tokens, drafted_s: float, plain_s: float):
    """Run `steps` decisions with fixed costs; returns (tokens, seconds, drafted steps)."""
    tokens = seconds = 0.0
    drafted_steps = 0
    for i in range(steps):
        if governor.draft_next():
            made = drafted_tokens(i) if callable(drafted_tokens) else drafted_tokens
            governor.record(True, made, drafted_s)
            tokens, seconds, drafted_steps = tokens + made, seconds + drafted_s, drafted_steps + 1
        else:
            governor.record(False, 1, plain_s)
            tokens, seconds = tokens + 1, seconds + plain_s
    return tokens, seconds, drafted_steps


def test_a_drafter_that_accepts_nothing_costs_under_five_percent_of_plain_speed():
    # A drafted step costing 2.7 plain steps and yielding one token: the 27B's measured case.
    governor = SpeculationGovernor()
    tokens, seconds, drafted = _simulate(governor, 2000, 1, 0.0272, 0.0101)
    assert tokens / seconds >= 0.95 / 0.0101
    assert governor.mode == "plain" or governor.run > 0
    assert governor.run == governor.max_run  # the probes kept losing: the plain runs grew to the longest
    assert drafted < 20


def test_a_losing_probe_is_repaid_within_its_plain_run():
    """A drafted step 26.4 ms for one token against 8.9 ms plain (the 27B, session 31): the first plain run is
    already long enough that the probe's extra 17.5 ms is PROBE_OVERHEAD of it (~99 steps, not min_run's 16),
    and over the first 256 steps fewer probes run than with doubling from 16."""
    from lucebox_core.speculative import governor as module

    governor = SpeculationGovernor()
    _simulate(governor, 20, 1, 0.0264, 0.0089)
    expected = (0.0264 - 0.0089) / (module.PROBE_OVERHEAD * 0.0089)
    assert governor.fallbacks == 1 and expected - 1 <= governor.run <= expected + 1 and governor.run > governor.min_run
    governor = SpeculationGovernor()
    tokens, seconds, drafted = _simulate(governor, 256, 1, 0.0264, 0.0089)
    assert drafted <= 4 and tokens / seconds >= 0.9 / 0.0089
    described = governor.describe()  # what /props, /metrics and the bench show
    assert described["drafted_steps"] == drafted and described["probes"] == governor.fallbacks
    assert described["last_probe_ms"] == pytest.approx(26.4)


def test_a_drafter_that_loses_narrowly_keeps_short_plain_runs():
    """A drafted step that costs little more than the plain tokens it yields: runs of min_run, so a recovery is
    found soon."""
    governor = SpeculationGovernor()
    _simulate(governor, 40, 2, 0.0180, 0.0101)  # 111 tok/s drafting against 99 plain... then slightly behind:
    _simulate(governor, 60, 2, 0.0205, 0.0101)  # 97.6 against 99
    assert governor.fallbacks >= 1 and governor.run <= 2 * governor.min_run


def test_a_drafter_that_wins_keeps_drafting():
    governor = SpeculationGovernor()
    _simulate(governor, 300, 9, 0.0272, 0.0101)  # 9 tokens a step: 331 tok/s against 99
    assert governor.fallbacks == 0
    assert governor.plain_tokens == governor.measure_run  # one short run to measure plain decoding, no more
    assert governor.mode == "drafting"


def test_drafting_resumes_when_acceptance_recovers():
    governor = SpeculationGovernor()
    _simulate(governor, 400, 1, 0.0272, 0.0101)
    assert governor.fallbacks > 0
    # The text changes and the drafter now accepts 8 a step: the next probe wins and drafting goes on.
    tokens, seconds, drafted = _simulate(governor, 600, 9, 0.0272, 0.0101)
    assert governor.mode == "drafting" and governor.run == 0
    assert drafted > 200


def test_a_slow_outlier_step_is_not_a_measurement():
    governor = SpeculationGovernor()
    _simulate(governor, 40, 1, 0.0272, 0.0101)
    before, discarded = governor.drafted.step_seconds, governor.drafted.discarded
    assert governor.plain.discarded == 1  # the first plain step: a warm-up, never a measurement
    governor.record(True, 1, 0.5)  # e.g. a CUDA graph recorded on a new sequence state
    assert governor.drafted.step_seconds == pytest.approx(before)
    assert governor.drafted.discarded == discarded + 1


def test_plain_steps_are_measured_as_a_run():
    """Steps whose tokens were fed ahead split the time unevenly (a short step, then one that waits for the
    kernels of both): the run's rate is its tokens over its seconds, none of its steps left out."""
    governor = SpeculationGovernor()
    _simulate(governor, 8, 1, 0.0272, 0.0101)  # the measured start: plain steps known
    governor.plain_left = 40
    for step in range(40):  # nine steps of 1 ms, then one of 80 ms that waits for them: 8.9 ms a step
        assert not governor.draft_next()
        governor.record(False, 1, 0.080 if step % 10 == 9 else 0.001)
    governor.record(True, 1, 0.0272)  # the probe closes the run
    assert governor.plain.step_seconds == pytest.approx(0.0089, rel=0.15)
    assert governor.plain.tokens_per_s == pytest.approx(1 / 0.0089, rel=0.15)


# -- through the engine -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from lucebox_qwen35 import draft_synth, synth

    folder = tmp_path_factory.mktemp("governor")
    target = synth.write(folder / "target.gguf", size="tiny", type="f32", seed=3)
    draft = draft_synth.write(folder / "draft.gguf", size="tiny", type="f32", seed=4, target=target)
    torch.manual_seed(0)
    loaded = load_model(target)
    return loaded, dflash.load(draft, loaded.model)


@pytest.fixture(scope="module")
def engines(pair):
    """A plain engine and an auto-budget speculative one (its verify cost curve measured once)."""
    loaded, drafter = pair
    plain = Engine(loaded.model, loaded.tokenizer, ctx_size=256)
    speculative = SpeculativeDecoder(loaded.model, drafter, spec_type="ddtree", budget="auto")
    return plain, Engine(loaded.model, loaded.tokenizer, ctx_size=256, speculative=speculative)


def _fresh(engines):
    plain, spec = engines
    spec.speculative.governor = SpeculationGovernor()
    return plain, spec


def _greedy(engine, prompt, n, **fields):
    return engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=GREEDY, ignore_eos=True,
                                             **fields))


def test_auto_budget_has_a_governor_and_a_fixed_budget_has_none(pair):
    loaded, drafter = pair
    assert SpeculativeDecoder(loaded.model, drafter, spec_type="ddtree", budget="auto").governor is not None
    assert SpeculativeDecoder(loaded.model, drafter, spec_type="ddtree", budget=22).governor is None
    assert SpeculativeDecoder(loaded.model, drafter, spec_type="ddtree", budget=22, adaptive=True).governor is not None


@pytest.mark.parametrize("plain_run", [1, 9])
def test_a_governed_plain_run_equals_plain_greedy(engines, plain_run):
    """Plain steps decided by the governor (their tokens fed ahead inside the run), then drafting again:
    the answer is plain greedy decoding's, and every plain step is counted."""
    plain, spec = _fresh(engines)
    prompt = [151644, 872, 198, 3838, 374, 220]
    reference = _greedy(plain, prompt, 30).token_ids
    governor = spec.speculative.governor
    governor.plain_left = plain_run  # as after a losing drafted step
    result = _greedy(spec, prompt, 16, force_accept=3, force_reference=reference)
    assert result.token_ids == reference[:16]
    assert result.timings.governed_plain_tokens == governor.plain_tokens >= plain_run
    assert result.timings.accepted_lengths
    # Every token is the first (from the prompt's logits), a drafted step's, or a governed plain one; the
    # step that ends the answer returns before it is recorded.
    assert 1 + sum(result.timings.accepted_lengths) + result.timings.governed_plain_tokens >= 16 - 1


def test_a_drafter_that_accepts_nothing_falls_back_to_plain_decoding(engines):
    """The tiny random drafter accepts (almost) nothing, and a drafted step costs a drafter pass and a verify
    of a tree: the governor, measuring real steps, decodes most tokens plainly, losslessly."""
    plain, spec = _fresh(engines)
    prompt = [1, 2, 3, 4, 5]
    reference = _greedy(plain, prompt, 48).token_ids
    result = _greedy(spec, prompt, 48)
    assert result.token_ids == reference
    governor = spec.speculative.governor
    assert governor.fallbacks >= 1
    assert result.timings.governed_plain_tokens > 24
    assert spec.speculative.describe()["speculation"]["fallbacks"] == governor.fallbacks


def test_metrics_carry_the_governors_probes():
    """`/metrics` renders what `describe()` says, the probes and the last probe's milliseconds included."""
    from lucebox_core.server.metrics import ServerMetrics

    governor = SpeculationGovernor()
    _simulate(governor, 60, 1, 0.0264, 0.0089)
    metrics = ServerMetrics(lambda: 0.0, lambda: 0.0, speculation=governor.describe).render()
    values = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("lucebox_speculation_")}
    assert values["lucebox_speculation_drafting"] == 0.0 and values["lucebox_speculation_fallbacks"] >= 1
    assert values["lucebox_speculation_probes"] == governor.probes >= 1
    assert values["lucebox_speculation_last_probe_ms"] == pytest.approx(26.4)
