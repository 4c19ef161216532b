"""Random weights for synthetic GGUF files: the bytes of each planned tensor, streamed chunk by chunk.

Matrices get random quantized blocks at a real initialisation's scale (`kquants.random_blocks`); the small
per-channel tensors (norms, scalars, the family's own) get values from the family's `small_tensor(name,
shape, rng)` rule. Up to a size every tensor gets its own random data; beyond it, blocks are drawn from a
pool per ggml type, so writing a 27B file takes minutes, not hours, and no two rows repeat in practice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .filetypes import stays_f32
from .gguf_out import TensorPlan, add_file_type, write_gguf
from .kquants import random_blocks

WEIGHT_STD = 0.02
INDEPENDENT_LIMIT = 1 << 30  # total weights up to which every tensor gets its own random data
POOL_WEIGHTS = 1 << 24  # weights per pool (per ggml type) for larger files
CHUNK_WEIGHTS = 1 << 20  # weights produced / copied per write

SmallTensorRule = Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray]


def named_size(sizes: Mapping[str, Any], name: str, arch: str) -> Any:
    """The config of the size `name` among a family's named `sizes`, or a ValueError listing them."""
    try:
        return sizes[name]
    except KeyError:
        raise ValueError(f"unknown {arch} size {name!r}; choose one of {', '.join(sizes)}") from None


class RandomWeights:
    """Streams the bytes of each planned tensor."""

    def __init__(self, seed: int, independent: bool, small_tensor: SmallTensorRule,
                 weight_std: float = WEIGHT_STD) -> None:
        self.seed = seed
        self.small_tensor = small_tensor
        self.weight_std = weight_std
        self.independent = independent
        self.pools: dict[GGMLQuantizationType, np.ndarray] = {}
        self.index = 0

    def __call__(self, plan: TensorPlan) -> Iterator[np.ndarray]:
        # One generator per tensor, seeded by (seed, position): the file is a function of the seed.
        rng = np.random.default_rng([self.seed, self.index])
        self.index += 1
        if stays_f32(plan.name, plan.shape):
            yield self.small_tensor(plan.name, plan.shape, rng).astype(np.float32)
            return
        n = int(np.prod(plan.shape))
        if self.independent:
            for start in range(0, n, CHUNK_WEIGHTS):
                yield random_blocks(plan.ggml_type, min(CHUNK_WEIGHTS, n - start), self.weight_std, rng)
            return
        # Each chunk gathers randomly chosen blocks of the pool: a row repeats another only if all
        # its blocks were drawn the same (about pool_blocks ** -blocks_per_row).
        pool = self._pool(plan.ggml_type)
        weights_per_block = GGML_QUANT_SIZES[plan.ggml_type][0]
        chunk_blocks = CHUNK_WEIGHTS // weights_per_block
        remaining = n // weights_per_block
        while remaining:
            take = min(chunk_blocks, remaining)
            yield np.take(pool, rng.integers(0, len(pool), take), axis=0)
            remaining -= take

    def _pool(self, ggml_type: GGMLQuantizationType) -> np.ndarray:
        if ggml_type not in self.pools:
            rng = np.random.default_rng([self.seed, 1 << 31, int(ggml_type)])
            blocks = random_blocks(ggml_type, POOL_WEIGHTS, self.weight_std, rng)
            self.pools[ggml_type] = blocks.reshape(-1, GGML_QUANT_SIZES[ggml_type][1])  # one row per block
        return self.pools[ggml_type]


def write_random_model(path: str | Path, tensors: Sequence[TensorPlan], *, arch: str, title: str, size: str,
                       type: str, seed: int, small_tensor: SmallTensorRule,
                       add_metadata: Callable[[Any], None]) -> Path:
    """Write a random-weight file of `tensors` to `path`: general keys that say it is no model (`title` names
    the family's layout), the file type, the family's own keys (`add_metadata(writer)`), then random data."""
    total = sum(int(np.prod(plan.shape)) for plan in tensors)

    def add_all_metadata(writer: Any) -> None:
        writer.add_name(f"{title} {size} RANDOM WEIGHTS (synthetic, seed {seed})")
        writer.add_description(f"Random weights with the {title} layout, for tests and benchmarks; not a model")
        add_file_type(writer, type)
        add_metadata(writer)

    return write_gguf(path, arch=arch, add_metadata=add_all_metadata, tensors=tensors,
                      data=RandomWeights(seed, total <= INDEPENDENT_LIMIT, small_tensor),
                      description=f"{arch} {size} {type}")
