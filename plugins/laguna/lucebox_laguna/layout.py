"""The laguna GGUF layout: hyper-parameters, metadata keys and tensor names/shapes, in one place.

Mirrors llama.cpp (`src/models/laguna.cpp`: `load_arch_hparams` / `load_arch_tensors`), so a file written from
this layout loads in llama.cpp and a file its converter wrote reads back into the same `LagunaConfig`.
Shapes are in numpy / PyTorch order `(rows, cols)` = `(out_features, in_features)`, the reverse of ggml's `ne`.

Laguna in llama.cpp's terms, with the GGUF key each is stored under (`laguna.` prefix):

| field | meaning | GGUF key |
| --- | --- | --- |
| `n_head` | per layer: query heads (XS.2: 48 on full layers, 64 on sliding ones) | `attention.head_count` (array) |
| `sliding_window` | sliding layers' window; layer i is full iff i % 4 == 0 (fixed) | `attention.sliding_window` |
| `rope_theta` / `rope_dim` | full layers' RoPE base and rotated dims (YaRN) | `rope.freq_base` / `dimension_count` |
| `rope_theta_swa` / `rope_dim_swa` | sliding layers' plain RoPE | `rope.freq_base_swa` / `dimension_count_swa` |
| `yarn_*` | the full layers' YaRN scaling | `rope.scaling.{type,factor,original_context_length,...}` |
| `n_dense_lead` | leading layers with a dense SwiGLU MLP instead of the MoE block | `leading_dense_block_count` |
| `expert_weights_scale` | the routed experts' sum is multiplied by it (2.5) | `expert_weights_scale` |
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
from gguf import GGUFValueType

from lucebox_core.errors import GGUFError
from lucebox_core.gguf_out import add_arch_metadata
from lucebox_core.ggufio import ArchMetadata, float32_decimal
from lucebox_core.synthetic import named_size

ARCH = "laguna"
FULL_ATTENTION_PERIOD = 4  # llama.cpp's `load_swa_pattern(ml, 4, dense_first=true)`: layer i full iff i % 4 == 0
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def is_full_layer(layer: int) -> bool:
    return layer % FULL_ATTENTION_PERIOD == 0


@attrs.frozen(kw_only=True)
class LagunaConfig:
    """Hyper-parameters of a Laguna text model, as llama.cpp reads them."""

    n_layer: int
    hidden: int
    ffn: int  # the leading dense layers' SwiGLU intermediate size
    n_head: tuple[int, ...] = attrs.field(converter=tuple)  # per layer
    n_head_kv: int
    head_dim: int = 128
    sliding_window: int = 512
    rope_theta: float = 500000.0
    rope_dim: int = 64
    rope_theta_swa: float = 10000.0
    rope_dim_swa: int = 128
    yarn_factor: float = 0.0  # 0: plain RoPE on the full layers too
    yarn_original_context: int = 4096
    yarn_beta_fast: float = 64.0
    yarn_beta_slow: float = 1.0
    eps: float = 1e-6
    vocab: int = 100352
    context_length: int = 131072
    n_expert: int = 256
    n_expert_used: int = 8
    expert_ffn: int = 512
    shared_ffn: int = 512
    expert_weights_scale: float = 2.5
    n_dense_lead: int = 1
    tied_output: bool = False

    def __attrs_post_init__(self) -> None:
        problems = []
        if len(self.n_head) != self.n_layer:
            problems.append(f"n_head has {len(self.n_head)} entries for {self.n_layer} layers")
        if self.n_head_kv <= 0 or any(h % self.n_head_kv for h in self.n_head):
            problems.append(f"attention heads {list(self.n_head)} not all multiples of KV heads {self.n_head_kv}")
        if not 0 < self.n_expert_used <= self.n_expert:
            problems.append(f"experts used {self.n_expert_used} not in 1..{self.n_expert}")
        for name, dim in (("rope_dim", self.rope_dim), ("rope_dim_swa", self.rope_dim_swa)):
            if dim <= 0 or dim % 2 or dim > self.head_dim:
                problems.append(f"{name} {dim} must be even and in 2..head_dim {self.head_dim}")
        if self.sliding_window <= 0:
            problems.append(f"sliding window {self.sliding_window} must be positive")
        if not 0 <= self.n_dense_lead <= self.n_layer:
            problems.append(f"leading dense blocks {self.n_dense_lead} not in 0..{self.n_layer}")
        if problems:
            raise ValueError("invalid LagunaConfig: " + "; ".join(problems))

    def is_sliding(self, layer: int) -> bool:
        return not is_full_layer(layer)

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_lead

    @property
    def yarn_attention_factor(self) -> float:
        """YaRN's magnitude scale of the rotated dims, `0.1 ln(factor) + 1` (transformers' `get_mscale`)."""
        return 0.1 * math.log(self.yarn_factor) + 1.0 if self.yarn_factor > 1 else 1.0

    # -- GGUF metadata ---------------------------------------------------------------------------

    def to_gguf_metadata(self) -> dict[str, Any]:
        """The `laguna.*` keys llama.cpp reads (values as Python scalars/lists; see `METADATA_TYPES`)."""
        k = f"{ARCH}."
        md = {
            k + "block_count": self.n_layer,
            k + "context_length": self.context_length,
            k + "embedding_length": self.hidden,
            k + "feed_forward_length": self.ffn,
            k + "attention.head_count": list(self.n_head),
            k + "attention.head_count_kv": self.n_head_kv,
            k + "attention.key_length": self.head_dim,
            k + "attention.value_length": self.head_dim,
            k + "attention.layer_norm_rms_epsilon": self.eps,
            k + "attention.sliding_window": self.sliding_window,
            k + "rope.freq_base": self.rope_theta,
            k + "rope.freq_base_swa": self.rope_theta_swa,
            k + "rope.dimension_count": self.rope_dim,
            k + "rope.dimension_count_swa": self.rope_dim_swa,
            k + "expert_count": self.n_expert,
            k + "expert_used_count": self.n_expert_used,
            k + "expert_feed_forward_length": self.expert_ffn,
            k + "expert_shared_feed_forward_length": self.shared_ffn,
            k + "expert_weights_norm": True,
            k + "expert_weights_scale": self.expert_weights_scale,
            k + "expert_gating_func": SIGMOID_GATING,
            k + "leading_dense_block_count": self.n_dense_lead,
            k + "vocab_size": self.vocab,
        }
        if self.yarn_factor > 1:
            md[k + "rope.scaling.type"] = "yarn"
            md[k + "rope.scaling.factor"] = self.yarn_factor
            md[k + "rope.scaling.original_context_length"] = self.yarn_original_context
            md[k + "rope.scaling.yarn_beta_fast"] = self.yarn_beta_fast
            md[k + "rope.scaling.yarn_beta_slow"] = self.yarn_beta_slow
        return md

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any], *, tensor_names: Iterable[str] | None = None,
                           source: str = "GGUF metadata") -> LagunaConfig:
        """Read the config back from GGUF metadata (key -> plain Python value). `tensor_names`, when given,
        decides `tied_output` (no `output.weight`)."""
        k = f"{ARCH}."
        keys = ArchMetadata(md, ARCH, source)
        get = keys.get
        n_layer = int(get("block_count"))
        heads = get("attention.head_count")
        heads = [int(heads)] * n_layer if not isinstance(heads, list) else [int(h) for h in heads]
        if len(heads) < n_layer:
            raise GGUFError(f"{source}: {k}attention.head_count has {len(heads)} entries for {n_layer} layers")
        kv = get("attention.head_count_kv")
        if isinstance(kv, list):
            if len(set(kv[:n_layer])) != 1:
                raise GGUFError(f"{source}: {k}attention.head_count_kv varies between layers: {kv}")
            kv = kv[0]
        head_dim = int(get("attention.key_length", 128))
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise GGUFError(f"{source}: {k}attention.value_length {get('attention.value_length')} differs from "
                            f"the key length {head_dim}")
        if "attention.sliding_window" not in keys or not int(get("attention.sliding_window")):
            raise GGUFError(f"{source}: {k}attention.sliding_window is missing or 0: only the hybrid (XS.2) "
                            "layout with sliding layers is supported")
        gating = int(get("expert_gating_func", SIGMOID_GATING))
        if gating != SIGMOID_GATING:
            raise GGUFError(f"{source}: {k}expert_gating_func = {gating}: Laguna's router is sigmoid "
                            f"({SIGMOID_GATING})")
        if not bool(get("expert_weights_norm", True)):
            raise GGUFError(f"{source}: {k}expert_weights_norm is false: Laguna renormalises the chosen weights")
        scaling = str(get("rope.scaling.type", "none"))
        if scaling not in ("yarn", "none"):
            raise GGUFError(f"{source}: {k}rope.scaling.type = {scaling!r}; Laguna's full layers use yarn")
        names = None if tensor_names is None else set(tensor_names)
        try:
            return cls(
                n_layer=n_layer, hidden=int(get("embedding_length")), ffn=int(get("feed_forward_length")),
                n_head=tuple(heads[:n_layer]), n_head_kv=int(kv), head_dim=head_dim,
                sliding_window=int(get("attention.sliding_window")),
                rope_theta=float32_decimal(get("rope.freq_base", 500000.0)),
                rope_dim=int(get("rope.dimension_count", head_dim)),
                rope_theta_swa=float32_decimal(get("rope.freq_base_swa", get("rope.freq_base", 10000.0))),
                rope_dim_swa=int(get("rope.dimension_count_swa", head_dim)),
                yarn_factor=float32_decimal(get("rope.scaling.factor", 0.0)) if scaling == "yarn" else 0.0,
                yarn_original_context=int(get("rope.scaling.original_context_length", 4096)),
                yarn_beta_fast=float32_decimal(get("rope.scaling.yarn_beta_fast", 32.0)),
                yarn_beta_slow=float32_decimal(get("rope.scaling.yarn_beta_slow", 1.0)),
                eps=float32_decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
                vocab=keys.vocab_size(), context_length=int(get("context_length", 131072)),
                n_expert=int(get("expert_count")), n_expert_used=int(get("expert_used_count")),
                expert_ffn=int(get("expert_feed_forward_length")),
                shared_ffn=int(get("expert_shared_feed_forward_length", get("expert_feed_forward_length"))),
                expert_weights_scale=float32_decimal(get("expert_weights_scale", 1.0)),
                n_dense_lead=int(get("leading_dense_block_count", 0)),
                tied_output=True if names is None else "output.weight" not in names,
            )
        except ValueError as exc:
            raise GGUFError(f"{source}: {exc}") from None


_F32 = GGUFValueType.FLOAT32
METADATA_TYPES: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {
    "attention.head_count": (GGUFValueType.ARRAY, GGUFValueType.INT32),
    "attention.layer_norm_rms_epsilon": (_F32, None),
    "rope.freq_base": (_F32, None),
    "rope.freq_base_swa": (_F32, None),
    "rope.scaling.type": (GGUFValueType.STRING, None),
    "rope.scaling.factor": (_F32, None),
    "rope.scaling.yarn_beta_fast": (_F32, None),
    "rope.scaling.yarn_beta_slow": (_F32, None),
    "expert_weights_norm": (GGUFValueType.BOOL, None),
    "expert_weights_scale": (_F32, None),
}


def add_metadata(writer: Any, cfg: LagunaConfig) -> None:
    """Write `cfg.to_gguf_metadata()` into a `gguf.GGUFWriter` with llama.cpp's value types."""
    add_arch_metadata(writer, ARCH, cfg.to_gguf_metadata(), METADATA_TYPES)


