"""`LUCEBOX_GDN_REPLAY=1`: a verify pass keeps its Gated DeltaNet steps' inputs instead of every node's state, and
the commit replays the accepted path (`ReplayedRecurrence`, the family ops `gated_delta_tree_reloaded` and
`gated_delta_path_`). The replayed state must be the state the tree walk gave the path's last node, to the bit
where both run the same kernels: the Triton kernels under the interpreter here, the reference ops on the CPU, the
CUDA kernels on a GPU."""

from __future__ import annotations

import os

# Before the kernels' module is first imported; a GPU run passes TRITON_INTERPRET=0 (its CUDA tests need compiled
# kernels, and the interpreter's tests then skip).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from lucebox_core.loading import load_model
from lucebox_core.torch_backend import TorchBackend
from lucebox_qwen35.ops import QWEN35_OPS
from lucebox_qwen35.verify import GDN_REPLAY_SWITCH, ReplayedRecurrence

# Trees whose nodes branch off earlier nodes (so the walk reloads states), in insertion order; a chain.
TREES = [[-1, 0, 0, 1, 3, 2, 2, 4, 1], [-1, 0, 1, 2, 3], [-1, 0, 1, 0, 3, 1, 5, 6, 2]]


def tree_path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def delta_inputs(nodes: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    key_heads, value_heads, dk, dv = 2, 4, 16, 32
    channels = 2 * key_heads * dk + value_heads * dv
    mixed = torch.randn(1, nodes, channels + 3, generator=gen).to(dtype)[..., :channels]  # strided rows
    ab = (torch.randn(1, nodes, 2 * value_heads, generator=gen) * 3).to(dtype)
    b, a = ab.split([value_heads, value_heads], dim=-1)
    ssm_a = -torch.rand(value_heads, generator=gen) * 4
    dt_bias = torch.randn(value_heads, generator=gen)
    state = torch.randn(1, value_heads, dk, dv, generator=gen) * 0.3
    return (mixed, a, b, ssm_a, dt_bias, state), key_heads, dk


def kernel_device(kernel, interpreted_type) -> str:
    """Where a Triton kernel's test runs: the CPU under the interpreter, else the GPU (compiled: the bits a user
    gets), else nowhere."""
    if isinstance(kernel, interpreted_type):
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("the kernels were imported compiled (TRITON_INTERPRET=0) and there is no GPU")
    return "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parents", TREES)
