"""The qwen3 GGUF layout (dense Qwen3, e.g. Qwen3-0.6B): hyper-parameters, metadata keys and tensor names/shapes.

Mirrors llama.cpp (`src/models/qwen3.cpp`, `load_arch_hparams` / `load_arch_tensors` for `LLM_ARCH_QWEN3`) and
its converter (`Qwen3Model`: the Qwen2 writer plus the per-head q/k norms), so a file written from this layout
loads in llama.cpp and a file its converter wrote reads back into the same `Qwen3Config`. Shapes are in numpy /
PyTorch order `(rows, cols)` = `(out_features, in_features)`, the reverse of ggml's `ne`.

Qwen3 in llama.cpp's terms, with the GGUF key each is stored under (`qwen3.` prefix):

| field | meaning | GGUF key |
| --- | --- | --- |
| `n_head` / `n_head_kv` | query heads / key-value heads (GQA: consecutive groups) | `attention.head_count` / `_kv` |
| `head_dim` | per head; NOT hidden / n_head for 0.6B (1024 / 16 = 64, the heads are 128) | `attention.key_length` |
| `rope_theta` | NeoX RoPE over the whole head | `rope.freq_base` |
| `ffn` | SwiGLU intermediate size | `feed_forward_length` |

The norms are plain RMSNorm (`x * w`, not zero-centred), stored as they are; `post_attention_layernorm` is
`ffn_norm`. With tied embeddings (0.6B) there is no `output.weight`: the head reuses `token_embd.weight`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
from gguf import GGUFValueType

from lucebox_core.errors import GGUFError
from lucebox_core.gguf_out import add_arch_metadata
from lucebox_core.ggufio import ArchMetadata, float32_decimal
from lucebox_core.synthetic import named_size

ARCH = "qwen3"


@attrs.frozen(kw_only=True)
class Qwen3Config:
    """Hyper-parameters of a dense Qwen3 text model, as llama.cpp reads them."""

    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    n_head_kv: int
    head_dim: int = 128
    rope_theta: float = 1e6
    eps: float = 1e-6
    vocab: int = 151936
    context_length: int = 40960
    tied_output: bool = True

    def __attrs_post_init__(self) -> None:
        problems = []
        for name in ("n_layer", "hidden", "ffn", "n_head", "n_head_kv", "head_dim", "vocab", "context_length"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} {getattr(self, name)} must be positive")
        if self.n_head_kv > 0 and self.n_head % self.n_head_kv:
            problems.append(f"attention heads {self.n_head} not a multiple of KV heads {self.n_head_kv}")
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even (NeoX RoPE rotates pairs)")
        if not self.rope_theta > 0 or not self.eps > 0:
            problems.append(f"rope theta {self.rope_theta} and eps {self.eps} must be positive")
        if problems:
            raise ValueError("invalid Qwen3Config: " + "; ".join(problems))

    # -- GGUF metadata ---------------------------------------------------------------------------

    def to_gguf_metadata(self) -> dict[str, Any]:
        """The `qwen3.*` keys llama.cpp reads (values as Python scalars; see `METADATA_TYPES`)."""
        k = f"{ARCH}."
        return {
            k + "block_count": self.n_layer,
            k + "context_length": self.context_length,
            k + "embedding_length": self.hidden,
            k + "feed_forward_length": self.ffn,
            k + "attention.head_count": self.n_head,
            k + "attention.head_count_kv": self.n_head_kv,
            k + "attention.key_length": self.head_dim,
            k + "attention.value_length": self.head_dim,
            k + "attention.layer_norm_rms_epsilon": self.eps,
            k + "rope.freq_base": self.rope_theta,
            k + "rope.dimension_count": self.head_dim,
            k + "vocab_size": self.vocab,
        }

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any], *, tensor_names: Iterable[str] | None = None,
                           source: str = "GGUF metadata") -> Qwen3Config:
        """Read the config back from GGUF metadata (key -> plain Python value); a GGUFError naming `source` and
        the key for what is missing or what this layout cannot hold. `tensor_names`, when given, decides
        `tied_output` (no `output.weight`)."""
        k = f"{ARCH}."
        keys = ArchMetadata(md, ARCH, source)
        get = keys.get
        n_head = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        kv = get("attention.head_count_kv", n_head)
        if isinstance(kv, list) or isinstance(get("attention.head_count"), list):
            raise GGUFError(f"{source}: {k}attention.head_count(_kv) is per layer; qwen3 has one count for all")
        # llama.cpp's default head size is hidden / heads; Qwen3's converter always writes key_length.
        head_dim = int(get("attention.key_length", hidden // max(n_head, 1)))
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise GGUFError(f"{source}: {k}attention.value_length {get('attention.value_length')} differs from "
                            f"the key length {head_dim}")
        rope_dim = int(get("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise GGUFError(f"{source}: {k}rope.dimension_count {rope_dim} is not the head size {head_dim}: "
                            "Qwen3 rotates whole heads")
        if str(get("rope.scaling.type", "none")) not in ("none", "linear") or \
                float(get("rope.scaling.factor", 1.0)) not in (0.0, 1.0):
            raise GGUFError(f"{source}: {k}rope.scaling.* set: RoPE scaling (YaRN) is not supported for qwen3")
        if int(get("attention.sliding_window", 0) or 0):
            raise GGUFError(f"{source}: {k}attention.sliding_window is set: sliding-window qwen3 is not supported")
        names = None if tensor_names is None else set(tensor_names)
        try:
            return cls(
                n_layer=int(get("block_count")), hidden=hidden, ffn=int(get("feed_forward_length")), n_head=n_head,
                n_head_kv=int(kv), head_dim=head_dim, rope_theta=float32_decimal(get("rope.freq_base", 1e6)),
                eps=float32_decimal(get("attention.layer_norm_rms_epsilon", 1e-6)), vocab=keys.vocab_size(),
                context_length=int(get("context_length", 40960)),
                tied_output=True if names is None else "output.weight" not in names,
            )
        except ValueError as exc:
            raise GGUFError(f"{source}: {exc}") from None


_F32 = GGUFValueType.FLOAT32
METADATA_TYPES: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {
    "attention.layer_norm_rms_epsilon": (_F32, None),
    "rope.freq_base": (_F32, None),
}


def add_metadata(writer: Any, cfg: Qwen3Config) -> None:
    """Write `cfg.to_gguf_metadata()` into a `gguf.GGUFWriter` with llama.cpp's value types."""
    add_arch_metadata(writer, ARCH, cfg.to_gguf_metadata(), METADATA_TYPES)


