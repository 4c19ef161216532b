"""The target side of speculative decoding for Qwen3.5: the drafter's feature ring (the outputs of chosen
layers at every committed position), one forward pass over a candidate tree without committing
anything, and the commit of the accepted path.

`SpeculativeTarget` is a part of `Qwen35Model` (which inherits it), kept apart from the plain forward pass
it reuses (`_run_layers`, the layers' `verify_tree` / `verify_static` mixers). Verification runs either
dynamically (K/V rows of the nodes returned, attention over the cache plus the tree) or as a static-shape
pass (the nodes' K/V written past the committed rows, a fixed window read) that a CUDA graph records once
per (window, node count); both give each node the logits the one-token decode step gives it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as Seq
from typing import Any

import attrs
import torch

from lucebox_core.errors import LuceboxError
from lucebox_core.kv import FullKVCache, window_limit
from lucebox_core.speculative.target import FeatureCapture, TreeVerification
from lucebox_core.speculative.trees import TreeIndex
from lucebox_core.split_step import SplitStaticStep
from lucebox_core.static_step import StaticInputs, StaticStep, kv_window, step_scope

# `LUCEBOX_RECORDED_COMMIT=0` commits every path eagerly (an A/B switch for `_commit_recorded`).
RECORDED_COMMIT_SWITCH = "LUCEBOX_RECORDED_COMMIT"
# A verify pass keeps its recurrent steps' inputs, not every node's state, and the commit replays the accepted path
# (`ReplayedRecurrence`); `LUCEBOX_GDN_REPLAY=0` keeps every node's state (an A/B; on since session 34: -0.6 ms of a
# 23-node 27B verify pass and -0.25 ms of its commit on the H100, the same bits).
GDN_REPLAY_SWITCH = "LUCEBOX_GDN_REPLAY"


@attrs.frozen
class ReplayedRecurrence:
    """A linear-attention layer's part of a verification, in place of the recurrent state after every node:
    the inputs of the nodes' recurrent steps, from which `commit` advances the live state along the accepted
    path (`gated_delta_path_`, the tree walk's arithmetic: the same bits the walk gave the path's last node).

    Why: the tree walk of a 23-node 27B verify wrote 3.5 GB of fp32 node states, 2.6 ms of a 23.5 ms pass
    (H100, session 32), to keep one state a layer; the replay reads the path's inputs and one state."""

    mixer: Any  # the layer's `model.GatedDeltaNet`: its ops, gates' parameters and head shape
    mixed: torch.Tensor  # [1, N, C] the convolved q | k | v channels (after SiLU)
    a: torch.Tensor  # [1, N, H_v]
    b: torch.Tensor  # [1, N, H_v]


def _replays(state: Any, verification: TreeVerification) -> bool:
    """Whether `verification` kept its linear layers' steps' inputs for `commit` to replay (the default; not with
    `LUCEBOX_GDN_REPLAY=0`)."""
    return bool(state.linear) and all(isinstance(verification.recurrent.get(layer), ReplayedRecurrence)
                                      for layer in state.linear)


def _commit_replayed(state: Any, verification: TreeVerification, steps: torch.Tensor, last: torch.Tensor) -> None:
    """Every linear layer's conv state after node `last` `[1]` and its recurrent state advanced along `steps` `[L]`
    from the live one: one `gated_delta_commit_` per device (a split model's layers sit on theirs)."""
    by_device: dict[torch.device, list[ReplayedRecurrence]] = {}
    layers_by_device: dict[torch.device, list[int]] = {}
    for layer in state.linear:
        replay = verification.recurrent[layer]
        by_device.setdefault(replay.mixed.device, []).append(replay)
        layers_by_device.setdefault(replay.mixed.device, []).append(layer)
    for device, replays in by_device.items():
        layers, mixer = layers_by_device[device], replays[0].mixer
        mixer.ops.gated_delta_commit_(
            [state.linear[layer].conv for layer in layers], [verification.conv[layer] for layer in layers],
            [state.linear[layer].recurrent for layer in layers], [r.mixed for r in replays], [r.a for r in replays],
            [r.b for r in replays], [r.mixer.ssm_a for r in replays], [r.mixer.dt_bias for r in replays],
            steps.to(device), last.to(device), mixer.num_k_heads, mixer.head_k_dim)


