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

from pathlib import Path

import numpy as np

from lucebox_core.errors import LuceboxError
from lucebox_core.filetypes import file_type, tensor_type
from lucebox_core.gguf_out import TensorPlan, write_gguf
from lucebox_core.synthetic import INDEPENDENT_LIMIT, WEIGHT_STD, RandomWeights  # noqa: F401 (WEIGHT_STD: the scale)

from . import layout
from . import vocab as vocab_source

TYPES = ("f32", "f16", "q8_0", "q4_k_m")


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
        data=RandomWeights(seed, total <= INDEPENDENT_LIMIT, _small_tensor),
        description=f"qwen35 {size} {type}",
    )
