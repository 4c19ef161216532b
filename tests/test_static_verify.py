"""The static-shape verify pass (what a CUDA graph records for speculative decoding) against the dynamic
one on the CPU: same logits for every node, and after committing a path, the same state (decoding on
from both gives the same logits). The static pass writes the nodes' K/V into the cache in insertion
order and `commit` compacts the accepted path, so this also checks that nothing of a rejected branch
leaks into later steps."""

from __future__ import annotations

import pytest
import torch

from lucebox_core.loading import load_model
from lucebox_qwen35 import synth

TREES = {
    "chain": ([-1, 0, 1, 2, 3], [[0, 1, 2, 3, 4], [0, 1]]),
    "tree": ([-1, 0, 0, 1, 3, 2, 2, 4], [[0, 2, 6], [0, 1, 3, 4, 7], [0]]),
}


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("static-verify") / f"tiny-{request.param}.gguf"
    synth.write(path, size="tiny", type=request.param, seed=13)
    return load_model(path, backend="torch", device="cpu").model  # the CPU reference, also where a GPU is


@pytest.fixture(scope="module")
def target_and_draft(tiny_target_and_draft):
    """The session's tiny f32 target, loaded once for the engine tests here (each routes its verify to the
    static pass through `monkeypatch`, for that test only), and the path of its drafter."""
    target, draft = tiny_target_and_draft
    return load_model(target, backend="torch", device="cpu"), draft


def static_verify(model, monkeypatch) -> None:
    """The model's verify pass is the static one (as on a GPU, without the recording) for this test."""
    import functools

    monkeypatch.setattr(model, "verify", functools.partial(type(model).verify, model, static=True, graphs=False))


@pytest.mark.parametrize("name", sorted(TREES))
def test_static_verify_equals_dynamic(tiny, name):
    parents, paths = TREES[name]
    gen = torch.Generator().manual_seed(len(parents))
    prompt = torch.randint(0, tiny.vocab_size, (37,), generator=gen)
    tokens = torch.randint(0, tiny.vocab_size, (len(parents),), generator=gen)
    for path in paths:
        dynamic, static = tiny.new_state(128), tiny.new_state(128)
        tiny.forward(dynamic, prompt)
        tiny.forward(static, prompt)
        v_dynamic = tiny.verify(dynamic, tokens, parents, static=False)
        v_static = tiny.verify(static, tokens, parents, static=True, graphs=False)
        torch.testing.assert_close(v_static.logits, v_dynamic.logits, atol=1e-5, rtol=1e-5)
        tiny.commit(dynamic, v_dynamic, path)
        tiny.commit(static, v_static, path)
        assert static.length == dynamic.length == len(prompt) + len(path)
        # Decode on from both: the compacted cache and the recurrent state must match plain decoding's.
        token = int(v_dynamic.logits[path[-1]].argmax())
        for _ in range(3):
            expected = tiny.forward(dynamic, torch.tensor([token]))
            got = tiny.forward(static, torch.tensor([token]))
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            token = int(expected[-1].argmax())


