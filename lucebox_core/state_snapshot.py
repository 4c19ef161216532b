"""Snapshots of a sequence's model state at a position, for the prefix cache.

A snapshot is everything a model's per-sequence state holds after `length` positions, as named host
tensors: the KV policy's rows (`KVCache.export_rows`), the recurrent state a hybrid model carries (its
linear-attention layers' convolution and recurrent tensors), and the drafter's feature ring rows of the last positions (what a
DFlash drafter re-projects its context from). Restoring one writes those tensors back *into the live
buffers* (in place: recorded decode steps and verify passes hold their addresses) and sets the length, so
the next forward call continues exactly as if the positions had been prefilled.

A family's model mixes `StateSnapshots` in; its state has the fields `kv`, `length`, `captured` and
(optionally) `features`, as the families' states do. A family with more per-sequence state returns it from
`recurrent_state_tensors` (live tensors, copied whole). Restoring checks every tensor's name, shape and dtype
against the live state first, and changes nothing when one does not match (a snapshot from another
configuration is refused, never half-loaded).
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import LuceboxError

FEATURES = "features"


class SnapshotMismatch(LuceboxError):
    """A snapshot that does not fit the live state (another model, KV type, context or drafter)."""


class StateSnapshots:
    """`snapshot_state` / `restore_state` as methods of a family's model (see the module's docstring)."""

    def recurrent_state_tensors(self, state: Any) -> dict[str, torch.Tensor]:
        """Per-sequence tensors besides the KV cache and the feature ring (copied whole); none by default."""
        return {}

    def snapshot_state(self, state: Any) -> dict[str, torch.Tensor]:
        """Host copies of everything `state` holds at its length (see the module's docstring)."""
        length = int(state.length)
        export = getattr(state.kv, "export_rows", None)
        if export is None:
            raise SnapshotMismatch(f"the KV policy's cache ({type(state.kv).__name__}) cannot export its rows")
        tensors = {f"kv.{name}": rows for name, rows in export(length).items()}
        tensors.update({f"state.{name}": t for name, t in self.recurrent_state_tensors(state).items()})
        features = getattr(state, "features", None)
        if features is not None and length:
            capacity = features.shape[0]
            slots = torch.arange(max(0, length - capacity), length, device=features.device) % capacity
            tensors[FEATURES] = features[slots]
        return {name: _host_copy(t) for name, t in tensors.items()}

    def restore_state(self, state: Any, tensors: dict[str, torch.Tensor], length: int) -> None:
        """Make `state` (empty, as a new sequence's) hold what `tensors` (from `snapshot_state` at `length`)
        held; a SnapshotMismatch, with `state` untouched, if they do not fit it."""
        if int(state.length) != 0:
            raise LuceboxError("a snapshot is restored into an empty sequence only")
        kv = {name[3:]: t for name, t in tensors.items() if name.startswith("kv.")}
        recurrent = {name[6:]: t for name, t in tensors.items() if name.startswith("state.")}
        live = self.recurrent_state_tensors(state)
        if set(recurrent) != set(live):
            raise SnapshotMismatch(f"the snapshot holds recurrent state {sorted(recurrent)}, the model {sorted(live)}")
        for name, saved in recurrent.items():
            _check_fits(f"state.{name}", saved, live[name].shape, live[name].dtype)
        features = getattr(state, "features", None)
        saved_features = tensors.get(FEATURES)
        if (saved_features is None) != (features is None or length == 0):
            raise SnapshotMismatch("the snapshot and the sequence disagree on a drafter's feature ring")
        if features is not None and saved_features is not None:
            rows = min(length, features.shape[0])
            _check_fits(FEATURES, saved_features, (rows, features.shape[1]), features.dtype)
        import_rows = getattr(state.kv, "import_rows", None)
        if import_rows is None:
            raise SnapshotMismatch(f"the KV policy's cache ({type(state.kv).__name__}) cannot import rows")
        try:
            import_rows(kv, length, check_only=True)
        except LuceboxError as exc:
            raise SnapshotMismatch(str(exc)) from None
        # Everything fits: write (in place) and move the length.
        import_rows(kv, length)
        for name, saved in recurrent.items():
            live[name].copy_(saved, non_blocking=True)
        if features is not None and saved_features is not None:
            capacity = features.shape[0]
            slots = torch.arange(length - saved_features.shape[0], length, device=features.device) % capacity
            features[slots] = saved_features.to(features.device, non_blocking=True)
        state.length = length
        state.captured = {}


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of `tensor`; in pinned memory when it comes from a GPU, so that restoring it
    is one DMA at the link's speed (a 32K-token snapshot of the 27B is 2.2 GB: ~0.1 s pinned, several times
    that from pageable memory, which the driver stages through a bounce buffer)."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.to("cpu", copy=True).contiguous()
    from .torch_backend import host_memory

    host = host_memory(tuple(tensor.shape), tensor.dtype, pinned=True)
    host.copy_(tensor)
    return host


def _check_fits(name: str, saved: torch.Tensor, shape: Any, dtype: torch.dtype) -> None:
    if tuple(saved.shape) != tuple(shape) or saved.dtype != dtype:
        raise SnapshotMismatch(f"snapshot tensor {name} is {tuple(saved.shape)} {saved.dtype}, the live state "
                               f"needs {tuple(shape)} {dtype}")
