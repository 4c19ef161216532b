"""The target side of speculative decoding that every family shares: the drafter's feature ring (the
outputs of chosen layers at every committed position) and the record of one tree verification.

A family's model mixes `FeatureCapture` in (a `state` is the family's per-sequence state, with the fields
`capture_layers`, `features` and `length`; the model has `layers`, `hidden_size` and `ops`) and fills a
`TreeVerification` in its own `verify`, to keep until `commit` picks the accepted path.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import attrs
import torch

from ..errors import LuceboxError
from .trees import TreeIndex


@attrs.frozen
class TreeVerification:
    """What a model's `verify` computed for a candidate tree, kept until `commit` picks a path."""

    tree: TreeIndex
    committed: int  # state.length at verification: the root's position
    logits: torch.Tensor  # [N, vocab]
    features: torch.Tensor | None  # [N, n_capture * hidden]
    kv_rows: dict[int, tuple[torch.Tensor, torch.Tensor]]  # attention layer -> K, V rows of every node
    # A family's per-node recurrent state (a linear-attention layer's); empty for attention-only models.
    conv: dict[int, torch.Tensor] = attrs.Factory(dict)  # layer -> [N, K-1, C], conv state after each node
    recurrent: dict[int, Any] = attrs.Factory(dict)  # layer -> [N, H_v, D_k, D_v], after each node (or the family's)
    # The static pass wrote every node's K/V into the cache at `committed + i` (insertion order) instead
    # of returning `kv_rows`; its tensors are a recording's buffers, valid until the next verify.
    static: bool = False
    # Static: the path whose rows `commit` has already moved to `committed + 0, 1, ...` (a second commit
    # of the same verification may only extend it: the moved-over rows held other nodes).
    compacted: list[int] = attrs.Factory(list)
    # Static and replayed: the key of the recording whose buffers its tensors are (the same tensors at every
    # replay of that key, so a recorded commit may read them); None: one-off tensors (a warm-up's, eager).
    recording: Any = None
    # The path whose recurrent steps `commit` replayed into the live state, where a family keeps its steps'
    # inputs rather than every node's state (qwen35's `ReplayedRecurrence`): a later commit may only extend it.
    replayed: list[int] = attrs.Factory(list)


class FeatureCapture:
    """The drafter's feature ring, as methods of a family's model."""

    def enable_capture(self, state: Any, layers: Collection[int], capacity: int) -> None:
        """Keep the outputs of `layers` (0-based: transformers' `hidden_states[i + 1]`) of every committed
        position in a ring of `capacity` rows, for a drafter. Positions already seen are not captured."""
        bad = [i for i in layers if not 0 <= i < len(self.layers)]
        if bad:
            raise LuceboxError(f"cannot capture layers {bad}: the target has {len(self.layers)} layers")
        width = len(layers) * self.hidden_size
        if (state.features is not None and state.capture_layers == tuple(layers)
                and tuple(state.features.shape) == (capacity, width)):
            # A reused state: the same ring, which its recorded decode steps write into.
            state.features.zero_()
            return
        state.capture_layers = tuple(layers)
        device = getattr(self, "feature_device", None) or self.ops.device  # a split model's: the head's
        state.features = torch.zeros(capacity, width, device=device, dtype=self.ops.dtype)

    def read_features(self, state: Any, start: int, end: int) -> torch.Tensor:
        """Captured features of committed positions `start .. end-1` (`[end - start, n * hidden]`)."""
        assert state.features is not None, "enable_capture was not called on this state"
        capacity = state.features.shape[0]
        if start < end - capacity or end > state.length:
            raise LuceboxError(f"features of positions {start}..{end - 1} are not held (ring of {capacity})")
        slots = torch.arange(start, end, device=state.features.device) % capacity
        return state.features[slots]

    def _concat_taps(self, state: Any, taps: list[torch.Tensor]) -> torch.Tensor:
        # `taps` follow layer order; the ring follows `capture_layers` order.
        # A split model's taps sit on their layers' devices: each goes to the ring's.
        order = sorted(state.capture_layers)
        device = state.features.device if state.features is not None else taps[0].device
        return torch.cat([taps[order.index(i)].to(device, non_blocking=True) for i in state.capture_layers], dim=-1)

    def _store_features(self, state: Any, start: int, rows: torch.Tensor) -> None:
        assert state.features is not None
        capacity = state.features.shape[0]
        start += max(0, len(rows) - capacity)  # a run longer than the ring keeps its last `capacity` rows
        rows = rows[-capacity:]
        slots = torch.arange(start, start + len(rows), device=state.features.device) % capacity
        state.features[slots] = rows.to(state.features.dtype)