# -- the named sizes ---------------------------------------------------------------------------

SIZES: dict[str, LagunaConfig] = {
    # Synthetic, for tests: rows a multiple of 256 (K-quants apply), five layers (full, three sliding, full)
    # with a 16-position window so the rings wrap in short tests, more query heads on the sliding layers than
    # on the full ones as in XS.2, YaRN on the full layers, 16 experts top-4; the Laguna-style vocabulary.
    # YaRN's beta_fast is 32 here, not XS.2's 64: llama.cpp's laguna loader (0c1e570) does not read
    # `rope.scaling.yarn_beta_fast` and always uses 32, so with 32 its greedy tokens are a check of the rest.
    "tiny": LagunaConfig(
        n_layer=5, hidden=256, ffn=512, n_head=(4, 8, 8, 8, 4), n_head_kv=2, head_dim=64, sliding_window=16,
        rope_dim=32, rope_dim_swa=64, yarn_factor=32.0, yarn_beta_fast=32.0, n_expert=16, n_expert_used=4,
        expert_ffn=256, shared_ffn=256,
    ),
    # poolside/Laguna-XS.2 (models.md 1.4).
    "xs2": LagunaConfig(
        n_layer=40, hidden=2048, ffn=8192, n_head=tuple(48 if is_full_layer(i) else 64 for i in range(40)),
        n_head_kv=8, yarn_factor=32.0,
    ),
}


