"""Spark: MoE experts that do not all fit on the GPU, kept hot where routing traffic says (foundations).

Three parts, each independent of any family and device:

- `RoutingProfile`: per (layer, expert) routing counts, accumulated from live traffic (`observe`), saved
  beside the model as `MODEL.gguf.spark.csv` (`layer,expert,count` lines) and loaded at the next start; a
  malformed file is refused with the line at fault, never half-read.
- `place_experts`: which experts are resident, under a byte budget: the most used per byte first (counts
  from a profile; uniform when there is none), at least `min_per_layer` in every layer.
- `ExpertSlots`: one layer's expert stack as a fixed pool of device slots (raw bytes of the GGUF blocks,
  one row an expert) filled from a host copy of every expert, with a device lookup table expert -> slot
  (-1: not resident). `resident_ids(ids)` brings the experts a batch routes to into slots (least recently
  used out first) and returns the ids mapped to slots, so a routed-expert op runs over the slot stack
  unchanged: the same bytes, the same arithmetic, the same output as the all-resident stack.

`OffloadedExperts` puts one MoE layer's three stacks (gate, up, down) behind such pools and runs the
routed-expert op over them; a batch that routes to more experts than the pool holds runs in groups of
experts that fit, summed in fp32 (then not bit-identical to the all-resident sum: greedy tokens are what
the tests hold equal). `attach_spark` gives every MoE block of a model (any family whose MoE block has
`gate_exps`, `up_exps`, `down_exps`, `top_k` and an `offload` slot, and calls `run_experts`) its pools, sized by
`place_experts` from a profile under a byte budget.

The stacks never go to the GPU whole: a GPU backend reads weights from the file's memory map and uploads them
at first use, and Spark replaces the stacks with its pools before any forward pass, so every expert's bytes
sit once in pinned host memory and only the slots are on the device. Not done yet: the CPU path for a
batch-1 miss, and a graphed decode step over the lookup tables (with Spark on, decode and verify run
eagerly).
"""

from __future__ import annotations

import csv
import io
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .errors import LuceboxError

PROFILE_SUFFIX = ".spark.csv"


class RoutingProfile:
    """Routing counts `[layers, experts]` (int64), safe to update from several generation threads."""

    def __init__(self, layers: int, experts: int, counts: torch.Tensor | None = None):
        self.layers, self.experts = layers, experts
        self.counts = counts if counts is not None else torch.zeros(layers, experts, dtype=torch.int64)
        self._lock = threading.Lock()

    def observe(self, layer: int, ids: torch.Tensor) -> None:
        """Count the experts a batch was routed to (`ids` `[T, k]`, any device)."""
        bins = torch.bincount(ids.reshape(-1).to("cpu", torch.int64), minlength=self.experts)[: self.experts]
        with self._lock:
            self.counts[layer] += bins

    @staticmethod
    def path_for(model_path: str | os.PathLike) -> Path:
        return Path(f"{model_path}{PROFILE_SUFFIX}")

    def save(self, path: str | os.PathLike) -> None:
        """Write `layer,expert,count` lines (non-zero counts) atomically."""
        out = io.StringIO()
        out.write("layer,expert,count\n")
        with self._lock:
            for layer, expert in torch.nonzero(self.counts).tolist():
                out.write(f"{layer},{expert},{int(self.counts[layer, expert])}\n")
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(out.getvalue())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike, layers: int, experts: int) -> RoutingProfile:
        """The profile in `path`, for a model of `layers` x `experts`; a LuceboxError naming the line at fault."""
        counts = torch.zeros(layers, experts, dtype=torch.int64)
        try:
            lines = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise LuceboxError(f"{path}: cannot read the Spark profile ({exc})") from None
        if not lines or lines[0].strip() != "layer,expert,count":
            raise LuceboxError(f"{path}: not a Spark profile (its first line must be 'layer,expert,count')")
        for number, row in enumerate(csv.reader(lines[1:]), start=2):
            try:
                layer, expert, count = (int(v) for v in row)
            except ValueError:
                raise LuceboxError(f"{path}, line {number}: expected three integers, got {row}") from None
            if not (0 <= layer < layers and 0 <= expert < experts) or count < 0:
                raise LuceboxError(f"{path}, line {number}: layer {layer} expert {expert} count {count} does not fit "
                                   f"a model of {layers} MoE layers and {experts} experts")
            counts[layer, expert] += count
        return cls(layers, experts, counts)


