"""The gemma4 GGUF layout: hyper-parameters, metadata keys and tensor names/shapes, in one place.

Mirrors llama.cpp (`src/models/gemma4.cpp`: `load_arch_hparams` / `load_arch_tensors`) and its HF converter
(`conversion/gemma.py`, `Gemma4Model`), so a file written from this layout loads in llama.cpp and a file
llama.cpp's converter wrote reads back into the same `Gemma4Config`.

Shapes are in numpy / PyTorch order `(rows, cols)` = `(out_features, in_features)`, the reverse of ggml's `ne`.

Gemma-4 in llama.cpp's terms, with the GGUF key each is stored under (`gemma4.` prefix):

| field | meaning | GGUF key |
| --- | --- | --- |
| `sliding` | per layer: a sliding-window layer (else full attention) | `attention.sliding_window_pattern` |
| `n_head_kv` | per layer: KV heads (sliding and full layers differ) | `attention.head_count_kv` (array) |
| `head_dim` / `head_dim_swa` | head dim of full / sliding layers | `attention.key_length` / `key_length_swa` |
| `rope_theta` / `rope_theta_swa` | RoPE base of full / sliding layers | `rope.freq_base` / `rope.freq_base_swa` |
| `n_expert`, `n_expert_used`, `expert_ffn` | the MoE block beside the dense MLP (26B-A4B) | `expert_count`, ... |

Full layers rotate only part of each head ("proportional" RoPE): llama.cpp stores it as a NeoX rotation of the
whole head with a `rope_freqs` tensor of per-pair frequency divisors, 1 for the rotated pairs and 1e30 for the
rest (whose angle is then ~0: identity).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np
from gguf import GGUFValueType

from lucebox_core.errors import GGUFError
from lucebox_core.gguf_out import add_arch_metadata
from lucebox_core.ggufio import ArchMetadata, float32_decimal
from lucebox_core.synthetic import named_size

ARCH = "gemma4"
UNROTATED_FREQ_FACTOR = 1e30  # llama.cpp's converter: the divisor that stops a pair from rotating


def _default_sliding(self: Gemma4Config) -> tuple[bool, ...]:
    # transformers' default: five sliding layers then one full, and the last layer always full.
    pattern = [(i + 1) % 6 != 0 for i in range(self.n_layer)]
    pattern[-1] = False
    return tuple(pattern)


@attrs.frozen(kw_only=True)
class Gemma4Config:
    """Hyper-parameters of a Gemma-4 text model (dense or MoE), as llama.cpp reads them."""

    n_layer: int
    hidden: int  # n_embd
    ffn: int  # dense GeGLU intermediate size (every layer)
    n_head: int
    n_head_kv_swa: int
    n_head_kv_full: int
    head_dim: int  # full layers (global_head_dim)
    head_dim_swa: int  # sliding layers
    sliding_window: int = 1024
    sliding: tuple[bool, ...] = attrs.field(default=attrs.Factory(_default_sliding, takes_self=True), converter=tuple)
    rope_theta: float = 1e6  # full layers
    rope_theta_swa: float = 1e4
    rope_dim_swa: int = 0  # rotated dims of sliding heads; 0: the whole head
    partial_rotary_full: float = 0.25  # share of a full head's pairs that rotate (for `rope_freqs` when writing)
    eps: float = 1e-6
    vocab: int = 262144
    context_length: int = 262144
    final_logit_softcap: float = 30.0
    n_expert: int = 0  # 0: a dense model (31B); 128 on the 26B-A4B
    n_expert_used: int = 0
    expert_ffn: int = 0
    k_eq_v: bool = True  # full layers have no attn_v: V is the raw K projection (through v_norm)
    tied_output: bool = True

    def __attrs_post_init__(self) -> None:
        problems = []
        if len(self.sliding) != self.n_layer:
            problems.append(f"sliding has {len(self.sliding)} entries for {self.n_layer} layers")
        for kind, kv in (("sliding", self.n_head_kv_swa), ("full", self.n_head_kv_full)):
            if kv <= 0 or self.n_head % kv:
                problems.append(f"attention heads {self.n_head} not a multiple of {kind} KV heads {kv}")
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            problems.append(f"experts used {self.n_expert_used} not in 1..{self.n_expert}")
        if self.n_expert and self.expert_ffn <= 0:
            problems.append("an MoE model needs expert_feed_forward_length")
        if self.sliding_window <= 0:
            problems.append(f"sliding window {self.sliding_window} must be positive")
        if problems:
            raise ValueError("invalid Gemma4Config: " + "; ".join(problems))

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def is_sliding(self, layer: int) -> bool:
        return self.sliding[layer]

    def layer_heads(self, layer: int) -> tuple[int, int]:
        """(KV heads, head dim) of `layer`."""
        return (self.n_head_kv_swa, self.head_dim_swa) if self.sliding[layer] else (self.n_head_kv_full, self.head_dim)

    def has_v_proj(self, layer: int) -> bool:
        return self.sliding[layer] or not self.k_eq_v

    @property
    def rotated_pairs_full(self) -> int:
        return int(self.head_dim * self.partial_rotary_full / 2)

    # -- GGUF metadata ---------------------------------------------------------------------------

    def to_gguf_metadata(self) -> dict[str, Any]:
        """The `gemma4.*` keys llama.cpp reads (values as Python scalars/lists; see `METADATA_TYPES`)."""
        k = f"{ARCH}."
        md = {
            k + "block_count": self.n_layer,
            k + "context_length": self.context_length,
            k + "embedding_length": self.hidden,
            k + "feed_forward_length": self.ffn,
            k + "attention.head_count": self.n_head,
            k + "attention.head_count_kv": [self.layer_heads(i)[0] for i in range(self.n_layer)],
            k + "rope.freq_base": self.rope_theta,
            k + "rope.freq_base_swa": self.rope_theta_swa,
            k + "attention.layer_norm_rms_epsilon": self.eps,
            k + "attention.key_length": self.head_dim,
            k + "attention.value_length": self.head_dim,
            k + "final_logit_softcapping": self.final_logit_softcap,
            k + "attention.sliding_window": self.sliding_window,
            k + "attention.shared_kv_layers": 0,
            k + "embedding_length_per_layer_input": 0,
            k + "attention.sliding_window_pattern": list(self.sliding),
            k + "attention.key_length_swa": self.head_dim_swa,
            k + "attention.value_length_swa": self.head_dim_swa,
            k + "rope.dimension_count": self.head_dim,
            k + "rope.dimension_count_swa": self.rope_dim_swa or self.head_dim_swa,
        }
        if self.is_moe:
            md[k + "expert_count"] = self.n_expert
            md[k + "expert_used_count"] = self.n_expert_used
            md[k + "expert_feed_forward_length"] = self.expert_ffn
        return md

    @classmethod
    def from_gguf_metadata(
        cls, md: Mapping[str, Any], *, tensor_names: Iterable[str] | None = None, source: str = "GGUF metadata"
    ) -> Gemma4Config:
        """Read the config back from GGUF metadata (key -> plain Python value). `tensor_names`, when given,
        decides `tied_output` (no `output.weight`) and `k_eq_v` (full layers without `attn_v`)."""
        k = f"{ARCH}."
        keys = ArchMetadata(md, ARCH, source)
        get = keys.get
        for key, what in (("attention.shared_kv_layers", "KV sharing between layers"),
                          ("embedding_length_per_layer_input", "per-layer input embeddings")):
            if int(get(key, 0)):
                raise GGUFError(f"{source}: {k}{key} = {get(key)}: {what} (the E2B/E4B layouts) are not supported; "
                                "this plugin runs the 26B-A4B and 31B layouts")
        n_layer = int(get("block_count"))
        sliding = [bool(s) for s in get("attention.sliding_window_pattern")]
        if len(sliding) < n_layer:
            raise GGUFError(f"{source}: {k}attention.sliding_window_pattern has {len(sliding)} entries "
                            f"for {n_layer} layers")
        sliding = sliding[:n_layer]
        kv = get("attention.head_count_kv")
        kv = [int(kv)] * n_layer if not isinstance(kv, list) else [int(x) for x in kv]
        if len(kv) < n_layer:
            raise GGUFError(f"{source}: {k}attention.head_count_kv has {len(kv)} entries for {n_layer} layers")
        kv_swa = {kv[i] for i in range(n_layer) if sliding[i]} or {kv[0]}
        kv_full = {kv[i] for i in range(n_layer) if not sliding[i]} or {kv[0]}
        if len(kv_swa) > 1 or len(kv_full) > 1:
            raise GGUFError(f"{source}: {k}attention.head_count_kv varies within sliding or full layers: {kv}")
        head_dim = int(get("attention.key_length"))
        head_dim_swa = int(get("attention.key_length_swa"))
        for key, expected in (("attention.value_length", head_dim), ("attention.value_length_swa", head_dim_swa)):
            if int(get(key, expected)) != expected:
                raise GGUFError(f"{source}: {k}{key} {get(key)} differs from the key length {expected}")
        rope_dim = int(get("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise GGUFError(f"{source}: {k}rope.dimension_count {rope_dim} != key_length {head_dim} (full layers "
                            "rotate whole heads, with rope_freqs choosing the pairs)")
        rope_dim_swa = int(get("rope.dimension_count_swa", head_dim_swa))
        names = None if tensor_names is None else set(tensor_names)
        n_expert = int(get("expert_count", 0))
        full = [i for i in range(n_layer) if not sliding[i]]
        if names is not None:
            k_eq_v = not any(f"blk.{i}.attn_v.weight" in names for i in full)
            if n_expert and "blk.0.ffn_gate_inp.weight" not in names:
                n_expert = 0
        else:
            k_eq_v = True
        try:
            return cls(
                n_layer=n_layer,
                hidden=int(get("embedding_length")),
                ffn=int(get("feed_forward_length")),
                n_head=int(get("attention.head_count")),
                n_head_kv_swa=kv_swa.pop(),
                n_head_kv_full=kv_full.pop(),
                head_dim=head_dim,
                head_dim_swa=head_dim_swa,
                sliding_window=int(get("attention.sliding_window")),
                sliding=tuple(sliding),
                rope_theta=float32_decimal(get("rope.freq_base", 1e6)),
                rope_theta_swa=float32_decimal(get("rope.freq_base_swa", 1e4)),
                rope_dim_swa=0 if rope_dim_swa == head_dim_swa else rope_dim_swa,
                eps=float32_decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
                vocab=keys.vocab_size(),
                context_length=int(get("context_length", 262144)),
                final_logit_softcap=float32_decimal(get("final_logit_softcapping", 0.0)),
                n_expert=n_expert,
                n_expert_used=int(get("expert_used_count", 0)) if n_expert else 0,
                expert_ffn=int(get("expert_feed_forward_length", 0)) if n_expert else 0,
                k_eq_v=k_eq_v,
                tied_output=True if names is None else "output.weight" not in names,
            )
        except ValueError as exc:
            raise GGUFError(f"{source}: {exc}") from None


_F32, _BOOL = GGUFValueType.FLOAT32, GGUFValueType.BOOL
METADATA_TYPES: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {
    "attention.head_count_kv": (GGUFValueType.ARRAY, GGUFValueType.INT32),
    "attention.sliding_window_pattern": (GGUFValueType.ARRAY, _BOOL),
    "attention.layer_norm_rms_epsilon": (_F32, None),
    "rope.freq_base": (_F32, None),
    "rope.freq_base_swa": (_F32, None),
    "final_logit_softcapping": (_F32, None),
}


def add_metadata(writer: Any, cfg: Gemma4Config) -> None:
    """Write `cfg.to_gguf_metadata()` into a `gguf.GGUFWriter` with llama.cpp's value types."""
    add_arch_metadata(writer, ARCH, cfg.to_gguf_metadata(), METADATA_TYPES)


