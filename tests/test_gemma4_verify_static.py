"""Gemma-4's static-shape speculative verify pass on the CPU reference backend (no graphs): what its tree
attention over a real cache (rings included) lets each node see, the same logits, features and K/V rows as
the eager pass before and after the sliding layers' rings wrap (and after a rollback, and over a Q8_0
cache), commits that decode on as plain decoding does, and the speculative loop with it."""

from __future__ import annotations

import pytest
import torch

from lucebox_core.engine import Engine, GenerationRequest
from lucebox_core.loading import load_model
from lucebox_core.sampling import SamplingParams
from lucebox_core.speculative import SpeculativeDecoder, dflash
from lucebox_gemma4 import synth
from lucebox_gemma4.loader import load
from lucebox_core.speculative.trees import TreeIndex
from lucebox_core.static_step import kv_window
from lucebox_core.kv import FullKVCache, KVLayerShape
from lucebox_core.torch_backend import TorchBackend

REFERENCE = TorchBackend("cpu", torch.float32)

GREEDY = SamplingParams(temperature=0)
WINDOW = 16  # the tiny sizes' sliding window
CHAIN = [-1, 0, 1, 2, 3]
BRANCHING = [-1, 0, 0, 1, 1, 2, 4]  # two children of the root, two of node 1, a grandchild of each side
CAPTURED = (1, 3)  # layers whose outputs a drafter would read


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4-verify-static")
    target = synth.write(folder / "target.gguf", size="tiny", type="f32", seed=21)
    moe = synth.write(folder / "moe.gguf", size="tiny-moe", type="f32", seed=22)
    draft = synth.write_draft(folder / "draft.gguf", size="tiny", type="f32", seed=23, target=target)
    return {"dense": target, "moe": moe, "draft": draft}


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request, files):
    return load(files[request.param])


def _tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(10, 5000, (count,), generator=torch.Generator().manual_seed(seed))


def _prefilled(model, committed: int, *, context: int = 512, rolled_back: bool = False):
    """A state holding `committed` positions, capturing features; `rolled_back`: one more position was held
    and rolled back (its row stays in the ring's slot, stale)."""
    state = model.new_state(context)
    model.enable_capture(state, CAPTURED, context)
    model.forward(state, _tokens(committed + rolled_back, committed))
    if rolled_back:
        state.kv.rollback(committed)
        state.length = committed
    return state


# -- what the static pass's attention sees -------------------------------------------------------------

DIMS = 64  # one-hot rows: positions below 57, the 7 tree nodes in the last dims


def _seen_by_tree_attention(cache, layer, committed, window, parents):
    """Which positions (and tree nodes, as `("node", i)`) each node's tree attention reads: zero queries and
    keys weigh every seen row alike, and one-hot values (position p in dim p, node i in dim 63 - i) make the
    output's support the set of rows seen."""
    nodes = len(parents)
    keys, values = cache.gather(layer, window)
    node_values = torch.zeros(nodes, 1, DIMS)
    for i in range(nodes):
        node_values[i, 0, DIMS - 1 - i] = 1
    visible = TreeIndex.build(parents).visibility()
    shape = cache.shapes[layer]
    out = REFERENCE.tree_attention(torch.zeros(1, nodes, 1, DIMS), keys, values, torch.tensor([committed]), visible,
                                   scale=1.0, node_k=torch.zeros(nodes, 1, DIMS), node_v=node_values,
                                   ring=shape.window or 0)
    return [{p if p < DIMS - nodes else ("node", DIMS - 1 - p) for p in out[0, n, 0].nonzero().flatten().tolist()}
            for n in range(nodes)]