def test_the_kernels_replay_each_path_to_the_bit(dtype, parents):
    """The reloaded-states walk gives every node the outputs of the full walk, and the states of the nodes it
    reloads; replaying any node's path from the committed state gives exactly the full walk's state there."""
    pytest.importorskip("triton")
    from lucebox_cuda import triton_fused
    from triton.runtime.interpreter import InterpretedFunction

    device = kernel_device(triton_fused._gated_delta_path_kernel, InterpretedFunction)
    inputs, key_heads, dk = delta_inputs(len(parents), dtype, len(parents))
    mixed, a, b, ssm_a, dt_bias, state = (t.to(device) for t in inputs)
    index = torch.tensor(parents, device=device)
    before = state.clone()
    out, all_states = triton_fused.gated_delta_tree(mixed, a, b, ssm_a, dt_bias, state, index, key_heads, dk)
    lean_out, lean_states = triton_fused.gated_delta_tree(mixed, a, b, ssm_a, dt_bias, state, index, key_heads, dk,
                                                          all_states=False)
    assert torch.equal(state, before)
    assert torch.equal(lean_out, out)
    reloaded = {p for i, p in enumerate(parents) if p >= 0 and p != i - 1}
    for node in reloaded:
        assert torch.equal(lean_states[node], all_states[node]), f"reloaded state of node {node}"
    for node in range(len(parents)):
        replayed = state.clone()
        triton_fused.gated_delta_path_(mixed, a, b, ssm_a, dt_bias, replayed,
                                       torch.tensor(tree_path(parents, node), device=device), key_heads, dk)
        assert torch.equal(replayed[0], all_states[node]), f"replayed state of node {node}"
    # The reference op, on the same inputs: the same states up to the kernels' summation order.
    ops = QWEN35_OPS.bind(TorchBackend("cpu", dtype))
    reference = state.cpu()
    path = torch.tensor(tree_path(parents, len(parents) - 1))
    ops.gated_delta_path_(*(t.cpu() for t in (mixed, a, b, ssm_a, dt_bias)), reference, path, key_heads, dk)
    error = ((reference - all_states[-1:].cpu()).norm() / all_states[-1].norm()).item()
    assert error < (1e-5 if dtype == torch.float32 else 2.5e-2), error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_commits_every_layer_as_the_per_layer_kernels(dtype):
    """`triton_commit.gated_delta_commit_` (three layers through address tables) leaves each layer's conv and
    recurrent states as the per-layer path kernel and a row copy do, to the bit; an empty path moves only the conv."""
    pytest.importorskip("triton")
    from lucebox_cuda import triton_commit, triton_fused
    from triton.runtime.interpreter import InterpretedFunction

    device = kernel_device(triton_commit._gated_delta_paths_kernel, InterpretedFunction)
    parents = TREES[2]
    layers = [delta_inputs(len(parents), dtype, seed) for seed in (1, 2, 3)]
    key_heads, dk = layers[0][1], layers[0][2]
    layers = [(tuple(t.to(device) for t in inputs), heads, dims) for inputs, heads, dims in layers]
    gen = torch.Generator().manual_seed(4)
    # As the tree convolution returns them: each node's last 3 rows of a 4-row window (rows apart by 4 * 40).
    conv_nodes = [torch.randn(len(parents), 4, 40, generator=gen).to(dtype)[:, 1:].to(device) for _ in layers]
    path, last = torch.tensor(tree_path(parents, 7), device=device), torch.tensor([7], device=device)
    for steps in (path, path[:0]):
        conv_live = [torch.zeros(1, 3, 40, dtype=dtype, device=device) for _ in layers]
        state_live = [inputs[5].clone() for inputs, _, _ in layers]
        triton_commit.gated_delta_commit_(
            None, conv_live, conv_nodes, state_live, *([inputs[i] for inputs, _, _ in layers] for i in range(5)),
            steps, last, key_heads, dk)
        for (inputs, _, _), conv, nodes, state in zip(layers, conv_live, conv_nodes, state_live):
            assert torch.equal(conv, nodes[7:8])
            expected = inputs[5].clone()
            triton_fused.gated_delta_path_(*inputs[:5], expected, steps, key_heads, dk)
            assert torch.equal(state, expected)


def test_the_reference_replay_is_the_reference_walk():
    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.float32))
    parents = TREES[0]
    (mixed, a, b, ssm_a, dt_bias, state), key_heads, dk = delta_inputs(len(parents), torch.float32, 7)
    _, states = ops.gated_delta_tree(mixed, a, b, ssm_a, dt_bias, state, torch.tensor(parents), key_heads, dk)
    for node in (0, 4, 7, 8):
        replayed = state.clone()
        ops.gated_delta_path_(mixed, a, b, ssm_a, dt_bias, replayed, torch.tensor(tree_path(parents, node)),
                              key_heads, dk)
        torch.testing.assert_close(replayed[0], states[node], atol=1e-6, rtol=1e-6)
    untouched = state.clone()
    ops.gated_delta_path_(mixed, a, b, ssm_a, dt_bias, untouched, torch.tensor([], dtype=torch.long), key_heads, dk)
    assert torch.equal(untouched, state)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from lucebox_qwen35 import synth

    path = tmp_path_factory.mktemp("gdn-replay") / "tiny.gguf"
    synth.write(path, size="tiny", type="q8_0", seed=31)
    return path


def _live_states(state) -> list[torch.Tensor]:
    return [t.clone() for linear in state.linear.values() for t in (linear.conv, linear.recurrent)]


