"""The prefix cache: the next turn of a conversation prefills only its new tokens.

A coding agent re-sends its whole conversation every turn. At each chat turn boundary of a prompt (the
position after an end-of-turn token: `<|im_end|>`, Gemma's `<turn|>`...) the engine may snapshot the
sequence's model state (`state_snapshot`: KV rows, recurrent state, the drafter's feature ring), keyed by a
hash of the tokens before it. A new request restores the longest cached boundary prefix of its prompt and
prefills only the rest.

Exactness: the engine always splits a prefill at turn boundaries (`Engine.prefill`), whether the cache is
on or not, so a state restored at a boundary is the very state a cold prefill of the same prompt passes
through, and what follows is computed by the same forward calls: output with a cache hit is bit for bit
the output without one (on the same backend). Generated tokens are never snapshotted: a decode step and a
prefill chunk round differently, so a turn's answer is prefilled again in the next request.

Two tiers:
- RAM: up to `slots` snapshots (`--prefix-cache-slots`), least recently used out first;
- disk (`--kv-cache-dir`): one file a snapshot under `<dir>/<fingerprint>/`, where the fingerprint names the
  model's weights, KV types, backend and drafter (`fingerprint`), written atomically on a background
  thread, within `--kv-cache-budget` bytes (least recently used files out first), found again after a
  restart. A file is checked whole before anything is restored (magic, format, fingerprint, the tokens it
  claims, every tensor's bytes by CRC-32): a corrupt or foreign file is skipped with a warning and removed,
  never loaded.

The file (`.lbkv`): the 8 bytes `LBXKVC01`, a little-endian u64 header length, a JSON header (format,
fingerprint, length, tokens, tensors: name, dtype, shape, offset, bytes, crc32), zero padding to 64 bytes,
then each tensor's bytes at its offset (from the payload's start).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from .errors import LuceboxError

log = logging.getLogger("lucebox.prefix_cache")

MAGIC = b"LBXKVC01"
FORMAT = 1
SUFFIX = ".lbkv"
ALIGN = 64
DEFAULT_SLOTS = 8
DEFAULT_MIN_TOKENS = 256
DEFAULT_DISK_BUDGET = 4 * 2**30
DEFAULT_RAM_BUDGET = 8 * 2**30  # a 27B's 32K-token snapshot is ~2 GiB: 8 slots of those would not fit most hosts

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                                                       torch.int8, torch.int32, torch.int64)}


class CacheFileError(LuceboxError):
    """A snapshot file that cannot be used (corrupt, truncated, foreign): skipped, never loaded."""


def parse_size(text: str | int, flag: str = "--kv-cache-budget") -> int:
    """Bytes for `4G`, `512M`, `1.5GiB`, `100000` (binary units: K = 1024); a LuceboxError otherwise."""
    if isinstance(text, int):
        value = text
    else:
        raw = str(text).strip().upper().removesuffix("IB").removesuffix("B")
        scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(raw[-1:], 1)
        number = raw[:-1] if raw[-1:] in "KMGT" and raw else raw
        try:
            value = int(float(number) * scale)
        except ValueError:
            raise LuceboxError(f"{flag}: cannot read {text!r} as a size (e.g. 4G, 512M, 100000)") from None
    if value <= 0:
        raise LuceboxError(f"{flag} must be positive, got {text!r}")
    return value


def turn_boundaries(token_ids: Sequence[int], end_of_turn_ids: Iterable[int]) -> list[int]:
    """The positions right after each end-of-turn token of `token_ids`, in order."""
    ends = frozenset(end_of_turn_ids)
    return [i + 1 for i, token in enumerate(token_ids) if token in ends]


def prefix_key(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()


def file_identity(path: str | os.PathLike, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """A hash of a (possibly huge) file's size, first MiB (a GGUF's header and tensor table) and `samples`
    spread-out pieces: another file, or the same layout with other weights, gives another value, without
    reading 15 GB."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    digest.update(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        for i in range(samples):
            f.seek(max(0, (size - sample_bytes) * (i + 1) // samples))
            digest.update(f.read(sample_bytes))
    return digest.hexdigest()


def fingerprint(parts: dict[str, Any]) -> str:
    """A short stable name for what makes snapshots interchangeable (see `Engine`'s use: the weights' file
    identities, KV types, dtype, backend, drafter)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


@attrs.frozen(kw_only=True)
class PrefixCacheConfig:
    slots: int = DEFAULT_SLOTS  # snapshots kept in RAM (0: none)
    min_tokens: int = DEFAULT_MIN_TOKENS  # shorter prefixes are not worth a snapshot
    directory: str | None = None  # --kv-cache-dir
    disk_budget: int = DEFAULT_DISK_BUDGET  # --kv-cache-budget, bytes
    ram_budget: int = DEFAULT_RAM_BUDGET  # --prefix-cache-ram, bytes the RAM slots may hold together

    @property
    def enabled(self) -> bool:
        return self.slots > 0 or self.directory is not None


@attrs.define
class Snapshot:
    tokens: tuple[int, ...]
    tensors: dict[str, torch.Tensor]

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@attrs.define
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    ram_hits: int = 0
    disk_hits: int = 0
    tokens_reused: int = 0
    snapshots: int = 0  # taken
    disk_writes: int = 0
    rejected_files: int = 0


class PrefixCache:
    """The two tiers (see the module's docstring); safe to use from several generation threads."""

    def __init__(self, config: PrefixCacheConfig, fingerprint: str):
        self.config = config
        self.fingerprint = fingerprint
        self.stats = PrefixCacheStats()
        self._ram: OrderedDict[str, Snapshot] = OrderedDict()
        self._lock = threading.Lock()
        self.folder = Path(config.directory) / fingerprint if config.directory else None
        self._writer: ThreadPoolExecutor | None = None
        self._pending: set[str] = set()  # keys being written to disk
        if self.folder is not None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise LuceboxError(f"--kv-cache-dir {config.directory}: cannot create {self.folder} ({exc})") from None
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lucebox-kv-disk")

    # -- what the engine calls ---------------------------------------------------------------------------

    def worth_keeping(self, length: int) -> bool:
        return length >= max(1, self.config.min_tokens)

    def contains(self, tokens: Sequence[int]) -> bool:
        key = prefix_key(tokens)
        with self._lock:
            if key in self._ram or key in self._pending:
                return True
        return self.folder is not None and (self.folder / f"{key}{SUFFIX}").is_file()

    def lookup(self, prompt: Sequence[int], boundaries: Sequence[int]) -> Snapshot | None:
        """The snapshot of the longest boundary prefix of `prompt` that is cached (shorter than the prompt:
        the last position's logits must still be computed), or None."""
        with self._lock:
            self.stats.lookups += 1
        for end in sorted((b for b in set(boundaries) if 0 < b < len(prompt)), reverse=True):
            tokens = tuple(prompt[:end])
            key = prefix_key(tokens)
            with self._lock:
                hit = self._ram.get(key)
                if hit is not None and hit.tokens == tokens:
                    self._ram.move_to_end(key)
                    self._count_hit(end, ram=True)
                    return hit
            found = self._load(key, tokens)
            if found is not None:
                self._keep_in_ram(key, found)
                with self._lock:
                    self._count_hit(end, ram=False)
                return found
        return None

    def store(self, tokens: Sequence[int], tensors: dict[str, torch.Tensor]) -> None:
        """Keep a snapshot (host tensors) of the state after `tokens`: in RAM, and written to disk."""
        snapshot = Snapshot(tuple(tokens), tensors)
        key = prefix_key(snapshot.tokens)
        with self._lock:
            self.stats.snapshots += 1
        self._keep_in_ram(key, snapshot)
        if self._writer is not None and not (self.folder / f"{key}{SUFFIX}").exists():
            with self._lock:
                self._pending.add(key)
            self._writer.submit(self._write, key, snapshot)

    def flush(self) -> None:
        """Wait for the disk writes queued so far."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def describe(self) -> dict[str, Any]:
        with self._lock:
            ram_bytes = sum(s.nbytes for s in self._ram.values())
            held = len(self._ram)
        disk_files, disk_bytes = self._disk_usage()
        return {"slots": self.config.slots, "held": held, "ram_bytes": ram_bytes, "ram_budget": self.config.ram_budget,
                "min_tokens": self.config.min_tokens,
                "directory": str(self.folder) if self.folder else None, "disk_files": disk_files,
                "disk_bytes": disk_bytes, "disk_budget": self.config.disk_budget if self.folder else None,
                "fingerprint": self.fingerprint, **attrs.asdict(self.stats)}

    # -- RAM ---------------------------------------------------------------------------------------------

    def _count_hit(self, tokens: int, *, ram: bool) -> None:
        self.stats.hits += 1
        self.stats.tokens_reused += tokens
        if ram:
            self.stats.ram_hits += 1
        else:
            self.stats.disk_hits += 1

    def _keep_in_ram(self, key: str, snapshot: Snapshot) -> None:
        if self.config.slots <= 0:
            return
        if snapshot.nbytes > self.config.ram_budget:
            log.warning("prefix cache: a %d-token snapshot (%d MiB) is larger than --prefix-cache-ram; not kept in "
                        "RAM", snapshot.length, snapshot.nbytes >> 20)
            return
        with self._lock:
            self._ram[key] = snapshot
            self._ram.move_to_end(key)
            held = sum(s.nbytes for s in self._ram.values())
            while len(self._ram) > self.config.slots or held > self.config.ram_budget:
                held -= self._ram.popitem(last=False)[1].nbytes

    # -- disk --------------------------------------------------------------------------------------------

    def _disk_usage(self) -> tuple[int, int]:
        if self.folder is None:
            return 0, 0
        files = list(self.folder.glob(f"*{SUFFIX}"))
        return len(files), sum(_size(f) for f in files)

    def _write(self, key: str, snapshot: Snapshot) -> None:
        try:
            if snapshot.nbytes > self.config.disk_budget:
                log.warning("prefix cache: a %d-token snapshot (%d MiB) is larger than --kv-cache-budget; not "
                            "written to disk", snapshot.length, snapshot.nbytes >> 20)
                return
            write_snapshot_file(self.folder / f"{key}{SUFFIX}", self.fingerprint, snapshot)
            with self._lock:
                self.stats.disk_writes += 1
            self._enforce_budget(keep=key)
        except OSError as exc:
            log.warning("prefix cache: cannot write a snapshot to %s: %s", self.folder, exc)
        finally:
            with self._lock:
                self._pending.discard(key)

    def _enforce_budget(self, keep: str) -> None:
        files = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda f: _mtime(f))
        total = sum(_size(f) for f in files)
        for old in files:
            if total <= self.config.disk_budget:
                break
            if old.stem == keep:
                continue
            total -= _size(old)
            old.unlink(missing_ok=True)

    def _load(self, key: str, tokens: tuple[int, ...]) -> Snapshot | None:
        if self.folder is None:
            return None
        path = self.folder / f"{key}{SUFFIX}"
        if not path.is_file():
            return None
        try:
            snapshot = read_snapshot_file(path, self.fingerprint)
            if snapshot.tokens != tokens:
                raise CacheFileError(f"{path}: holds another token prefix than its name says")
        except CacheFileError as exc:
            log.warning("prefix cache: skipping %s", exc)
            with self._lock:
                self.stats.rejected_files += 1
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: the budget evicts others first
        return snapshot


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def write_snapshot_file(path: Path, fingerprint: str, snapshot: Snapshot) -> None:
    """Write `snapshot` to `path` atomically (a temporary file renamed over it)."""
    entries, offset, blobs = [], 0, []
    for name, tensor in snapshot.tensors.items():
        blob = tensor.contiguous().view(torch.uint8).reshape(-1).numpy() if tensor.numel() else np.zeros(0, np.uint8)
        entries.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                        "offset": offset, "bytes": int(blob.nbytes), "crc32": zlib.crc32(blob)})
        blobs.append(blob)
        offset += -(-blob.nbytes // ALIGN) * ALIGN
    header = json.dumps({"format": FORMAT, "fingerprint": fingerprint, "created": time.time(),
                         "length": snapshot.length, "tokens": list(snapshot.tokens), "tensors": entries}).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // ALIGN) * ALIGN
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(MAGIC + struct.pack("<Q", len(header)) + header)
            out.write(bytes(start - out.tell()))
            for entry, blob in zip(entries, blobs):
                out.write(bytes(start + entry["offset"] - out.tell()))
                out.write(memoryview(blob))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_snapshot_file(path: Path, fingerprint: str) -> Snapshot:
    """The snapshot in `path`, checked whole; a CacheFileError saying why if it cannot be used."""
    try:
        # Mapped, not read: a 2 GB snapshot is copied once, tensor by tensor, not held twice.
        data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    except (OSError, ValueError) as exc:
        raise CacheFileError(f"{path}: cannot be read ({exc})") from None
    if len(data) < len(MAGIC) + 8 or bytes(data[: len(MAGIC)]) != MAGIC:
        raise CacheFileError(f"{path}: not a Lucebox prefix-cache file (bad magic)")
    (header_len,) = struct.unpack("<Q", bytes(data[len(MAGIC) : len(MAGIC) + 8]))
    try:
        if len(MAGIC) + 8 + header_len > len(data):
            raise CacheFileError(f"{path}: truncated in its header")
        header = json.loads(bytes(data[len(MAGIC) + 8 : len(MAGIC) + 8 + header_len]))
        if header["format"] != FORMAT:
            raise CacheFileError(f"{path}: format {header['format']}, this Lucebox reads {FORMAT}")
        if header["fingerprint"] != fingerprint:
            raise CacheFileError(f"{path}: made for another model or configuration (fingerprint "
                                 f"{header['fingerprint']}, this server {fingerprint})")
        tokens = tuple(int(t) for t in header["tokens"])
        if len(tokens) != int(header["length"]):
            raise CacheFileError(f"{path}: {len(tokens)} tokens for a length of {header['length']}")
        start = -(-(len(MAGIC) + 8 + header_len) // ALIGN) * ALIGN
        tensors = {}
        for entry in header["tensors"]:
            begin, size = start + int(entry["offset"]), int(entry["bytes"])
            if begin + size > len(data):
                raise CacheFileError(f"{path}: truncated in tensor {entry['name']}")
            blob = np.array(data[begin : begin + size])
            if zlib.crc32(blob) != int(entry["crc32"]):
                raise CacheFileError(f"{path}: tensor {entry['name']} fails its checksum (corrupt)")
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                raise CacheFileError(f"{path}: tensor {entry['name']} has an unknown dtype {entry['dtype']!r}")
            raw = torch.from_numpy(blob)
            tensors[entry["name"]] = raw.view(dtype).reshape([int(n) for n in entry["shape"]])
    except CacheFileError:
        raise
    except (ValueError, KeyError, TypeError, RuntimeError, UnicodeDecodeError, struct.error) as exc:
        raise CacheFileError(f"{path}: malformed header or tensor table ({type(exc).__name__}: {exc})") from None
    return Snapshot(tokens, tensors)
