"""Random-weight qwen35 and qwen35moe GGUF files with llama.cpp's exact layout, metadata and type mixes.

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

from lucebox_core import gguf_out
from lucebox_core.errors import LuceboxError
from lucebox_core.filetypes import file_type
from lucebox_core.gguf_out import TensorPlan
from lucebox_core.specs import SYNTHESIZED_TYPES
from lucebox_core.synthetic import (WEIGHT_STD, RandomWeights, router_skew_scale, with_router_skew,
                                    write_random_model)

from . import layout, layout_moe, layout_qwen3
from . import vocab as vocab_source

# WEIGHT_STD (the matrices' scale) and RandomWeights (their data) are the core's, named here for the tests.
__all__ = ["TYPES", "WEIGHT_STD", "RandomWeights", "qwen3_tensor_plans", "tensor_plans", "write", "write_moe",
           "write_qwen3"]

TYPES = SYNTHESIZED_TYPES


def tensor_plans(cfg: layout.Qwen35Config, type: str) -> list[TensorPlan]:
    """The tensors of a `type` file of `cfg`, in file order, with their ggml types."""
    return gguf_out.tensor_plans(layout.tensor_shapes(cfg), type, n_layer=cfg.n_layer, tied_output=cfg.tied_output)


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
    if name.endswith((".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")):
        # The MoE router and the shared expert's gate (kept F32) are matrices like the others.
        return rng.normal(0.0, WEIGHT_STD, n)
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
    return _write(path, layout.ARCH, size=size, type=type, seed=seed, vocab=vocab)


def write_moe(
    path: str | Path,
    *,
    size: str = "tiny",
    type: str = "f32",
    seed: int = 0,
    vocab: str | Path | None = None,
    router_skew: float | None = None,
) -> Path:
    """Write a random-weight qwen35moe GGUF of `size` (tiny, 35b-a3b); the rest as `write`. `router_skew` F:
    routers biased toward a hot set of experts per layer, about F of the picks (`synthetic.with_router_skew`)."""
    return _write(path, layout.MOE_ARCH, size=size, type=type, seed=seed, vocab=vocab, router_skew=router_skew)


def _write(path: str | Path, arch: str, *, size: str, type: str, seed: int, vocab: str | Path | None,
           router_skew: float | None = None) -> Path:
    try:
        cfg = layout_moe.size(size) if arch == layout.MOE_ARCH else layout.size(size)
        file_type(type, TYPES)
        if router_skew is not None:  # out of reach: refused before anything is written
            router_skew_scale(router_skew, cfg.n_expert, cfg.n_expert_used)
    except ValueError as exc:
        raise LuceboxError(str(exc)) from None
    tokens = vocab_source.synthetic(vocab, cfg.vocab)

    def add_metadata(writer) -> None:
        layout.add_metadata(writer, cfg)
        tokens.add_to_writer(writer)

    title = "Qwen3.5 MoE" if arch == layout.MOE_ARCH else "Qwen3.5"
    label = size if router_skew is None else f"{size} router skew {router_skew:g}"
    small_tensor = _small_tensor if router_skew is None else with_router_skew(_small_tensor, router_skew,
                                                                              cfg.n_expert_used)
    return write_random_model(path, tensor_plans(cfg, type), arch=arch, title=title, size=label, type=type,
                              seed=seed, small_tensor=small_tensor, add_metadata=add_metadata)


# -- qwen3 (dense Qwen3, e.g. Qwen3-0.6B) -------------------------------------------------------------------


def qwen3_tensor_plans(cfg: layout_qwen3.Qwen3Config, type: str) -> list[TensorPlan]:
    """The tensors of a `type` qwen3 file of `cfg`, in file order, with their ggml types."""
    return gguf_out.tensor_plans(layout_qwen3.tensor_shapes(cfg), type, n_layer=cfg.n_layer,
                                 tied_output=cfg.tied_output)


def _qwen3_small_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("norm.weight"):  # plain RMSNorm weights (`x * w`), initialised at 1
        return rng.uniform(0.9, 1.1, int(np.prod(shape)))
    raise ValueError(f"no synthetic rule for small tensor {name}")


def write_qwen3(
    path: str | Path,
    *,
    size: str = "tiny",
    type: str = "f32",
    seed: int = 0,
    vocab: str | Path | None = None,
) -> Path:
    """Write a random-weight qwen3 GGUF of `size` (tiny, 0.6b) and `type` (f32, f16, q8_0, q4_k_m) to `path`;
    the vocabulary is Qwen3's (`vocab.qwen3`), or `vocab`'s (a GGUF to copy the tokenizer from)."""
    try:
        cfg = layout_qwen3.size(size)
        file_type(type, TYPES)
    except ValueError as exc:
        raise LuceboxError(str(exc)) from None
    tokens = vocab_source.qwen3(vocab, cfg.vocab)

    def add_metadata(writer) -> None:
        layout_qwen3.add_metadata(writer, cfg)
        tokens.add_to_writer(writer)

    return write_random_model(path, qwen3_tensor_plans(cfg, type), arch=layout_qwen3.ARCH, title="Qwen3", size=size,
                              type=type, seed=seed, small_tensor=_qwen3_small_tensor, add_metadata=add_metadata)
