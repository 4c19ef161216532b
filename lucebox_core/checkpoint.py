"""Reading a Hugging Face checkpoint for conversion to GGUF: the safetensors files of a folder, where each
GGUF tensor comes from (a key, its expected shape, the converter's transform), the checks before anything is
written, and the encoding of one tensor in a plain GGUF type."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from .errors import LuceboxError

T = GGMLQuantizationType
Transform = Callable[[torch.Tensor], torch.Tensor]


def identity(w: torch.Tensor) -> torch.Tensor:
    return w


class Checkpoint:
    """The safetensors files of a folder (single file, sharded with an index, or a plain set)."""

    def __init__(self, hf_dir: Path) -> None:
        from safetensors import safe_open

        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({hf_dir / f for f in weight_map.values()})
        else:
            files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise LuceboxError(f"{hf_dir}: no *.safetensors weights found")
        self.location: dict[str, Path] = {}
        self.handles: dict[Path, Any] = {}
        for file in files:
            if not file.is_file():
                raise LuceboxError(f"{index}: names shard {file.name}, which is missing")
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise LuceboxError(f"{file}: cannot open as safetensors: {exc}") from None
            self.handles[file] = handle
            for key in handle.keys():  # a safetensors handle, not a dict
                self.location[key] = file

    def __contains__(self, key: str) -> bool:
        return key in self.location

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.handles[self.location[key]].get_slice(key).get_shape())

    def tensor(self, key: str) -> torch.Tensor:
        return self.handles[self.location[key]].get_tensor(key)


@attrs.frozen
class TensorSource:
    """Where a GGUF tensor comes from: an HF key, its expected on-disk shape and the transform."""

    key: str
    hf_shape: tuple[int, ...]
    transform: Transform


def encode_tensor(x: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    if ggml_type == T.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if ggml_type == T.F16:
        return np.ascontiguousarray(x, dtype=np.float16)
    return quants.quantize(np.ascontiguousarray(x, dtype=np.float32), ggml_type)


def check_sources(checkpoint: Checkpoint, sources: dict[str, TensorSource], prefix: str, hf_dir: Path, *,
                  family: str, skipped: Iterable[str] = (), also_used: Iterable[str] = ("lm_head.weight",)) -> None:
    """Fail before writing anything if a tensor is missing, mis-shaped or unexpected."""
    for name, source in sources.items():
        if source.key not in checkpoint:
            raise LuceboxError(f"{hf_dir}: missing tensor {source.key} (for {name})")
        shape = checkpoint.shape(source.key)
        if shape != source.hf_shape:
            raise LuceboxError(
                f"{checkpoint.location[source.key]}: tensor {source.key} has shape {list(shape)}, "
                f"expected {list(source.hf_shape)} from config.json"
            )
    used = {s.key for s in sources.values()} | set(also_used)
    skipped = tuple(skipped)
    unexpected = [
        key for key in checkpoint.location
        if key not in used and not key.startswith(skipped) and key.startswith(prefix)
    ]
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:5])
        raise LuceboxError(f"{hf_dir}: tensors that the {family} layout has no place for: {shown}")