class SpeculativeTarget(FeatureCapture):
    """Feature capture, tree verification and commit, as methods of `Qwen35Model` (a `state` here is a
    `model.Qwen35State`, a `layer` a `model.DecoderLayer`; this module does not import the model's, which
    imports it)."""

    def verify(self, state: Any, tokens: Seq[int] | torch.Tensor, parents: Seq[int], *,
               static: bool | None = None, graphs: bool | None = None) -> TreeVerification:
        """Run a candidate tree in one forward pass without committing anything.

        `tokens[0]` is the root (the pending token, at position `state.length`), node `i` has parent
        `parents[i]` (`-1` for the root; parents precede children) and sits at position
        `state.length + depth(i)`. Each node sees the committed prefix and its own ancestors; Gated
        DeltaNet and conv state follow each node's own parent chain. Chain verification is the tree
        with parents `[-1, 0, 1, ...]`.

        `static` (default: on where decode steps are graphed) runs the static-shape pass, which writes the
        nodes' K/V into the cache past the committed rows and reads a fixed window, so `graphs` (default
        likewise) can record it once per (window, node count) and replay it.
        """
        ops = self.ops
        tree = TreeIndex.build(parents, device=ops.device)
        token_ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).to(ops.device)
        committed = state.length
        static = self.decode_graphs if static is None else static
        # The static pass writes every node's K/V at committed + i; the dynamic one only needs the deepest
        # node's position.
        needed = committed + (tree.size if static else tree.max_depth + 1)
        if needed > state.kv.max_context:
            raise LuceboxError(
                f"context overflow: verifying {tree.size} nodes at position {committed} needs rows up to "
                f"{needed - 1}; the context holds {state.kv.max_context}"
            )
        # A bounded pool (kvflash) makes room for the nodes as plain decoding of the chain would: the same plan
        # whichever pass runs, so a static and a dynamic verify leave the same residency.
        state.kv.ensure_room(tree.size if static else tree.max_depth + 1)
        if static:
            with step_scope(self):  # Spark's promotions between steps, paged experts inside (static_step)
                return self._verify_static(state, tree, token_ids, self.decode_graphs if graphs is None else graphs)
        positions = committed + tree.depths
        visible = tree.visibility()
        kv_rows, conv, recurrent, taps = {}, {}, {}, []

        def mix(layer: Any, x: torch.Tensor) -> torch.Tensor:
            if layer.linear_attn is not None:
                out, conv[layer.index], recurrent[layer.index] = layer.linear_attn.verify_tree(
                    x, state.linear[layer.index], self._local(layer, tree.parents)
                )
            else:
                out, k_rows, v_rows = layer.self_attn.verify_tree(x, self._local(layer, positions), state.kv,
                                                                  self._local(layer, visible))
                kv_rows[layer.index] = (k_rows, v_rows)
            return out

        hidden = self._run_layers(ops.embedding(token_ids, self.embed_tokens)[None], mix,
                                  lambda layer, output: taps.append(output[0]), state.capture_layers)
        features = self._concat_taps(state, taps) if state.features is not None else None
        logits = self.head_ops.linear(hidden, self.lm_head)[0]
        return TreeVerification(tree, committed, logits, features, kv_rows, conv, recurrent)

    def _verify_static(self, state: Any, tree: TreeIndex, token_ids: torch.Tensor,
                       use_graphs: bool) -> TreeVerification:
        ops = self.ops
        nodes, committed = tree.size, state.length
        if self.split_steps:
            return self._verify_static_split(state, tree, token_ids, use_graphs)
        if state.verify is None:
            state.verify = StaticStep(ops, "verify pass", graphs=self.decode_graphs)
        # The tree's tokens, shape and the committed length (the root's position) in fixed device buffers.
        inputs = state.verify.inputs(tokens=token_ids, parents=tree.parents, depths=tree.depths,
                                     visible=tree.visibility(), start=committed)
        inputs.set("embedded", ops.embedding(inputs.tokens, self.embed_tokens)[None])
        window = kv_window(committed + nodes, window_limit(state.kv), self.decode_min_window)
        # Keyed on whether features are captured too: a recording without them would return none.
        key = (window, nodes, state.features is not None)
        replayed = use_graphs and state.verify.holds(key, inputs)
        logits, features, conv, recurrent = state.verify.run(
            key, lambda step_inputs: self._static_verify_pass(state, step_inputs, window), inputs, graphs=use_graphs)
        return TreeVerification(tree, committed, logits, features, {}, conv, recurrent, static=True,
                                recording=key if replayed else None)

    def _static_verify_pass(self, state: Any, inputs: StaticInputs, window: int):
        """The verify pass as a function of its static inputs, `window` and N alone (what a graph records)."""
        positions = inputs.start + inputs.depths
        conv, recurrent, taps = {}, {}, []

        def mix(layer: Any, x: torch.Tensor) -> torch.Tensor:
            if layer.linear_attn is not None:
                out, conv[layer.index], recurrent[layer.index] = layer.linear_attn.verify_tree(
                    x, state.linear[layer.index], self._local(layer, inputs.parents)
                )
                return out
            return layer.self_attn.verify_static(x, self._local(layer, positions), self._local(layer, inputs.start),
                                                 state.kv, window, self._local(layer, inputs.visible))

        hidden = self._run_layers(inputs.embedded, mix, lambda layer, output: taps.append(output[0]),
                                  state.capture_layers)
        features = self._concat_taps(state, taps) if state.features is not None else None
        return self.head_ops.linear(hidden, self.lm_head)[0], features, conv, recurrent

    def _verify_static_split(self, state: Any, tree: TreeIndex, token_ids: torch.Tensor,
                             use_graphs: bool) -> TreeVerification:
        """The static verify pass of a split model: a recording per part (`split_step.SplitStaticStep`), each
        part holding the tree's shape and the committed length in buffers on its device."""
        nodes, committed = tree.size, state.length
        if state.verify is None:
            state.verify = SplitStaticStep(self.part_ops, "verify pass", graphs=None if self.decode_graphs else False,
                                           failed_parts=self.failed_parts)
        shape = dict(parents=tree.parents, depths=tree.depths, visible=tree.visibility(), start=committed)
        inputs = [state.verify.inputs(0, tokens=token_ids, **shape)]
        inputs += [state.verify.inputs(part, **shape) for part in range(1, state.verify.parts)]
        inputs[0].set("embedded", self.ops.embedding(inputs[0].tokens, self.embed_tokens)[None])
        window = kv_window(committed + nodes, window_limit(state.kv), self.decode_min_window)
        key = (window, nodes, state.features is not None)
        results = state.verify.run(
            key, lambda part, step_inputs: self._static_verify_part(state, part, step_inputs, window), inputs,
            graphs=use_graphs)
        conv, recurrent = {}, {}
        for part_conv, part_recurrent in results[:-1]:
            conv.update(part_conv)
            recurrent.update(part_recurrent)
        logits, features, last_conv, last_recurrent = results[-1]
        conv.update(last_conv)
        recurrent.update(last_recurrent)
        return TreeVerification(tree, committed, logits, features, {}, conv, recurrent, static=True)

    def _static_verify_part(self, state: Any, part: int, inputs: StaticInputs, window: int):
        """Part `part` of the split verify pass, as a function of its static inputs, `window` and N alone:
        hands over as the split decode step does; returns its layers' conv and recurrent states (the last
        part also the logits and the features)."""
        positions = inputs.start + inputs.depths
        conv, recurrent = {}, {}

        def mix(layer: Any, x: torch.Tensor) -> torch.Tensor:
            if layer.linear_attn is not None:
                out, conv[layer.index], recurrent[layer.index] = layer.linear_attn.verify_tree(
                    x, state.linear[layer.index], inputs.parents)
                return out
            return layer.self_attn.verify_static(x, positions, inputs.start, state.kv, window, inputs.visible)

        tapped = state.capture_layers
        handed, hidden, pending = self._static_part_layers(part, inputs, mix, tapped)
        if part < len(self.part_layers) - 1:
            return handed, (conv, recurrent)
        features = None
        if state.features is not None:
            features = self._concat_taps(state, self._gathered_taps(inputs, handed, tapped))
        logits = self.head_ops.linear(self._final_norm(hidden, pending), self.lm_head)[0]
        return {}, (logits, features, conv, recurrent)

    def commit(self, state: Any, verification: TreeVerification, path: Seq[int]) -> None:
        """Keep the accepted `path` (node indices from the root, each the parent of the next): their KV
        rows compacted to positions `committed .. committed + len(path) - 1`, the conv and recurrent
        state after the last of them and their features. Nothing of any other node survives."""
        path = list(path)
        parents = verification.tree.parent_list
        if not path or path[0] != 0 or any(parents[b] != a for a, b in itertools.pairwise(path)):
            raise ValueError(f"{path} is not a path from the root of the verified tree")
        done = verification.compacted
        if verification.static and path[: len(done)] != done[: len(path)]:
            raise ValueError(f"{path} leaves the path {done} already committed from this verification")
        replayed = verification.replayed
        if replayed and path[: len(replayed)] != replayed:
            raise ValueError(f"{path} does not extend the path {replayed} whose recurrent steps this verification's "
                             f"commit replayed (a replayed state cannot go back: {GDN_REPLAY_SWITCH}=0 keeps every "
                             "node's)")
        committed = verification.committed  # committing again (a longer path) first undoes the last one
        state.kv.rollback(committed)
        if (verification.recording is not None and not done and isinstance(state.kv, FullKVCache)
                and os.environ.get(RECORDED_COMMIT_SWITCH, "1") != "0"):
            return self._commit_recorded(state, verification, path)
        index = torch.tensor(path, dtype=torch.long, device=self.ops.device)
        if verification.static:  # the nodes' rows are in the cache in insertion order: compact the path
            if len(path) > len(done):
                # Only the new part moves: positions committed + 0 .. len(done) - 1 already hold the earlier
                # part, and the new part's sources (path[i] >= i >= len(done)) were never written over.
                state.kv.move(committed + index[len(done):],
                              committed + torch.arange(len(done), len(path), device=index.device))
                verification.compacted[:] = path
            state.kv.commit(committed + len(path))
        for layer, (k_rows, v_rows) in verification.kv_rows.items():
            rows = index.to(k_rows.device)  # a split model's rows sit on their layer's device
            state.kv.append(layer, k_rows[rows], v_rows[rows])
        last = path[-1]
        if _replays(state, verification):  # the live state holds the end of `replayed`: step on from it
            _commit_replayed(state, verification, index[len(verification.replayed):], index[-1:])
        else:
            for layer, linear in state.linear.items():  # in place: a recorded decode step holds these buffers
                linear.conv.copy_(verification.conv[layer][last : last + 1])
                linear.recurrent.copy_(verification.recurrent[layer][last : last + 1])
        verification.replayed[:] = path
        if state.features is not None and verification.features is not None:
            self._store_features(state, committed, verification.features[index.to(verification.features.device)])
        state.length = committed + len(path)

    def _commit_recorded(self, state: Any, verification: TreeVerification, path: list[int]) -> None:
        """`commit` of a replayed static verification's first path, as a recording of its own per (verify
        recording, path length), replayed from then on.

        Why: the eager commit of the 27B is ~170 small launches (K/V rows moved in 16 layers, 48 layers' conv and
        recurrent states, the features), 1.7-2.3 ms a speculative step while the GPU waits (H100, session 32); a
        replay launches them at once (0.88 ms). The path and the committed length are read on the device;
        the verification's tensors are that verify recording's buffers, the same at every replay of it, and
        the recording lives in the verify pass's `StaticStep`, so it goes when they go."""
        committed, length = verification.committed, len(path)
        inputs = state.verify.inputs(commit_path=torch.tensor(path, dtype=torch.long), commit_start=committed)
        ring = state.features.data_ptr() if state.features is not None else None  # a ring made anew: record anew
        state.verify.run(("commit", verification.recording, length, ring),
                         lambda step_inputs: self._commit_step(state, verification, step_inputs), inputs)
        verification.compacted[:] = path
        verification.replayed[:] = path
        state.kv.commit(committed + length)
        state.length = committed + length

    def _commit_step(self, state: Any, verification: TreeVerification, inputs: StaticInputs) -> None:
        """What `commit` moves, as a function of the path `[L]` and the committed length `[1]` on the device."""
        index, start = inputs.commit_path, inputs.commit_start
        length = index.shape[0]
        steps = torch.arange(length, device=index.device)
        state.kv.move(start + index, start + steps)  # all reads before any write: path[i] >= i
        last = index[length - 1:]
        if _replays(state, verification):
            _commit_replayed(state, verification, index, last)
        else:
            for layer, linear in state.linear.items():  # in place: a recorded decode step holds these buffers
                pairs = ((linear.conv, verification.conv[layer]), (linear.recurrent, verification.recurrent[layer]))
                for live, nodes in pairs:
                    if live.dtype == nodes.dtype and live.is_contiguous():
                        torch.index_select(nodes, 0, last, out=live)  # no temporary: the 27B's are 3 MB a layer
                    else:
                        live.copy_(nodes.index_select(0, last))
        if state.features is not None and verification.features is not None:
            capacity = state.features.shape[0]
            kept = min(length, capacity)  # a path longer than the ring keeps its last `capacity` rows
            rows = verification.features.index_select(0, index[length - kept:])
            slots = (start + (length - kept) + steps[:kept]) % capacity
            state.features.index_copy_(0, slots, rows.to(state.features.dtype))