@pytest.mark.parametrize("rolled_back", [False, True])
@pytest.mark.parametrize(("window", "context"), [(WINDOW, 512), (WINDOW, 20), (0, 512)])
def test_tree_attention_sees_what_the_eager_pass_sees(window, context, rolled_back):
    """Over a real cache (a sliding layer's ring before and after it wraps, a context barely longer than the
    window, a full layer; after a rollback of one position the rolled-back row stays stale in its slot), each
    node sees exactly the eager pass's rows: the committed positions within its window, and its ancestors."""
    tree = TreeIndex.build(BRANCHING)
    depths = tree.depths.tolist()
    ancestors = tree.visibility()
    for committed in range(1 if rolled_back else 0, DIMS - len(BRANCHING)):
        if committed + tree.max_depth >= context:
            continue
        cache = FullKVCache({0: KVLayerShape(1, DIMS, DIMS, window=window)}, context)
        held = committed + rolled_back
        rows = torch.eye(DIMS)[:held, None, :]
        for p in range(held):  # one position at a time, as decoding writes them
            cache.append(0, torch.zeros(1, 1, DIMS), rows[p : p + 1])
        if rolled_back:
            cache.rollback(committed)
        seen = _seen_by_tree_attention(cache, 0, committed, kv_window(committed, context), BRANCHING)
        for node, depth in enumerate(depths):
            position = committed + depth
            first = max(0, position - window + 1) if window else 0
            expected = set(range(first, committed)) | {("node", i) for i in range(len(BRANCHING)) if ancestors[node, i]}
            assert seen[node] == expected, (committed, node)


# -- the static pass against the eager one -----------------------------------------------------------