# -- the named sizes ---------------------------------------------------------------------------

SIZES: dict[str, Gemma4Config] = {
    # Synthetic, for tests and the default model: rows a multiple of 256 (K-quants apply), a window of 16 so
    # the sliding layers' ring wraps in short tests, layers 2 and 5 full attention with their own KV heads
    # and head dim, a quarter of the full layers' pairs rotating; the real vocabulary.
    "tiny": Gemma4Config(
        n_layer=6, hidden=256, ffn=512, n_head=4, n_head_kv_swa=2, n_head_kv_full=1, head_dim=128,
        head_dim_swa=64, sliding_window=16, sliding=(True, True, False, True, True, False),
    ),
    "tiny-moe": Gemma4Config(
        n_layer=6, hidden=256, ffn=256, n_head=4, n_head_kv_swa=2, n_head_kv_full=1, head_dim=128,
        head_dim_swa=64, sliding_window=16, sliding=(True, True, False, True, True, False),
        n_expert=8, n_expert_used=2, expert_ffn=256,
    ),
    # google/gemma-4-26B-A4B-it (models.md 1.3; the real tokenizer fixture carries these hyper-parameters).
    "26b-a4b": Gemma4Config(
        n_layer=30, hidden=2816, ffn=2112, n_head=16, n_head_kv_swa=8, n_head_kv_full=2, head_dim=512,
        head_dim_swa=256, n_expert=128, n_expert_used=8, expert_ffn=704,
    ),
    # google/gemma-4-31B-it.
    "31b": Gemma4Config(
        n_layer=60, hidden=5376, ffn=21504, n_head=32, n_head_kv_swa=16, n_head_kv_full=4, head_dim=512,
        head_dim_swa=256,
    ),
}


