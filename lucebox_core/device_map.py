"""Where each part of a model runs: the target's layers cut into contiguous parts, one torch device each, and
the drafter's device (`--target-device`, `--target-devices` with `--target-layer-split`, `--draft-device`).

A `DeviceMap` knows devices only as torch device strings; it names no GPU and no family. A family that can
split places each layer's weights, KV and recurrent state on `layer_device(i)`, runs the embedding on
`embed_device` and the final norm and output head on `head_device`, and calls `hand_over` on the hidden
state where consecutive layers belong to different parts. The hand-over goes by part index, not by device
equality: two parts on the same device still copy, so a split onto `cpu,cpu` runs the very code path a
split onto two GPUs runs (there the copy is a peer copy where the GPUs allow it). A split model's static
steps (the decode step, the verify pass) run a recording per part instead (`split_step`), the hand-over
copied into the next part's static buffers between replays. The split changes no arithmetic: every op runs
the same kernels on the same values, so output is bit-identical to one device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from .errors import LuceboxError

TARGET_DEVICE_FLAG = "--target-device"
TARGET_DEVICES_FLAG = "--target-devices"
SPLIT_FLAG = "--target-layer-split"
DRAFT_DEVICE_FLAG = "--draft-device"


def available_devices() -> list[str]:
    """The torch devices this machine has: `cpu`, then `cuda:0 ..` (ROCm's GPUs answer as cuda too)."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devices


def check_device(text: str, flag: str) -> str:
    """`text` as a torch device string this machine has (`cuda` alone means `cuda:0`); a LuceboxError naming
    `flag` and the devices that exist otherwise."""
    try:
        device = torch.device(text.strip())
    except (RuntimeError, ValueError):
        raise LuceboxError(f"{flag}: {text!r} is not a torch device (e.g. cpu, cuda:0); this machine has "
                           f"{', '.join(available_devices())}") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    name = str(device)
    if device.type in ("cpu", "meta"):
        return device.type
    if name not in available_devices():
        raise LuceboxError(f"{flag}: no device {name} on this machine; it has {', '.join(available_devices())}")
    return name


def split_values(text: str, parts: int) -> list[float]:
    """The numbers of `--target-layer-split`, one positive number per device (what can be checked before
    the model's layer count is known)."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise LuceboxError(f"{SPLIT_FLAG}: expected comma-separated fractions or layer counts, got {text!r}") from None
    if len(values) != parts:
        raise LuceboxError(f"{SPLIT_FLAG}: {len(values)} parts for the {parts} devices of {TARGET_DEVICES_FLAG}")
    if any(not v > 0 for v in values):
        raise LuceboxError(f"{SPLIT_FLAG}: every part must be positive, got {text!r}")
    return values


def parse_split(text: str, parts: int, layers: int) -> list[int]:
    """Layers per part from `--target-layer-split`: fractions summing to 1 (`0.5,0.5`) or layer counts
    summing to the layer count (`14,10`); every part gets at least one layer."""
    values = split_values(text, parts)
    if parts > layers:
        raise LuceboxError(f"{TARGET_DEVICES_FLAG}: {parts} parts for a model of {layers} layers")
    if all(v == int(v) for v in values) and sum(values) == layers:
        counts = [int(v) for v in values]
    elif abs(sum(values) - 1.0) < 1e-6:
        # Fractions: cumulative boundaries rounded, so the counts always add up to the layer count.
        bounds, total = [0], 0.0
        for v in values:
            total += v
            bounds.append(round(total * layers))
        bounds[-1] = layers
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
    else:
        raise LuceboxError(f"{SPLIT_FLAG}: {text!r} sums to {sum(values):g}: give fractions summing to 1 or layer "
                           f"counts summing to the model's {layers} layers")
    if any(c < 1 for c in counts):
        raise LuceboxError(f"{SPLIT_FLAG}: {text!r} leaves a part without layers ({counts} of {layers})")
    return counts


@attrs.frozen
class DeviceMap:
    """The target's parts (a device each, contiguous layers each) and the drafter's device."""

    devices: tuple[str, ...]  # one per part, in layer order; parts may share a device
    layer_parts: tuple[int, ...]  # part index of each layer
    draft_device: str | None = None  # None: the drafter runs on the embedding's device

    @classmethod
    def single(cls, device: str, layers: int, draft_device: str | None = None) -> DeviceMap:
        return cls((device,), (0,) * layers, draft_device)

    @classmethod
    def from_split(cls, devices: Sequence[str], counts: Sequence[int], draft_device: str | None = None) -> DeviceMap:
        parts = tuple(part for part, count in enumerate(counts) for _ in range(count))
        return cls(tuple(devices), parts, draft_device)

    @property
    def parts(self) -> int:
        return len(self.devices)

    @property
    def is_split(self) -> bool:
        return self.parts > 1

    @property
    def physical_devices(self) -> tuple[str, ...]:
        """The distinct devices the target's parts use, in order."""
        return tuple(dict.fromkeys(self.devices))

    def layer_part(self, layer: int) -> int:
        return self.layer_parts[layer]

    def layer_device(self, layer: int) -> str:
        return self.devices[self.layer_parts[layer]]

    @property
    def embed_device(self) -> str:
        return self.devices[0]

    @property
    def head_device(self) -> str:
        return self.devices[-1]

    def part_layers(self, part: int) -> list[int]:
        return [i for i, p in enumerate(self.layer_parts) if p == part]

    def describe(self) -> dict[str, Any]:
        """What /props and the log report."""
        return {
            "parts": [{"device": device, "layers": _ranges(self.part_layers(part))}
                      for part, device in enumerate(self.devices)],
            "embed_device": self.embed_device, "head_device": self.head_device,
            "draft_device": self.draft_device,
        }


def _ranges(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers else ""


def hand_over(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """`tensor` copied to `device` at a part boundary: always a copy (the next part owns its activations,
    even when both parts share a device), asynchronous where the devices allow (a peer copy between GPUs,
    ordered after the producer's stream)."""
    return tensor.to(device, non_blocking=True, copy=True)


def build_device_map(*, device: str | None, target_device: str | None, target_devices: str | None,
                     layer_split: str | None, draft_device: str | None, layers: int | None) -> DeviceMap | None:
    """The map the flags ask for, checked (unknown devices, a split that does not add up, more parts than
    layers: a LuceboxError naming the flag), or None when no multi-device flag is given. `layers`: the
    target's layer count (None: the split is checked against it later)."""
    if target_device is not None and target_devices is not None:
        raise LuceboxError(f"{TARGET_DEVICE_FLAG} and {TARGET_DEVICES_FLAG} exclude each other")
    if device is not None and (target_device is not None or target_devices is not None):
        raise LuceboxError(f"--device and {TARGET_DEVICE_FLAG}/{TARGET_DEVICES_FLAG} exclude each other "
                           f"(--device is {TARGET_DEVICE_FLAG}'s older name)")
    if layer_split is not None and target_devices is None:
        raise LuceboxError(f"{SPLIT_FLAG} needs {TARGET_DEVICES_FLAG}")
    draft = check_device(draft_device, DRAFT_DEVICE_FLAG) if draft_device is not None else None
    if target_devices is None:
        if target_device is None and draft is None:
            return None
        base = check_device(target_device or device or _default_device(), TARGET_DEVICE_FLAG)
        return DeviceMap.single(base, layers or 1, draft)
    devices = [check_device(d, TARGET_DEVICES_FLAG) for d in target_devices.split(",") if d.strip()]
    if not devices:
        raise LuceboxError(f"{TARGET_DEVICES_FLAG}: no device in {target_devices!r}")
    if layers is None:  # the default model, not chosen yet: the split is checked once its header is read
        if layer_split is not None:
            split_values(layer_split, len(devices))
        return None
    # No split given: layers shared out evenly.
    counts = parse_split(layer_split or ",".join(f"{1 / len(devices)!r}" for _ in devices), len(devices), layers)
    return DeviceMap.from_split(devices, counts, draft)


def _default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def model_layer_count(gguf_file: Any) -> int | None:
    """The target's layer count from its GGUF header (`<arch>.block_count`), None where it has none."""
    value = gguf_file.metadata.get(f"{gguf_file.architecture}.block_count")
    return None if value is None else int(value)


class SplitKVCache:
    """One sequence's KV cache over a split model: one cache per part (made by the KV policy, on the part's
    device, for the part's attention layers), addressed by layer like a single cache. Whole-sequence
    bookkeeping (`commit`, `rollback`, `move`, `ensure_room`) goes to every part."""

    def __init__(self, caches: Mapping[int, Any], layer_parts: Mapping[int, int]) -> None:
        self._caches = dict(caches)  # part -> KVCache
        self._part_of = dict(layer_parts)  # cached layer -> part
        first = next(iter(self._caches.values()))
        self.max_context, self.k_type, self.v_type, self.dtype = first.max_context, first.k_type, first.v_type, first.dtype
        self.shapes = {layer: shape for cache in self._caches.values() for layer, shape in cache.shapes.items()}

    def __repr__(self) -> str:
        return f"SplitKVCache({', '.join(f'part {p}: {c!r}' for p, c in self._caches.items())})"

    def _of(self, layer: int) -> Any:
        return self._caches[self._part_of[layer]]

    @property
    def length(self) -> int:
        return max(cache.length for cache in self._caches.values())

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self._caches.values())

    @property
    def bytes_per_token(self) -> int:
        return sum(cache.bytes_per_token for cache in self._caches.values())

    def ensure_room(self, new_tokens: int) -> None:
        for cache in self._caches.values():
            cache.ensure_room(new_tokens)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self._of(layer).append(layer, k, v)

    def read(self, layer: int):
        return self._of(layer).read(layer)

    def as_stored(self, k: torch.Tensor, v: torch.Tensor):
        return next(iter(self._caches.values())).as_stored(k, v)  # every part stores the same types

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        cache = self._of(layer)
        cache.write(layer, positions.to(k.device), k, v)

    def gather(self, layer: int, size: int):
        return self._of(layer).gather(layer, size)

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        for cache in self._caches.values():
            device = getattr(cache, "device", source.device)
            cache.move(source.to(device), destination.to(device))

    def commit(self, length: int) -> None:
        for cache in self._caches.values():
            cache.commit(length)

    def rollback(self, length: int) -> None:
        for cache in self._caches.values():
            cache.rollback(length)

    def export_rows(self, length: int) -> dict[str, torch.Tensor]:
        rows: dict[str, torch.Tensor] = {}
        for cache in self._caches.values():
            rows.update(cache.export_rows(length))
        return rows

    def import_rows(self, rows: Mapping[str, torch.Tensor], length: int, *, check_only: bool = False) -> None:
        """Each part takes its layers' rows (a snapshot does not depend on the split that wrote it)."""
        strangers = sorted(name for name in rows if int(name.split(".")[0]) not in self._part_of)
        if strangers:
            raise LuceboxError(f"these KV rows name layers this cache does not hold: {', '.join(strangers[:4])}")
        for check in (True, False) if not check_only else (True,):  # every part checked before any is written
            for cache in self._caches.values():
                mine = {name: rows[name] for name in rows if int(name.split(".")[0]) in cache.shapes}
                cache.import_rows(mine, length, check_only=check)
