"""DFlash draft files for a given `DraftConfig`: random ones, what every family's drafter synthesizer writes once
it has chosen the drafter's shape for its target (`lucebox synth --arch <family>-dflash-draft`), and trained
ones, from given weights (`write_draft`).

Random matrices are random blocks of the requested type at a fresh initialisation's scale (`kquants`), norms
F32 near 1, like the target synthesizers'. Given weights are encoded as llama.cpp's converter would (norms and
other 1-D tensors F32, matrices in the file type's ggml type).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LuceboxError
from ..filetypes import file_type, stays_f32, tensor_type
from ..gguf_out import TensorPlan, add_file_type, write_gguf
from ..kquants import random_blocks
from .dflash import DraftConfig, add_metadata

TYPES = ("f32", "f16", "q8_0", "q4_k_m")
WEIGHT_STD = 0.02
CHUNK_WEIGHTS = 1 << 20  # a multiple of every block size


def write_random_draft(path: str | Path, cfg: DraftConfig, *, type: str = "f32", seed: int = 0,
                       name: str = "", size: str = "") -> Path:
    """Write a random drafter of shape `cfg` as a `type` GGUF at `path`; `name` says what it is for."""
    ftype = _file_type(type)
    plans = tensor_plans(cfg, type)

    def data(plan: TensorPlan) -> Iterator[np.ndarray]:
        rng = np.random.default_rng([seed, plans.index(plan)])
        n = int(np.prod(plan.shape))
        if stays_f32(plan.name, plan.shape):
            yield rng.uniform(0.9, 1.1, n).astype(np.float32)
            return
        for start in range(0, n, CHUNK_WEIGHTS):
            yield random_blocks(plan.ggml_type, min(CHUNK_WEIGHTS, n - start), WEIGHT_STD, rng)

    def add(writer) -> None:
        writer.add_name(name or f"DFlash draft {size} RANDOM WEIGHTS (synthetic, seed {seed})")
        writer.add_file_type(int(ftype))
        add_metadata(writer, cfg)

    return write_gguf(path, arch=cfg.architecture, add_metadata=add, tensors=plans, data=data,
                      description=f"{cfg.architecture} {size} {type}".replace("  ", " "))


def _file_type(type: str) -> Any:
    try:
        return file_type(type, TYPES)
    except ValueError as exc:
        raise LuceboxError(str(exc)) from None


def tensor_plans(cfg: DraftConfig, type: str) -> list[TensorPlan]:
    """The tensors of a `type` draft file of shape `cfg`, in file order, with their ggml types."""
    return [
        TensorPlan(tensor, shape, tensor_type(tensor, shape, type, n_layer=cfg.n_layer, tied_output=False))
        for tensor, shape in cfg.tensor_shapes().items()
    ]


def write_draft(path: str | Path, cfg: DraftConfig, weights: Mapping[str, Any], *, type: str = "q8_0", name: str,
                add_metadata_extra: Callable[[Any], None] | None = None) -> Path:
    """Write a drafter with the given `weights` (GGUF name -> float array or tensor in the file's numpy-order
    shape) as a `type` GGUF at `path`. `add_metadata_extra(writer)` adds keys of the caller's own (a trained
    drafter's provenance). Every tensor of the layout must be given, and nothing else."""
    from ..checkpoint import encoded_bytes

    _file_type(type)
    plans = tensor_plans(cfg, type)
    missing = [p.name for p in plans if p.name not in weights]
    unknown = sorted(set(weights) - {p.name for p in plans})
    if missing or unknown:
        raise LuceboxError(f"draft weights do not match the layout: missing {missing[:5]}, unexpected {unknown[:5]}")
    for plan in plans:
        if tuple(weights[plan.name].shape) != plan.shape:
            raise LuceboxError(f"draft weight {plan.name} has shape {tuple(weights[plan.name].shape)}, "
                               f"expected {plan.shape}")

    def data(plan: TensorPlan) -> Iterator[np.ndarray]:
        import torch

        yield encoded_bytes(torch.as_tensor(weights[plan.name]).detach().float().cpu().contiguous(), plan.ggml_type)

    def add(writer) -> None:
        writer.add_name(name)
        add_file_type(writer, type)
        add_metadata(writer, cfg)
        if add_metadata_extra is not None:
            add_metadata_extra(writer)

    return write_gguf(path, arch=cfg.architecture, add_metadata=add, tensors=plans, data=data,
                      description=f"{cfg.architecture} {type}")
