"""How much device memory a qwen35 model and one sequence need: weights, KV, DeltaNet state, logits.

Computed from the layout alone (no file, no GPU), so a user can check before loading that, say, the 27B
Q4_K_M model with a 32K context fits a 24 GB card.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import torch

from lucebox_core.kv import (
    K_FLAG,
    V_FLAG,
    KVLayerShape,
    kv_bytes_per_token,
    kv_cache_type,
)
from lucebox_core.quants import QuantTensor

from .layout import Qwen35Config, tensor_shapes

Weight = QuantTensor | torch.Tensor


@attrs.frozen
class MemoryEstimate:
    """Device bytes of a model and one sequence, by part. Not counted: activations of a forward pass
    (bounded by the prefill chunk), the allocator's slack and the CUDA context."""

    weights: int
    kv: int  # K and V of every full-attention layer for the whole context
    deltanet: int  # conv and fp32 recurrent state of every Gated DeltaNet layer
    logits: int  # the decode step's logits buffer and the copy handed out

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.deltanet + self.logits

    def __str__(self) -> str:
        gib = 2**30
        return (f"{self.total / gib:.2f} GiB (weights {self.weights / gib:.2f}, KV {self.kv / gib:.2f}, "
                f"DeltaNet state {self.deltanet / gib:.3f}, logits {self.logits / gib:.4f})")


def estimate_memory(
    config: Qwen35Config,
    ctx_size: int,
    *,
    weight_bytes: int,
    cache_type_k: str | torch.dtype = "f16",
    cache_type_v: str | torch.dtype = "f16",
    activation_dtype: torch.dtype = torch.bfloat16,
) -> MemoryEstimate:
    """The device memory a `config` model of `weight_bytes` needs for one sequence of `ctx_size` positions
    with the given KV cache types (see `MemoryEstimate` for what is left out)."""
    k_type, v_type = kv_cache_type(cache_type_k, K_FLAG), kv_cache_type(cache_type_v, V_FLAG)
    attention_layers = len(config.full_layers)
    linear_layers = config.n_layer - attention_layers
    per_token = kv_bytes_per_token(KVLayerShape(config.n_head_kv, config.head_dim, config.head_dim), k_type, v_type)
    recurrent = config.ssm_dt_rank * config.ssm_d_state * (config.ssm_d_inner // config.ssm_dt_rank) * 4
    conv = (config.ssm_d_conv - 1) * config.gdn_conv_dim * activation_dtype.itemsize
    return MemoryEstimate(
        weights=weight_bytes,
        kv=attention_layers * ctx_size * per_token,
        deltanet=linear_layers * (recurrent + conv),
        logits=2 * config.vocab * 4,
    )


def layout_weight_bytes(config: Qwen35Config, file_type: str) -> int:
    """Bytes of every tensor of a `file_type` GGUF (`f16`, `q8_0`, `q4_k_m`...) of `config`, from the
    layout and llama.cpp's type choices alone: no file needed."""
    from lucebox_core.filetypes import nbytes, tensor_type

    return sum(
        nbytes(tensor_type(name, shape, file_type, n_layer=config.n_layer, tied_output=config.tied_output), shape)
        for name, shape in tensor_shapes(config).items()
    )


def tensor_bytes(weight: Weight) -> int:
    return int(weight.nbytes) if not isinstance(weight, torch.Tensor) else weight.numel() * weight.element_size()


def weights_of(part: Any) -> Iterator[Weight]:
    """Every tensor of a model part (a layer, a mixer), kept in its GGUF type or not; not the ones a fused
    projection replaces (the part's `unused_weights()`)."""
    unused = part.unused_weights() if hasattr(part, "unused_weights") else ()
    for field in attrs.fields(type(part)):
        if field.name in unused:
            continue
        value = getattr(part, field.name)
        if isinstance(value, (QuantTensor, torch.Tensor)):
            yield value
        elif attrs.has(type(value)):
            yield from weights_of(value)
