"""Reading GGUF files: checked metadata access and zero-copy tensors from the memory map.

`GGUFFile` maps the file and parses the header itself with `struct` over the map: GGUFReader builds a
numpy view for every element of every array, which makes opening a 250k-token vocabulary take seconds.
Here opening only walks the header to find where each value lies; values are decoded when first asked
for. Every way a file can be broken (missing, not GGUF, truncated, inconsistent) surfaces as one
`GGUFError` naming the file and, where there is one, the key or tensor at fault; nothing from numpy or
struct leaks out. The `gguf` package is used only for its constants.
"""

from __future__ import annotations

import difflib
import itertools
import math
import mmap
import os
import struct
import sys
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_args, get_origin

import attrs
import numpy as np
import torch
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

from .errors import GGUFError
from .quants import SUPPORTED_TYPES, QuantTensor

_MISSING: Any = object()
_SUPPORTED_VERSIONS = (2, 3)  # version 1 used 32-bit counts and lengths
_PREAMBLE_BYTES = 24  # magic, version, tensor count, metadata count
# The least bytes one metadata entry (key length, empty key, value type, a 1-byte value) and one tensor
# description (name length, empty name, dimension count, type, offset) can take; used to reject
# absurd counts before parsing.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_MAX_ARRAY_NESTING = 16

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Each numeric value type: its struct format (for a single value) and numpy dtype (for an array, decoded
# in one call; the same dtypes GGUFReader uses, so values come out identical).
_NUMBER_FORMATS: dict[GGUFValueType, tuple[struct.Struct, np.dtype]] = {
    value_type: (struct.Struct("<" + code), np.dtype(dtype))
    for value_type, code, dtype in [
        (GGUFValueType.UINT8, "B", "<u1"), (GGUFValueType.INT8, "b", "<i1"),
        (GGUFValueType.UINT16, "H", "<u2"), (GGUFValueType.INT16, "h", "<i2"),
        (GGUFValueType.UINT32, "I", "<u4"), (GGUFValueType.INT32, "i", "<i4"),
        (GGUFValueType.UINT64, "Q", "<u8"), (GGUFValueType.INT64, "q", "<i8"),
        (GGUFValueType.FLOAT32, "f", "<f4"), (GGUFValueType.FLOAT64, "d", "<f8"),
        (GGUFValueType.BOOL, "?", "?"),
    ]
}


@attrs.frozen
class TensorInfo:
    """Where a tensor lives in the file. `shape` is in torch order (GGUF `ne` reversed)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    offset: int  # absolute byte offset of the data in the file

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@attrs.frozen
class _Field:
    """Where one metadata value lies in the map; decoded on first use.

    For a string, `start` is its first byte and `count` its length in bytes; for an array, `start` is its
    first element and `count` the number of elements; for a number, `count` is 1.
    """

    value_type: GGUFValueType
    item_type: GGUFValueType | None  # arrays only
    start: int
    count: int


@attrs.frozen
class _RawTensor:
    """A tensor description as the header states it, before any check."""

    name: str
    ne: tuple[int, ...]  # GGUF order, innermost dimension first
    raw_type: int
    relative_offset: int


class _PastEndOfFile(Exception):
    def __init__(self, offset: int, end: int):
        super().__init__(f"a read of bytes {offset}..{end}")


class _Malformed(Exception):
    pass


class _UnsupportedValue(Exception):
    pass


class _HeaderCursor:
    """Bounds-checked reads of the header, front to back."""

    def __init__(self, buffer: mmap.mmap, position: int):
        self.buffer, self.size, self.position = buffer, len(buffer), position

    def take(self, n_bytes: int) -> int:
        """Step over `n_bytes`; return where they start."""
        start = self.position
        end = start + n_bytes
        if end > self.size:
            raise _PastEndOfFile(start, end)
        self.position = end
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buffer, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buffer, self.take(8))[0]

    def name(self, what: str) -> str:
        """A key or tensor name: a length-prefixed string that must be UTF-8 to be looked up at all."""
        length = self.u64()
        start = self.take(length)
        try:
            return self.buffer[start : start + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Malformed(f"{what} at byte {start} is not UTF-8 ({exc.reason})") from None

    def value_type(self, raw: int, key: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise _Malformed(f"metadata key {key!r} has unknown value type {raw}") from None

    def field(self, key: str) -> _Field:
        value_type = self.value_type(self.u32(), key)
        if value_type == GGUFValueType.STRING:
            length = self.u64()
            return _Field(value_type, None, self.take(length), length)
        if value_type != GGUFValueType.ARRAY:
            return _Field(value_type, None, self.take(_NUMBER_FORMATS[value_type][0].size), 1)
        item_type = self.value_type(self.u32(), key)
        count = self.u64()
        start = self.position
        self.skip_items(item_type, count, key)
        return _Field(value_type, item_type, start, count)

    def skip_items(self, item_type: GGUFValueType, count: int, key: str, depth: int = 0) -> None:
        """Step over `count` array elements of `item_type`."""
        if item_type in _NUMBER_FORMATS:
            self.take(count * _NUMBER_FORMATS[item_type][0].size)
        elif item_type == GGUFValueType.STRING:
            self.position = _skip_strings(self.buffer, self.position, count)
        else:  # arrays of arrays: rare, so walked element by element
            if depth >= _MAX_ARRAY_NESTING:  # a corrupt file must not exhaust Python's recursion limit
                raise _Malformed(f"metadata key {key!r} nests arrays more than {_MAX_ARRAY_NESTING} deep")
            for _ in range(count):
                inner_type = self.value_type(self.u32(), key)
                self.skip_items(inner_type, self.u64(), key, depth + 1)

    def tensor(self) -> _RawTensor:
        name = self.name("a tensor name")
        n_dims = self.u32()
        ne = struct.unpack_from(f"<{n_dims}Q", self.buffer, self.take(8 * n_dims))
        return _RawTensor(name, ne, self.u32(), self.u64())


def _skip_strings(buffer: mmap.mmap, position: int, count: int) -> int:
    """The end of `count` length-prefixed strings starting at `position`.

    This loop is most of the time it takes to open a file with a large vocabulary, so it stays minimal.
    """
    size = len(buffer)
    if position + 8 * count > size:  # each string takes at least its 8-byte length
        raise _PastEndOfFile(position, position + 8 * count)
    unpack_length = _U64.unpack_from
    start = position
    try:
        for _ in range(count):
            start = position
            position += 8 + unpack_length(buffer, position)[0]
            if position > size:
                raise _PastEndOfFile(start + 8, position)
    except struct.error:  # the length itself lies past the end
        raise _PastEndOfFile(start, start + 8) from None
    return position


def _decode_strings(buffer: mmap.mmap, position: int, count: int) -> list[str]:
    """`count` length-prefixed UTF-8 strings starting at `position` (already bounds-checked)."""
    unpack_length = _U64.unpack_from
    strings = []
    append = strings.append
    for _ in range(count):
        length = unpack_length(buffer, position)[0]
        position += 8
        append(buffer[position : position + length].decode("utf-8"))
        position += length
    return strings


class GGUFFile:
    """An open GGUF file: metadata as Python values and tensors as zero-copy `QuantTensor`s.

    Opening parses and checks the whole header; metadata values are decoded on first use, and tensor
    data stays in the memory map until used.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._buffer = _map_file(self.path)
        self.file_size = len(self._buffer)
        self.version, tensor_count, kv_count = _check_preamble(self.path, self._buffer)
        self._fields: dict[str, _Field] = {}
        self._values: dict[str, Any] = {}
        cursor = _HeaderCursor(self._buffer, _PREAMBLE_BYTES)
        try:
            raw_tensors = self._parse_header(cursor, kv_count, tensor_count)
        except (_PastEndOfFile, _Malformed) as exc:
            keys = list(self._fields)
            after = f" (the last metadata key that parsed is {keys[-1]!r})" if keys else ""
            if isinstance(exc, _PastEndOfFile):
                raise GGUFError(f"{self.path}: truncated header: {exc} runs past the end of the file "
                                f"({self.file_size} bytes){after}") from None
            raise GGUFError(f"{self.path}: malformed header: {exc}{after}") from None
        alignment = self._alignment()
        data_start = -(-cursor.position // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = _check_tensors(self.path, raw_tensors, data_start, alignment,
                                                             self.file_size)
        # The whole file as a read-only numpy array, for zero-copy tensor views.
        self._map = np.frombuffer(self._buffer, dtype=np.uint8)

    def _parse_header(self, cursor: _HeaderCursor, kv_count: int, tensor_count: int) -> list[_RawTensor]:
        for _ in range(kv_count):
            key = cursor.name("a metadata key")
            if key in self._fields:
                raise _Malformed(f"metadata key {key!r} appears twice")
            self._fields[key] = cursor.field(key)
        return [cursor.tensor() for _ in range(tensor_count)]

    def _alignment(self) -> int:
        field = self._fields.get("general.alignment")
        if field is None:
            return GGUF_DEFAULT_ALIGNMENT
        if field.value_type != GGUFValueType.UINT32:
            raise GGUFError(f"{self.path}: metadata key 'general.alignment' has type {field.value_type.name}, "
                            f"expected UINT32")
        alignment = self._value("general.alignment")
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: metadata key 'general.alignment' is {alignment}, which is not a "
                            f"power of two")
        return alignment

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, architecture={self.architecture!r}, tensors={len(self.tensors)})"

    # --- metadata ------------------------------------------------------------------------------------

    @property
    def architecture(self) -> str | None:
        return self.get("general.architecture", str, default=None)

    @property
    def metadata(self) -> dict[str, Any]:
        """Every metadata key as a plain Python value (str, int, float, bool or a list of those)."""
        return {key: self._value(key) for key in self._fields}

    def keys(self) -> list[str]:
        return list(self._fields)

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, type: Any = None, default: Any = _MISSING) -> Any:
        """The value of metadata `key`, checked against `type` when given.

        `type` is `str`, `int`, `float`, `bool`, `list` or `list[T]`. An int is accepted (and returned
        as float) where a float is expected; a bool is never taken for an int. A missing key returns
        `default`, or raises `GGUFError` when there is none.
        """
        if key not in self._fields:
            if default is _MISSING:
                raise GGUFError(f"{self.path}: missing metadata key {key!r}")
            return default
        value = self._value(key)
        if type is None:
            return value
        checked = _as_type(value, type)
        if checked is _MISSING:
            raise GGUFError(f"{self.path}: metadata key {key!r} has type {self._gguf_type(key)}, "
                            f"expected {_type_name(type)}")
        return checked

    def arch_get(self, suffix: str, type: Any = None, default: Any = _MISSING) -> Any:
        """`get(f"{architecture}.{suffix}")`, e.g. `arch_get("block_count", int)`."""
        architecture = self.architecture
        if architecture is None:
            if default is not _MISSING:
                return default
            raise GGUFError(f"{self.path}: missing metadata key 'general.architecture' "
                            f"(needed to look up '<architecture>.{suffix}')")
        return self.get(f"{architecture}.{suffix}", type, default)

    def value_type(self, key: str) -> tuple[GGUFValueType, GGUFValueType | None]:
        """The GGUF type a key is stored with, and its items' type for an array (to copy it exactly)."""
        if key not in self._fields:
            raise GGUFError(f"{self.path}: no metadata key {key!r}")
        field = self._fields[key]
        return field.value_type, field.item_type

    def _gguf_type(self, key: str) -> str:
        field = self._fields[key]
        if field.value_type != GGUFValueType.ARRAY:
            return field.value_type.name
        assert field.item_type is not None
        return "ARRAY of " + (field.item_type.name if field.count else "nothing (empty)")

    def _value(self, key: str) -> Any:
        if key not in self._values:
            try:
                self._values[key] = _field_value(self._buffer, self._fields[key])
            except UnicodeDecodeError as exc:
                raise GGUFError(f"{self.path}: metadata key {key!r} holds a string that is not UTF-8 "
                                f"({exc.reason} at byte {exc.start})") from None
            except _UnsupportedValue as exc:
                raise GGUFError(f"{self.path}: metadata key {key!r}: {exc}") from None
        return self._values[key]

    # --- tensors -------------------------------------------------------------------------------------

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str, shape: tuple[int | None, ...] | None = None) -> QuantTensor:
        """Tensor `name` as a `QuantTensor` whose bytes are a read-only view on the memory map.

        `shape` (torch order; `None` matches any size) is checked when given.
        """
        info = self.tensors.get(name)
        if info is None:
            close = difflib.get_close_matches(name, self.tensors, n=3)
            hint = f"; similar names: {', '.join(close)}" if close else ""
            raise GGUFError(f"{self.path}: missing tensor {name!r}{hint}")
        if shape is not None and not _shape_matches(info.shape, shape):
            raise GGUFError(f"{self.path}: tensor {name!r} has shape {info.shape}, expected {tuple(shape)}")
        if info.ggml_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise GGUFError(f"{self.path}: tensor {name!r} has type {info.ggml_type.name}, which Lucebox "
                            f"cannot decode (supported: {supported})")
        raw = self._map[info.offset : info.offset + info.n_bytes]
        with warnings.catch_warnings():
            # The map is read-only on purpose (a 16 GB file must not become private memory), and torch
            # warns that it cannot mark tensors read-only. QuantTensor documents that its bytes are
            # never written.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(raw)
        return QuantTensor(name, info.ggml_type, info.shape, data)


