"""Reading a Hugging Face checkpoint for conversion to GGUF: its `config.json`, the safetensors files of a
folder, where each GGUF tensor comes from (a key, its expected shape, the converter's transform), the checks
before anything is written, and the encoding of one tensor in a plain GGUF type."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from .errors import LuceboxError
from .filetypes import file_type
from .gguf_out import TensorPlan, add_file_type, write_gguf

T = GGMLQuantizationType
Transform = Callable[[torch.Tensor], torch.Tensor]


def identity(w: torch.Tensor) -> torch.Tensor:
    return w


# Where the text model's tensors sit: under the language model of a multimodal checkpoint, else at the top.
TEXT_PREFIXES = ("model.language_model.", "model.")


def check_output_type(type: str, types: tuple[str, ...]) -> None:
    """A LuceboxError unless `type` is one of the file types a converter writes."""
    try:
        file_type(type, types)
    except ValueError as exc:
        raise LuceboxError(str(exc)) from None


def read_hf_config(hf_dir: Path, model_types: tuple[str, ...], family: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint's `config.json` and its text model's part (`text_config` of a multimodal one, else all of
    it); a LuceboxError unless its `model_type` is one of `model_types` (`family` says what they are)."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise LuceboxError(f"{config_path}: missing; {hf_dir} is not a Hugging Face checkpoint folder")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise LuceboxError(f"{config_path}: not valid JSON ({exc})") from None
    model_type = config.get("model_type")
    if model_type not in model_types:
        raise LuceboxError(f"{config_path}: model_type {model_type!r} is not {family} ({' or '.join(model_types)})")
    return config, config.get("text_config") or config


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

    def text_prefix(self, hf_dir: Path, prefixes: tuple[str, ...] = TEXT_PREFIXES) -> str:
        """The first of `prefixes` that the text model's embedding sits under."""
        found = next((p for p in prefixes if f"{p}embed_tokens.weight" in self), None)
        if found is None:
            names = " or ".join(f"{p}embed_tokens.weight" for p in prefixes)
            raise LuceboxError(f"{hf_dir}: no embedding tensor ({names})")
        return found


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


def encoded_bytes(weight: torch.Tensor, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """A float32 tensor as the bytes of a `ggml_type` GGUF tensor, ready for `write_gguf`."""
    return encode_tensor(weight.numpy(), ggml_type).reshape(-1).view(np.uint8)


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


def converted_data(checkpoint: Checkpoint,
                   sources: dict[str, TensorSource]) -> Callable[[TensorPlan], Iterator[np.ndarray]]:
    """`write_gguf`'s data for converted tensors: each read from the checkpoint in float32, through its
    source's transform, in the plan's shape and ggml type (one tensor in memory at a time)."""

    def data(plan: TensorPlan) -> Iterator[np.ndarray]:
        source = sources[plan.name]
        weight = source.transform(checkpoint.tensor(source.key).to(torch.float32)).reshape(plan.shape)
        yield encoded_bytes(weight, plan.ggml_type)

    return data


def write_converted(path: str | Path, hf_dir: Path, config: dict[str, Any], *, arch: str, type: str,
                    tensors: Sequence[TensorPlan], data: Callable[[TensorPlan], Iterable[Any]],
                    add_metadata: Callable[[Any], None]) -> Path:
    """Write a converted checkpoint to `path`: the general keys (its name: the config's `_name_or_path`, else
    the folder's; the file type), then the family's own (`add_metadata(writer)`), then the tensors."""

    def add_all_metadata(writer: Any) -> None:
        writer.add_name(str(config.get("_name_or_path") or hf_dir.resolve().name))
        add_file_type(writer, type)
        add_metadata(writer)

    return write_gguf(path, arch=arch, add_metadata=add_all_metadata, tensors=tensors, data=data,
                      description=f"converting to {type}")