def size(name: str) -> LagunaConfig:
    return named_size(SIZES, name, ARCH)


# -- tensors -----------------------------------------------------------------------------------


def tensor_shapes(cfg: LagunaConfig) -> dict[str, tuple[int, ...]]:
    """Every GGUF tensor of a laguna model and its shape (numpy order), in file order (llama.cpp's
    `llama_model_laguna::load_arch_tensors`, per-head attention gate)."""
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab, cfg.hidden)}
    for il in range(cfg.n_layer):
        blk, heads = f"blk.{il}.", cfg.n_head[il]
        shapes[blk + "attn_norm.weight"] = (cfg.hidden,)
        shapes[blk + "attn_q.weight"] = (heads * cfg.head_dim, cfg.hidden)
        shapes[blk + "attn_k.weight"] = (cfg.n_head_kv * cfg.head_dim, cfg.hidden)
        shapes[blk + "attn_v.weight"] = (cfg.n_head_kv * cfg.head_dim, cfg.hidden)
        shapes[blk + "attn_output.weight"] = (cfg.hidden, heads * cfg.head_dim)
        shapes[blk + "attn_q_norm.weight"] = (cfg.head_dim,)
        shapes[blk + "attn_k_norm.weight"] = (cfg.head_dim,)
        shapes[blk + "attn_gate.weight"] = (heads, cfg.hidden)
        shapes[blk + "ffn_norm.weight"] = (cfg.hidden,)
        if cfg.is_moe(il):
            shapes[blk + "ffn_gate_inp.weight"] = (cfg.n_expert, cfg.hidden)
            shapes[blk + "exp_probs_b.bias"] = (cfg.n_expert,)
            shapes[blk + "ffn_gate_exps.weight"] = (cfg.n_expert, cfg.expert_ffn, cfg.hidden)
            shapes[blk + "ffn_up_exps.weight"] = (cfg.n_expert, cfg.expert_ffn, cfg.hidden)
            shapes[blk + "ffn_down_exps.weight"] = (cfg.n_expert, cfg.hidden, cfg.expert_ffn)
            shapes[blk + "ffn_gate_shexp.weight"] = (cfg.shared_ffn, cfg.hidden)
            shapes[blk + "ffn_up_shexp.weight"] = (cfg.shared_ffn, cfg.hidden)
            shapes[blk + "ffn_down_shexp.weight"] = (cfg.hidden, cfg.shared_ffn)
        else:
            shapes[blk + "ffn_gate.weight"] = (cfg.ffn, cfg.hidden)
            shapes[blk + "ffn_up.weight"] = (cfg.ffn, cfg.hidden)
            shapes[blk + "ffn_down.weight"] = (cfg.hidden, cfg.ffn)
    shapes["output_norm.weight"] = (cfg.hidden,)
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab, cfg.hidden)
    return shapes
