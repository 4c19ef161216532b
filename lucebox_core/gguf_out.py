"""Write a GGUF file tensor by tensor, chunk by chunk, atomically.

`gguf.GGUFWriter` writes the header, metadata and tensor directory; the tensor data is then streamed
from a callback, so no tensor (let alone the file) has to sit in memory whole. The file is written
under a temporary name in the target directory, fsynced and renamed into place, so a reader (or a
second process writing the same file) never sees a partial file.
"""

from __future__ import annotations

import logging

import os
import secrets
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

# gguf's writer logs every file it writes at INFO; our own progress bar and messages say enough.
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)

from .filetypes import file_type, nbytes, tensor_type

Chunk = Any  # bytes-like: a contiguous numpy array, bytes or memoryview


@attrs.frozen
class TensorPlan:
    """One tensor to write: name, numpy-order shape and ggml type."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        return nbytes(self.ggml_type, self.shape)


def tensor_plans(shapes: Mapping[str, tuple[int, ...]], type: str, *, n_layer: int,
                 tied_output: bool) -> list[TensorPlan]:
    """The tensors of a `type` file with these numpy-order `shapes`, in file order, each with the ggml type
    llama.cpp gives it in that file type."""
    return [TensorPlan(name, shape, tensor_type(name, shape, type, n_layer=n_layer, tied_output=tied_output))
            for name, shape in shapes.items()]


def add_file_type(writer: GGUFWriter, type: str) -> None:
    """`general.file_type` of a `type` file and, when it holds quantized blocks, the quantization version
    (GGML_QNT_VERSION) that llama.cpp's quantizer writes beside it."""
    writer.add_file_type(int(file_type(type)))
    if type not in ("f32", "f16", "bf16"):
        writer.add_quantization_version(2)


def add_arch_metadata(writer: GGUFWriter, arch: str, metadata: Mapping[str, Any],
                      value_types: Mapping[str, tuple[GGUFValueType, GGUFValueType | None]]) -> None:
    """Write a family's `ARCH.*` keys with llama.cpp's value types: `value_types` by key without the `ARCH.`
    prefix, as (type, array item type); a key it does not name is a UINT32."""
    for key, value in metadata.items():
        vtype, sub = value_types.get(key.removeprefix(f"{arch}."), (GGUFValueType.UINT32, None))
        writer.add_key_value(key, value, vtype, sub)


def _progress(total: int, description: str) -> Any:
    """A rich progress bar on an interactive stderr, else None."""
    if not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), console=Console(stderr=True), transient=True,
    )
    progress.start()
    progress.add_task(description, total=total)
    return progress


def write_gguf(
    path: str | Path,
    *,
    arch: str,
    add_metadata: Callable[[GGUFWriter], None],
    tensors: Sequence[TensorPlan],
    data: Callable[[TensorPlan], Iterable[Chunk]],
    description: str = "writing",
) -> Path:
    """Write `tensors` (their bytes streamed by `data(plan)`) and metadata to `path`, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    writer = GGUFWriter(None, arch)
    add_metadata(writer)
    for plan in tensors:
        # With a raw ggml type the writer takes `shape` as the logical numpy-order shape.
        writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes, raw_dtype=plan.ggml_type)
    align = writer.data_alignment
    progress = None
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        progress = _progress(sum(p.nbytes for p in tensors), description)
        with open(tmp, "ab") as out:
            for plan in tensors:
                out.write(bytes(-out.tell() % align))
                written = 0
                for chunk in data(plan):
                    n = chunk.nbytes if isinstance(chunk, np.ndarray) else len(chunk)
                    out.write(chunk)
                    written += n
                    if progress is not None:
                        progress.advance(progress.task_ids[0], n)
                if written != plan.nbytes:
                    raise RuntimeError(f"{plan.name}: wrote {written} bytes, expected {plan.nbytes}")
            out.write(bytes(-out.tell() % align))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if progress is not None:
            progress.stop()
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not possible on every platform; the rename itself is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
