"""Building a `LagunaModel` from a GGUF: every tensor checked against the layout, weights kept in their GGUF
types, the RoPE frequencies of both layer kinds computed once."""

from __future__ import annotations

import math
from typing import Any

import torch

from lucebox_core.ggufio import MetadataView
from lucebox_core.loading import LayoutTensors, start_family_load

from .layout import LagunaConfig, tensor_shapes
from .model import ARCHITECTURE, GGUF_NAMES, LagunaAttention, LagunaDecoderLayer, LagunaMLP, LagunaModel, LagunaMoE
from .ops import LAGUNA_OPS


def load(gguf_file: Any, backend: Any = None, **options: Any) -> LagunaModel:
    """Build a `LagunaModel` from a GGUF (a `GGUFFile` or a path) on `backend` (default: torch on the CPU).

    Options: `kv_policy` (default the built-in `full`), `cache_type_k` / `cache_type_v` (KV storage types, each
    independently; default `kv_dtype`, else the backend's dtype).
    """
    start = start_family_load(gguf_file, backend, options, family="laguna", architecture=ARCHITECTURE)
    gguf_file = start.gguf
    config = LagunaConfig.from_gguf_metadata(MetadataView(gguf_file), tensor_names=gguf_file.tensors,
                                             source=str(gguf_file.path))
    ops = LAGUNA_OPS.bind(start.backend)
    src = LayoutTensors(gguf_file, tensor_shapes(config), GGUF_NAMES, ops, family="laguna")
    full_freq = yarn_inverse_frequencies(config, ops.device)
    swa_freq = plain_inverse_frequencies(config.rope_theta_swa, config.rope_dim_swa, ops.device)

    embed_tokens = src.weight("embed_tokens")
    lm_head = embed_tokens if config.tied_output else src.weight("lm_head")
    layers = []
    for i in range(config.n_layer):
        sliding = config.is_sliding(i)
        a = "layers.{i}.self_attn."
        attention = LagunaAttention(
            ops, layer_index=i, q_proj=src.weight(a + "q_proj", i), k_proj=src.weight(a + "k_proj", i),
            v_proj=src.weight(a + "v_proj", i), o_proj=src.weight(a + "o_proj", i),
            g_proj=src.weight(a + "g_proj", i),
            q_norm=src.vector(a + "q_norm", i), k_norm=src.vector(a + "k_norm", i), num_heads=config.n_head[i],
            num_kv_heads=config.n_head_kv, head_dim=config.head_dim, inv_freq=swa_freq if sliding else full_freq,
            attention_factor=1.0 if sliding else config.yarn_attention_factor,
            sliding_window=config.sliding_window if sliding else 0, eps=config.eps,
        )
        attention.fuse_projections()
        m = "layers.{i}.mlp."
        if config.is_moe(i):
            shared = LagunaMLP(ops, *(src.weight(m + f"shared_experts.{part}_proj", i)
                                      for part in ("gate", "up", "down")))
            mlp: LagunaMLP | LagunaMoE = LagunaMoE(
                ops, router=src.weight(m + "gate.weight", i),
                selection_bias=src.vector(m + "gate.e_score_correction_bias", i, dtype=torch.float32),
                gate_exps=src.weight(m + "experts.gate_proj", i), up_exps=src.weight(m + "experts.up_proj", i),
                down_exps=src.weight(m + "experts.down_proj", i), shared_expert=shared, top_k=config.n_expert_used,
                routed_scale=config.expert_weights_scale,
            )
        else:
            mlp = LagunaMLP(ops, src.weight(m + "gate_proj", i), src.weight(m + "up_proj", i),
                            src.weight(m + "down_proj", i))
        (mlp.shared_expert if isinstance(mlp, LagunaMoE) else mlp).fuse_projections()
        layers.append(LagunaDecoderLayer(
            index=i, self_attn=attention, mlp=mlp, input_layernorm=src.vector("layers.{i}.input_layernorm", i),
            post_attention_layernorm=src.vector("layers.{i}.post_attention_layernorm", i)))
    return LagunaModel(config, ops, embed_tokens, layers, norm=src.vector("norm"), lm_head=lm_head, **start.kv,
                       source=str(gguf_file.path))


def plain_inverse_frequencies(theta: float, rotated: int, device: Any) -> torch.Tensor:
    """`theta^(-2j / rotated)` for each rotated pair j, fp32."""
    return 1.0 / (theta ** (torch.arange(0, rotated, 2, dtype=torch.float32, device=device) / rotated))


def yarn_inverse_frequencies(config: LagunaConfig, device: Any) -> torch.Tensor:
    """The full layers' frequencies: plain RoPE without YaRN; with it, YaRN's blend per pair of the
    extrapolated frequency (fast-turning pairs, kept) and the interpolated one (slow pairs, divided by the
    factor), ramping linearly between the correction dims of `beta_fast` and `beta_slow` rotations over the
    original context (floored / ceiled, as transformers and llama.cpp both do)."""
    dim, theta = config.rope_dim, config.rope_theta
    extrapolated = plain_inverse_frequencies(theta, dim, device)
    if config.yarn_factor <= 1:
        return extrapolated

    def correction_dim(rotations: float) -> float:
        return dim * math.log(config.yarn_original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(config.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(config.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    return extrapolated / config.yarn_factor * (1 - keep) + extrapolated * keep