def size(name: str) -> Gemma4Config:
    return named_size(SIZES, name, ARCH)


# -- tensors -----------------------------------------------------------------------------------


def tensor_shapes(cfg: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Every GGUF tensor of a gemma4 model and its shape (numpy order), in file order (llama.cpp's
    `llama_model_gemma4::load_arch_tensors` for the 26B-A4B / 31B layouts)."""
    shapes: dict[str, tuple[int, ...]] = {"rope_freqs.weight": (cfg.head_dim // 2,),
                                          "token_embd.weight": (cfg.vocab, cfg.hidden)}
    for il in range(cfg.n_layer):
        blk = f"blk.{il}."
        kv_heads, head_dim = cfg.layer_heads(il)
        shapes[blk + "attn_norm.weight"] = (cfg.hidden,)
        shapes[blk + "attn_q.weight"] = (cfg.n_head * head_dim, cfg.hidden)
        shapes[blk + "attn_k.weight"] = (kv_heads * head_dim, cfg.hidden)
        if cfg.has_v_proj(il):
            shapes[blk + "attn_v.weight"] = (kv_heads * head_dim, cfg.hidden)
        shapes[blk + "attn_output.weight"] = (cfg.hidden, cfg.n_head * head_dim)
        shapes[blk + "attn_q_norm.weight"] = (head_dim,)
        shapes[blk + "attn_k_norm.weight"] = (head_dim,)
        shapes[blk + "post_attention_norm.weight"] = (cfg.hidden,)
        shapes[blk + "layer_output_scale.weight"] = (1,)
        shapes[blk + "ffn_norm.weight"] = (cfg.hidden,)
        shapes[blk + "ffn_gate.weight"] = (cfg.ffn, cfg.hidden)
        shapes[blk + "ffn_up.weight"] = (cfg.ffn, cfg.hidden)
        shapes[blk + "ffn_down.weight"] = (cfg.hidden, cfg.ffn)
        shapes[blk + "post_ffw_norm.weight"] = (cfg.hidden,)
        if cfg.is_moe:
            shapes[blk + "ffn_gate_inp.weight"] = (cfg.n_expert, cfg.hidden)
            shapes[blk + "ffn_gate_inp.scale"] = (cfg.hidden,)
            shapes[blk + "pre_ffw_norm_2.weight"] = (cfg.hidden,)
            shapes[blk + "post_ffw_norm_1.weight"] = (cfg.hidden,)
            shapes[blk + "post_ffw_norm_2.weight"] = (cfg.hidden,)
            shapes[blk + "ffn_gate_up_exps.weight"] = (cfg.n_expert, 2 * cfg.expert_ffn, cfg.hidden)
            shapes[blk + "ffn_down_exps.weight"] = (cfg.n_expert, cfg.hidden, cfg.expert_ffn)
            shapes[blk + "ffn_down_exps.scale"] = (cfg.n_expert,)
    shapes["output_norm.weight"] = (cfg.hidden,)
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab, cfg.hidden)
    return shapes


def rope_freq_factors(cfg: Gemma4Config) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes: 1 for the rotating pairs of a full head, 1e30 else."""
    rotated = cfg.rotated_pairs_full
    return np.array([1.0] * rotated + [UNROTATED_FREQ_FACTOR] * (cfg.head_dim // 2 - rotated), dtype=np.float32)
