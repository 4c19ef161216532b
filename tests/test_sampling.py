"""The sampler and the stop-string matcher."""

import random

import pytest
import torch

from lucebox_core.errors import LuceboxError
from lucebox_core.sampling import Sampler, SamplingParams, StopMatcher


def _logits(seed=0, n=1000):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_temperature_zero_means_greedy():
    logits = _logits()
    sampler = Sampler(SamplingParams(temperature=0))
    assert sampler.sample(logits) == int(torch.argmax(logits))


def test_same_seed_same_tokens_different_seed_differs():
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    draws = lambda p: [Sampler(p).sample(_logits(i)) for i in range(50)]  # noqa: E731
    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=99))


def test_top_k_keeps_exactly_k():
    logits = _logits()
    probs = Sampler(SamplingParams(temperature=1.0, top_k=7, top_p=1.0, min_p=0.0, seed=0)).probabilities(logits)
    support = set(torch.nonzero(probs).flatten().tolist())
    assert support == set(torch.topk(logits, 7).indices.tolist())
    expected = torch.softmax(logits[torch.topk(logits, 7).indices], 0)
    torch.testing.assert_close(probs[torch.topk(logits, 7).indices], expected)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = _logits(3)
    p = 0.8
    probs = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=p, min_p=0.0, seed=0)).probabilities(logits)
    full = torch.softmax(logits, 0)
    order = torch.argsort(full, descending=True)
    cumulative = torch.cumsum(full[order], 0)
    n_keep = int((cumulative < p).sum()) + 1
    assert set(torch.nonzero(probs).flatten().tolist()) == set(order[:n_keep].tolist())


def test_min_p_drops_tokens_below_fraction_of_best():
    logits = _logits(5)
    probs = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1, seed=0)).probabilities(logits)
    full = torch.softmax(logits, 0)
    assert set(torch.nonzero(probs).flatten().tolist()) == set(torch.nonzero(full >= 0.1 * full.max()).flatten().tolist())


def test_temperature_sharpens():
    logits = _logits(7)
    base = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    cold = SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    torch.testing.assert_close(Sampler(cold).probabilities(logits), torch.softmax(logits / 0.5, 0))
    torch.testing.assert_close(Sampler(base).probabilities(logits), torch.softmax(logits, 0))


def test_penalties_follow_llama_cpp_formulas():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    history = [0, 1, 1]
    params = SamplingParams(temperature=0, repeat_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5)
    out = Sampler(params).apply_penalties(logits, history)
    # token 0: positive logit divided, seen once; token 1: negative logit multiplied, seen twice
    torch.testing.assert_close(out, torch.tensor([2.0 / 2 - 0.5 - 0.25, -2.0 * 2 - 1.0 - 0.25, 1.0, 0.5]))
    assert Sampler(params).sample(logits, history) == 2


def test_sampling_matches_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42))
    counts = torch.bincount(torch.tensor([sampler.sample(logits) for _ in range(4000)]), minlength=4).float()
    expected = torch.softmax(logits, 0) * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom


def test_bad_params_are_clear_errors():
    with pytest.raises(LuceboxError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(LuceboxError, match="temperature"):
        SamplingParams(temperature=-1)


def test_gguf_sampling_defaults_override_llama_cpp_defaults():
    params = SamplingParams.from_gguf_defaults({"general.sampling.temp": 0.6, "general.sampling.top_k": 20}, top_p=0.5)
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.6, 20, 0.5, 0.05)


@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_match_across_any_split(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab<|>\n é") for _ in range(60))
    stops = ["<|a", "\n\n", "bé"]
    cuts = sorted(rng.sample(range(1, len(text)), 15))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    matcher = StopMatcher(stops)
    shown = ""
    for piece in pieces:
        shown += matcher.push(piece)
        if matcher.stopped:
            break
    shown += matcher.flush()
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    assert shown == text[:first]
    assert matcher.stopped == (first < len(text))
