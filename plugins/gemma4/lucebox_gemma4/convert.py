"""Convert a transformers Gemma-4 checkpoint folder (`Gemma4ForConditionalGeneration` or `Gemma4ForCausalLM`,
dense or MoE) to a gemma4 GGUF with llama.cpp's conventions (`conversion/gemma.py`, `Gemma4Model`):

- norms stay as they are (Gemma-4's RMSNorm is a plain `x * w`: no `+ 1`);
- `router.proj` -> `ffn_gate_inp.weight`, `router.scale` -> `ffn_gate_inp.scale`, `router.per_expert_scale`
  -> `ffn_down_exps.scale`, `experts.gate_up_proj` / `experts.down_proj` -> `ffn_gate_up_exps` /
  `ffn_down_exps` (the fused `[E, 2I, H]` and `[E, H, I]` stacks as they are), `layer_scalar` ->
  `layer_output_scale.weight`;
- the full layers' proportional RoPE becomes llama.cpp's `rope_freqs` factors (1 for the rotating pairs,
  1e30 for the rest).

The vocabulary is Gemma-4's (the packaged tokenizer, or `vocab`, a GGUF to copy `tokenizer.*` from), cut or
padded to the checkpoint's `vocab_size`. Vision and audio towers are skipped. Tensors are read, transformed
and written one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lucebox_core.checkpoint import (Checkpoint, TensorSource, check_output_type, check_sources, converted_data,
                                     identity, read_hf_config, write_converted)
from lucebox_core.errors import LuceboxError
from lucebox_core.gguf_out import TensorPlan
from lucebox_core.specs import CONVERTED_TYPES

from . import layout
from .synth import synthetic_vocab, tensor_plans

TYPES = CONVERTED_TYPES
MODEL_TYPES = ("gemma4", "gemma4_text")
_SKIPPED_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def config_from_hf(text: dict[str, Any], *, tied_output: bool) -> layout.Gemma4Config:
    """A `Gemma4Config` from a transformers `Gemma4TextConfig` dict (`text_config` of the multimodal one)."""
    if int(text.get("num_kv_shared_layers") or 0) or int(text.get("hidden_size_per_layer_input") or 0):
        raise ValueError("KV sharing and per-layer input embeddings (the E2B/E4B layouts) are not supported")
    n_layer = int(text["num_hidden_layers"])
    types = text.get("layer_types") or [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
                                        for i in range(n_layer)]
    rope = text.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if full.get("rope_type", "proportional") != "proportional" or sliding.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters {rope}: expected proportional RoPE on full layers, default on sliding ones")
    moe = bool(text.get("enable_moe_block"))
    # Saved configs carry the full layers' head dim and KV heads in `per_layer_config` (the constructor's
    # `global_head_dim` / `num_global_key_value_heads` arguments are not written back).
    overrides = [(text.get("per_layer_config") or {}).get(str(i), {}) for i, t in enumerate(types) if t == "full_attention"]
    override = overrides[0] if overrides else {}
    head_dim = int(text.get("global_head_dim") or override.get("head_dim") or 512)
    kv_full = text.get("num_global_key_value_heads") or override.get("num_key_value_heads") or text["num_key_value_heads"]
    return layout.Gemma4Config(
        n_layer=n_layer, hidden=int(text["hidden_size"]), ffn=int(text["intermediate_size"]),
        n_head=int(text["num_attention_heads"]), n_head_kv_swa=int(text["num_key_value_heads"]),
        n_head_kv_full=int(kv_full),
        head_dim=head_dim, head_dim_swa=int(text.get("head_dim") or 256),
        sliding_window=int(text.get("sliding_window") or 1024), sliding=[t == "sliding_attention" for t in types],
        rope_theta=float(full.get("rope_theta", 1e6)), rope_theta_swa=float(sliding.get("rope_theta", 1e4)),
        partial_rotary_full=float(full.get("partial_rotary_factor", 0.25)), eps=float(text.get("rms_norm_eps", 1e-6)),
        vocab=int(text.get("vocab_size", 262144)), context_length=int(text.get("max_position_embeddings", 262144)),
        final_logit_softcap=float(text.get("final_logit_softcapping") or 0.0),
        n_expert=int(text.get("num_experts") or 0) if moe else 0,
        n_expert_used=int(text.get("top_k_experts") or 0) if moe else 0,
        expert_ffn=int(text.get("moe_intermediate_size") or 0) if moe else 0,
        k_eq_v=bool(text.get("attention_k_eq_v", False)), tied_output=tied_output,
    )


def _sources(cfg: layout.Gemma4Config, prefix: str) -> dict[str, TensorSource]:
    shapes = layout.tensor_shapes(cfg)
    sources: dict[str, TensorSource] = {}

    def add(name: str, key: str) -> None:
        sources[name] = TensorSource(key, shapes[name], identity)

    add("token_embd.weight", prefix + "embed_tokens.weight")
    for il in range(cfg.n_layer):
        blk, hf = f"blk.{il}.", f"{prefix}layers.{il}."
        add(blk + "attn_norm.weight", hf + "input_layernorm.weight")
        for gguf_name, hf_name in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                                   ("attn_output", "o_proj"), ("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
            if blk + gguf_name + ".weight" in shapes:
                add(blk + gguf_name + ".weight", hf + f"self_attn.{hf_name}.weight")
        add(blk + "post_attention_norm.weight", hf + "post_attention_layernorm.weight")
        add(blk + "layer_output_scale.weight", hf + "layer_scalar")
        add(blk + "ffn_norm.weight", hf + "pre_feedforward_layernorm.weight")
        for part in ("gate", "up", "down"):
            add(blk + f"ffn_{part}.weight", hf + f"mlp.{part}_proj.weight")
        add(blk + "post_ffw_norm.weight", hf + "post_feedforward_layernorm.weight")
        if cfg.is_moe:
            add(blk + "ffn_gate_inp.weight", hf + "router.proj.weight")
            add(blk + "ffn_gate_inp.scale", hf + "router.scale")
            add(blk + "ffn_down_exps.scale", hf + "router.per_expert_scale")
            add(blk + "ffn_gate_up_exps.weight", hf + "experts.gate_up_proj")
            add(blk + "ffn_down_exps.weight", hf + "experts.down_proj")
            add(blk + "pre_ffw_norm_2.weight", hf + "pre_feedforward_layernorm_2.weight")
            add(blk + "post_ffw_norm_1.weight", hf + "post_feedforward_layernorm_1.weight")
            add(blk + "post_ffw_norm_2.weight", hf + "post_feedforward_layernorm_2.weight")
    add("output_norm.weight", prefix + "norm.weight")
    if not cfg.tied_output:
        add("output.weight", "lm_head.weight")
    return sources


def convert(hf_dir: str | Path, path: str | Path, *, type: str = "f32", vocab: str | Path | None = None) -> Path:
    """Convert the Gemma-4 checkpoint in `hf_dir` to a `type` (f32, f16, bf16, q8_0) GGUF at `path`."""
    hf_dir = Path(hf_dir)
    check_output_type(type, TYPES)
    config, text = read_hf_config(hf_dir, MODEL_TYPES, "Gemma-4")
    checkpoint = Checkpoint(hf_dir)
    prefix = checkpoint.text_prefix(hf_dir)
    tied = "lm_head.weight" not in checkpoint or bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings")))
    try:
        cfg = config_from_hf(text, tied_output=tied)
    except (ValueError, KeyError) as exc:
        raise LuceboxError(f"{hf_dir / 'config.json'}: {exc}") from None
    tokens = synthetic_vocab(vocab, cfg.vocab)
    sources = _sources(cfg, prefix)
    check_sources(checkpoint, sources, prefix, hf_dir, family="gemma4", skipped=_SKIPPED_PREFIXES)
    plans = tensor_plans(cfg, type)

    converted = converted_data(checkpoint, sources)

    def data(plan: TensorPlan) -> Iterator[np.ndarray]:
        if plan.name == "rope_freqs.weight":  # computed from the config: the checkpoint has no such tensor
            yield layout.rope_freq_factors(cfg)
        else:
            yield from converted(plan)

    def add_metadata(writer: Any) -> None:
        layout.add_metadata(writer, cfg)
        tokens.add_to_writer(writer)

    return write_converted(path, hf_dir, config, arch=layout.ARCH, type=type, tensors=plans, data=data,
                           add_metadata=add_metadata)