def place_experts(counts: torch.Tensor, expert_bytes: Sequence[int], budget: int, *,
                  min_per_layer: int = 1) -> list[list[int]]:
    """Resident experts per layer under `budget` bytes: `min_per_layer` of each layer's most used first,
    then the most routed per byte across layers. `expert_bytes[layer]`: one expert's bytes in that layer.
    Ties go to the lower layer and expert (a stable placement)."""
    layers, experts = counts.shape
    chosen: list[list[int]] = [[] for _ in range(layers)]
    spent = 0
    order = [sorted(range(experts), key=lambda e, l=l: (-int(counts[l, e]), e)) for l in range(layers)]
    for layer in range(layers):
        for expert in order[layer][:min_per_layer]:
            spent += expert_bytes[layer]
            chosen[layer].append(expert)
    if spent > budget:
        raise LuceboxError(f"the expert budget ({budget / 2**30:.2f} GiB) does not hold {min_per_layer} expert(s) a "
                           f"layer ({spent / 2**30:.2f} GiB)")
    rest = [(-int(counts[l, e]) / expert_bytes[l], l, e) for l in range(layers) for e in order[l][min_per_layer:]]
    for _, layer, expert in sorted(rest):
        if spent + expert_bytes[layer] > budget:
            continue
        spent += expert_bytes[layer]
        chosen[layer].append(expert)
    return [sorted(c) for c in chosen]


@attrs.define
class SlotStats:
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0


class ExpertSlots:
    """One layer's experts in `slots` device rows, filled from `host` `[experts, bytes]` (see the module's
    docstring). `initial`: the experts placed resident at the start (at most `slots`)."""

    def __init__(self, host: torch.Tensor, slots: int, device: str | torch.device, initial: Sequence[int] = ()):
        experts = host.shape[0]
        if host.dim() != 2 or not 0 < slots <= experts:
            raise LuceboxError(f"an expert pool needs a [experts, bytes] host stack and 1..{experts} slots, got "
                               f"{tuple(host.shape)} and {slots}")
        if len(initial) > slots:
            raise LuceboxError(f"{len(initial)} experts placed resident do not fit {slots} slots")
        self.host, self.device = host, torch.device(device)
        self.stack = torch.empty(slots, host.shape[1], dtype=host.dtype, device=self.device)
        self.slot_of = torch.full((experts,), -1, dtype=torch.long, device=self.device)
        self._lru: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self._free = list(range(slots))[::-1]
        self.stats = SlotStats()
        for expert in initial:
            self._bring(int(expert))

    @property
    def resident(self) -> list[int]:
        return sorted(self._lru)

    def _bring(self, expert: int) -> None:
        if self._free:
            slot = self._free.pop()
        else:
            evicted, slot = self._lru.popitem(last=False)
            self.slot_of[evicted] = -1
        self.stack[slot].copy_(self.host[expert], non_blocking=True)
        self.slot_of[expert] = slot
        self._lru[expert] = slot
        self.stats.bytes_moved += self.host.shape[1]

    def resident_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (experts, any shape) mapped to the slots now holding them, after bringing in the missing
        ones. A batch may not route to more distinct experts than there are slots."""
        needed = torch.unique(ids).tolist()
        if len(needed) > self.stack.shape[0]:
            raise LuceboxError(f"a batch routes to {len(needed)} experts but the pool has {self.stack.shape[0]} slots")
        for expert in needed:  # hits first, so a miss never evicts an expert this batch needs
            if expert in self._lru:
                self._lru.move_to_end(expert)
                self.stats.hits += 1
        for expert in needed:
            if expert not in self._lru:
                self.stats.misses += 1
                self._bring(expert)
        return self.slot_of[ids.to(self.device)]


# -- wiring: a model's MoE blocks behind slot pools -------------------------------------------------------

STACKS = ("gate_exps", "up_exps", "down_exps")


def run_experts(ops: Any, block: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A MoE block's routed experts: the op over its stacks, or through its Spark pools when it has them."""
    if block.offload is None:
        return ops.moe_experts_swiglu(x, block.gate_exps, block.up_exps, block.down_exps, weights, ids)
    return block.offload(ops, x, weights, ids)


