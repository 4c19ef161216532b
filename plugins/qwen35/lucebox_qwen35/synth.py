"""Random-weight qwen35 GGUF files with llama.cpp's exact layout, metadata and type mixes.

Weights look like a fresh initialisation: matrices zero-mean with std 0.02, norms in [0.9, 1.1], GDN decay
`ssm_a` in [-16, -1] and `ssm_dt.bias` = softplus^-1 of dt in [1e-3, 0.1] (Qwen3.5's own init
ranges), conv taps uniform in [-0.5, 0.5]. Quantized matrices are random blocks built directly
(`kquants`), never encoded from floats.

Small files (up to `INDEPENDENT_LIMIT` weights: tiny and 0.8b) get independent random data for
every tensor. Larger ones (27b) are assembled from a pool of pre-made random blocks per type, each
block of a tensor drawn from it at random: writing is then bound by the disk, not by random number
generation, and memory stays at a few pools plus one chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from lucebox_core.errors import LuceboxError

from . import layout
from . import vocab as vocab_source
from .filetypes import file_type, stays_f32, tensor_type
from .gguf_out import TensorPlan, write_gguf
from .kquants import random_blocks

TYPES = ("f32", "f16", "q8_0", "q4_k_m")
WEIGHT_STD = 0.02
INDEPENDENT_LIMIT = 1 << 30  # total weights up to which every tensor gets its own random data
POOL_WEIGHTS = 1 << 24  # weights per pool (per ggml type) for larger files
CHUNK_WEIGHTS = 1 << 20  # weights produced / copied per write


def tensor_plans(cfg: layout.Qwen35Config, type: str) -> list[TensorPlan]:
    """The tensors of a `type` file of `cfg`, in file order, with their ggml types."""
    return [
        TensorPlan(name, shape, tensor_type(name, shape, type, n_layer=cfg.n_layer, tied_output=cfg.tied_output))
        for name, shape in layout.tensor_shapes(cfg).items()
    ]


def _small_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Values of the per-channel tensors, in the ranges the real model is initialised with."""
    n = int(np.prod(shape))
    if name.endswith("_norm.weight"):
        # Stored as llama.cpp stores them: already `1 + w` for the zero-centred norms.
        return rng.uniform(0.9, 1.1, n)
    if name.endswith(".ssm_a"):
        return -np.exp(rng.uniform(np.log(1.0), np.log(16.0), n))
    if name.endswith(".ssm_dt.bias"):
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), n))
        return np.log(np.expm1(dt))
    if name.endswith(".ssm_conv1d.weight"):
        return rng.uniform(-0.5, 0.5, n)
    raise ValueError(f"no synthetic rule for small tensor {name}")


class _Weights:
    """Streams the bytes of each planned tensor."""

    def __init__(self, seed: int, independent: bool) -> None:
        self.seed = seed
        self.independent = independent
        self.pools: dict[GGMLQuantizationType, np.ndarray] = {}
        self.index = 0

    def __call__(self, plan: TensorPlan) -> Iterator[np.ndarray]:
        # One generator per tensor, seeded by (seed, position): the file is a function of the seed.
        rng = np.random.default_rng([self.seed, self.index])
        self.index += 1
        if stays_f32(plan.name, plan.shape):
            yield _small_tensor(plan.name, plan.shape, rng).astype(np.float32)
            return
        n = int(np.prod(plan.shape))
        if self.independent:
            for start in range(0, n, CHUNK_WEIGHTS):
                yield random_blocks(plan.ggml_type, min(CHUNK_WEIGHTS, n - start), WEIGHT_STD, rng)
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
            blocks = random_blocks(ggml_type, POOL_WEIGHTS, WEIGHT_STD, rng)
            self.pools[ggml_type] = blocks.reshape(-1, GGML_QUANT_SIZES[ggml_type][1])  # one row per block
        return self.pools[ggml_type]


def write(
    path: str | Path,
    *,
    size: str = "tiny",
    type: str = "f32",
    seed: int = 0,
    vocab: str | Path | None = None,
) -> Path:
    """Write a random-weight qwen35 GGUF of `size` (tiny, 0.8b, 27b) and `type` (f32, f16, q8_0,
    q4_k_m) to `path`; `vocab` is a GGUF to take the vocabulary from (default: the packaged one)."""
    try:
        cfg = layout.size(size)
        ftype = file_type(type, TYPES)
    except ValueError as exc:
        raise LuceboxError(str(exc)) from None
    tokens = vocab_source.synthetic(vocab, cfg.vocab)
    tensors = tensor_plans(cfg, type)
    total = sum(int(np.prod(p.shape)) for p in tensors)

    def add_metadata(writer) -> None:
        writer.add_name(f"Qwen3.5 {size} RANDOM WEIGHTS (synthetic, seed {seed})")
        writer.add_description("Random weights with the Qwen3.5 layout, for tests and benchmarks; not a model")
        writer.add_file_type(int(ftype))
        if type not in ("f32", "f16"):
            writer.add_quantization_version(2)  # GGML_QNT_VERSION, as llama.cpp's quantizer writes
        layout.add_metadata(writer, cfg)
        tokens.add_to_writer(writer)

    return write_gguf(
        path,
        arch=layout.ARCH,
        add_metadata=add_metadata,
        tensors=tensors,
        data=_Weights(seed, independent=total <= INDEPENDENT_LIMIT),
        description=f"qwen35 {size} {type}",
    )
