"""Convert a transformers Qwen3 checkpoint folder (`Qwen3ForCausalLM`, e.g. Qwen3-0.6B) to a qwen3 GGUF with
llama.cpp's conventions (its `Qwen3Model` converter):

- every tensor is stored as it is: Qwen3's norms are plain `x * w` (no `1 + w`), `q_proj` holds only queries;
- `post_attention_layernorm` is `ffn_norm`, `q_norm` / `k_norm` are `attn_q_norm` / `attn_k_norm`;
- with tied embeddings (`tie_word_embeddings`, or no `lm_head.weight` on disk) there is no `output.weight`.

The vocabulary is the folder's `tokenizer.json` (+ `tokenizer_config.json`, whose chat template is kept) with
the `qwen2` pre-tokenizer, else `vocab` (a GGUF to copy `tokenizer.*` from); padded with `[PAD{i}]` to the
checkpoint's `vocab_size`. Tensors are read and written one at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lucebox_core.checkpoint import (Checkpoint, TensorSource, check_output_type, check_sources, converted_data,
                                     identity, read_hf_config, write_converted)
from lucebox_core.errors import LuceboxError
from lucebox_core.specs import CONVERTED_TYPES

from . import layout_qwen3 as layout
from . import vocab as vocab_source
from .synth import qwen3_tensor_plans

TYPES = CONVERTED_TYPES
MODEL_TYPES = ("qwen3",)
_ATTENTION = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
              "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}


def config_from_hf(text: dict[str, Any], *, tied_output: bool) -> layout.Qwen3Config:
    """A `Qwen3Config` from a transformers `Qwen3Config` dict; a ValueError naming what llama.cpp's qwen3 layout
    cannot hold (biases, sliding windows, RoPE scaling)."""
    if text.get("attention_bias"):
        raise ValueError("attention_bias is true: the qwen3 layout has no attention biases")
    if text.get("use_sliding_window"):
        raise ValueError("use_sliding_window is true: sliding-window qwen3 is not supported")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r}: only plain RoPE (rope_type 'default') is supported for qwen3")
    theta = rope.get("rope_theta", text.get("rope_theta", 1e6))
    n_head = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    return layout.Qwen3Config(
        n_layer=int(text["num_hidden_layers"]), hidden=hidden, ffn=int(text["intermediate_size"]), n_head=n_head,
        n_head_kv=int(text.get("num_key_value_heads") or n_head),
        head_dim=int(text.get("head_dim") or hidden // n_head), rope_theta=float(theta),
        eps=float(text.get("rms_norm_eps", 1e-6)), vocab=int(text.get("vocab_size", 151936)),
        context_length=int(text.get("max_position_embeddings", 40960)), tied_output=tied_output,
    )


def _sources(cfg: layout.Qwen3Config, prefix: str) -> dict[str, TensorSource]:
    """Where each GGUF tensor comes from (all unchanged)."""
    shapes = layout.tensor_shapes(cfg)
    sources: dict[str, TensorSource] = {}

    def add(name: str, key: str) -> None:
        sources[name] = TensorSource(key, shapes[name], identity)

    add("token_embd.weight", prefix + "embed_tokens.weight")
    for il in range(cfg.n_layer):
        blk, hf = f"blk.{il}.", f"{prefix}layers.{il}."
        add(blk + "attn_norm.weight", hf + "input_layernorm.weight")
        for gguf_name, hf_name in _ATTENTION.items():
            add(blk + gguf_name + ".weight", hf + f"self_attn.{hf_name}.weight")
        add(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
        for part in ("gate", "up", "down"):
            add(blk + f"ffn_{part}.weight", hf + f"mlp.{part}_proj.weight")
    add("output_norm.weight", prefix + "norm.weight")
    if not cfg.tied_output:
        add("output.weight", "lm_head.weight")
    return sources


def _vocabulary(hf_dir: Path, vocab: str | Path | None, size: int) -> vocab_source.Vocab:
    if vocab is not None:
        tokens = vocab_source.from_gguf(vocab)
    else:
        found = vocab_source.from_hf_folder(hf_dir, pre=vocab_source.QWEN3_PRE)
        if found is None:
            raise LuceboxError(f"{hf_dir}: no tokenizer.json; pass a vocabulary GGUF (--vocab FILE) to copy the "
                               "tokenizer from")
        tokens = found
    try:
        tokens.pad_to(size)
    except ValueError as exc:
        raise LuceboxError(f"{vocab or hf_dir / 'tokenizer.json'}: {exc} (vocab_size {size})") from None
    im_end = tokens.id_of("<|im_end|>")
    if im_end is not None:  # llama.cpp finds Qwen's end of turn by its text
        tokens.set_id("eot", im_end)
    return tokens


def convert(hf_dir: str | Path, path: str | Path, *, type: str = "f32", vocab: str | Path | None = None) -> Path:
    """Convert the Qwen3 checkpoint in `hf_dir` to a `type` (f32, f16, bf16, q8_0) qwen3 GGUF at `path`."""
    hf_dir = Path(hf_dir)
    check_output_type(type, TYPES)
    config, text = read_hf_config(hf_dir, MODEL_TYPES, "a dense Qwen3")
    checkpoint = Checkpoint(hf_dir)
    prefix = checkpoint.text_prefix(hf_dir, ("model.",))
    # transformers leaves `lm_head.weight` out of a tied checkpoint; a tied config with one on disk still ties.
    tied = "lm_head.weight" not in checkpoint or bool(text.get("tie_word_embeddings", False))
    try:
        cfg = config_from_hf(text, tied_output=tied)
    except KeyError as exc:
        raise LuceboxError(f"{hf_dir / 'config.json'}: missing field {exc}") from None
    except ValueError as exc:
        raise LuceboxError(f"{hf_dir / 'config.json'}: {exc}") from None
    sources = _sources(cfg, prefix)
    check_sources(checkpoint, sources, prefix, hf_dir, family="qwen3")
    tokens = _vocabulary(hf_dir, vocab, cfg.vocab)

    def add_metadata(writer: Any) -> None:
        layout.add_metadata(writer, cfg)
        tokens.add_to_writer(writer)

    return write_converted(path, hf_dir, config, arch=layout.ARCH, type=type, tensors=qwen3_tensor_plans(cfg, type),
                           data=converted_data(checkpoint, sources), add_metadata=add_metadata)