# -- the named sizes ---------------------------------------------------------------------------

SIZES: dict[str, Qwen3Config] = {
    # Synthetic, for tests: the real 151,936-token vocabulary over a 64-wide model keeps the f32 file near
    # 40 MB; 4 query heads over 2 KV heads of 32 (GQA), head size not hidden / heads, as in 0.6B (64 / 4 = 16).
    "tiny": Qwen3Config(n_layer=4, hidden=64, ffn=256, n_head=4, n_head_kv=2, head_dim=32),
    # Qwen/Qwen3-0.6B (models.md 1.5).
    "0.6b": Qwen3Config(n_layer=28, hidden=1024, ffn=3072, n_head=16, n_head_kv=8, head_dim=128),
}


def size(name: str) -> Qwen3Config:
    return named_size(SIZES, name, ARCH)


# -- tensors -----------------------------------------------------------------------------------


def tensor_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every GGUF tensor of a qwen3 model and its shape (numpy order), in file order."""
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab, cfg.hidden)}
    q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    for il in range(cfg.n_layer):
        blk = f"blk.{il}."
        shapes[blk + "attn_norm.weight"] = (cfg.hidden,)
        shapes[blk + "attn_q.weight"] = (q_rows, cfg.hidden)
        shapes[blk + "attn_k.weight"] = (kv_rows, cfg.hidden)
        shapes[blk + "attn_v.weight"] = (kv_rows, cfg.hidden)
        shapes[blk + "attn_output.weight"] = (cfg.hidden, q_rows)
        shapes[blk + "attn_q_norm.weight"] = (cfg.head_dim,)
        shapes[blk + "attn_k_norm.weight"] = (cfg.head_dim,)
        shapes[blk + "ffn_norm.weight"] = (cfg.hidden,)
        shapes[blk + "ffn_gate.weight"] = (cfg.ffn, cfg.hidden)
        shapes[blk + "ffn_up.weight"] = (cfg.ffn, cfg.hidden)
        shapes[blk + "ffn_down.weight"] = (cfg.hidden, cfg.ffn)
    shapes["output_norm.weight"] = (cfg.hidden,)
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab, cfg.hidden)
    return shapes
