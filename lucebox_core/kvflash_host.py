"""KVFlash's host side: where paged-out chunks live (`HostChunkArena`) and how their bytes travel
(`PageCopier`: `torch_backend.SideCopier`, a device service like the backend's other stream work).

A paged-out chunk is one *record* of the arena: the chunk's raw rows of every layer's K and V, as the pool
stores them, at fixed offsets. Records are carved out of slabs of many records allocated at once (pinned
where the device is a GPU: `cudaHostAlloc` is slow, and once per chunk and layer it cost more than the copies)
and a freed record is reused, so in steady state a page-out allocates nothing.

Copies run on a side CUDA stream: a copy-out waits for what the compute stream has enqueued so far (the rows
are final), and the compute stream waits for the copy-out before anything may overwrite those slots; a
recall waits for the compute stream's moves and the compute stream waits for the recall before attention
reads the rows. All copies are ordered on the one side stream, so a record freed by a recall and reused by
a later copy-out is never written before it has been read. On the CPU (no streams) the copies are plain
synchronous ones.
"""

from __future__ import annotations

import math

import torch

from .torch_backend import SideCopier, host_memory

PageCopier = SideCopier  # the pool <-> host copies (a device service: on a side stream where there is one)

SLAB_BYTES = 256 << 20  # a slab of host records: at most this many bytes (and at least one record)
SLAB_RECORDS = 64  # ... and at most this many records
ALIGN = 64  # each block of a record starts on this boundary (views of any element type stay aligned)


class HostChunkArena:
    """Fixed-layout host records (`blocks`: name -> (shape, dtype)) in slabs allocated many at a time."""

    def __init__(self, blocks: dict[str, tuple[tuple[int, ...], torch.dtype]], *, pin: bool,
                 slab_bytes: int = SLAB_BYTES) -> None:
        self._layout: dict[str, tuple[int, int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        self.chunk_bytes = 0  # the raw bytes one record holds (what a page moves)
        for name, (shape, dtype) in blocks.items():
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            self._layout[name] = (offset, nbytes, tuple(shape), dtype)
            self.chunk_bytes += nbytes
            offset += -(-nbytes // ALIGN) * ALIGN
        self.record_bytes = max(offset, ALIGN)
        self.records_per_slab = max(1, min(SLAB_RECORDS, slab_bytes // self.record_bytes))
        self.pin = pin
        self.slabs: list[torch.Tensor] = []
        self._views: list[dict[str, torch.Tensor]] = []  # record -> its blocks (views into a slab)
        self._free: list[int] = []

    @property
    def capacity_bytes(self) -> int:
        return sum(slab.numel() for slab in self.slabs)

    @property
    def records_in_use(self) -> int:
        return len(self._views) - len(self._free)

    def take(self) -> int:
        """A free record (a new slab only when none is left)."""
        if not self._free:
            self._grow()
        return self._free.pop()

    def release(self, record: int) -> None:
        self._free.append(record)

    def views(self, record: int) -> dict[str, torch.Tensor]:
        return self._views[record]

    def _grow(self) -> None:
        slab = host_memory((self.records_per_slab, self.record_bytes), torch.uint8, pinned=self.pin)
        first = len(self._views)
        for row in slab:
            self._views.append({name: row[offset:offset + nbytes].view(dtype).view(shape)
                                for name, (offset, nbytes, shape, dtype) in self._layout.items()})
        self.slabs.append(slab)
        self._free.extend(range(len(self._views) - 1, first - 1, -1))  # lowest first