def test_static_verify_then_a_longer_commit(tiny):
    """Committing a prefix of the path and then the whole path (the engine stops inside a block only
    when a stop string ends it, but commit allows it) leaves the whole path committed."""
    parents, _ = TREES["tree"]
    gen = torch.Generator().manual_seed(99)
    prompt = torch.randint(0, tiny.vocab_size, (20,), generator=gen)
    tokens = torch.randint(0, tiny.vocab_size, (len(parents),), generator=gen)
    dynamic, static = tiny.new_state(64), tiny.new_state(64)
    tiny.forward(dynamic, prompt)
    tiny.forward(static, prompt)
    v = tiny.verify(static, tokens, parents, static=True, graphs=False)
    tiny.commit(static, v, [0, 1])
    tiny.commit(static, v, [0, 1, 3, 4])
    tiny.forward(dynamic, tokens[[0, 1, 3, 4]])
    probe = torch.tensor([int(tokens[7])])
    torch.testing.assert_close(tiny.forward(static, probe), tiny.forward(dynamic, probe), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
def test_forced_speculative_decoding_through_the_static_pass(target_and_draft, spec_type, monkeypatch):
    """The whole speculative loop on the static verify pass (as on a GPU, without the recording): forced
    acceptance holds and the output equals plain greedy decoding, for a short and a full block."""
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams
    from lucebox_core.speculative import dflash
    from lucebox_core.speculative.loop import SpeculativeDecoder

    loaded, draft = target_and_draft
    model = loaded.model
    static_verify(model, monkeypatch)
    greedy = SamplingParams(temperature=0)
    plain = Engine(model, loaded.tokenizer, ctx_size=256)
    speculative = Engine(model, loaded.tokenizer, ctx_size=256,
                         speculative=SpeculativeDecoder(model, dflash.load(draft, model), spec_type=spec_type))
    prompt = [9000, 17, 42]
    reference = plain.generate(GenerationRequest(prompt_ids=prompt, max_tokens=40, sampling=greedy,
                                                 ignore_eos=True)).token_ids
    for accept in (3, 15):
        n = 2 * (accept + 1) + 1
        result = speculative.generate(GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=greedy,
                                                        ignore_eos=True, force_accept=accept,
                                                        force_reference=reference))
        assert result.token_ids == reference[:n]
        assert result.timings.accepted_lengths[:2] == [accept + 1] * 2


def test_static_commit_of_a_branch_prefix_then_the_whole_branch(tiny):
    """A static commit moves rows that held other nodes: committing a prefix of a branch and then the
    whole branch must move only the new part (a second full move would read the moved-over rows)."""
    parents = [-1, 0, 0, 2, 3]
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, tiny.vocab_size, (17,), generator=gen)
    tokens = torch.randint(0, tiny.vocab_size, (len(parents),), generator=gen)
    static, plain = tiny.new_state(64), tiny.new_state(64)
    tiny.forward(static, prompt)
    tiny.forward(plain, prompt)
    v = tiny.verify(static, tokens, parents, static=True, graphs=False)
    tiny.commit(static, v, [0, 2, 3])
    tiny.commit(static, v, [0, 2, 3])  # the same path again: nothing moves twice
    tiny.commit(static, v, [0, 2, 3, 4])
    with pytest.raises(ValueError, match="already committed"):
        tiny.commit(static, v, [0, 1])
    tiny.forward(plain, tokens[[0, 2, 3, 4]])
    probe = torch.tensor([int(tokens[1])])
    torch.testing.assert_close(tiny.forward(static, probe), tiny.forward(plain, probe), atol=1e-5, rtol=1e-5)


def test_speculative_decoding_runs_to_the_end_of_the_context(target_and_draft, monkeypatch):
    """A DDTree of budget + 1 nodes needs more rows than a block: near the end of the context the engine
    finishes plainly instead of overflowing (the static pass writes every node's row)."""
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams
    from lucebox_core.speculative import dflash
    from lucebox_core.speculative.loop import SpeculativeDecoder

    loaded, draft = target_and_draft
    model = loaded.model
    static_verify(model, monkeypatch)
    decoder = SpeculativeDecoder(model, dflash.load(draft, model), spec_type="ddtree", budget=22)
    assert decoder.max_nodes == 23
    engine = Engine(model, loaded.tokenizer, ctx_size=64, speculative=decoder)
    plain = Engine(model, loaded.tokenizer, ctx_size=64)
    request = GenerationRequest(prompt_ids=list(range(100, 140)), max_tokens=24,
                                sampling=SamplingParams(temperature=0), ignore_eos=True)
    assert engine.generate(request).token_ids == plain.generate(request).token_ids