def _map_file(path: Path) -> mmap.mmap:
    """The whole file, memory-mapped read-only."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise GGUFError(f"{path}: the file is empty, not a GGUF file")
            # The map stays valid after the file is closed.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read the file ({exc.strerror or exc})") from None


def _check_preamble(path: Path, buffer: mmap.mmap) -> tuple[int, int, int]:
    """Check the fixed 24-byte start of the file; return (version, tensor count, metadata key count)."""
    size = len(buffer)
    head = buffer[:_PREAMBLE_BYTES]
    if head[:4] != GGUF_MAGIC.to_bytes(4, "little"):
        raise GGUFError(f"{path}: not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")
    if len(head) < _PREAMBLE_BYTES:
        raise GGUFError(f"{path}: truncated header: the file is only {size} bytes")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0 and version:
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")
    if version not in _SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: "
                        f"{', '.join(map(str, _SUPPORTED_VERSIONS))})")
    if sys.byteorder != "little":
        raise GGUFError(f"{path}: reading GGUF tensors needs a little-endian machine")
    tensor_count = int.from_bytes(head[8:16], "little")
    kv_count = int.from_bytes(head[16:24], "little")
    if kv_count * _MIN_KV_BYTES + tensor_count * _MIN_TENSOR_INFO_BYTES > size - _PREAMBLE_BYTES:
        raise GGUFError(f"{path}: corrupt header: it claims {kv_count} metadata keys and {tensor_count} "
                        f"tensors, more than a {size}-byte file can hold")
    return version, tensor_count, kv_count


def _check_tensors(path: Path, raw_tensors: list[_RawTensor], data_start: int, alignment: int,
                   file_size: int) -> dict[str, TensorInfo]:
    """The tensor table, checked: known types, whole blocks, aligned, inside the file, no overlaps."""
    tensors: dict[str, TensorInfo] = {}
    for raw in raw_tensors:
        where = f"{path}: tensor {raw.name!r}"
        try:
            ggml_type = GGMLQuantizationType(raw.raw_type)
            blocks, block_bytes = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise GGUFError(f"{where} has unknown ggml type {raw.raw_type}") from None
        row = raw.ne[0] if raw.ne else 1
        if row % blocks:
            raise GGUFError(f"{where}: a {ggml_type.name} row of {row} values is not a whole number of "
                            f"{blocks}-value blocks")
        if raw.relative_offset % alignment:
            raise GGUFError(f"{where}: data offset {raw.relative_offset} is not a multiple of the file's "
                            f"alignment {alignment}")
        start = data_start + raw.relative_offset
        n_bytes = math.prod(raw.ne) // blocks * block_bytes
        if start + n_bytes > file_size:
            raise GGUFError(f"{where}: data (bytes {start}..{start + n_bytes}) lies past the end of the file "
                            f"({file_size} bytes); the file is probably truncated")
        if raw.name in tensors:
            raise GGUFError(f"{where} is described twice")
        tensors[raw.name] = TensorInfo(raw.name, ggml_type, tuple(reversed(raw.ne)), n_bytes, start)
    spans = sorted((info.offset, info.offset + info.n_bytes, info.name) for info in tensors.values())
    for (_, prev_end, prev_name), (start, _, name) in itertools.pairwise(spans):
        if start < prev_end:
            raise GGUFError(f"{path}: tensor {name!r} overlaps the data of tensor {prev_name!r}")
    return tensors


def _field_value(buffer: mmap.mmap, field: _Field) -> Any:
    """A metadata value as a Python value. Strings are decoded strictly as UTF-8."""
    if field.value_type == GGUFValueType.STRING:
        return buffer[field.start : field.start + field.count].decode("utf-8")
    if field.value_type != GGUFValueType.ARRAY:
        return _NUMBER_FORMATS[field.value_type][0].unpack_from(buffer, field.start)[0]
    if field.count == 0:
        return []
    if field.item_type == GGUFValueType.ARRAY:
        raise _UnsupportedValue("arrays of arrays are not supported")
    if field.item_type == GGUFValueType.STRING:
        return _decode_strings(buffer, field.start, field.count)
    assert field.item_type is not None
    dtype = _NUMBER_FORMATS[field.item_type][1]
    return np.frombuffer(buffer, dtype=dtype, count=field.count, offset=field.start).tolist()


def _as_type(value: Any, expected: Any) -> Any:
    """`value` converted to `expected` if it fits (int -> float only), else `_MISSING`."""
    if get_origin(expected) is list:
        if not isinstance(value, list):
            return _MISSING
        (item_type,) = get_args(expected) or (None,)
        if item_type is None:
            return value
        items = [_as_type(item, item_type) for item in value]
        return _MISSING if any(item is _MISSING for item in items) else items
    if expected is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _MISSING
    if expected is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISSING
    return value if isinstance(value, expected) else _MISSING


def _type_name(expected: Any) -> str:
    if get_origin(expected) is list:
        args = get_args(expected)
        return f"list[{_type_name(args[0])}]" if args else "list"
    return getattr(expected, "__name__", repr(expected))


def _shape_matches(actual: tuple[int, ...], expected: tuple[int | None, ...]) -> bool:
    return len(actual) == len(expected) and all(e is None or a == e for a, e in zip(actual, expected))


# --- `lucebox info` --------------------------------------------------------------------------------


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A summary of a GGUF file for `lucebox info`; works on vocabulary-only files too."""
    gf = GGUFFile(path)
    architecture = gf.architecture
    tensor_counts: Counter[str] = Counter()
    tensor_bytes: Counter[str] = Counter()
    for info in gf.tensors.values():
        tensor_counts[info.ggml_type.name] += 1
        tensor_bytes[info.ggml_type.name] += info.n_bytes
    tokens = gf.get("tokenizer.ggml.tokens", list, default=None)
    return {
        "path": str(gf.path),
        "file_size": gf.file_size,
        "gguf_version": gf.version,
        "architecture": architecture,
        "name": gf.get("general.name", str, default=None),
        "parameter_count": sum(info.n_elements for info in gf.tensors.values()),
        "tensor_count": len(gf.tensors),
        "tensor_types": {
            name: {"tensors": tensor_counts[name], "bytes": tensor_bytes[name]}
            for name, _ in tensor_bytes.most_common()
        },
        "tokenizer": gf.get("tokenizer.ggml.model", str, default=None),
        "vocab_size": len(tokens) if tokens is not None else None,
        "has_chat_template": "tokenizer.chat_template" in gf,
        "context_length": gf.arch_get("context_length", int, default=None),
        "block_count": gf.arch_get("block_count", int, default=None),
    }


