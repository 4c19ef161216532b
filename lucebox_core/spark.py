"""Spark: MoE experts that do not all fit on the GPU, kept hot where routing traffic says.

Three parts, each independent of any family and device:

- `RoutingProfile`: per (layer, expert) routing counts, accumulated from live traffic (`observe`), saved
  beside the model as `MODEL.gguf.spark.csv` (`layer,expert,count` lines) and loaded at the next start; a
  malformed file is refused with the line at fault, never half-read.
- `place_experts`: which experts are resident, under a byte budget: the most used per byte first (counts
  from a profile; uniform when there is none), at least `min_per_layer` in every layer.
- `ExpertSlots`: one layer's expert stack as a fixed pool of device slots (raw bytes of the GGUF blocks,
  one row an expert) filled from a host copy of every expert, with a device lookup table expert -> slot
  (-1: not resident); the least routed resident out first (its count in the profile; ties: the least
  recently used), least recently used where it has no counts.

Spark knows no family's experts: a MoE block declares them as an `ExpertLayout` (its `expert_layout`): the
attributes holding its expert stacks, the op that runs the experts over them and that op's paged variant
(`SWIGLU_EXPERTS`: separate gate, up and down stacks and the core's `moe_experts_swiglu`; a family may name
its own, such as a fused `[gate | up]` stack and a GeGLU op). `OffloadedExperts` puts one MoE layer's stacks
behind such pools, one table for all of them. `attach_spark` gives every MoE block of a model (a layer's
`mlp` or `moe` that declares its layout, has `top_k` and an `offload` slot, and calls `run_experts`) its
pools, sized by `place_experts` from a profile under a byte budget. The stacks never go to the GPU whole: a
GPU backend reads weights from the file's memory map and uploads them at first use, and Spark replaces the
stacks with its pools before any forward pass, so every expert's bytes sit once in pinned host memory and
only the slots are on the device.

Two ways to run a layer's routed experts, both exact:

- Graphed (the decode step and the static verify pass, where the backend records graphs and runs the layout's
  paged op, e.g. `moe_experts_swiglu_paged`): each stack is an `ExpertPages` (slots, host stack, table), and
  the op reads a resident expert from its slot and any other straight from pinned host memory (zero-copy over
  the bus: on CUDA the paged `moe_matvec` kernel): no host decision inside the step, the same bytes and the
  same arithmetic as the all-resident stack, so the same bits, and the step stays one recorded graph. The step
  counts the experts it routed into a device tensor (inside the paged products); between steps
  (`GraphedSteps.scope`, around every static step the model runs) Spark reads those counts back (a copy queued
  after each step into one of two host buffers in turn; once a step is queued it reads the newest copy that
  has landed, never waiting for the step just queued, so the accounting lags a step and runs while the GPU
  works), counts them into the profile, and promotes the most routed misses into slots, at most
  `promotion_bytes` a step. A miss is promoted only where its count outranks the least routed resident's by
  `RANK_MARGIN` (which it evicts), so a placement that matches the traffic stays put (an LRU swapped experts
  in and out on every step: 23 MiB a token of copies, slower than reading the misses from host memory), and
  one a prefill or a shift in the traffic has upset is brought back. An evicted expert leaves the table after
  the step that may read its slot; the slot is filled on a copy stream beside the next step, and its table
  entry lands after that next step, before the one after it (`GraphedSteps.between_steps`).
- Eager (prefill, and every step where the backend has no paged kernel or records no graphs, or a split
  model): `resident_ids` brings the experts a batch routes to into slots on the host and maps the ids to
  slots, so the plain op runs over the slot stack; a batch that routes to more experts than the pool holds
  runs in groups of experts that fit, summed in fp32 (then not bit-identical to the all-resident sum:
  greedy tokens are what the tests hold equal). Without the graphed mode the model's decode steps run
  eagerly (`decode_graphs` off).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from .errors import LuceboxError
from .torch_backend import SideCopier, add_shared_expert

PROFILE_SUFFIX = ".spark.csv"
# Expert bytes promoted into slots between two graphed steps at most (all layers together): ~1 ms of copy over
# PCIe 4, so a promotion never holds a decode step up by much.
PROMOTION_BYTES = 24 * 2**20
# A missed expert is promoted where its routing count exceeds the least routed resident's by this factor: the
# margin keeps two experts of near-equal counts from trading places step after step.
RANK_MARGIN = 1.25


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

    def add(self, counts: torch.Tensor) -> None:
        """Count `counts` `[layers, experts]` (what graphed steps routed) in."""
        with self._lock:
            self.counts += counts.to("cpu", torch.int64)

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
    hits: int = 0  # routed experts found resident (per batch, or per graphed step)
    misses: int = 0  # routed experts not resident
    bytes_moved: int = 0  # host-to-device bytes copied into slots
    zero_copy_reads: int = 0  # routed pairs of graphed steps computed from host memory
    promotions: int = 0  # experts brought into slots between graphed steps


@attrs.frozen(eq=False)
class ExpertPages:
    """One expert stack as a layout's paged op (e.g. `moe_experts_swiglu_paged`) reads it: expert e's blocks
    are row `where[e]` of the slots `pool` where that is >= 0, else row e of `host`."""

    pool: Any  # QuantTensor [slots, rows, cols]: the device slots
    host: torch.Tensor  # [experts, bytes]: every expert (pinned on a GPU)
    where: torch.Tensor  # [experts] long, on the slots' device: the slot holding each expert, or -1
    pinned: bool = False  # whether `host` is pinned (found once: a kernel's check must not ask the driver)
    # The layer's row of the graphed steps' routing counts (`GraphedSteps.routed`), or None: the paged op adds
    # one per routed pair it reads (the CUDA kernels in the product's own launch). Set on the layer's first
    # stack only, so each pair counts once.
    counts: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.host.shape[0], *self.pool.shape[1:])

    def count(self, ids: torch.Tensor) -> None:
        """Add the routed pairs `ids` to `counts` (where set): what a paged op without the CUDA kernels does."""
        if self.counts is not None:
            flat = ids.reshape(-1).to(self.counts.device)
            self.counts.index_add_(0, flat, torch.ones_like(flat))

    def gather(self, experts: torch.Tensor) -> Any:
        """Experts `experts` (`[n]`, ascending) as a stack `[n, rows, cols]` of their blocks, from where they are."""
        slots = self.pool.data.reshape(self.pool.shape[0], -1)
        slot = self.where[experts.to(self.where.device)]
        from_host = self.host[experts.to(self.host.device)].to(slots.device)
        rows = torch.where((slot >= 0)[:, None], slots[slot.clamp(min=0)], from_host)
        return attrs.evolve(self.pool, name=f"{self.pool.name}.gathered", shape=(len(experts), *self.pool.shape[1:]),
                            data=rows.reshape(-1), volatile=True)


class Residency:
    """Host arrays `[layers, experts]` of which slot holds each expert (-1: none) and when each was last used,
    one row a layer (`ExpertSlots`' tie-break, and its order where it has no counts), and the clock of those uses."""

    def __init__(self, layers: int, experts: int):
        self.slot = np.full((layers, experts), -1, dtype=np.int64)
        self.tick = np.zeros((layers, experts), dtype=np.int64)
        self.clock = 0

    def now(self) -> int:
        self.clock += 1
        return self.clock


class ExpertSlots:
    """One layer's experts in `slots` device rows, filled from `host` `[experts, bytes]` (see the module's
    docstring). `initial`: the experts placed resident at the start (at most `slots`). `more_hosts`: further
    stacks of the layer (its up and down beside its gate) kept in the same slots: one residency for all, an
    expert is resident in every stack or in none, so a promotion is one decision and its copies.

    The victim of a reservation is the resident expert of the lowest routing count (`counts`: the layer's row of
    the profile, a live view), then of the oldest use tick, then the lowest id; without counts the order is
    least recently used. Ticks are host arrays (not an ordered dict): the graphed steps' accounting marks every
    routed expert of all layers in one array operation."""

    def __init__(self, host: torch.Tensor, slots: int, device: str | torch.device, initial: Sequence[int] = (),
                 table: torch.Tensor | None = None, *, more_hosts: Sequence[torch.Tensor] = (),
                 mirror: Residency | None = None, row: int = 0, counts: np.ndarray | None = None):
        """`table`: the device table `[experts]` to keep (a view of Spark's one table of all layers); default a
        new one. `mirror`, `row`: the host arrays of all layers' residencies this layer's is row `row` of (so
        the accounting of a graphed step settles every layer at once); default its own. `counts`: `[experts]`,
        the layer's routing counts, read at each eviction (a view of the profile's, updated in place)."""
        experts = host.shape[0]
        hosts = [host, *more_hosts]
        for stack in hosts:
            if stack.dim() != 2 or stack.shape[0] != experts or not 0 < slots <= experts:
                raise LuceboxError(f"an expert pool needs [experts, bytes] host stacks of {experts} experts and "
                                   f"1..{experts} slots, got {tuple(stack.shape)} and {slots}")
        if len(initial) > slots:
            raise LuceboxError(f"{len(initial)} experts placed resident do not fit {slots} slots")
        self.hosts, self.host, self.device = hosts, host, torch.device(device)
        self.stacks = [torch.empty(slots, h.shape[1], dtype=h.dtype, device=self.device) for h in hosts]
        self.stack = self.stacks[0]
        self.slot_of = table if table is not None else torch.full((experts,), -1, dtype=torch.long, device=self.device)
        self.mirror = mirror if mirror is not None else Residency(1, experts)
        self.row = row
        self._slot = self.mirror.slot[row]  # the table's host mirror: expert -> slot, or -1
        self._tick = self.mirror.tick[row]  # when each expert was last used
        self.counts = counts
        self._free = list(range(slots))[::-1]
        self.expert_bytes = sum(h.shape[1] for h in hosts)
        self.stats = SlotStats()
        for expert in initial:
            self._bring(int(expert))

    @property
    def resident(self) -> list[int]:
        return np.flatnonzero(self._slot >= 0).tolist()

    def is_resident(self, expert: int) -> bool:
        return bool(self._slot[expert] >= 0)

    def touch(self, expert: int) -> bool:
        """Mark `expert` used now if it is resident; whether it is."""
        if self._slot[expert] >= 0:
            self._tick[expert] = self.mirror.now()
            return True
        return False

    def victim(self, keep: np.ndarray | None = None) -> int | None:
        """The resident expert the next reservation evicts (see the class), `keep` (`[experts]` bool) aside;
        None where no candidate is left."""
        candidates = self._slot >= 0
        if keep is not None:
            candidates &= ~keep
        if not candidates.any():
            return None
        if self.counts is not None:
            counts = np.where(candidates, self.counts, np.iinfo(np.int64).max)
            candidates &= counts == counts.min()
        return int(np.argmin(np.where(candidates, self._tick, np.iinfo(np.int64).max)))

    def outranks(self, expert: int) -> bool:
        """Whether promoting `expert` is worth its copy: a slot is free, there are no counts (LRU), or its count
        exceeds the victim's by `RANK_MARGIN`."""
        if self._free or self.counts is None:
            return True
        victim = self.victim()
        return victim is None or bool(self.counts[expert] > RANK_MARGIN * self.counts[victim])

    def reserve(self, expert: int, keep: np.ndarray | None = None) -> tuple[int, int | None]:
        """A slot for `expert` (free, or the `victim`'s, `keep` aside), on the host only: (slot, the expert
        evicted from it or None). The caller copies the bytes and updates the table (`_bring`, or Spark's
        promotions on the copy stream)."""
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = self.victim(keep)
            if evicted is None:
                raise LuceboxError(f"no slot for expert {expert}: every resident expert is kept")
            slot = int(self._slot[evicted])
            self._slot[evicted] = -1
        self._slot[expert] = slot
        self._tick[expert] = self.mirror.now()
        self.stats.bytes_moved += self.expert_bytes
        return slot, evicted

    def fills(self, expert: int, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The copies `(slot row, host row)` that put `expert` into `slot` of every stack."""
        return [(stack[slot], host[expert]) for stack, host in zip(self.stacks, self.hosts)]

    def _bring(self, expert: int, keep: np.ndarray | None = None) -> None:
        """`expert` into a free slot or the `victim`'s: the copy and the table updates queued on the current
        stream (after the work that read the slot, before the work that reads the table)."""
        slot, evicted = self.reserve(expert, keep)
        if evicted is not None:
            self.slot_of[evicted] = -1
        for target, source in self.fills(expert, slot):
            target.copy_(source, non_blocking=True)
        self.slot_of[expert] = slot

    def resident_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (experts, any shape) mapped to the slots now holding them, after bringing in the missing
        ones. A batch may not route to more distinct experts than there are slots."""
        needed = torch.unique(ids).tolist()
        if len(needed) > self.stack.shape[0]:
            raise LuceboxError(f"a batch routes to {len(needed)} experts but the pool has {self.stack.shape[0]} slots")
        for expert in needed:
            if self.touch(expert):
                self.stats.hits += 1
        keep = np.zeros(self._slot.shape[0], dtype=bool)
        keep[needed] = True  # a miss never evicts an expert this batch needs
        for expert in needed:
            if not self.is_resident(expert):
                self.stats.misses += 1
                self._bring(expert, keep)
        return self.slot_of[ids.to(self.device)]


# -- wiring: a model's MoE blocks behind slot pools -------------------------------------------------------


@attrs.frozen
class ExpertLayout:
    """How a MoE block stores and runs its routed experts, as the block declares it to Spark (its
    `expert_layout`): Spark needs no more to offload any family's experts."""

    stacks: tuple[str, ...]  # the block's attributes holding the stacks `[E, rows, cols]`, the output's last
    op: str  # the op over the stacks: `ops.<op>(x, *stacks, weights, ids)`, weights `[T, k]`, ids `[T, k]`
    paged_op: str  # the same over `ExpertPages`, one per stack: `ops.<paged_op>(x, *pages, weights, ids)`

    def run(self, ops: Any, stacks: Sequence[Any], x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            **shared: Any) -> torch.Tensor:
        return getattr(ops, self.op)(x, *stacks, weights, ids, **shared)


# Routed SwiGLU experts over separate gate, up and down stacks: the core's generic op and its paged variant.
SWIGLU_EXPERTS = ExpertLayout(("gate_exps", "up_exps", "down_exps"), "moe_experts_swiglu", "moe_experts_swiglu_paged")


def run_experts(ops: Any, block: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                **shared: Any) -> torch.Tensor:
    """A MoE block's routed experts: its layout's op over its stacks, or through its Spark pools when it has them.
    `shared`: the op's `shared` and `shared_logit` (an always-on shared expert added in the op: it stays on the
    device, never in Spark's pools)."""
    if block.offload is None:
        layout = block.expert_layout
        return layout.run(ops, [getattr(block, name) for name in layout.stacks], x, weights, ids, **shared)
    return block.offload(ops, x, weights, ids, **shared)


class OffloadedExperts:
    """One MoE layer's expert stacks (those its `ExpertLayout` names) behind `ExpertSlots` pools of `slots`
    experts each, one table for all: an expert is resident in every stack or in none."""

    def __init__(self, layer: int, stacks: Sequence[Any], slots: int, resident: Sequence[int],
                 profile: RoutingProfile | None = None, device: str | torch.device | None = None,
                 layout: ExpertLayout = SWIGLU_EXPERTS, table: torch.Tensor | None = None,
                 mirror: Residency | None = None):
        """`stacks`: the layer's stacks in `layout`'s order. `device`: where the slots live, the model's compute
        device (default: where the stacks' bytes are). Not the bytes' device by default on a GPU: a GPU backend
        leaves weights in the file's memory map until their first use, so the stacks are still on the host when
        Spark takes them (and never go up whole)."""
        if len(stacks) != len(layout.stacks):
            raise LuceboxError(f"an expert layout of {len(layout.stacks)} stacks ({', '.join(layout.stacks)}) "
                               f"was given {len(stacks)}")
        self.layer, self.profile, self.layout = layer, profile, layout
        self.slots = slots
        self.steps: GraphedSteps | None = None  # set by `attach_spark` where the steps run graphed
        hosts = []
        for stack in stacks:
            device = torch.device(device) if device is not None else stack.data.device
            host = stack.data.reshape(stack.shape[0], -1).to("cpu")
            if device.type == "cuda":
                host = host.pin_memory()  # copies into the slots overlap the step's work; kernels read it too
            hosts.append(host)
        # One residency for the layer's stacks (`ExpertSlots` with more hosts): one table, which lets a paged op
        # read two stacks in one launch (`expert_matvec_pair` pairs stacks of one table: gate and up), and one
        # decision per promotion. `pools` stays a list (of one) for the callers that walk it.
        counts = profile.counts[layer].numpy() if profile is not None else None  # a view: the live counts
        pool = ExpertSlots(hosts[0], slots, device, initial=resident, table=table, more_hosts=hosts[1:],
                           mirror=mirror, row=layer if mirror is not None else 0, counts=counts)
        self.pools = [pool]
        self.views = [attrs.evolve(stack, name=f"{stack.name}.slots", shape=(slots, *stack.shape[1:]),
                                   data=rows.reshape(-1), volatile=True) for stack, rows in zip(stacks, pool.stacks)]
        self.pages = [ExpertPages(view, host, pool.slot_of, host.is_pinned()) for view, host in zip(self.views, hosts)]
        self.expert_bytes = pool.expert_bytes

    def __call__(self, ops: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 **shared: Any) -> torch.Tensor:
        steps = self.steps
        if steps is not None and steps.inside:  # a static step: paged, nothing decided on the host
            # The paged op also counts the routed pairs into `steps.routed` (the first stack's `counts`).
            return getattr(ops, self.layout.paged_op)(x, *self.pages, weights, ids, **shared)
        if steps is not None:
            steps.land()  # promotions still on the copy stream: the eager lookup reads and moves slots
        if self.profile is not None:
            self.profile.observe(self.layer, ids)
        needed = torch.unique(ids)
        if needed.numel() <= self.slots:
            return self._run(ops, x, weights, ids, **shared)
        # More experts than slots (a long prefill chunk): groups of experts that fit, in expert order.
        out = torch.zeros(x.shape[0], self.views[-1].shape[1], dtype=torch.float32, device=x.device)
        for start in range(0, needed.numel(), self.slots):
            group = needed[start : start + self.slots]
            chosen = torch.isin(ids, group)
            part_ids = torch.where(chosen, ids, group[0])
            out += self._run(ops, x, weights * chosen, part_ids).float()
        # The shared expert added once, after the groups, as the op adds it.
        return add_shared_expert(ops, out.to(x.dtype), x, shared.get("shared"), shared.get("shared_logit"))

    def _run(self, ops: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **shared: Any) -> torch.Tensor:
        return self.layout.run(ops, self.views, x, weights, self.pools[0].resident_ids(ids), **shared)

    def promote(self, expert: int) -> tuple[int, int | None, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Reserve a slot for `expert` (one for all the layer's stacks); (slot, the expert evicted or None, the
        copies `(slot row, host row)` that fill it). The caller queues the copies and the table updates
        (`GraphedSteps.between_steps`)."""
        pool = self.pools[0]
        slot, evicted = pool.reserve(expert)
        pool.stats.promotions += 1
        return slot, evicted, pool.fills(expert, slot)

    def describe(self) -> dict[str, Any]:
        stats = self.pools[0].stats
        moved = sum(pool.stats.bytes_moved for pool in self.pools)
        return {"layer": self.layer, "slots": self.slots, "experts": self.pools[0].host.shape[0],
                "hits": stats.hits, "misses": stats.misses, "bytes_moved": moved,
                "zero_copy_reads": stats.zero_copy_reads, "promotions": stats.promotions}


class GraphedSteps:
    """The graphed mode's traffic, shared by a model's MoE layers (see the module's docstring): `routed`
    `[layers, experts]`, the pairs the static steps routed (cumulative, on the device, counted inside the
    steps); a host copy of it queued after each step; and, between steps, the accounting and the promotions."""

    def __init__(self, ops: Any, layers: list[OffloadedExperts], profile: RoutingProfile, promotion_bytes: int,
                 tables: torch.Tensor | None = None):
        """`tables`: `[layers, experts]`, whose rows are the layers' tables (one write updates them all); None
        where they are apart (each layer's table written on its own). The layers' residencies must be the rows
        of one `Residency`, in order (`attach_spark` makes them so): the accounting settles them all at once."""
        self.mirror = layers[0].pools[0].mirror
        if any(layer.pools[0].mirror is not self.mirror or layer.pools[0].row != i for i, layer in enumerate(layers)):
            raise LuceboxError("Spark's graphed steps need the layers' residencies as the rows of one Residency")
        self.ops, self.layers, self.profile = ops, layers, profile
        self.promotion_bytes = promotion_bytes
        device = torch.device(ops.device)
        experts = layers[0].pools[0].host.shape[0]
        self.experts = experts
        self.slots_per_layer = np.array([[layer.slots] for layer in layers])
        self.smallest_expert = min(layer.expert_bytes for layer in layers)  # a budget below it promotes nothing
        self.tables = tables
        self.copier = SideCopier(device)  # promotions' copies, beside the steps (see `between_steps`)
        self._pending: tuple[dict[tuple[int, int], int], Any] | None = None  # placed (layer, expert) -> slot, marker
        self.routed = torch.zeros(len(layers), experts, dtype=torch.long, device=device)
        # Two host copies, the steps' in turn: the accounting before a step reads the newest copy that has
        # landed and never waits for the step the engine has just queued (decode fed ahead keeps the GPU
        # busy while the host accounts; waiting here left it idle between steps).
        self.routed_host = [torch.zeros(len(layers), experts, dtype=torch.long, pin_memory=device.type == "cuda")
                            for _ in range(2)]
        self._copies: list[tuple[int, Any] | None] = [None, None]  # (step, event after its copy) per buffer
        self._accounted_step = 0  # the step whose cumulative counts `counted` holds
        self.counted = torch.zeros(len(layers), experts, dtype=torch.long)  # of the copies, accounted
        # The tables' updates go up from pinned memory, two buffers in turn (each reused once its copy has
        # run): from pageable memory a copy waits for the stream to drain, which left the GPU idle while the
        # host prepared the next step (~0.13 ms a step on Laguna-XS.2 with promotions on the H200).
        self._updates = [torch.empty(2 * len(layers) * experts, dtype=torch.long, pin_memory=device.type == "cuda")
                         for _ in range(2)]
        self._update_events: list[Any] = [None, None]
        self._update_turn = 0
        self._thread = threading.local()  # `inside`: per generation thread (-np: several drive steps)
        self._lock = threading.Lock()  # the accounting and the promotions, one thread at a time
        self.steps = 0  # static steps run

    @property
    def inside(self) -> bool:
        """Whether this thread is running a static step (warming it up, recording, replaying or running it)."""
        return getattr(self._thread, "inside", False)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Around one static step: inside, the experts run paged; once it is queued, its counts are copied to
        the host (queued too), and what the steps before it routed is accounted and the hot misses promoted
        (`between_steps`) while the GPU runs it. After the step, not before: where the caller waits for each
        step (a token sampled on the host), the accounting before the next step left the GPU idle (~0.13 ms
        a step on Laguna-XS.2 on the H200)."""
        self._thread.inside = True
        try:
            yield
        finally:
            self._thread.inside = False
            with self._lock:  # steps of several threads share the one (current) stream: copies stay in order
                self.steps += 1
                buffer = self.steps % 2  # the other one may still be read by an accounting
                self.routed_host[buffer].copy_(self.routed, non_blocking=True)
                self._copies[buffer] = (self.steps, self.ops.record_event())
        self.between_steps()

    def account(self, *, wait: bool = True) -> list[tuple[int, int, int]]:
        """Count the routing of the steps run since the last accounted one into the profile and the layers'
        stats (with `wait`, up to the last step run; else up to the newest whose copy has landed); the misses
        as (-pairs, MoE layer, expert), most routed first."""
        with self._lock:
            return self._account(wait)

    def _account(self, wait: bool, ranked: bool = False) -> list[tuple[int, int, int]]:
        landed = None
        for copy in sorted((c for c in self._copies if c is not None), key=lambda c: -c[0]):  # newest first
            step, event = copy
            if step <= self._accounted_step:
                break
            if wait:
                self.ops.wait_event(event)
            elif not self.ops.event_done(event):
                continue
            landed = copy
            break
        if landed is None:
            return []
        self._accounted_step = landed[0]
        host = self.routed_host[landed[0] % 2]
        routed = host - self.counted
        self.counted.copy_(host)
        self.profile.add(routed)
        return self._settle(routed.numpy(), ranked)

    def _settle(self, pairs: np.ndarray, ranked: bool = False) -> list[tuple[int, int, int]]:
        """Account the pairs `[layers, experts]` the steps routed, every layer at once: an expert routed to is a
        hit (marked used now) where resident, else a miss whose pairs were read from host memory. The misses as
        (-pairs, layer, expert), most routed first; with `ranked`, only those whose count outranks their layer's
        least routed resident (the promotions' candidates: in a steady state none, and no Python loop)."""
        used = pairs > 0
        hits = used & (self.mirror.slot >= 0)
        self.mirror.tick[hits] = self.mirror.now()
        missed = used & ~hits
        missed_pairs = np.where(missed, pairs, 0)
        for layer, layer_hits, layer_misses, reads in zip(self.layers, hits.sum(axis=1).tolist(),
                                                          missed.sum(axis=1).tolist(), missed_pairs.sum(axis=1).tolist()):
            stats = layer.pools[0].stats
            stats.hits += layer_hits
            stats.misses += layer_misses
            stats.zero_copy_reads += reads
        if ranked:
            counts = self.profile.counts.numpy()
            weakest = np.where(self.mirror.slot >= 0, counts, np.iinfo(np.int64).max).min(axis=1, keepdims=True)
            full = (self.mirror.slot >= 0).sum(axis=1, keepdims=True) == self.slots_per_layer
            missed &= ~full | (counts > RANK_MARGIN * weakest)
        index, expert = np.nonzero(missed)
        return sorted(zip((-pairs[index, expert]).tolist(), index.tolist(), expert.tolist()))

    def between_steps(self) -> None:
        """After a step is queued: land the promotions decided after the step before it, `account`, then promote
        the most routed misses that outrank their layer's least routed resident (`ExpertSlots.outranks`), most
        pairs first, within `promotion_bytes`. A promotion's evicted expert leaves the table now (queued on the
        current stream, after the step that may read its slot: the next step reads it from host memory); the
        slot is filled on the copy stream while that next step runs, and the new entry lands before the step
        after it (`land`, here after the next step). So the copies never hold the compute stream up (0.5 ms of
        a 5 ms 35B-A3B step when they were queued on it), and a promoted expert is read from its slot two
        steps later."""
        with self._lock:
            self._land()  # decided after the step before this one: their copies ran beside this one
            budget = self.promotion_bytes
            cleared: list[tuple[int, int]] = []
            placed: dict[tuple[int, int], int] = {}
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            for _, index, expert in self._account(wait=False, ranked=True):
                if budget < self.smallest_expert:  # (--spark-promote 0: accounted, nothing promoted)
                    break
                layer = self.layers[index]
                # Ranked again: each promotion in a layer evicts its victim, so the next one faces another.
                if layer.expert_bytes <= budget and layer.pools[0].outranks(expert):
                    budget -= layer.expert_bytes
                    slot, evicted, fills = layer.promote(expert)
                    if evicted is not None and placed.pop((index, evicted), None) is None:
                        cleared.append((index, evicted))  # (one placed this batch is not in the table yet)
                    placed[(index, expert)] = slot
                    copies += fills
            if placed:
                self._write_tables(cleared, [-1] * len(cleared))
                self._pending = (placed, self.copier.copy_behind(copies))

    def land(self) -> None:
        """Make the current stream wait for the promotions' copies and enter them in the tables (before any
        use of the slots outside a step: the eager lookup, a test's look at the tables)."""
        with self._lock:
            self._land()

    def _land(self) -> None:
        """Land the pending promotions: the current stream waits for their copies, then their table entries
        are written."""
        if self._pending is None:
            return
        placed, marker = self._pending
        self._pending = None
        self.copier.land(marker)
        self._write_tables(list(placed), list(placed.values()))

    def _write_tables(self, places: list[tuple[int, int]], slots: list[int]) -> None:
        """`table[layer][expert] = slot` for each place, queued on the current stream: one copy and one
        scatter for all layers where their tables are rows of one tensor."""
        if not places:
            return
        if self.tables is None:
            for (index, expert), slot in zip(places, slots):
                self.layers[index].pools[0].slot_of[expert] = slot
            return
        turn = self._update_turn % 2
        self._update_turn += 1
        self.ops.wait_event(self._update_events[turn])  # its last copy ran long ago: two steps back at least
        count = len(places)
        staging = self._updates[turn][: 2 * count]
        staging[:count] = torch.tensor([index * self.experts + expert for index, expert in places])
        staging[count:] = torch.tensor(slots)
        update = staging.to(self.tables.device, non_blocking=True)
        self._update_events[turn] = self.ops.record_event()
        self.tables.view(-1).index_copy_(0, update[:count], update[count:])


@attrs.define
class Spark:
    """What `attach_spark` did to a model: its layers' pools, the profile they count into, and where it is saved."""

    layers: list[OffloadedExperts]
    profile: RoutingProfile
    profile_path: Path | None
    budget: int
    expert_bytes: int  # of every layer's stacks, all experts
    graphed: GraphedSteps | None = None  # where the static steps run graphed over paged experts
    promotion_bytes: int = PROMOTION_BYTES  # promoted between two graphed steps at most (--spark-promote)

    def describe(self) -> dict[str, Any]:
        per_layer = [layer.describe() for layer in self.layers]
        total = {key: sum(d[key] for d in per_layer)
                 for key in ("hits", "misses", "bytes_moved", "zero_copy_reads", "promotions")}
        hits, misses = total["hits"], total["misses"]
        resident = sum(d["slots"] for d in per_layer) / max(1, sum(d["experts"] for d in per_layer))
        return {"enabled": True, "budget_bytes": self.budget, "expert_bytes": self.expert_bytes,
                "residency": round(resident, 4), **total,
                "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                "graphed": self.graphed is not None, "promotion_bytes": self.promotion_bytes,
                "profile": str(self.profile_path) if self.profile_path else None}

    def save_profile(self) -> None:
        """Write the profile (with the last graphed steps' routing counted in: call it between requests)."""
        if self.graphed is not None:
            self.graphed.account()
        if self.profile_path is not None:
            self.profile.save(self.profile_path)


# Where a decoder layer may hold its MoE block: in place of the MLP, or beside it.
BLOCK_PLACES = ("mlp", "moe")


def is_moe_block(block: Any) -> bool:
    """Whether `block` is a MoE block Spark can offload: it declares its `expert_layout` (and holds those
    stacks), its `top_k`, and an `offload` slot, and runs its experts through `run_experts`."""
    layout = getattr(block, "expert_layout", None)
    return (isinstance(layout, ExpertLayout) and all(hasattr(block, name) for name in layout.stacks)
            and hasattr(block, "top_k") and hasattr(block, "offload"))


def moe_blocks(model: Any) -> list[tuple[int, Any]]:
    """(layer index, MoE block) of a model's layers that have one (in `BLOCK_PLACES`; see `is_moe_block`)."""
    found = []
    for i, layer in enumerate(getattr(model, "layers", [])):
        block = next((b for b in (getattr(layer, place, None) for place in BLOCK_PLACES) if is_moe_block(b)), None)
        if block is not None:
            found.append((i, block))
    return found


def pages_supported(ops: Any, layer: OffloadedExperts, top_k: int) -> bool:
    """Whether `ops` runs the paged op on `layer`'s pages without a host decision: the reference on the CPU
    (where no graph is recorded, and the emulated graph contract of the tests re-runs it), else a kernel
    that accepts them (the reference on a GPU gathers on the host: not recordable)."""
    if torch.device(ops.device).type == "cpu":
        return True
    op = getattr(ops, layer.layout.paged_op, None)
    if not hasattr(op, "choice"):  # no kernel installed for it on this backend
        return False
    x = torch.zeros(1, layer.views[0].shape[2], dtype=ops.dtype, device=ops.device)
    weights = torch.zeros(1, top_k, dtype=torch.float32, device=ops.device)
    ids = torch.zeros(1, top_k, dtype=torch.long, device=ops.device)
    return op.choice(x, *layer.pages, weights, ids) != "reference"


def spark_budget(text: str | int | None) -> tuple[int | None, float]:
    """`--spark-vram`: (bytes, 0.5) for a size (`4G`, `512M`, `100000`), or (None, the share) for a
    percentage of the experts' bytes (`60%`); (None, 0.5) when not given (half of them)."""
    from .prefix_cache import parse_size

    if text is None:
        return None, 0.5
    if isinstance(text, str) and text.strip().endswith("%"):
        number = text.strip()[:-1]
        try:
            percent = float(number)
        except ValueError:
            raise LuceboxError(f"--spark-vram: cannot read {text!r} as a percentage of the experts' bytes "
                               "(e.g. 60%)") from None
        if not 0 < percent <= 100:
            raise LuceboxError(f"--spark-vram: {text!r} is not a share of the experts' bytes in (0%, 100%]")
        return None, percent / 100
    return parse_size(text, "--spark-vram"), 0.5


def spark_promotion_bytes(text: str | int | None) -> int:
    """`--spark-promote`: bytes for a size (`24M`, `100000`), 0 for `0` (no promotions), `PROMOTION_BYTES`
    when not given."""
    from .prefix_cache import parse_size

    if text is None:
        return PROMOTION_BYTES
    if str(text).strip() in ("0", "0B", "0M", "0K", "0G"):
        return 0
    return parse_size(text, "--spark-promote")


def attach_spark(model: Any, budget: int | None = None, *, model_path: str | os.PathLike | None = None,
                 share: float = 0.5, promotion_bytes: int = PROMOTION_BYTES) -> Spark:
    """Put every MoE block of `model` behind slot pools: resident experts chosen by the profile beside
    `model_path` (uniform when there is none) under `budget` bytes (default: `share` of the experts' bytes),
    at least `top_k` a layer. The static steps run graphed over paged experts where the model records graphs
    and the backend runs the paged op (`model.static_step_scope` is then Spark's), else eagerly."""
    blocks = moe_blocks(model)
    if not blocks:
        raise LuceboxError(f"--spark: {type(model).__name__} has no MoE layers to offload")
    experts = getattr(blocks[0][1], blocks[0][1].expert_layout.stacks[0]).shape[0]
    per_expert = [sum(getattr(block, name).nbytes for name in block.expert_layout.stacks) // experts
                  for _, block in blocks]
    total = sum(per_expert) * experts
    budget = int(total * share) if budget is None else budget
    path = RoutingProfile.path_for(model_path) if model_path is not None else None
    profile = (RoutingProfile.load(path, len(blocks), experts) if path is not None and path.is_file()
               else RoutingProfile(len(blocks), experts))
    top_k = max(block.top_k for _, block in blocks)
    placed = place_experts(profile.counts, per_expert, budget, min_per_layer=top_k)
    # Every layer's table a row of one tensor: the promotions between two steps update them in one write.
    tables = torch.full((len(blocks), experts), -1, dtype=torch.long, device=model.ops.device)
    mirror = Residency(len(blocks), experts)  # their host side: which slot holds each expert, its last use
    layers = []
    for moe_index, ((layer, block), resident) in enumerate(zip(blocks, placed)):
        layout = block.expert_layout
        offload = OffloadedExperts(moe_index, [getattr(block, name) for name in layout.stacks], len(resident),
                                   resident, profile, device=model.ops.device, layout=layout,
                                   table=tables[moe_index], mirror=mirror)
        block.offload = offload
        for name, view in zip(layout.stacks, offload.views):  # the full stacks leave the device: the pools hold
            setattr(block, name, view)  # what is resident
        layers.append(offload)
    graphed = None
    split = len(getattr(model, "part_ops", None) or ()) > 1  # one device's slots: a split model steps eagerly
    if model.decode_graphs and not split and pages_supported(model.ops, layers[0], top_k):
        graphed = GraphedSteps(model.ops, layers, profile, promotion_bytes, tables)
        for layer in layers:
            layer.steps = graphed
            layer.pages[0] = attrs.evolve(layer.pages[0], counts=graphed.routed[layer.layer])
        model.static_step_scope = graphed.scope
    else:
        # The eager lookup runs on the host (which experts a token needs decides what to copy), so the decode
        # step and the verify pass cannot be replayed as graphs over it: they run eagerly, exact all the same.
        model.decode_graphs = False
    return Spark(layers, profile, path, budget, total, graphed, promotion_bytes)