@pytest.mark.parametrize("spec_type", [None, "chain", "ddtree"])
def test_a_released_sequence_is_reused_and_decodes_as_a_fresh_one(target_and_draft, spec_type, monkeypatch):
    """The engine empties and reuses a finished request's state (so its recorded graphs are replayed, not
    made again): requests of different lengths in turn give exactly what a fresh state gives each."""
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams
    from lucebox_core.speculative import dflash
    from lucebox_core.speculative.loop import SpeculativeDecoder

    loaded, draft = target_and_draft
    model = loaded.model
    static_verify(model, monkeypatch)

    def engine(idle: int) -> Engine:
        speculative = None
        if spec_type is not None:
            speculative = SpeculativeDecoder(model, dflash.load(draft, model), spec_type=spec_type)
        return Engine(model, loaded.tokenizer, ctx_size=200, speculative=speculative, idle_sequences=idle)

    # A long request, a short one in the state it leaves (positions 0-69 written), then one whose prompt and
    # decode (to position 44) lie inside what the first left: a random drafter's step accepts about one
    # token, so each decoded token is a draft and a verify pass, and a few per request suffice.
    greedy = SamplingParams(temperature=0)
    requests = [GenerationRequest(prompt_ids=list(range(100, 100 + n)), max_tokens=m, sampling=greedy,
                                  ignore_eos=True) for n, m in ((60, 10), (5, 6), (33, 12))]
    pooled, fresh = engine(1), engine(0)
    assert [pooled.generate(r).token_ids for r in requests] == [fresh.generate(r).token_ids for r in requests]
    sequence = pooled.new_sequence()
    state = sequence.state
    pooled.release(sequence)
    again = pooled.new_sequence()
    assert again.state is state and again.state.length == 0 and not again.tokens
    assert fresh.new_sequence().state is not fresh.new_sequence().state


def test_released_sequences_are_pooled_by_state_and_never_while_streaming(target_and_draft):
    """An open stream still commits into its state when closed, so releasing its sequence pools nothing;
    releasing an old wrapper of a recycled state again does not put that state in the pool twice."""
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.errors import LuceboxError
    from lucebox_core.sampling import SamplingParams

    loaded, _ = target_and_draft
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=64, idle_sequences=2)
    request = GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=4, sampling=SamplingParams(temperature=0),
                                ignore_eos=True)
    sequence = engine.new_sequence()
    steps = engine.stream(sequence, request)
    next(steps)
    with pytest.raises(LuceboxError, match="being generated on already"):
        next(engine.stream(sequence, request))
    engine.release(sequence)
    assert engine.new_sequence().state is not sequence.state  # not pooled: the stream is open
    steps.close()
    engine.release(sequence)
    recycled = engine.new_sequence()
    assert recycled.state is sequence.state
    engine.release(recycled)
    engine.release(sequence)  # the old wrapper of the same state
    first, second = engine.new_sequence(), engine.new_sequence()
    assert first.state is sequence.state and second.state is not sequence.state



def _commit_rounds(recorded, plain, tolerance: float) -> None:
    """Five verify-and-commit rounds on `recorded` (graphs on), each path decoded by `plain` on a state of its
    own; after each, a probe token's logits and the feature ring (shorter than the sequence) agree. Round 1
    warms the verify pass up (its commit eager); from round 2 the pass replays and commits are recorded: length
    3 (round 2), 5, then 3 again from another start (a replay of round 2's), then 1."""
    parents, _ = TREES["tree"]
    gen = torch.Generator().manual_seed(23)
    mine, theirs = recorded.new_state(160), plain.new_state(160)
    layers = (0, len(recorded.layers) - 1)
    recorded.enable_capture(mine, layers, 12)
    plain.enable_capture(theirs, layers, 12)
    device = recorded.ops.device
    prompt = torch.randint(0, recorded.vocab_size, (19,), generator=gen)
    recorded.forward(mine, prompt.to(device))
    plain.forward(theirs, prompt.to(plain.ops.device))
    close = {"atol": tolerance, "rtol": tolerance}
    for path in ([0, 2, 6], [0, 1, 3], [0, 1, 3, 4, 7], [0, 2, 5], [0]):
        tokens = torch.randint(0, recorded.vocab_size, (len(parents),), generator=gen)
        verification = recorded.verify(mine, tokens, parents)
        recorded.commit(mine, verification, path)
        plain.forward(theirs, tokens[path].to(plain.ops.device))
        assert mine.length == theirs.length
        probe = torch.randint(0, recorded.vocab_size, (1,), generator=gen)
        torch.testing.assert_close(recorded.forward(mine, probe.to(device)).cpu(),
                                   plain.forward(theirs, probe.to(plain.ops.device)).cpu(), **close)
        torch.testing.assert_close(recorded.read_features(mine, mine.length - 12, mine.length).cpu(),
                                   plain.read_features(theirs, theirs.length - 12, theirs.length).cpu(), **close)
    commits = [(key, graph) for key, (graph, _) in mine.verify._recorded.items() if key[0][0] == "commit"]
    assert sorted(key[0][2] for key, _ in commits) == [1, 3, 5]
    if hasattr(commits[0][1], "replays"):  # the stand-in counts its replays
        assert [graph.replays for key, graph in commits if key[0][2] == 3] == [1]