def _assert_same_verification(static, eager):
    """The same values up to float32 roundoff: the static pass reads more (masked) rows, in slot order, so its
    sums run in another order, and the tiny models' sharp softmax (unit-RMS q and k, scale 1.0) amplifies that
    to 1e-5 of the hidden states; a row wrongly seen or hidden moves them by 1e-2 and more."""
    torch.testing.assert_close(static.logits, eager.logits, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(static.features, eager.features, atol=2e-4, rtol=1e-4)
    assert static.kv_rows.keys() == eager.kv_rows.keys()
    for layer, (keys, values) in eager.kv_rows.items():
        torch.testing.assert_close(static.kv_rows[layer][0], keys, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(static.kv_rows[layer][1], values, atol=2e-4, rtol=1e-4)


def _verify_both(model, state, parents, seed):
    tokens = _tokens(len(parents), 1000 + seed)
    eager = model.verify(state, tokens, parents, static=False)
    static = model.verify(state, tokens, parents, static=True, graphs=False)
    return eager, static


@pytest.mark.parametrize("committed", [5, 15, 16, 17, 40, 300])  # the rings not full, full, wrapped; window 320
@pytest.mark.parametrize("parents", [CHAIN, BRANCHING], ids=["chain", "tree"])
def test_static_pass_equals_the_eager_pass(model, committed, parents):
    state = _prefilled(model, committed)
    eager, static = _verify_both(model, state, parents, committed)
    assert state.verify is not None and state.kv.length == committed == state.length  # nothing written
    _assert_same_verification(static, eager)
    assert static.kv_rows.keys() == {layer.index for layer in model.layers}
    assert not static.static and static.committed == committed  # rows returned, committed as the eager ones


@pytest.mark.parametrize("committed", [16, 17, 33])
def test_a_stale_row_after_a_rollback_is_not_seen(model, committed):
    state = _prefilled(model, committed, rolled_back=True)
    eager, static = _verify_both(model, state, BRANCHING, committed)
    _assert_same_verification(static, eager)


def test_a_short_context_and_a_q8_0_cache(files):
    quantized = load(files["dense"], cache_type_k="q8_0", cache_type_v="q8_0")
    for context, committed in ((24, 20), (512, 40)):  # a window capped at the context; a wrapped ring
        state = _prefilled(quantized, committed, context=context)
        eager, static = _verify_both(quantized, state, BRANCHING, committed)
        _assert_same_verification(static, eager)


def test_one_recording_key_per_window_nodes_and_features(model, monkeypatch):
    keys = []
    state = _prefilled(model, 10)
    model.verify(state, _tokens(5, 1), CHAIN, static=True, graphs=False)
    original = type(state.verify).run

    def spy(step, key, *args, **kwargs):
        keys.append(key)
        return original(step, key, *args, **kwargs)

    monkeypatch.setattr(type(state.verify), "run", spy)
    model.verify(state, _tokens(7, 2), BRANCHING, static=True, graphs=False)
    model.forward(state, _tokens(290, 3))
    model.verify(state, _tokens(5, 4), CHAIN, static=True, graphs=False)
    assert keys == [(256, 7, True), (320, 5, True)]


# -- commits ------------------------------------------------------------------------------------------


def _plain_greedy(model, prompt: torch.Tensor, count: int) -> list[int]:
    state = model.new_state(128)
    logits, tokens = model.forward(state, prompt, last_only=True), []
    for _ in range(count):
        tokens.append(int(logits[-1].argmax()))
        logits = model.forward(state, torch.tensor([tokens[-1]]))
    return tokens


def test_commits_of_static_verifications_decode_on_as_plain_decoding(model):
    prompt, total = _tokens(11, 5), 30
    reference = _plain_greedy(model, prompt, total)
    state = model.new_state(128)
    model.enable_capture(state, CAPTURED, 128)
    model.forward(state, prompt)
    generated = [reference[0]]  # the pending root
    while len(generated) < 22:  # blocks of up to 4 accepted across the rings' wrap at 16 and 32
        truth = reference[len(generated) : len(generated) + 3]
        decoy = [(t + 1) % 5000 for t in truth]
        # The root, the true continuation as one branch, a wrong one beside it.
        tokens = [generated[-1], *truth, *decoy]
        parents = [-1, 0, 1, 2, 0, 4, 5][: len(tokens)]
        verification = model.verify(state, tokens, parents, static=True, graphs=False)
        best = verification.logits.argmax(dim=-1).tolist()
        path = [0]
        while True:  # the greedy walk: the child whose token the target picks
            child = next((i for i, p in enumerate(parents) if p == path[-1] and tokens[i] == best[path[-1]]), None)
            if child is None:
                break
            path.append(child)
        model.commit(state, verification, path)
        generated += [tokens[i] for i in path[1:]] + [best[path[-1]]]
        assert generated == reference[: len(generated)]
        assert torch.equal(model.read_features(state, state.length - len(path), state.length),
                           verification.features[path].to(state.features.dtype))
    logits = model.forward(state, torch.tensor([generated[-1]]))  # plain decoding on from the committed state
    while len(generated) < total:
        generated.append(int(logits[-1].argmax()))
        logits = model.forward(state, torch.tensor([generated[-1]]))
    assert generated == reference


# -- the speculative loop with the static pass ----------------------------------------------------------


@pytest.fixture(scope="module")
def spec_setup(files):
    loaded = load_model(files["dense"])
    return loaded, dflash.load(files["draft"], loaded.model)


@pytest.fixture
def static_verify(spec_setup, monkeypatch):
    """The target's verify always static (as on a GPU, graphs aside); counts the static passes."""
    model = spec_setup[0].model
    passes = []
    verify, verify_static = model.verify, model._verify_static

    def counted(*args, **kwargs):
        passes.append(args[1].size)
        return verify_static(*args, **kwargs)

    monkeypatch.setattr(model, "verify", lambda state, tokens, parents, **_: verify(state, tokens, parents,
                                                                                     static=True, graphs=False))
    monkeypatch.setattr(model, "_verify_static", counted)
    return passes


def _greedy(loaded, prompt, n, drafter=None, spec_type="ddtree", **fields):
    speculative = None if drafter is None else SpeculativeDecoder(loaded.model, drafter, spec_type=spec_type)
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=256, speculative=speculative)
    return engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=GREEDY, ignore_eos=True,
                                             **fields))


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
def test_drafted_output_with_static_verify_equals_plain_greedy(spec_setup, static_verify, spec_type):
    loaded, drafter = spec_setup
    prompt = [2, 105, 2364, 107, 9259]
    plain = _greedy(loaded, prompt, 8).token_ids
    assert _greedy(loaded, prompt, 8, drafter, spec_type).token_ids == plain
    assert static_verify


@pytest.mark.parametrize("spec_type", ["chain", "ddtree"])
@pytest.mark.parametrize("accept", [0, 3, 15])
def test_every_forced_acceptance_with_static_verify_equals_plain_greedy(spec_setup, static_verify, spec_type, accept):
    loaded, drafter = spec_setup
    prompt = [2, 105, 2364, 107, 1000 + accept]
    n = 2 * (accept + 1) + 1  # the first token, then two whole blocks: the sliding rings wrap (window 16)
    reference = _greedy(loaded, prompt, 40).token_ids
    result = _greedy(loaded, prompt, n, drafter, spec_type, force_accept=accept, force_reference=reference)
    assert result.token_ids == reference[:n]
    assert result.timings.accepted_lengths[:2] == [accept + 1] * 2
    assert static_verify
