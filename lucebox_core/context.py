"""How many positions a sequence gets: `-c N`, or by default what fits.

What fits is the model's trained context, capped by the KV cache the memory left after loading holds for
each of the `-np` sequences (the `full` policy allocates a sequence's whole KV up front): on a GPU, the
free device memory less a reserve for activations, logits, graphs and the drafter; on the CPU, half the
available RAM, and at most `CPU_CONTEXT_CAP` positions (a CPU prefills a few hundred tokens a second at
best, and the weight cache grows after loading). The embedded default model always gets at least
`DEFAULT_MODEL_CONTEXT` (it is tiny; coding agents open with prompts of 6,000 tokens and more). A model
split over devices (`--target-devices`) is fitted per device: each holds its own parts' KV, and the device
whose budget runs out first decides (it is the one named).
"""

from __future__ import annotations

from typing import Any

import attrs

CPU_CONTEXT_CAP = 32_768
DEFAULT_MODEL_CONTEXT = 32_768
FALLBACK_CONTEXT = 32_768  # a model that does not describe its KV layers: its size per position is unknown
LEAST_CONTEXT = 2_048  # memory that fits less than this is reported, not obeyed: a smaller model is the fix
GRANULE = 256  # chosen sizes are whole multiples of this (kernels tile the cache in blocks of it)
DEVICE_RESERVE_BYTES = 1 << 30  # plus DEVICE_RESERVE_FRACTION of the free memory, kept out of the KV budget
DEVICE_RESERVE_FRACTION = 0.10


@attrs.frozen
class ContextChoice:
    """The context chosen and the figures it was chosen from (shown at start-up and in `/props`)."""

    size: int
    trained: int  # the model's own context length (GGUF metadata)
    requested: int | None  # -c, or None for "what fits"
    fits: int | None = None  # positions whose KV the memory holds per sequence (None: not measured)
    kv_bytes_per_position: int | None = None
    budget_bytes: int | None = None  # memory set aside for each sequence's KV
    device: str = "cpu"
    cap: int | None = None  # the CPU cap or the default model's floor, where one applied

    def describe(self) -> str:
        if self.requested is not None:
            clipped = f", -c {self.requested} clipped to the trained context" if self.requested > self.trained else ""
            return f"context {self.size} (-c{clipped})"
        parts = [f"trained {self.trained}"]
        if self.fits is not None:
            parts.append(f"memory holds {self.fits} on {self.device}")
        if self.cap is not None:
            parts.append(f"cap {self.cap}")
        return f"context {self.size} (what fits: {', '.join(parts)}; -c N overrides)"

    def as_dict(self) -> dict[str, Any]:
        return {"n_ctx": self.size, "chosen_by": "-c" if self.requested is not None else "auto",
                "n_ctx_train": self.trained, "requested": self.requested, "memory_fits": self.fits,
                "kv_bytes_per_position": self.kv_bytes_per_position, "device": self.device}


def kv_bytes_per_position(model: Any) -> int | None:
    """Bytes one more position takes in the model's KV cache (sliding-window layers keep a fixed ring and do
    not count), or None for a model that does not describe its KV layers."""
    from .kv import kv_bytes_per_token

    shapes = getattr(model, "kv_layer_shapes", None)
    k_type, v_type = getattr(model, "cache_type_k", None), getattr(model, "cache_type_v", None)
    if shapes is None or k_type is None or v_type is None:
        return None
    return sum(kv_bytes_per_token(shape, k_type, v_type) for shape in shapes().values() if not shape.window)


def fit_context(loaded: Any, *, parallel: int = 1, requested: int | None = None,
                default_model: bool = False) -> ContextChoice:
    """The context for sequences of `loaded` (a `LoadedModel`, weights in place): `requested` (clipped to the
    trained context), else what fits (see the module's doc)."""
    model, backend = loaded.model, loaded.backend
    trained = int(model.context_length)
    device = str(getattr(backend, "device", "cpu"))
    if requested is not None:
        return ContextChoice(min(requested, trained), trained, requested, device=device)
    per_position = kv_bytes_per_position(model)
    on_cpu = device.startswith("cpu")
    fits = budget = None
    split = split_memory(model, parallel)
    if split is not None:  # a split model: the device whose share of the KV runs out first decides
        fits, per_position, budget, device = split
        on_cpu = device.startswith("cpu")
    else:
        free = backend.free_memory() if hasattr(backend, "free_memory") else None
        if per_position is not None and free is not None:
            budget = kv_budget(free, on_cpu, parallel)
            fits = max(0, budget) // max(1, per_position) // GRANULE * GRANULE
    size = min(trained, fits if fits is not None else FALLBACK_CONTEXT)
    cap = None
    if on_cpu and size > CPU_CONTEXT_CAP:
        size = cap = CPU_CONTEXT_CAP
    size = max(size, min(trained, LEAST_CONTEXT))
    if default_model and size < min(trained, DEFAULT_MODEL_CONTEXT):
        size = cap = min(trained, DEFAULT_MODEL_CONTEXT)
    return ContextChoice(size, trained, None, fits, per_position, budget, device, cap)


def kv_budget(free: int, on_cpu: bool, parallel: int) -> int:
    """Bytes of one device's free memory set aside for each sequence's KV (see the module's doc)."""
    if on_cpu:
        return free // 2 // max(1, parallel)
    return int((free - DEVICE_RESERVE_BYTES) * (1 - DEVICE_RESERVE_FRACTION)) // max(1, parallel)


def split_memory(model: Any, parallel: int) -> tuple[int, int, int, str] | None:
    """For a model split over devices (`model.device_map`, a backend per part in `model.part_ops`): each
    device holds the KV of its parts' layers only, so what fits there is its own budget over its own bytes a
    position; the context is the least of those. (positions, bytes a position there, budget there, device)
    of the device that decides, or None for a model on one device or one that does not describe its KV."""
    from .kv import kv_bytes_per_token

    device_map, part_ops = getattr(model, "device_map", None), getattr(model, "part_ops", None)
    shapes = getattr(model, "kv_layer_shapes", None)
    k_type, v_type = getattr(model, "cache_type_k", None), getattr(model, "cache_type_v", None)
    if device_map is None or not device_map.is_split or not part_ops or shapes is None or k_type is None:
        return None
    per_device: dict[str, int] = {}
    backend_of: dict[str, Any] = {}
    for layer, shape in shapes().items():
        part = device_map.layer_part(layer)
        device = str(part_ops[part].device)
        backend_of.setdefault(device, part_ops[part])
        if not shape.window:
            per_device[device] = per_device.get(device, 0) + kv_bytes_per_token(shape, k_type, v_type)
    choice = None
    for device, per_position in per_device.items():
        backend = backend_of[device]
        if not hasattr(backend, "free_memory"):
            return None
        budget = kv_budget(backend.free_memory(), device.startswith("cpu"), parallel)
        fits = max(0, budget) // max(1, per_position) // GRANULE * GRANULE
        if choice is None or fits < choice[0]:
            choice = (fits, per_position, budget, device)
    return choice
