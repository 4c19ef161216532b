"""The target side of speculative decoding for Gemma-4: one forward pass over a candidate tree that commits
nothing, and the commit of the accepted path.

Gemma-4 has no recurrent state, so a verify pass is attention only: each node's K/V are computed, every
node attends to what the cache holds (a sliding layer: its ring, within the window of the node's own
position) and to its ancestors in the tree, and nothing is written; `commit` writes the accepted nodes'
rows at the positions after the committed ones, in path order. Because nothing is written before the
commit, a sliding layer's ring of exactly `window` rows is enough (no scratch rows past the committed ones).

The pass runs eagerly (the rows each node sees, read and masked by host-known positions) or as a static-shape
pass that a CUDA graph records once per (KV window, node count, features on/off) and replays. The static pass
runs each layer's attention as the decode step does, through `tree_attention` with the nodes' rows apart from
the cache (a sliding layer's cache being a ring of `window` slots): each node's key sequence is the one the
decode step reads once the node's path is committed, in the same slot order, cut into the same tiles. So on a
GPU a verified node gets the decode step's logits to the bit (the products of one arithmetic class, the norms
row by row), and greedy speculative output equals plain greedy output.
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
from lucebox_core.static_step import StaticInputs, StaticStep, kv_window, step_scope


class Gemma4SpeculativeTarget(FeatureCapture):
    """Tree verification and commit, as methods of `Gemma4Model` (a `state` is a `model.Gemma4State`)."""

    def verify(self, state: Any, tokens: Seq[int] | torch.Tensor, parents: Seq[int], *,
               static: bool | None = None, graphs: bool | None = None) -> TreeVerification:
        """Run a candidate tree in one pass without committing anything. `tokens[0]` is the root (the pending
        token, at position `state.length`); node `i` has parent `parents[i]` (-1 for the root; parents before
        children) and sits at `state.length + depth(i)`; it sees the committed prefix and its ancestors.

        `static` (default: on where decode steps are graphed) runs the static-shape pass, which `graphs`
        (default likewise) records once per (KV window, node count, features on/off) and replays; its
        tensors are then the recording's buffers, valid until this state's next verify pass (the walk reads
        the logits and `commit` the rows and features before that). Both passes see the same rows: their
        logits differ only by the order of float sums (the static pass reads masked rows too, in slot order)."""
        ops = self.ops
        tree = TreeIndex.build(parents, device=ops.device)
        token_ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).to(ops.device)
        committed = state.length
        if committed + tree.max_depth + 1 > state.kv.max_context:
            raise LuceboxError(f"context overflow: verifying {tree.size} nodes at position {committed} needs "
                               f"positions up to {committed + tree.max_depth}; the context holds {state.kv.max_context}")
        if self.decode_graphs if static is None else static:
            with step_scope(self):  # Spark's promotions between steps, paged experts inside (static_step)
                return self._verify_static(state, tree, token_ids, self.decode_graphs if graphs is None else graphs)
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

    # -- the static verify pass ------------------------------------------------------------------------

    def _verify_static(self, state: Any, tree: TreeIndex, token_ids: torch.Tensor,
                       use_graphs: bool) -> TreeVerification:
        ops = self.ops
        committed = state.length
        if state.verify is None:
            state.verify = StaticStep(ops, "verify pass", graphs=self.decode_graphs)
        # The tree's tokens, shape and the committed length (the root's position) in fixed device buffers.
        inputs = state.verify.inputs(tokens=token_ids, depths=tree.depths, visible=tree.visibility(),
                                     start=committed)
        inputs.set("embedded", self.embed(inputs.tokens)[None])  # eagerly: dequantizers build host constants
        # The held rows are positions < committed: a full layer reads the first `window` rows (which cover
        # them), a sliding layer its whole ring (or as much of it as the window covers before it first wraps).
        window = kv_window(committed, state.kv.max_context, self.decode_min_window)
        # Keyed on whether features are captured too: a recording without them would return none.
        key = (window, tree.size, state.features is not None)
        logits, features, kv_rows = state.verify.run(
            key, lambda step_inputs: self._static_verify_pass(state, step_inputs, window), inputs, graphs=use_graphs)
        return TreeVerification(tree, committed, logits, features, kv_rows)

    def _static_verify_pass(self, state: Any, inputs: StaticInputs, window: int):
        """The verify pass as a function of its static inputs, `window` and the node count alone (what a graph
        records): every position comes from the device buffer `inputs.start`. Nothing is written: each layer's
        tree attention reads the cache's committed rows (a sliding layer's ring) and the nodes' rows apart, as
        the decode step does with one node. Returns the logits, the features (or None) and each layer's node
        K/V rows for `commit`."""
        positions = inputs.start + inputs.depths
        kv_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        taps: list[torch.Tensor] = []

        def attend(layer: Any, x: torch.Tensor) -> torch.Tensor:
            attn = layer.self_attn
            query, key, value = attn.project(x, positions)
            kv_rows[layer.index] = (key[0], value[0])
            node_keys, node_values = state.kv.as_stored(key[0], value[0])  # as plain decoding will read them
            held_keys, held_values = state.kv.gather(layer.index, window)
            return attn.output(attn.tree_attention(query, held_keys, held_values, inputs.start, inputs.visible,
                                                   node_keys, node_values))

        tapped = state.capture_layers if state.features is not None else ()
        hidden = self._run_layers(inputs.embedded, attend, lambda layer, output: taps.append(output[0]), tapped)
        features = self._concat_taps(state, taps) if state.features is not None else None
        return self.output_logits(hidden)[0], features, kv_rows

    def commit(self, state: Any, verification: TreeVerification, path: Seq[int]) -> None:
        """Keep the accepted `path` (node indices from the root, each the parent of the next): their K/V
        appended at positions `committed ..`, their features stored (the same for both passes)."""
        path = list(path)
        parents = verification.tree.parent_list
        if not path or path[0] != 0 or any(parents[b] != a for a, b in itertools.pairwise(path)):
            raise ValueError(f"{path} is not a path from the root of the verified tree")
        committed = verification.committed
        index = torch.tensor(path, dtype=torch.long, device=self.ops.device)
        positions = torch.arange(committed, committed + len(path), device=self.ops.device)
        # Written in place and declared held (the static steps' way): `append` would also read back every row
        # a next query sees (a whole ring per sliding layer), which the commit does not need.
        state.kv.rollback(committed)
        for layer, (k_rows, v_rows) in verification.kv_rows.items():
            state.kv.write(layer, positions, k_rows[index], v_rows[index])
        state.kv.commit(committed + len(path))
        if state.features is not None and verification.features is not None:
            self._store_features(state, committed, verification.features[index])
        state.length = committed + len(path)