def format_description(d: dict[str, Any]) -> str:
    """`describe()`'s result as a short aligned table."""
    def show(value: Any) -> str:
        return "-" if value is None else str(value)

    rows = [
        ("file", d["path"]),
        ("size", _human_bytes(d["file_size"])),
        ("gguf version", show(d["gguf_version"])),
        ("architecture", show(d["architecture"])),
        ("name", show(d["name"])),
        ("parameters", _human_count(d["parameter_count"])),
        ("tensors", show(d["tensor_count"])),
        ("tokenizer", show(d["tokenizer"])),
        ("vocab size", show(d["vocab_size"])),
        ("chat template", "yes" if d["has_chat_template"] else "no"),
        ("context length", show(d["context_length"])),
        ("blocks", show(d["block_count"])),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    types = d["tensor_types"]
    if types:
        type_width = max(len(name) for name in types)
        count_width = max(len(str(entry["tensors"])) for entry in types.values())
        lines.append("tensor types:")
        lines += [f"  {name:<{type_width}}  {entry['tensors']:>{count_width}} tensors  "
                  f"{_human_bytes(entry['bytes']):>10}" for name, entry in types.items()]
    return "\n".join(lines)


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exponent = min(int(math.log(n, 1024)), 3)
    return f"{n / 1024**exponent:.2f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def _human_count(n: int) -> str:
    if n >= 1_000_000:
        scaled = f"{n / 1e9:.2f} B" if n >= 1_000_000_000 else f"{n / 1e6:.2f} M"
        return f"{scaled} ({n:,})"
    return f"{n:,}"


class MetadataView(Mapping[str, Any]):
    """GGUF metadata decoded key by key on access: `GGUFFile.metadata` would decode the whole
    248k-entry vocabulary, which takes seconds and is not needed to build the model."""

    def __init__(self, gguf_file: Any):
        self.gguf = gguf_file

    def __getitem__(self, key: str) -> Any:
        if key not in self.gguf:
            raise KeyError(key)
        return self.gguf.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self.gguf

    def __iter__(self) -> Iterator[str]:
        return iter(self.gguf.keys())

    def __len__(self) -> int:
        return len(self.gguf.keys())


class ArchMetadata:
    """The `ARCH.*` keys of GGUF metadata (key -> plain Python value), as a family's config reads them.

    Checks `general.architecture` first; a key asked for without a default that is missing, a GGUFError
    naming `source` (the file) and the full key."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, source: str = "GGUF metadata"):
        found = metadata.get("general.architecture", arch)
        if found != arch:
            raise GGUFError(f"{source}: general.architecture is {found!r}, expected {arch!r}")
        self.metadata, self.prefix, self.source = metadata, f"{arch}.", source

    def __contains__(self, key: str) -> bool:
        return self.prefix + key in self.metadata

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value of `ARCH.key`, else `default`."""
        if self.prefix + key in self.metadata:
            return self.metadata[self.prefix + key]
        if default is _MISSING:
            raise GGUFError(f"{self.source}: missing metadata key {self.prefix + key}")
        return default

    def vocab_size(self) -> int:
        """`ARCH.vocab_size`, else the length of the tokenizer's table (llama.cpp's converters write either)."""
        if "vocab_size" in self:
            return int(self.get("vocab_size"))
        if "tokenizer.ggml.tokens" in self.metadata:
            return len(self.metadata["tokenizer.ggml.tokens"])
        raise GGUFError(f"{self.source}: missing metadata key {self.prefix}vocab_size (and no tokenizer.ggml.tokens)")


def float32_decimal(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-6, not 9.99999997e-07): the
    value the config was written from."""
    return float(str(np.float32(value)))
