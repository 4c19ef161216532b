"""Convert a transformers Laguna checkpoint folder (`LagunaForCausalLM`) to a laguna GGUF with llama.cpp's
conventions:

- norms stay as they are (Laguna's RMSNorm is a plain `x * w`);
- the per-expert `mlp.experts.{e}.{gate,up,down}_proj` are stacked into `ffn_{gate,up,down}_exps`, the
  router is `ffn_gate_inp`, `e_score_correction_bias` (on disk under `mlp.experts.`, in transformers under
  `mlp.gate.`) is `exp_probs_b.bias`, the shared expert is `ffn_*_shexp`;
- `g_proj` is `attn_gate`, `post_attention_layernorm` is `ffn_norm`.

The vocabulary is the folder's `tokenizer.json` when it has one (Laguna's BPE with the `laguna`
pre-tokenizer), else `vocab` (a GGUF to copy `tokenizer.*` from), else the packaged Laguna-style one; cut or
padded to the checkpoint's `vocab_size`. Tensors are read, transformed and written one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lucebox_core.checkpoint import (Checkpoint, TensorSource, check_output_type, check_sources, converted_data,
                                     encoded_bytes, identity, read_hf_config, write_converted)
from lucebox_core.errors import LuceboxError
from lucebox_core.gguf_out import TensorPlan
from lucebox_core.specs import CONVERTED_TYPES
from lucebox_core.vocab import from_hf_folder

from . import layout
from .synth import END_OF_TURN, laguna_vocab, tensor_plans

TYPES = CONVERTED_TYPES
MODEL_TYPES = ("laguna",)
_EXPERT_PARTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def config_from_hf(text: dict[str, Any], *, tied_output: bool) -> layout.LagunaConfig:
    """A `LagunaConfig` from a transformers `LagunaConfig` dict; a ValueError for what llama.cpp's laguna
    layout cannot hold (another attention pattern, a per-element gate, dense layers after MoE ones...)."""
    n_layer = int(text["num_hidden_layers"])
    types = text.get("layer_types") or ["full_attention"] * n_layer
    expected = ["full_attention" if layout.is_full_layer(i) else "sliding_attention" for i in range(n_layer)]
    if list(types) != expected:
        raise ValueError(f"layer_types {types}: the laguna layout has full attention exactly at every 4th layer "
                         "from the first (Laguna-XS.2's pattern)")
    gating = text.get("gating", True)
    if not (gating is True or gating == "per-head"):
        raise ValueError(f"gating {gating!r}: only the per-head attention output gate (XS.2) is supported")
    if float(text.get("moe_router_logit_softcapping") or 0.0):
        raise ValueError("moe_router_logit_softcapping is set: llama.cpp's laguna router has no soft-cap")
    mlp_types = text.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layer - 1)
    dense_lead = next((i for i, t in enumerate(mlp_types) if t != "dense"), n_layer)
    if any(t != "sparse" for t in mlp_types[dense_lead:]):
        raise ValueError(f"mlp_layer_types {mlp_types}: dense layers must all come first")
    heads = text.get("num_attention_heads_per_layer") or [text["num_attention_heads"]] * n_layer
    rope = text.get("rope_parameters") or {}
    full, sliding = dict(rope.get("full_attention") or {}), rope.get("sliding_attention") or {}
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        if key not in full and key in rope:  # XS.2's config keeps some YaRN keys at the top level
            full[key] = rope[key]
    head_dim = int(text.get("head_dim") or 128)
    yarn = full.get("rope_type", "default") == "yarn"
    if full.get("rope_type", "default") not in ("yarn", "default") or sliding.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters {rope}: expected YaRN (or default) on full layers, default on sliding ones")
    return layout.LagunaConfig(
        n_layer=n_layer, hidden=int(text["hidden_size"]), ffn=int(text["intermediate_size"]),
        n_head=tuple(int(h) for h in heads), n_head_kv=int(text["num_key_value_heads"]), head_dim=head_dim,
        sliding_window=int(text.get("sliding_window") or 512),
        rope_theta=float(full.get("rope_theta", 500000.0)),
        rope_dim=int(head_dim * float(full.get("partial_rotary_factor", 1.0))),
        rope_theta_swa=float(sliding.get("rope_theta", 10000.0)),
        rope_dim_swa=int(head_dim * float(sliding.get("partial_rotary_factor", 1.0))),
        yarn_factor=float(full.get("factor", 0.0)) if yarn else 0.0,
        yarn_original_context=int(full.get("original_max_position_embeddings", 4096)),
        yarn_beta_fast=float(full.get("beta_fast") or 32.0), yarn_beta_slow=float(full.get("beta_slow") or 1.0),
        eps=float(text.get("rms_norm_eps", 1e-6)), vocab=int(text.get("vocab_size", 100352)),
        context_length=int(text.get("max_position_embeddings", 131072)),
        n_expert=int(text.get("num_experts", 256)), n_expert_used=int(text.get("num_experts_per_tok", 8)),
        expert_ffn=int(text.get("moe_intermediate_size", 512)),
        shared_ffn=int(text.get("shared_expert_intermediate_size", 512)),
        expert_weights_scale=float(text.get("moe_routed_scaling_factor", 1.0)), n_dense_lead=dense_lead,
        tied_output=tied_output,
    )


def _sources(cfg: layout.LagunaConfig, prefix: str) -> dict[str, TensorSource]:
    """Where each GGUF tensor but the expert stacks comes from."""
    shapes = layout.tensor_shapes(cfg)
    sources: dict[str, TensorSource] = {}

    def add(name: str, key: str) -> None:
        sources[name] = TensorSource(key, shapes[name], identity)

    add("token_embd.weight", prefix + "embed_tokens.weight")
    for il in range(cfg.n_layer):
        blk, hf = f"blk.{il}.", f"{prefix}layers.{il}."
        add(blk + "attn_norm.weight", hf + "input_layernorm.weight")
        for gguf_name, hf_name in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                                   ("attn_output", "o_proj"), ("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm"),
                                   ("attn_gate", "g_proj")):
            add(blk + gguf_name + ".weight", hf + f"self_attn.{hf_name}.weight")
        add(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
        if cfg.is_moe(il):
            add(blk + "ffn_gate_inp.weight", hf + "mlp.gate.weight")
            add(blk + "exp_probs_b.bias", hf + "mlp.experts.e_score_correction_bias")
            for part in ("gate", "up", "down"):
                add(blk + f"ffn_{part}_shexp.weight", hf + f"mlp.shared_expert.{part}_proj.weight")
        else:
            for part in ("gate", "up", "down"):
                add(blk + f"ffn_{part}.weight", hf + f"mlp.{part}_proj.weight")
    add("output_norm.weight", prefix + "norm.weight")
    if not cfg.tied_output:
        add("output.weight", "lm_head.weight")
    return sources


def _expert_keys(cfg: layout.LagunaConfig, prefix: str) -> dict[str, list[TensorSource]]:
    """Each expert stack's per-expert sources, in expert order."""
    shapes = layout.tensor_shapes(cfg)
    stacks: dict[str, list[TensorSource]] = {}
    for il in range(cfg.n_layer):
        if not cfg.is_moe(il):
            continue
        for gguf_part, hf_part in _EXPERT_PARTS.items():
            name = f"blk.{il}.{gguf_part}.weight"
            stacks[name] = [TensorSource(f"{prefix}layers.{il}.mlp.experts.{e}.{hf_part}.weight", shapes[name][1:],
                                         identity) for e in range(cfg.n_expert)]
    return stacks


