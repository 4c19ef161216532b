"""Reading GGUF files: checked metadata access and zero-copy tensors from the memory map.

`GGUFFile` wraps `gguf.GGUFReader`, which maps the file and parses the header. Every way a file can be
broken (missing, not GGUF, truncated, inconsistent) surfaces as one `GGUFError` naming the file and,
where there is one, the key or tensor at fault; nothing from numpy or struct leaks out.
"""

from __future__ import annotations

import difflib
import math
import os
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, get_args, get_origin

import attrs
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS, GGUFReader, ReaderField

from .errors import GGUFError
from .quants import SUPPORTED_TYPES, QuantTensor

_MISSING: Any = object()
_PREAMBLE_BYTES = 24  # magic, version, tensor count, metadata count
# The least bytes one metadata entry (key length, empty key, value type, a 1-byte value) and one tensor
# description (name length, empty name, dimension count, type, offset) can take; used to reject
# absurd counts before parsing.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


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


class _PastEndOfFile(Exception):
    def __init__(self, offset: int, end: int):
        super().__init__(f"a read of bytes {offset}..{end}")
        self.offset, self.end = offset, end


class _HeaderError(Exception):
    """A parse failure inside GGUFReader, with the last metadata key that parsed, for context."""

    def __init__(self, cause: Exception, last_key: str | None):
        super().__init__(str(cause))
        self.cause, self.last_key = cause, last_key


class _CheckedReader(GGUFReader):
    """GGUFReader with bounds-checked reads and tensor table checks.

    GGUFReader slices its memory map without checking the end, so a truncated file yields short arrays
    that fail later in confusing ways (or, for an array of numbers, loop over empty reads). Here every
    read past the end raises at once, and the tensor table is checked (type, alignment, bounds,
    overlap) before GGUFReader builds views on it, so errors can name the tensor. Both hooks override
    GGUFReader internals (`_get`, `_build_tensors`), which have kept their signatures across gguf
    releases.
    """

    def __init__(self, path: Path, file_size: int):
        self._path, self._file_size = path, file_size
        self._plain: np.ndarray | None = None
        try:
            super().__init__(path, mode="r")
        except GGUFError:
            raise
        except Exception as exc:  # any failure while parsing means the header is malformed
            keys = [key for key in getattr(self, "fields", {}) if not key.startswith("GGUF.")]
            raise _HeaderError(exc, keys[-1] if keys else None) from exc

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if self._plain is None:
            # Slicing the np.memmap subclass costs several times more than slicing a plain view of it,
            # and the header of a large vocabulary takes millions of slices.
            self._plain = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        end = offset + dtype.itemsize * int(count)
        if end > self._plain.shape[0]:
            raise _PastEndOfFile(offset, end)
        values = self._plain[offset:end].view(dtype)
        order = self.byte_order if override_order is None else override_order
        return values if order in ("I", "<") else values.view(dtype.newbyteorder(order))

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        spans = []
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_type, relative_offset = field.parts
            name = bytes(name_data).decode("utf-8")
            spans.append(self._check_tensor(name, dims.tolist(), int(raw_type[0]), start_offs,
                                            int(relative_offset[0])))
        spans.sort()
        for (_, prev_end, prev_name), (start, _, name) in zip(spans, spans[1:]):
            if start < prev_end:
                raise GGUFError(f"{self._path}: tensor {name!r} overlaps the data of tensor {prev_name!r}")
        super()._build_tensors(start_offs, fields)

    def _check_tensor(self, name: str, ne: list[int], raw_type: int, data_start: int,
                      relative_offset: int) -> tuple[int, int, str]:
        where = f"{self._path}: tensor {name!r}"
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            blocks, block_bytes = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise GGUFError(f"{where} has unknown ggml type {raw_type}") from None
        row = ne[0] if ne else 1
        if row % blocks:
            raise GGUFError(f"{where}: a {ggml_type.name} row of {row} values is not a whole number of "
                            f"{blocks}-value blocks")
        if relative_offset % self.alignment:
            raise GGUFError(f"{where}: data offset {relative_offset} is not a multiple of the file's "
                            f"alignment {self.alignment}")
        start = data_start + relative_offset
        end = start + math.prod(ne) // blocks * block_bytes
        if end > self._file_size:
            raise GGUFError(f"{where}: data (bytes {start}..{end}) lies past the end of the file "
                            f"({self._file_size} bytes); the file is probably truncated")
        return start, end, name