class OffloadedExperts:
    """One MoE layer's gate, up and down stacks behind `ExpertSlots` pools of `slots` experts each."""

    def __init__(self, layer: int, stacks: Sequence[Any], slots: int, resident: Sequence[int],
                 profile: RoutingProfile | None = None, device: str | torch.device | None = None):
        """`device`: where the slots live, the model's compute device (default: where the stacks' bytes are).
        Not the bytes' device by default on a GPU: a GPU backend leaves weights in the file's memory map until
        their first use, so the stacks are still on the host when Spark takes them (and never go up whole)."""
        self.layer, self.profile = layer, profile
        self.slots = slots
        self.pools, self.views = [], []
        for stack in stacks:
            experts = stack.shape[0]
            device = torch.device(device) if device is not None else stack.data.device
            host = stack.data.reshape(experts, -1).to("cpu")
            if device.type == "cuda":
                host = host.pin_memory()  # copies into the slots overlap the step's work
            pool = ExpertSlots(host, slots, device, initial=resident)
            self.pools.append(pool)
            self.views.append(attrs.evolve(stack, name=f"{stack.name}.slots", shape=(slots, *stack.shape[1:]),
                                           data=pool.stack.reshape(-1), volatile=True))

    def __call__(self, ops: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.profile is not None:
            self.profile.observe(self.layer, ids)
        needed = torch.unique(ids)
        if needed.numel() <= self.slots:
            return self._run(ops, x, weights, ids)
        # More experts than slots (a long prefill chunk): groups of experts that fit, in expert order.
        out = torch.zeros(x.shape[0], self.views[2].shape[1], dtype=torch.float32, device=x.device)
        for start in range(0, needed.numel(), self.slots):
            group = needed[start : start + self.slots]
            chosen = torch.isin(ids, group)
            part_ids = torch.where(chosen, ids, group[0])
            out += self._run(ops, x, weights * chosen, part_ids).float()
        return out.to(x.dtype)

    def _run(self, ops: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        mapped = [pool.resident_ids(ids) for pool in self.pools]
        return ops.moe_experts_swiglu(x, *self.views, weights, mapped[0])

    def describe(self) -> dict[str, Any]:
        stats = self.pools[0].stats
        moved = sum(pool.stats.bytes_moved for pool in self.pools)
        return {"layer": self.layer, "slots": self.slots, "experts": self.pools[0].host.shape[0],
                "hits": stats.hits, "misses": stats.misses, "bytes_moved": moved}


@attrs.define
class Spark:
    """What `attach_spark` did to a model: its layers' pools, the profile they count into, and where it is saved."""

    layers: list[OffloadedExperts]
    profile: RoutingProfile
    profile_path: Path | None
    budget: int
    expert_bytes: int  # of every layer's stacks, all experts

    def describe(self) -> dict[str, Any]:
        per_layer = [layer.describe() for layer in self.layers]
        hits = sum(d["hits"] for d in per_layer)
        misses = sum(d["misses"] for d in per_layer)
        resident = sum(d["slots"] for d in per_layer) / max(1, sum(d["experts"] for d in per_layer))
        return {"enabled": True, "budget_bytes": self.budget, "expert_bytes": self.expert_bytes,
                "residency": round(resident, 4), "hits": hits, "misses": misses,
                "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                "bytes_moved": sum(d["bytes_moved"] for d in per_layer),
                "profile": str(self.profile_path) if self.profile_path else None}

    def save_profile(self) -> None:
        if self.profile_path is not None:
            self.profile.save(self.profile_path)


def moe_blocks(model: Any) -> list[tuple[int, Any]]:
    """(layer index, MoE block) of a model whose layers' `mlp` may be a MoE block (see `attach_spark`)."""
    return [(i, layer.mlp) for i, layer in enumerate(getattr(model, "layers", []))
            if all(hasattr(layer.mlp, name) for name in (*STACKS, "top_k", "offload"))]


def attach_spark(model: Any, budget: int | None = None, *, model_path: str | os.PathLike | None = None,
                 share: float = 0.5) -> Spark:
    """Put every MoE block of `model` behind slot pools: resident experts chosen by the profile beside
    `model_path` (uniform when there is none) under `budget` bytes (default: `share` of the experts' bytes),
    at least `top_k` a layer."""
    blocks = moe_blocks(model)
    if not blocks:
        raise LuceboxError(f"--spark: {type(model).__name__} has no MoE layers to offload")
    experts = blocks[0][1].gate_exps.shape[0]
    per_expert = [sum(getattr(block, name).nbytes for name in STACKS) // experts for _, block in blocks]
    total = sum(per_expert) * experts
    budget = int(total * share) if budget is None else budget
    path = RoutingProfile.path_for(model_path) if model_path is not None else None
    profile = (RoutingProfile.load(path, len(blocks), experts) if path is not None and path.is_file()
               else RoutingProfile(len(blocks), experts))
    top_k = max(block.top_k for _, block in blocks)
    placed = place_experts(profile.counts, per_expert, budget, min_per_layer=top_k)
    layers = []
    for moe_index, ((layer, block), resident) in enumerate(zip(blocks, placed)):
        offload = OffloadedExperts(moe_index, [getattr(block, name) for name in STACKS], len(resident), resident,
                                   profile, device=model.ops.device)
        block.offload = offload
        for name in STACKS:  # the full stacks leave the device: the pools hold what is resident
            setattr(block, name, offload.views[STACKS.index(name)])
        layers.append(offload)
    # A pool's lookup runs on the host (which experts a token needs decides what to copy), so the decode step
    # and the verify pass cannot be replayed as graphs over it yet: they run eagerly, exact all the same.
    model.decode_graphs = False
    return Spark(layers, profile, path, budget, total)