def _vocab(hf_dir: Path, vocab: str | Path | None, size: int) -> Any:
    if vocab is None and (hf_dir / "tokenizer.json").is_file():
        tokens = from_hf_folder(hf_dir, pre="laguna")
        tokens.pad_to(size)
        end_of_turn = tokens.id_of(END_OF_TURN)
        if end_of_turn is not None:
            tokens.set_id("eot", end_of_turn)
        return tokens
    return laguna_vocab(vocab, size)


def convert(hf_dir: str | Path, path: str | Path, *, type: str = "f32", vocab: str | Path | None = None) -> Path:
    """Convert the Laguna checkpoint in `hf_dir` to a `type` (f32, f16, bf16, q8_0) GGUF at `path`."""
    hf_dir = Path(hf_dir)
    check_output_type(type, TYPES)
    config, text = read_hf_config(hf_dir, MODEL_TYPES, "Laguna")
    checkpoint = Checkpoint(hf_dir)
    prefix = checkpoint.text_prefix(hf_dir, ("model.",))
    tied = "lm_head.weight" not in checkpoint or bool(text.get("tie_word_embeddings", False))
    try:
        cfg = config_from_hf(text, tied_output=tied)
    except (ValueError, KeyError) as exc:
        raise LuceboxError(f"{hf_dir / 'config.json'}: {exc}") from None
    sources = _sources(cfg, prefix)
    stacks = _expert_keys(cfg, prefix)
    expert_sources = {f"{name}[{e}]": source for name, parts in stacks.items() for e, source in enumerate(parts)}
    check_sources(checkpoint, {**sources, **expert_sources}, prefix, hf_dir, family="laguna")
    tokens = _vocab(hf_dir, vocab, cfg.vocab)
    plans = tensor_plans(cfg, type)
    converted = converted_data(checkpoint, sources)

    def data(plan: TensorPlan) -> Iterator[np.ndarray]:
        if plan.name in stacks:  # one expert stack: the experts read one by one, stacked in float32
            stacked = torch.stack([checkpoint.tensor(s.key).to(torch.float32) for s in stacks[plan.name]])
            yield encoded_bytes(stacked.reshape(plan.shape), plan.ggml_type)
        else:
            yield from converted(plan)

    def add_metadata(writer: Any) -> None:
        layout.add_metadata(writer, cfg)
        tokens.add_to_writer(writer)

    return write_converted(path, hf_dir, config, arch=layout.ARCH, type=type, tensors=plans, data=data,
                           add_metadata=add_metadata)