@pytest.mark.parametrize("static", [False, True])
def test_a_replayed_commit_leaves_the_states_a_kept_one_leaves(tiny, static, monkeypatch):
    """Two states of one model verify the same tree and commit the same paths, one keeping every node's state,
    one replaying; the conv and recurrent states are equal after each commit, an extending commit steps on from
    the first, and a commit that would go back is refused with a message naming the switch."""
    model = load_model(tiny, backend="torch", device="cpu").model
    parents = TREES[0]
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.vocab_size, (21,), generator=gen)
    tokens = torch.randint(0, model.vocab_size, (len(parents),), generator=gen)
    kept, replayed = model.new_state(96), model.new_state(96)
    model.forward(kept, prompt)
    model.forward(replayed, prompt)
    monkeypatch.setenv(GDN_REPLAY_SWITCH, "0")
    v_kept = model.verify(kept, tokens, parents, static=static, graphs=False)
    monkeypatch.setenv(GDN_REPLAY_SWITCH, "1")
    v_replayed = model.verify(replayed, tokens, parents, static=static, graphs=False)
    assert all(isinstance(r, ReplayedRecurrence) for r in v_replayed.recurrent.values())
    assert not any(isinstance(r, ReplayedRecurrence) for r in v_kept.recurrent.values())
    torch.testing.assert_close(v_replayed.logits, v_kept.logits, atol=0, rtol=0)
    for path in ([0, 1], [0, 1, 3, 4], [0, 1, 3, 4, 7]):
        model.commit(kept, v_kept, path)
        model.commit(replayed, v_replayed, path)
        for mine, theirs in zip(_live_states(replayed), _live_states(kept)):
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=GDN_REPLAY_SWITCH):
        model.commit(replayed, v_replayed, [0, 1, 3])
    probe = torch.tensor([int(tokens[2])])
    torch.testing.assert_close(model.forward(replayed, probe), model.forward(kept, probe), atol=1e-5, rtol=1e-5)


def test_replayed_commits_through_recordings(tiny_target_and_draft, monkeypatch):
    """On emulated graphs (`test_static_step.GraphStandIn`), replayed verifications committed through their
    commit recordings (`_commit_step` replays the path on the device) leave the states plain decoding leaves."""
    from lucebox_qwen35.loader import load
    from test_static_step import GraphStandIn
    from test_static_verify import _commit_rounds

    monkeypatch.setenv(GDN_REPLAY_SWITCH, "1")
    target, _ = tiny_target_and_draft
    _commit_rounds(load(target, GraphStandIn(kernel_table_for={})), load(target, TorchBackend(kernel_table_for={})),
                   1e-5)


def test_forced_speculative_decoding_with_replayed_commits(tiny_target_and_draft, monkeypatch):
    """The whole speculative loop, replaying: forced acceptance holds and the output is plain greedy decoding's."""
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams
    from lucebox_core.speculative import dflash
    from lucebox_core.speculative.loop import SpeculativeDecoder

    monkeypatch.setenv(GDN_REPLAY_SWITCH, "1")
    target, draft = tiny_target_and_draft
    loaded = load_model(target, backend="torch", device="cpu")
    greedy = SamplingParams(temperature=0)
    plain = Engine(loaded.model, loaded.tokenizer, ctx_size=256)
    prompt = [9000, 17, 42]
    reference = plain.generate(GenerationRequest(prompt_ids=prompt, max_tokens=30, sampling=greedy,
                                                 ignore_eos=True)).token_ids
    speculative = Engine(loaded.model, loaded.tokenizer, ctx_size=256,
                         speculative=SpeculativeDecoder(loaded.model, dflash.load(draft, loaded.model)))
    result = speculative.generate(GenerationRequest(prompt_ids=prompt, max_tokens=30, sampling=greedy, ignore_eos=True,
                                                    force_accept=7, force_reference=reference))
    assert result.token_ids == reference[:30]
    assert result.timings.accepted_lengths[:2] == [8, 8]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_commits_on_cuda(tiny_target_and_draft, monkeypatch):
    """With CUDA graphs on the CUDA backend (bf16): two states verify the same trees, one keeping every node's
    state, one replaying (recorded commits both); the probes' logits are equal to the bit, round after round."""
    from test_static_verify import switched_rounds

    target, _ = tiny_target_and_draft
    model = load_model(target, backend="cuda", device="cuda").model
    states = switched_rounds(model, monkeypatch, GDN_REPLAY_SWITCH, TREES[0], 41, capture=False)
    for mine, theirs in zip(_live_states(states["1"]), _live_states(states["0"])):
        assert torch.equal(mine, theirs)
