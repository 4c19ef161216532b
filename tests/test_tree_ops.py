"""The reference ops of tree verification against their definitions: `tree_attention` is masked
`attention` over the committed prefix plus the node rows, `gated_delta_rule_tree` is the recurrent rule
along each node's own ancestry."""

import pytest
import torch

from lucebox_core.speculative.trees import TreeIndex
from lucebox_core.torch_backend import TorchBackend
from lucebox_qwen35.ops import QWEN35_OPS

TREES = [[-1], [-1, 0, 1, 2], [-1, 0, 0, 1, 3, 2, 2], [-1, 0, 1, 0, 3, 3, 5, 1]]


@pytest.mark.parametrize("parents", TREES)
@pytest.mark.parametrize("position", [0, 7])
def test_tree_attention_is_masked_attention(parents, position):
    ops = QWEN35_OPS.bind(TorchBackend())  # the torch reference with the qwen35 family's ops
    generator = torch.Generator().manual_seed(len(parents) * 31 + position)
    nodes, q_heads, kv_heads, dim = len(parents), 6, 2, 16
    rows = position + nodes + 5  # rows past the tree hold garbage the kernel must not read as keys
    q = torch.randn(1, nodes, q_heads, dim, generator=generator)
    k = torch.randn(rows, kv_heads, dim, generator=generator)
    v = torch.randn(rows, kv_heads, dim, generator=generator)
    visible = TreeIndex.build(parents).visibility()
    out = ops.tree_attention(q, k, v, torch.tensor([position]), visible, scale=dim**-0.5)
    mask = torch.cat([torch.ones(nodes, position, dtype=torch.bool), visible], dim=1)
    end = position + nodes
    reference = ops.attention(q, k[None, :end], v[None, :end], scale=dim**-0.5, mask=mask)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("parents", TREES)
def test_gated_delta_rule_tree_follows_each_ancestry(parents):
    ops = QWEN35_OPS.bind(TorchBackend())  # the torch reference with the qwen35 family's ops
    generator = torch.Generator().manual_seed(len(parents))
    nodes, k_heads, v_heads, dk, dv = len(parents), 2, 4, 8, 6
    q = ops.l2norm(torch.randn(1, nodes, k_heads, dk, generator=generator))
    k = ops.l2norm(torch.randn(1, nodes, k_heads, dk, generator=generator))
    v = torch.randn(1, nodes, v_heads, dv, generator=generator)
    g = -torch.rand(1, nodes, v_heads, generator=generator)
    beta = torch.rand(1, nodes, v_heads, generator=generator)
    state = torch.randn(1, v_heads, dk, dv, generator=generator)
    before = state.clone()
    out, node_states = ops.gated_delta_rule_tree(q, k, v, g, beta, state, torch.tensor(parents))
    assert torch.equal(state, before)
    for node in range(nodes):
        path, i = [], node
        while i >= 0:
            path.append(i)
            i = parents[i]
        path = torch.tensor(path[::-1])
        ref_out, ref_state = ops.gated_delta_rule_recurrent(
            q[:, path], k[:, path], v[:, path], g[:, path], beta[:, path], state
        )
        torch.testing.assert_close(out[0, node], ref_out[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(node_states[node], ref_state[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("parents", TREES)
def test_causal_conv1d_tree_follows_each_ancestry(parents):
    """Each node's output and conv state equal one-token convolutions along its own path from the root,
    starting from the committed state."""
    ops = QWEN35_OPS.bind(TorchBackend())  # the torch reference with the qwen35 family's ops
    generator = torch.Generator().manual_seed(7 + len(parents))
    nodes, channels, kernel = len(parents), 5, 4
    x = torch.randn(1, nodes, channels, generator=generator)
    weight = torch.randn(channels, kernel, generator=generator)
    state = torch.randn(1, kernel - 1, channels, generator=generator)
    y, node_states = ops.causal_conv1d_tree(x, weight, state, torch.tensor(parents))
    for node in range(nodes):
        path, i = [], node
        while i >= 0:
            path.append(i)
            i = parents[i]
        conv_state = state
        for step in reversed(path):
            out, conv_state = ops.causal_conv1d_step(x[:, step], weight, conv_state)
        torch.testing.assert_close(y[0, node], out[0])
        torch.testing.assert_close(node_states[node], conv_state[0])
