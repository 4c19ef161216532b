"""The qwen35 GGUF layout: hyper-parameters, metadata keys and tensor names/shapes, in one place.

Everything here mirrors llama.cpp (`src/models/qwen35.cpp`, `load_arch_hparams`/`load_arch_tensors`)
and its HF converter (`conversion/qwen.py`), so a file written from this layout loads in llama.cpp
and a file llama.cpp's converter wrote reads back into the same `Qwen35Config`.

Shapes are given in **numpy / PyTorch order** `(rows, cols)` = `(out_features, in_features)`, the
reverse of ggml's `ne` (`ne[0]` is the row length). `gguf.GGUFReader` reports `ReaderTensor.shape`
in ggml order, so compare against `tuple(reversed(t.shape))`.

Qwen3.5 vocabulary terms used below, with the GGUF key each is stored under:

| field | meaning | GGUF key (`qwen35.` prefix) |
| --- | --- | --- |
| `ssm_d_conv` | depthwise causal conv kernel of the Gated DeltaNet (GDN) layers | `ssm.conv_kernel` |
| `ssm_d_state` | GDN key head dim (= value head dim in llama.cpp) | `ssm.state_size` |
| `ssm_n_group` | GDN key heads (`linear_num_key_heads`) | `ssm.group_count` |
| `ssm_dt_rank` | GDN value heads (`linear_num_value_heads`) | `ssm.time_step_rank` |
| `ssm_d_inner` | GDN value heads x value head dim | `ssm.inner_size` |
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import attrs
from gguf import GGUFValueType

from lucebox_core.errors import GGUFError
from lucebox_core.filetypes import keep_f32, layer_of  # noqa: F401 (layer_of: part of the layout's vocabulary)
from lucebox_core.gguf_out import add_arch_metadata
from lucebox_core.ggufio import ArchMetadata, float32_decimal
from lucebox_core.synthetic import named_size

ARCH = "qwen35"
MOE_ARCH = "qwen35moe"
# llama.cpp's converter keeps the Gated DeltaNet convolution kernels F32 in every file type.
keep_f32("ssm_conv1d")


def _default_recurrent(self: Qwen35Config) -> tuple[bool, ...]:
    # llama.cpp's fallback when `attention.recurrent_layers` is absent: full attention every
    # `full_attention_interval`-th layer (i % 4 == 3 for the real models), GDN everywhere else.
    return tuple((i + 1) % self.full_attention_interval != 0 for i in range(self.n_layer))


@attrs.frozen(kw_only=True)
class Qwen35Config:
    """Hyper-parameters of a dense Qwen3.5 / Qwen3.6 text model, as llama.cpp reads them."""

    arch: ClassVar[str] = ARCH  # the GGUF architecture, also the metadata keys' prefix
    n_layer: int
    hidden: int  # n_embd
    ffn: int  # SwiGLU intermediate size
    n_head: int  # full-attention query heads
    n_head_kv: int
    head_dim: int  # full-attention head dim (key_length = value_length)
    ssm_d_conv: int = 4
    ssm_d_state: int = 128
    ssm_n_group: int
    ssm_dt_rank: int
    ssm_d_inner: int
    full_attention_interval: int = 4
    rope_theta: float = 1e7
    rope_dim: int = 64  # rotated dims per head (partial RoPE, 0.25 x head_dim)
    rope_sections: tuple[int, int, int, int] = attrs.field(default=(11, 11, 10, 0), converter=tuple)
    eps: float = 1e-6
    vocab: int = 248320
    context_length: int = 262144
    tied_output: bool = False  # no `output.weight`: the LM head reuses `token_embd.weight`
    recurrent: tuple[bool, ...] = attrs.field(
        default=attrs.Factory(_default_recurrent, takes_self=True), converter=tuple
    )

    def __attrs_post_init__(self) -> None:
        problems = []
        if len(self.recurrent) != self.n_layer:
            problems.append(f"recurrent has {len(self.recurrent)} entries for {self.n_layer} layers")
        if self.ssm_dt_rank % self.ssm_n_group:
            problems.append(f"GDN value heads {self.ssm_dt_rank} not a multiple of key heads {self.ssm_n_group}")
        if self.ssm_d_inner != self.ssm_dt_rank * self.ssm_d_state:
            # llama.cpp sizes value heads with ssm.state_size, so key and value head dims must agree.
            problems.append(
                f"ssm_d_inner {self.ssm_d_inner} != value heads {self.ssm_dt_rank} x head dim {self.ssm_d_state}"
            )
        if self.n_head % self.n_head_kv:
            problems.append(f"attention heads {self.n_head} not a multiple of KV heads {self.n_head_kv}")
        if len(self.rope_sections) != 4:
            problems.append(f"rope_sections must have 4 entries, got {self.rope_sections}")
        if problems:
            raise ValueError("invalid Qwen35Config: " + "; ".join(problems))

    # -- derived sizes ---------------------------------------------------------------------------

    @property
    def gdn_key_dim(self) -> int:
        """Channels of q (and of k) in a GDN layer: key heads x key head dim."""
        return self.ssm_n_group * self.ssm_d_state

    @property
    def gdn_conv_dim(self) -> int:
        """Channels through the GDN conv and rows of `attn_qkv`: [q | k | v]."""
        return 2 * self.gdn_key_dim + self.ssm_d_inner

    @property
    def full_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.recurrent) if not r]

    def is_recurrent(self, layer: int) -> bool:
        return self.recurrent[layer]

    # -- GGUF metadata ---------------------------------------------------------------------------

    def to_gguf_metadata(self) -> dict[str, Any]:
        """The `qwen35.*` keys llama.cpp reads (values as Python scalars/lists; see `METADATA_TYPES`)."""
        k = f"{self.arch}."
        return {
            k + "block_count": self.n_layer,
            k + "context_length": self.context_length,
            k + "embedding_length": self.hidden,
            **{k + key: value for key, value in self._ffn_metadata().items()},
            k + "attention.head_count": self.n_head,
            k + "attention.head_count_kv": self.n_head_kv,
            k + "attention.key_length": self.head_dim,
            k + "attention.value_length": self.head_dim,
            k + "attention.layer_norm_rms_epsilon": self.eps,
            k + "rope.freq_base": self.rope_theta,
            k + "rope.dimension_count": self.rope_dim,
            k + "rope.dimension_sections": list(self.rope_sections),
            k + "ssm.conv_kernel": self.ssm_d_conv,
            k + "ssm.state_size": self.ssm_d_state,
            k + "ssm.group_count": self.ssm_n_group,
            k + "ssm.time_step_rank": self.ssm_dt_rank,
            k + "ssm.inner_size": self.ssm_d_inner,
            k + "full_attention_interval": self.full_attention_interval,
            k + "attention.recurrent_layers": list(self.recurrent),
            k + "vocab_size": self.vocab,
        }

    # -- the feed-forward block: what the MoE variant overrides ------------------------------------

    def _ffn_metadata(self) -> dict[str, Any]:
        return {"feed_forward_length": self.ffn}

    @classmethod
    def _ffn_fields(cls, get: Callable[..., Any]) -> dict[str, Any]:
        """The FFN's config fields from GGUF metadata (`get(key)`, key without the arch prefix)."""
        return {"ffn": int(get("feed_forward_length"))}

    @classmethod
    def _ffn_fields_from_hf(cls, need: Callable[[str], Any], text: Mapping[str, Any]) -> dict[str, Any]:
        return {"ffn": int(need("intermediate_size"))}

    def ffn_shapes(self) -> dict[str, tuple[int, ...]]:
        """The FFN tensors of one layer (names after `blk.N.`): the dense SwiGLU."""
        return {
            "ffn_gate.weight": (self.ffn, self.hidden),
            "ffn_up.weight": (self.ffn, self.hidden),
            "ffn_down.weight": (self.hidden, self.ffn),
        }

    @classmethod
    def from_gguf_metadata(
        cls,
        md: Mapping[str, Any],
        *,
        tensor_names: Iterable[str] | None = None,
        source: str = "GGUF metadata",
    ) -> Qwen35Config:
        """Read the config back from GGUF metadata (key -> plain Python value).

        `tensor_names`, when given, decides `tied_output` (no `output.weight`). `source` names the
        file in error messages.
        """
        k = f"{cls.arch}."
        keys = ArchMetadata(md, cls.arch, source)
        get = keys.get
        vocab = keys.vocab_size()
        n_layer = int(get("block_count"))
        interval = int(get("full_attention_interval", 4))
        recurrent = get("attention.recurrent_layers", None)
        if recurrent is None:
            recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
        elif len(recurrent) < n_layer:
            raise GGUFError(
                f"{source}: {k}attention.recurrent_layers has {len(recurrent)} entries for {n_layer} layers"
            )
        sections = [int(s) for s in get("rope.dimension_sections")]
        sections = (sections + [0, 0, 0, 0])[:4]
        key_length = int(get("attention.key_length"))
        value_length = int(get("attention.value_length", key_length))
        if value_length != key_length:
            raise GGUFError(f"{source}: {k}attention.value_length {value_length} != key_length {key_length}")
        tied = False if tensor_names is None else "output.weight" not in set(tensor_names)
        try:
            return cls(
                n_layer=n_layer,
                hidden=int(get("embedding_length")),
                **cls._ffn_fields(get),
                n_head=int(get("attention.head_count")),
                n_head_kv=int(get("attention.head_count_kv")),
                head_dim=key_length,
                ssm_d_conv=int(get("ssm.conv_kernel")),
                ssm_d_state=int(get("ssm.state_size")),
                ssm_n_group=int(get("ssm.group_count")),
                ssm_dt_rank=int(get("ssm.time_step_rank")),
                ssm_d_inner=int(get("ssm.inner_size")),
                full_attention_interval=interval,
                rope_theta=float32_decimal(get("rope.freq_base")),
                rope_dim=int(get("rope.dimension_count")),
                rope_sections=tuple(sections),
                eps=float32_decimal(get("attention.layer_norm_rms_epsilon")),
                vocab=vocab,
                context_length=int(get("context_length")),
                tied_output=tied,
                recurrent=tuple(bool(r) for r in recurrent[:n_layer]),
            )
        except ValueError as exc:
            raise GGUFError(f"{source}: {exc}") from None

    @classmethod
    def from_hf_config(cls, text: Mapping[str, Any], *, tied_output: bool) -> Qwen35Config:
        """Build the config from a transformers `qwen3_5_text` config dict (the `text_config`).

        Raises `ValueError` naming the offending key; the converter turns it into a user error.
        """

        def need(key: str) -> Any:
            if key not in text:
                raise ValueError(f"missing key {key!r}")
            return text[key]

        n_layer = int(need("num_hidden_layers"))
        hidden = int(need("hidden_size"))
        n_head = int(need("num_attention_heads"))
        head_dim = int(text.get("head_dim") or hidden // n_head)
        # transformers 5 keeps rope settings in `rope_parameters`; older configs at the top level.
        rope = dict(text.get("rope_scaling") or {})
        rope.update(text.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        sections = list(rope.get("mrope_section") or [11, 11, 10])
        sections = (sections + [0, 0, 0, 0])[:4]
        interval = int(text.get("full_attention_interval", 4))
        layer_types = text.get("layer_types")
        if layer_types is not None:
            if len(layer_types) != n_layer:
                raise ValueError(f"layer_types has {len(layer_types)} entries for {n_layer} layers")
            unknown = set(layer_types) - {"linear_attention", "full_attention"}
            if unknown:
                raise ValueError(f"unknown layer_types {sorted(unknown)}")
            recurrent = tuple(t == "linear_attention" for t in layer_types)
        else:
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
        k_dim = int(text.get("linear_key_head_dim", 128))
        v_dim = int(text.get("linear_value_head_dim", 128))
        if k_dim != v_dim:
            raise ValueError(f"linear_key_head_dim {k_dim} != linear_value_head_dim {v_dim} (llama.cpp needs equal)")
        v_heads = int(need("linear_num_value_heads"))
        return cls(
            n_layer=n_layer,
            hidden=hidden,
            **cls._ffn_fields_from_hf(need, text),
            n_head=n_head,
            n_head_kv=int(need("num_key_value_heads")),
            head_dim=head_dim,
            ssm_d_conv=int(text.get("linear_conv_kernel_dim", 4)),
            ssm_d_state=k_dim,
            ssm_n_group=int(need("linear_num_key_heads")),
            ssm_dt_rank=v_heads,
            ssm_d_inner=v_heads * v_dim,
            full_attention_interval=interval,
            rope_theta=theta,
            rope_dim=int(head_dim * partial),
            rope_sections=tuple(sections),
            eps=float(text.get("rms_norm_eps", 1e-6)),
            vocab=int(need("vocab_size")),
            context_length=int(text.get("max_position_embeddings", 262144)),
            tied_output=tied_output,
            recurrent=recurrent,
        )


# GGUF value types of the keys `to_gguf_metadata` returns, as llama.cpp's converter writes them.
METADATA_TYPES: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {
    "attention.layer_norm_rms_epsilon": (GGUFValueType.FLOAT32, None),
    "rope.freq_base": (GGUFValueType.FLOAT32, None),
    "rope.dimension_sections": (GGUFValueType.ARRAY, GGUFValueType.INT32),
    "attention.recurrent_layers": (GGUFValueType.ARRAY, GGUFValueType.BOOL),
}


def add_metadata(writer: Any, cfg: Qwen35Config) -> None:
    """Write `cfg.to_gguf_metadata()` into a `gguf.GGUFWriter` with llama.cpp's value types."""
    add_arch_metadata(writer, cfg.arch, cfg.to_gguf_metadata(), METADATA_TYPES)


# -- the named sizes ---------------------------------------------------------------------------

SIZES: dict[str, Qwen35Config] = {
    # Synthetic, for tests and the default model: every matrix row length is a multiple of 256 so
    # K-quants apply everywhere; 2 GDN key heads / 4 value heads so the V-head reorder matters;
    # layers 3 and 7 are full attention; real vocabulary size and tied output like 0.8B.
    "tiny": Qwen35Config(
        n_layer=8, hidden=256, ffn=768, n_head=2, n_head_kv=1, head_dim=256,
        ssm_d_state=128, ssm_n_group=2, ssm_dt_rank=4, ssm_d_inner=512, tied_output=True,
    ),
    # Qwen/Qwen3.5-0.8B (models.md 1.1).
    "0.8b": Qwen35Config(
        n_layer=24, hidden=1024, ffn=3584, n_head=8, n_head_kv=2, head_dim=256,
        ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=16, ssm_d_inner=2048, tied_output=True,
    ),
    # Qwen/Qwen3.5-27B and Qwen3.6-27B (models.md 1.1).
    "27b": Qwen35Config(
        n_layer=64, hidden=5120, ffn=17408, n_head=24, n_head_kv=4, head_dim=256,
        ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=48, ssm_d_inner=6144, tied_output=False,
    ),
}


def size(name: str) -> Qwen35Config:
    return named_size(SIZES, name, ARCH)


# -- tensors -----------------------------------------------------------------------------------


def tensor_shapes(cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every GGUF tensor of a qwen35 (or qwen35moe) model and its shape (numpy order), in file order.

    Matches llama.cpp's `llama_model_qwen35{,moe}::load_arch_tensors` (without the optional MTP block).
    """
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab, cfg.hidden)}
    for il in range(cfg.n_layer):
        blk = f"blk.{il}."
        shapes[blk + "attn_norm.weight"] = (cfg.hidden,)
        if cfg.is_recurrent(il):
            shapes[blk + "attn_qkv.weight"] = (cfg.gdn_conv_dim, cfg.hidden)
            shapes[blk + "attn_gate.weight"] = (cfg.ssm_d_inner, cfg.hidden)
            shapes[blk + "ssm_conv1d.weight"] = (cfg.gdn_conv_dim, cfg.ssm_d_conv)
            shapes[blk + "ssm_dt.bias"] = (cfg.ssm_dt_rank,)
            shapes[blk + "ssm_a"] = (cfg.ssm_dt_rank,)
            shapes[blk + "ssm_beta.weight"] = (cfg.ssm_dt_rank, cfg.hidden)
            shapes[blk + "ssm_alpha.weight"] = (cfg.ssm_dt_rank, cfg.hidden)
            shapes[blk + "ssm_norm.weight"] = (cfg.ssm_d_state,)
            shapes[blk + "ssm_out.weight"] = (cfg.hidden, cfg.ssm_d_inner)
        else:
            # attn_q rows hold [q_h | gate_h] per head, interleaved head by head.
            shapes[blk + "attn_q.weight"] = (2 * cfg.n_head * cfg.head_dim, cfg.hidden)
            shapes[blk + "attn_k.weight"] = (cfg.n_head_kv * cfg.head_dim, cfg.hidden)
            shapes[blk + "attn_v.weight"] = (cfg.n_head_kv * cfg.head_dim, cfg.hidden)
            shapes[blk + "attn_output.weight"] = (cfg.hidden, cfg.n_head * cfg.head_dim)
            shapes[blk + "attn_q_norm.weight"] = (cfg.head_dim,)
            shapes[blk + "attn_k_norm.weight"] = (cfg.head_dim,)
        shapes[blk + "post_attention_norm.weight"] = (cfg.hidden,)
        shapes.update({blk + name: shape for name, shape in cfg.ffn_shapes().items()})
    shapes["output_norm.weight"] = (cfg.hidden,)
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab, cfg.hidden)
    return shapes


def reorder_v_heads(x: Any, dim: int, n_k_heads: int, n_v_heads: int, head_dim: int) -> Any:
    """Value heads from Hugging Face's grouped order to llama.cpp's tiled order, along `dim`.

    HF groups value heads by the key head they share: `[K0: v0 v1 .., K1: v0 v1 .., ...]`
    (`repeat_interleave`). GGUF stores them tiled, `[v0 of K0, v0 of K1, ..., v1 of K0, ...]`, so a
    kernel broadcasts key heads with a plain repeat. `head_dim` is the width of one head along
    `dim` (1 for per-head scalars). Works on numpy arrays and torch tensors.
    """
    if n_v_heads == n_k_heads:
        return x
    shape = list(x.shape)
    dim = dim % len(shape)
    per_k = n_v_heads // n_k_heads
    split = shape[:dim] + [n_k_heads, per_k, head_dim] + shape[dim + 1 :]
    y = x.reshape(split)
    y = y.swapaxes(dim, dim + 1)  # numpy and torch both spell it this way
    return y.reshape(shape)


def tiled_to_grouped(x: Any, dim: int, n_k_heads: int, n_v_heads: int, head_dim: int) -> Any:
    """Inverse of `reorder_v_heads`: GGUF's tiled value-head order back to Hugging Face's grouped one."""
    if n_v_heads == n_k_heads:
        return x
    shape = list(x.shape)
    dim = dim % len(shape)
    per_k = n_v_heads // n_k_heads
    split = shape[:dim] + [per_k, n_k_heads, head_dim] + shape[dim + 1 :]
    y = x.reshape(split)
    y = y.swapaxes(dim, dim + 1)  # numpy and torch both spell it this way
    return y.reshape(shape)
