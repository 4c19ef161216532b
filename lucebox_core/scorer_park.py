"""Where PFlash's scorer lives between requests: resident beside the target, or parked (loaded per use).

On a small card the target's weights and KV take most of the memory; a resident scorer (Qwen3-0.6B: about
1.2 GB of weights, and keys for every prompt token it reads) would then leave the target too little, or not
load at all. Parked, the scorer is loaded for each compression, used, and released (its weights, its keys and
its backend's cached weights freed, the allocator's cache returned) before the target's prefill runs.

`decide_residency` makes the choice once, after the target is loaded, from the device's free memory; the
`ScorerResidency` it returns says which and why (`/props` reports it). `ScorerSlot` holds the scorer
accordingly, lends it (`run`) and counts its loads (`/metrics`).
"""

from __future__ import annotations

import gc
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch

# Beyond the scorer's weights and keys: its activations (a layer's queries, values and MLP rows over the
# prompt) and the allocator's fragmentation.
PARK_MARGIN_BYTES = 512 * 2**20


@attrs.frozen(kw_only=True)
class ScorerResidency:
    """Whether the scorer stays loaded, and why: the figures the choice was made from."""

    parked: bool
    reason: str
    device: str
    free_bytes: int | None = None  # the device's free memory once the target was loaded
    weight_bytes: int = 0  # the scorer's tensors
    kv_bytes: int = 0  # its keys and values over the longest prompt it may read
    margin_bytes: int = PARK_MARGIN_BYTES

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.margin_bytes

    def describe(self) -> dict[str, Any]:
        return {"residency": "parked" if self.parked else "resident", "reason": self.reason, "device": self.device,
                "free_bytes": self.free_bytes, "needed_bytes": self.needed_bytes, "weight_bytes": self.weight_bytes,
                "kv_bytes": self.kv_bytes}


def decide_residency(*, device: str, free_bytes: int | None, weight_bytes: int, kv_bytes: int,
                     skip_park: bool = False, force_park: bool = False,
                     margin_bytes: int = PARK_MARGIN_BYTES) -> ScorerResidency:
    """Resident when asked (`--prefill-skip-park`), off a GPU, or when weights + KV + margin fit in the free
    memory; parked when they do not (or when a test forces it)."""
    figures = dict(device=device, free_bytes=free_bytes, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                   margin_bytes=margin_bytes)
    mib = 2**20
    if skip_park:
        return ScorerResidency(parked=False, reason="--prefill-skip-park keeps the scorer loaded", **figures)
    if force_park:
        return ScorerResidency(parked=True, reason="parking forced (testing)", **figures)
    if torch.device(device).type != "cuda" or free_bytes is None:
        # Parking saves device memory beside the target's weights and KV; off a GPU both live in host RAM,
        # which is not the limit this addresses (and reloading the scorer would cost every request).
        return ScorerResidency(parked=False, reason=f"on {device}: parking saves GPU memory only", **figures)
    needed = weight_bytes + kv_bytes + margin_bytes
    if free_bytes >= needed:
        return ScorerResidency(parked=False, reason=f"fits: {free_bytes // mib} MiB free beside the target, "
                                                    f"{needed // mib} MiB needed", **figures)
    return ScorerResidency(parked=True, reason=f"does not fit beside the target: {free_bytes // mib} MiB free, "
                                               f"{needed // mib} MiB needed (weights, keys over "
                                               f"the longest prompt, margin)", **figures)


_NOT_WEIGHTS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType, threading.Thread)


def tensor_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages reachable from `root` through attributes, lists, tuples and dicts
    (a model's weights, whatever the family keeps them in)."""
    seen_objects: set[int] = set()
    seen_storages: set[tuple[str, int]] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, _NOT_WEIGHTS):
            continue
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
        elif attrs.has(type(obj)):  # slotted attrs classes (QuantTensor)
            stack.extend(getattr(obj, field.name, None) for field in attrs.fields(type(obj)))
    return total


def scorer_kv_bytes(model: Any, tokens: int) -> int:
    """The keys and values a scorer holds over a prompt of `tokens`, in its compute dtype (every layer)."""
    element = torch.empty((), dtype=model.ops.dtype).element_size()
    shapes = model.kv_layer_shapes().values()
    per_token = sum(shape.kv_heads * (shape.k_head_dim + shape.v_head_dim) for shape in shapes)
    return per_token * element * tokens


@attrs.define
class ScorerStats:
    loads: int = 0  # loads for a use (while parked), the first (at start-up, to check and measure) not counted
    load_seconds: float = 0.0


class ScorerSlot:
    """The scorer, resident or parked (see `run`)."""

    def __init__(self, load: Callable[[], Any], residency: ScorerResidency, model: Any = None, *,
                 first_load: Callable[[], Any] | None = None, release_memory: Callable[[], None] | None = None):
        """`load()`: a new scorer model; `model`: the resident one (None while parked: the caller drops its
        first load before this frees it); `first_load`: a weak reference to that first load, so `loaded` says
        whether it is gone; `release_memory`: returns freed device memory to the device (default: torch's CUDA
        cache)."""
        if residency.parked and model is not None:
            raise ValueError("a parked scorer slot holds no model between uses")
        if not residency.parked and model is None:
            raise ValueError("a resident scorer slot needs its model")
        self.residency = residency
        self.stats = ScorerStats()
        self._load = load
        self._model = model
        self._release_memory = release_memory or _empty_device_cache
        self._lock = threading.Lock()
        # A weak reference to the last parked load (or the start-up one): `loaded` tells whether it is freed.
        self._last_loaded: Callable[[], Any] = first_load if residency.parked and first_load else lambda: None
        if residency.parked:
            self._release()  # the first load, dropped by the caller

    @property
    def loaded(self) -> bool:
        """Whether a scorer model is alive now (resident, or a parked load not yet collected)."""
        return self._model is not None or self._last_loaded() is not None

    def run(self, function: Callable[[Any], Any]) -> Any:
        """`function(scorer)`'s answer: the resident scorer lent as it is; while parked, a fresh load
        (serialized: two at once would need twice the memory parking saves), released before returning. A
        call, not a context manager: a `with ... as` name would keep the parked model alive after the block."""
        if self._model is not None:
            return function(self._model)
        with self._lock:
            start = time.perf_counter()
            model = self._load()
            self.stats.loads += 1
            self.stats.load_seconds += time.perf_counter() - start
            self._last_loaded = weakref.ref(model)
            try:
                return function(model)
            finally:
                del model
                self._release()

    def _release(self) -> None:
        gc.collect()  # a model's objects may sit in reference cycles, which only the cycle collector frees
        self._release_memory()

    def describe(self) -> dict[str, Any]:
        return {**self.residency.describe(), "loads": self.stats.loads, "load_seconds": self.stats.load_seconds,
                "loaded": self.loaded}


def _empty_device_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