class GGUFFile:
    """An open GGUF file: metadata as Python values and tensors as zero-copy `QuantTensor`s.

    Opening parses and checks the whole header; tensor data stays in the memory map until used.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.file_size = _check_preamble(self.path)
        try:
            self._reader = _CheckedReader(self.path, self.file_size)
        except _HeaderError as exc:
            after = f" (the last metadata key that parsed is {exc.last_key!r})" if exc.last_key else ""
            if isinstance(exc.cause, _PastEndOfFile):
                raise GGUFError(f"{self.path}: truncated header: {exc.cause} runs past the end of the "
                                f"file ({self.file_size} bytes){after}") from None
            raise GGUFError(f"{self.path}: malformed header ({type(exc.cause).__name__}: "
                            f"{exc.cause}){after}") from exc.cause
        self.version = int(self._reader.fields["GGUF.version"].parts[0][0])
        self._fields = {key: field for key, field in self._reader.fields.items()
                        if not key.startswith("GGUF.")}
        self._values: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {
            t.name: TensorInfo(t.name, GGMLQuantizationType(t.tensor_type),
                               tuple(int(d) for d in reversed(t.shape.tolist())), int(t.n_bytes),
                               int(t.data_offset))
            for t in self._reader.tensors
        }

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

    def _gguf_type(self, key: str) -> str:
        types = self._fields[key].types
        if types[0] == GGUFValueType.ARRAY:
            return "ARRAY of " + (types[-1].name if len(types) > 1 else "nothing (empty)")
        return types[0].name

    def _value(self, key: str) -> Any:
        if key not in self._values:
            try:
                self._values[key] = _field_value(self._fields[key])
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
        raw = self._reader.data[info.offset : info.offset + info.n_bytes]
        with warnings.catch_warnings():
            # The map is read-only on purpose (a 16 GB file must not become private memory), and torch
            # warns that it cannot mark tensors read-only. QuantTensor documents that its bytes are
            # never written.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(raw)
        return QuantTensor(name, info.ggml_type, info.shape, data)


def _check_preamble(path: Path) -> int:
    """Check the fixed 24-byte start of the file; return the file size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_PREAMBLE_BYTES)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    if not head:
        raise GGUFError(f"{path}: the file is empty, not a GGUF file")
    if head[:4] != GGUF_MAGIC.to_bytes(4, "little"):
        raise GGUFError(f"{path}: not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")
    if len(head) < _PREAMBLE_BYTES:
        raise GGUFError(f"{path}: truncated header: the file is only {size} bytes")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0 and version:
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")
    if version not in READER_SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: "
                        f"{', '.join(map(str, READER_SUPPORTED_VERSIONS))})")
    if sys.byteorder != "little":
        raise GGUFError(f"{path}: reading GGUF tensors needs a little-endian machine")
    tensor_count = int.from_bytes(head[8:16], "little")
    kv_count = int.from_bytes(head[16:24], "little")
    if kv_count * _MIN_KV_BYTES + tensor_count * _MIN_TENSOR_INFO_BYTES > size - _PREAMBLE_BYTES:
        raise GGUFError(f"{path}: corrupt header: it claims {kv_count} metadata keys and {tensor_count} "
                        f"tensors, more than a {size}-byte file can hold")
    return size


class _UnsupportedValue(Exception):
    pass


def _field_value(field: ReaderField) -> Any:
    """A ReaderField as a Python value. Strings are decoded strictly as UTF-8."""
    kind = field.types[0]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    if kind != GGUFValueType.ARRAY:
        return field.parts[-1][0].item()
    if len(field.types) == 1:  # an empty array records no element type
        return []
    if field.types[1] == GGUFValueType.ARRAY:
        raise _UnsupportedValue("arrays of arrays are not supported")
    if field.types[1] == GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return np.concatenate([field.parts[i] for i in field.data]).tolist()


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
