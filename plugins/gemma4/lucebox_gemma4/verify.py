"""The target side of speculative decoding for Gemma-4: one forward pass over a candidate tree that commits
nothing, and the commit of the accepted path.

Gemma-4 has no recurrent state, so a verify pass is attention only: each node's K/V are computed, every
node attends to what the cache holds (a sliding layer: its ring, within the window of the node's own
position) and to its ancestors in the tree, and nothing is written; `commit` appends the accepted nodes'
rows in path order. Because nothing is written before the commit, a sliding layer's ring of exactly
`window` rows is enough (no scratch rows past the committed ones).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

import torch

from lucebox_core.errors import LuceboxError
from lucebox_core.kv import window_start
from lucebox_core.speculative.target import FeatureCapture, TreeVerification
from lucebox_core.speculative.trees import TreeIndex


class Gemma4SpeculativeTarget(FeatureCapture):
    """Tree verification and commit, as methods of `Gemma4Model` (a `state` is a `model.Gemma4State`)."""

    def verify(self, state: Any, tokens: Seq[int] | torch.Tensor, parents: Seq[int], *,
               static: bool | None = None, graphs: bool | None = None) -> TreeVerification:
        """Run a candidate tree in one pass without committing anything. `tokens[0]` is the root (the pending
        token, at position `state.length`); node `i` has parent `parents[i]` (-1 for the root; parents before
        children) and sits at `state.length + depth(i)`; it sees the committed prefix and its ancestors.
        (`static`, `graphs`: accepted for the verifier's interface; Gemma-4's pass is always the eager one.)"""
        ops = self.ops
        tree = TreeIndex.build(parents, device=ops.device)
        token_ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).to(ops.device)
        committed = state.length
        if committed + tree.max_depth + 1 > state.kv.max_context:
            raise LuceboxError(f"context overflow: verifying {tree.size} nodes at position {committed} needs "
                               f"positions up to {committed + tree.max_depth}; the context holds {state.kv.max_context}")
        positions = committed + tree.depths
        ancestry = tree.visibility().to(ops.device)  # [N, N]: node n sees node i
        kv_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        taps: list[torch.Tensor] = []

        def attend(layer: Any, x: torch.Tensor) -> torch.Tensor:
            attn = layer.self_attn
            query, key, value = attn.project(x, positions)
            kv_rows[layer.index] = (key[0], value[0])
            node_keys, node_values = state.kv.as_stored(key[0], value[0])  # as plain decoding will read them
            held_keys, held_values = state.kv.read(layer.index)
            first = window_start(attn.kv_shape, committed)
            held_positions = torch.arange(first, first + held_keys.shape[0], device=x.device)
            mask = torch.cat([attn.visibility(positions, held_positions),
                              ancestry & attn.visibility(positions, positions)], dim=1)
            keys = torch.cat([held_keys.to(query.dtype), node_keys.to(query.dtype)])[None]
            values = torch.cat([held_values.to(query.dtype), node_values.to(query.dtype)])[None]
            return attn.output(ops.attention(query, keys, values, scale=1.0, mask=mask))

        hidden = self._run_layers(self.embed(token_ids)[None], attend, lambda layer, output: taps.append(output[0]),
                                  state.capture_layers)
        features = self._concat_taps(state, taps) if state.features is not None else None
        return TreeVerification(tree, committed, self.output_logits(hidden)[0], features, kv_rows)

    def commit(self, state: Any, verification: TreeVerification, path: Seq[int]) -> None:
        """Keep the accepted `path` (node indices from the root, each the parent of the next): their K/V
        appended at positions `committed ..`, their features stored."""
        path = list(path)
        parents = verification.tree.parent_list
        if not path or path[0] != 0 or any(parents[b] != a for a, b in itertools.pairwise(path)):
            raise ValueError(f"{path} is not a path from the root of the verified tree")
        committed = verification.committed
        index = torch.tensor(path, dtype=torch.long, device=self.ops.device)
        state.kv.rollback(committed)
        for layer, (k_rows, v_rows) in verification.kv_rows.items():
            state.kv.append(layer, k_rows[index], v_rows[index])
        if state.features is not None and verification.features is not None:
            self._store_features(state, committed, verification.features[index])
        state.length = committed + len(path)
