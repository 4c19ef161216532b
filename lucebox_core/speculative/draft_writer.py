"""Random-weight DFlash draft files for a given `DraftConfig`: what every family's drafter synthesizer writes
once it has chosen the drafter's shape for its target (`lucebox synth --arch <family>-dflash-draft`).

Matrices are random blocks of the requested type at a fresh initialisation's scale (`kquants`), norms F32
near 1, like the target synthesizers'.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import LuceboxError
from ..filetypes import file_type, stays_f32, tensor_type
from ..gguf_out import TensorPlan, write_gguf
from ..kquants import random_blocks
from .dflash import DraftConfig, add_metadata

TYPES = ("f32", "f16", "q8_0", "q4_k_m")
WEIGHT_STD = 0.02
CHUNK_WEIGHTS = 1 << 20  # a multiple of every block size


def write_random_draft(path: str | Path, cfg: DraftConfig, *, type: str = "f32", seed: int = 0,
                       name: str = "", size: str = "") -> Path:
    """Write a random drafter of shape `cfg` as a `type` GGUF at `path`; `name` says what it is for."""
    try:
        ftype = file_type(type, TYPES)
    except ValueError as exc:
        raise LuceboxError(str(exc)) from None
    plans = [
        TensorPlan(tensor, shape, tensor_type(tensor, shape, type, n_layer=cfg.n_layer, tied_output=False))
        for tensor, shape in cfg.tensor_shapes().items()
    ]

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
