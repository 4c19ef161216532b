"""Writing the trained demo pair as GGUF through the project's writers, and what surrounds it: the weights'
round trip through the file's quantized types before anything is measured, the training metadata, and the
split into parts that travel (and are stored) under 16 MiB each, with checksums.

The target goes through `gguf_out.write_gguf` with the qwen35 layout's tensor plans and metadata
(`lucebox_qwen35.layout`) and the synthetic vocabulary a `lucebox synth` file gets (the packaged Qwen3.5
tokenizer padded to 248,320 entries, the chat template); the drafter through
`lucebox_core.speculative.draft_writer.write_draft`. Matrices are encoded by `checkpoint.encoded_bytes`
(gguf's quantizers), as the converter encodes them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType

from lucebox_core import gguf_out
from lucebox_core.checkpoint import encoded_bytes
from lucebox_core.quants import dequantize
from lucebox_core.speculative import draft_writer
from lucebox_qwen35 import layout
from lucebox_qwen35.default import sha256_of
from lucebox_qwen35 import vocab as qwen_vocab

PART_BYTES = 15 * 1024 * 1024
METADATA_PREFIX = "lucebox.train."


def target_plans(config: layout.Qwen35Config, type: str) -> list[gguf_out.TensorPlan]:
    return gguf_out.tensor_plans(layout.tensor_shapes(config), type, n_layer=config.n_layer,
                                 tied_output=config.tied_output)


def file_bytes(plans: list[gguf_out.TensorPlan], metadata_bytes: int = 0) -> int:
    """Tensor data of `plans` (plus `metadata_bytes` for the header): what the file will weigh, roughly."""
    return sum(p.nbytes for p in plans) + metadata_bytes


@torch.no_grad()
def quantize_roundtrip_(tensors: Iterator[tuple[str, torch.Tensor]], plans: list[gguf_out.TensorPlan]) -> int:
    """Replace every parameter that the file stores in a lossy type by its decoded encoding, in place, so the
    model measured (and the drafter's teacher) is the model in the file. Returns how many were replaced.

    Encoding a decoded Q8_0 tensor gives the same bytes again, so writing the file afterwards stores exactly
    these weights."""
    types = {p.name: p.ggml_type for p in plans}
    changed = 0
    for name, tensor in tensors:
        ggml_type = types[name]
        if ggml_type == GGMLQuantizationType.F32:
            continue
        if not isinstance(tensor, torch.nn.Parameter):
            raise ValueError(f"{name} is stored as {ggml_type.name} but is not a parameter of the model")
        raw = torch.from_numpy(encoded_bytes(tensor.detach().float().cpu().contiguous(), ggml_type))
        tensor.copy_(dequantize(raw, ggml_type, tuple(tensor.shape)).to(tensor.device, tensor.dtype))
        changed += 1
    return changed


def add_training_metadata(writer: Any, values: dict[str, Any]) -> None:
    """`lucebox.train.<key>` keys with plain types: strings, bools, ints, floats, lists of strings."""
    for key, value in values.items():
        name = METADATA_PREFIX + key
        if isinstance(value, bool):
            writer.add_key_value(name, value, GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(name, value, GGUFValueType.INT64)
        elif isinstance(value, float):
            writer.add_key_value(name, value, GGUFValueType.FLOAT64)
        elif isinstance(value, str):
            writer.add_key_value(name, value, GGUFValueType.STRING)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            writer.add_key_value(name, list(value), GGUFValueType.ARRAY, GGUFValueType.STRING)
        else:
            writer.add_key_value(name, json.dumps(value, sort_keys=True), GGUFValueType.STRING)


def write_target(path: Path, model: Any, type: str, *, name: str, description: str, training: dict[str, Any]) -> Path:
    config = model.config
    plans = target_plans(config, type)
    weights = dict(model.gguf_tensors())
    if list(weights) != [p.name for p in plans]:
        raise ValueError("the trainable target's tensors do not follow the qwen35 layout")
    tokens = qwen_vocab.synthetic(None, config.vocab)

    def add_metadata(writer: Any) -> None:
        writer.add_name(name)
        writer.add_description(description)
        writer.add_license("MIT (weights); trained on the Python standard library's source (PSF-2.0)")
        gguf_out.add_file_type(writer, type)
        layout.add_metadata(writer, config)
        tokens.add_to_writer(writer)
        add_training_metadata(writer, training)

    def data(plan: gguf_out.TensorPlan) -> Iterator[np.ndarray]:
        yield encoded_bytes(weights[plan.name].detach().float().cpu().reshape(plan.shape).contiguous(), plan.ggml_type)

    return gguf_out.write_gguf(path, arch=layout.ARCH, add_metadata=add_metadata, tensors=plans, data=data,
                               description=f"demo target {type}")


def write_drafter(path: Path, drafter: Any, type: str, *, name: str, training: dict[str, Any]) -> Path:
    weights = {n: t.detach() for n, t in drafter.gguf_tensors()}
    return draft_writer.write_draft(path, drafter.config, weights, type=type, name=name,
                                    add_metadata_extra=lambda writer: add_training_metadata(writer, training))


# -- parts -------------------------------------------------------------------------------------------------


def split_into_parts(files: list[Path], folder: Path, part_bytes: int = PART_BYTES) -> dict[str, Any]:
    """Compress each file (gzip: the zero rows of the unused vocabulary and the tokenizer's metadata shrink the
    target fourfold) and cut the stream into `<name>.gz.partNN` pieces of at most `part_bytes` in `folder`;
    write `manifest.json` there: per file its size and sha256 uncompressed, and each part's (what
    `lucebox_qwen35.default` reassembles)."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"format": 2, "encoding": "gzip", "part_bytes": part_bytes, "files": []}
    for path in files:
        # mtime 0 and no name in the header: the same file always gives the same parts.
        stored = gzip.compress(path.read_bytes(), compresslevel=6, mtime=0)
        parts = []
        for index, start in enumerate(range(0, len(stored), part_bytes)):
            chunk = stored[start:start + part_bytes]
            part = folder / f"{path.name}.gz.part{index:02d}"
            part.write_bytes(chunk)
            parts.append({"name": part.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
        manifest["files"].append({"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_of(path),
                                  "stored_bytes": len(stored), "parts": parts})
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
