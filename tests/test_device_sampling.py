"""The device sampler: the same penalties, kept sets and distribution as `Sampler`, from device state only.

`Sampler` (the host reference) builds penalties from a list of the history and draws with a generator;
`DeviceSampler` keeps a count per id over the penalty window (and a ring of the window's tokens) on the
device and draws with a counter-based hash, so the draw can end a recorded decode step. Checked here: the
adjusted logits equal `apply_penalties`' exactly over random logits and histories as the window slides
(sizes -1, 0, N), the filtered distribution equals `probabilities` exactly (ties included), the draws
follow it (chi-square), and a seed replays.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lucebox_core.device_sampling import (DeviceSampler, DrawShape, SamplerBuffers, adjusted_logits,
                                          filtered_logits, uniforms)
from lucebox_core.errors import LuceboxError
from lucebox_core.sampling import Sampler, SamplingParams

VOCAB = 40  # small, so histories repeat tokens often


def _logits(seed: int, n: int = VOCAB, *, ties: bool = False) -> torch.Tensor:
    logits = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    return torch.round(logits * 2) / 2 if ties else logits  # rounded to halves: many equal logits


def _suppressed(seed: int) -> torch.Tensor:
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:3]] = True
    return mask


@pytest.mark.parametrize("window", [-1, 0, 1, 7, 64])
def test_penalties_from_the_device_window_equal_the_host_history(window):
    """As tokens are drawn the window slides (a ring shorter, equal or longer than the history); at every
    step the adjusted logits equal `apply_penalties(suppress(...))` of the history bit for bit."""
    rng = random.Random(window)
    for case in range(6):
        params = SamplingParams(temperature=rng.choice([0.0, 0.9]), repeat_last_n=window,
                                repeat_penalty=rng.choice([1.0, 1.3, 0.7]), presence_penalty=rng.choice([0.0, 0.4]),
                                frequency_penalty=rng.choice([0.0, 0.25, -0.1]),
                                logit_bias=[(rng.randrange(VOCAB), rng.uniform(-5, 5)) for _ in range(case % 3)],
                                seed=case)
        suppressed = _suppressed(case) if case % 2 else None
        history = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 3, 20]))]
        host = Sampler(params, suppressed=suppressed)
        device = DeviceSampler(params, SamplerBuffers("cpu"), VOCAB, suppressed, history)
        for step in range(30):
            logits = _logits(1000 * case + step)
            expected = host.apply_penalties(host.suppress(logits.float()), history)
            assert torch.equal(adjusted_logits(device.shape, device.buffers, logits), expected), (case, step)
            history.append(int(device.sample(logits, history)))


def test_the_window_reloads_when_the_history_moved_without_it():
    """Tokens the device did not draw (accepted by speculative decoding) reach the window through a reload."""
    params = SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=4, frequency_penalty=0.5)
    history = [1, 2, 3]
    device = DeviceSampler(params, SamplerBuffers("cpu"), VOCAB, None, history)
    history += [int(device.sample(_logits(1), history)), 5, 5, 6]
    host = Sampler(params)
    device.sample(_logits(2), history)  # reloads from the longer history first
    device.load(history)
    assert torch.equal(adjusted_logits(device.shape, device.buffers, _logits(3)),
                       host.apply_penalties(_logits(3), history))


@pytest.mark.parametrize("ties", [False, True])
def test_filters_and_temperature_give_the_probabilities_of_the_host_sampler(ties):
    """top-k, top-p, min-p and temperature keep the same ids with the same probabilities as `probabilities`,
    bit for bit, with ties at the cuts (logits rounded to halves) falling the same way."""
    rng = random.Random(int(ties))
    for case in range(40):
        params = SamplingParams(temperature=rng.choice([0.3, 0.8, 1.0, 2.5]), top_k=rng.choice([0, 1, 5, 17, VOCAB]),
                                top_p=rng.choice([1.0, 0.95, 0.6, 0.2]), min_p=rng.choice([0.0, 0.05, 0.3]),
                                seed=case)
        logits = _logits(case, ties=ties)
        device = DeviceSampler(params, SamplerBuffers("cpu"), VOCAB)
        x = adjusted_logits(device.shape, device.buffers, logits)
        ours = torch.softmax(filtered_logits(device.shape, device.buffers, x), dim=-1)
        assert torch.equal(ours, Sampler(params).probabilities(logits)), (case, params)


def test_a_bias_outside_the_vocabulary_is_a_clear_error():
    with pytest.raises(LuceboxError, match="token 40, outside the vocabulary"):
        DeviceSampler(SamplingParams(logit_bias={40: 1.0}), SamplerBuffers("cpu"), VOCAB)


def test_a_top_k_of_the_whole_vocabulary_or_more_is_off():
    assert DrawShape.of(SamplingParams(top_k=VOCAB), VOCAB, False).top_k == 0
    assert DrawShape.of(SamplingParams(top_k=VOCAB + 5), VOCAB, False).top_k == 0
    assert DrawShape.of(SamplingParams(top_k=3), VOCAB, False).top_k == 3


def test_draws_follow_the_probabilities():
    """Pearson's chi-square of 12,000 draws against `Sampler.probabilities` over 8 ids (one dropped by each
    filter), far below the 0.01 % critical value; dropped ids are never drawn."""
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.97, min_p=0.02, seed=2024)
    logits = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -3.0])
    probs = Sampler(params).probabilities(logits)
    device = DeviceSampler(params, SamplerBuffers("cpu"), 8)
    draws = 12000
    counts = torch.bincount(torch.cat([device.sample(logits, ()) for _ in range(draws)]), minlength=8).double()
    kept = probs > 0
    assert 3 <= int(kept.sum()) < 8 and counts[~kept].sum() == 0
    expected = probs[kept].double() * draws
    chi_square = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi_square < 27.0, chi_square  # df <= 6: p = 1e-4 lies at 27.9


def test_uniforms_are_open_and_flat():
    seed = torch.tensor([123, 456])
    u = torch.cat([uniforms(seed, torch.tensor([c]), torch.arange(4096)) for c in range(8)])
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    histogram = torch.histc(u.float(), bins=16, min=0, max=1)
    assert float(histogram.min()) > 0.9 * len(u) / 16  # no bucket starved
    # Another draw counter, or another seed, gives other numbers.
    assert not torch.equal(uniforms(seed, torch.tensor([0]), torch.arange(64)),
                           uniforms(seed, torch.tensor([1]), torch.arange(64)))
    assert not torch.equal(uniforms(seed, torch.tensor([0]), torch.arange(64)),
                           uniforms(torch.tensor([124, 456]), torch.tensor([0]), torch.arange(64)))


def test_a_seed_replays_and_another_seed_differs():
    def run(seed):
        params = SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.2, seed=seed)
        device, history = DeviceSampler(params, SamplerBuffers("cpu"), VOCAB), []
        for step in range(60):
            history.append(int(device.sample(_logits(step), history)))
        return history

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_reusing_the_buffers_for_a_new_request_starts_afresh():
    """A sequence's buffers serve request after request: a new sampler resets the counter and the window."""
    params = SamplingParams(temperature=1.0, repeat_penalty=1.4, repeat_last_n=5, seed=3)
    buffers = SamplerBuffers("cpu")
    first = DeviceSampler(params, buffers, VOCAB, None, [1, 2])
    tokens = [int(first.sample(_logits(i), [1, 2] + [0] * i)) for i in range(5)]
    again = DeviceSampler(params, buffers, VOCAB, None, [1, 2])
    assert [int(again.sample(_logits(i), [1, 2] + [0] * i)) for i in range(5)] == tokens


class _HostValuesSpy(TorchDispatchMode):
    """Records the operations that turn a Python value into a tensor (`lift_fresh`) or copy one tensor into
    another wholesale (`copy_`): on CUDA either copies from the host, which a graph capture refuses."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.copy_.default):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, top_k=7, top_p=0.9, min_p=0.02, repeat_penalty=1.3, repeat_last_n=8,
                   presence_penalty=0.2, frequency_penalty=0.1, logit_bias={3: 2.0}, seed=5),
    SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=7),
    SamplingParams(temperature=0, repeat_penalty=1.6, repeat_last_n=-1),
])
def test_the_recorded_draw_copies_nothing_from_the_host(params):
    """What a recorded decode step ends with must be device work only: no host scalar becomes a tensor and
    nothing is copied wholesale (the GPU failure this guards: `t[0] = False` in top-p's filter made CUDA
    graph capture refuse the step, which then ran eagerly)."""
    sampler = DeviceSampler(params, SamplerBuffers("cpu"), VOCAB, _suppressed(1), [1, 2, 3, 2])
    draw = sampler.recorded()
    with _HostValuesSpy() as spy:
        for seed in range(3):
            draw(_logits(seed))
    assert spy.seen == []