def test_a_replayed_verification_commits_through_a_recording_of_its_own(tiny_target_and_draft):
    """On emulated graphs (`test_static_step.GraphStandIn`: a replay re-runs the step over the static buffers only),
    a replayed static verification's commit is recorded per (verify recording, path length) and replayed with other
    paths and starts: each commit leaves the KV rows, the Gated DeltaNet states and the drafter's feature ring as
    plain decoding of the path (an eager model) leaves them."""
    from lucebox_core.torch_backend import TorchBackend
    from lucebox_qwen35.loader import load
    from test_static_step import GraphStandIn

    target, _ = tiny_target_and_draft
    _commit_rounds(load(target, GraphStandIn(kernel_table_for={})), load(target, TorchBackend(kernel_table_for={})),
                   1e-5)


def switched_rounds(model, monkeypatch, switch: str, parents: list[int], seed: int, *, capture: bool) -> dict:
    """Two states of `model` (on CUDA) verify the same trees and commit the same paths, one with the environment
    switch `switch` at "1", the other at "0"; after each commit a probe's logits (and with `capture`, the feature
    rings) are equal to the bit. Returns the states by switch value."""
    gen = torch.Generator().manual_seed(seed)
    states = {"1": model.new_state(160), "0": model.new_state(160)}
    prompt = torch.randint(0, model.vocab_size, (19,), generator=gen).cuda()
    for state in states.values():
        if capture:
            model.enable_capture(state, (0, len(model.layers) - 1), 12)
        model.forward(state, prompt)
    for path in ([0, 2, 6], [0, 1, 3], [0, 1, 3, 4, 7], [0, 2, 5], [0]):
        tokens = torch.randint(0, model.vocab_size, (len(parents),), generator=gen)
        probe = torch.randint(0, model.vocab_size, (1,), generator=gen).cuda()
        logits = {}
        for value, state in states.items():
            monkeypatch.setenv(switch, value)
            model.commit(state, model.verify(state, tokens, parents), path)
            logits[value] = model.forward(state, probe).clone()
        assert states["1"].length == states["0"].length
        assert torch.equal(logits["1"], logits["0"])
        length = states["1"].length
        if capture:
            assert torch.equal(model.read_features(states["1"], length - 12, length),
                               model.read_features(states["0"], length - 12, length))
    return states


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recorded_commits_on_cuda(tiny_target_and_draft, monkeypatch):
    """With CUDA graphs on the CUDA backend (bf16): two states of one model verify the same trees, one committing
    through the recordings, the other eagerly (`LUCEBOX_RECORDED_COMMIT=0`); both commits copy the same bits, so
    the probes' logits and the feature rings are equal to the bit, round after round."""
    from lucebox_qwen35.verify import RECORDED_COMMIT_SWITCH

    target, _ = tiny_target_and_draft
    model = load_model(target, backend="cuda", device="cuda").model
    states = switched_rounds(model, monkeypatch, RECORDED_COMMIT_SWITCH, TREES["tree"][0], 29, capture=True)
    lengths = [[key[0][2] for key in state.verify._recorded if key[0][0] == "commit"] for state in states.values()]
    assert sorted(lengths[0]) == [1, 3, 5] and lengths[1] == []
