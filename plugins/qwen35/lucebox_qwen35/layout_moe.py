"""The qwen35moe GGUF layout: the Qwen3.5 / Qwen3.6 hybrid with a mixture-of-experts FFN in every layer.

Everything but the FFN is the dense layout's (`layout.py`); this adds the expert hyper-parameters and the
MoE block's tensors, as llama.cpp's `llama_model_qwen35moe::load_arch_tensors` reads them:

| tensor (`blk.N.`) | shape (numpy order) | transformers |
| --- | --- | --- |
| `ffn_gate_inp.weight` | `[n_expert, hidden]` (F32) | `mlp.gate.weight`, the softmax router |
| `ffn_gate_exps.weight`, `ffn_up_exps.weight` | `[n_expert, expert_ffn, hidden]` | halves of `mlp.experts.gate_up_proj` |
| `ffn_down_exps.weight` | `[n_expert, hidden, expert_ffn]` | `mlp.experts.down_proj` |
| `ffn_gate_inp_shexp.weight` | `[hidden]` (F32) | `mlp.shared_expert_gate.weight`, one logit per token |
| `ffn_{gate,up}_shexp.weight` | `[shared_ffn, hidden]` | `mlp.shared_expert.{gate,up}_proj` |
| `ffn_down_shexp.weight` | `[hidden, shared_ffn]` | `mlp.shared_expert.down_proj` |

Metadata adds `qwen35moe.expert_count`, `expert_used_count`, `expert_feed_forward_length` and
`expert_shared_feed_forward_length`; there is no `feed_forward_length` (no dense FFN).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs

from lucebox_core.synthetic import named_size

from .layout import MOE_ARCH, Qwen35Config


@attrs.frozen(kw_only=True)
class Qwen35MoeConfig(Qwen35Config):
    """Hyper-parameters of a Qwen3.5 / Qwen3.6 MoE text model (e.g. 35B-A3B), as llama.cpp reads them."""

    arch: ClassVar[str] = MOE_ARCH
    ffn: int = 0  # no dense FFN
    n_expert: int
    n_expert_used: int  # top-k; the chosen softmax probabilities are renormalised to sum 1
    expert_ffn: int  # each routed expert's SwiGLU intermediate size
    shared_expert_ffn: int  # the shared expert's intermediate size

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"invalid Qwen35MoeConfig: top-{self.n_expert_used} of {self.n_expert} experts")

    def _ffn_metadata(self) -> dict[str, Any]:
        return {
            "expert_count": self.n_expert,
            "expert_used_count": self.n_expert_used,
            "expert_feed_forward_length": self.expert_ffn,
            "expert_shared_feed_forward_length": self.shared_expert_ffn,
        }

    @classmethod
    def _ffn_fields(cls, get: Callable[..., Any]) -> dict[str, Any]:
        return {
            "n_expert": int(get("expert_count")),
            "n_expert_used": int(get("expert_used_count")),
            "expert_ffn": int(get("expert_feed_forward_length")),
            "shared_expert_ffn": int(get("expert_shared_feed_forward_length")),
        }

    @classmethod
    def _ffn_fields_from_hf(cls, need: Callable[[str], Any], text: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "n_expert": int(need("num_experts")),
            "n_expert_used": int(need("num_experts_per_tok")),
            "expert_ffn": int(need("moe_intermediate_size")),
            "shared_expert_ffn": int(need("shared_expert_intermediate_size")),
        }

    def ffn_shapes(self) -> dict[str, tuple[int, ...]]:
        """The MoE block's tensors of one layer (names after `blk.N.`), in llama.cpp's order."""
        e, h, f, s = self.n_expert, self.hidden, self.expert_ffn, self.shared_expert_ffn
        return {
            "ffn_gate_inp.weight": (e, h),
            "ffn_gate_exps.weight": (e, f, h),
            "ffn_up_exps.weight": (e, f, h),
            "ffn_down_exps.weight": (e, h, f),
            "ffn_gate_inp_shexp.weight": (h,),
            "ffn_gate_shexp.weight": (s, h),
            "ffn_up_shexp.weight": (s, h),
            "ffn_down_shexp.weight": (h, s),
        }


MOE_SIZES: dict[str, Qwen35Config] = {
    # Synthetic, for tests: the dense tiny's hybrid (layers 3 and 7 full attention, 2 GDN key heads / 4 value
    # heads) with 8 experts, top-2, every row length a multiple of 256 so K-quants apply everywhere.
    "tiny": Qwen35MoeConfig(
        n_layer=8, hidden=256, n_head=2, n_head_kv=1, head_dim=256,
        ssm_d_state=128, ssm_n_group=2, ssm_dt_rank=4, ssm_d_inner=512, tied_output=True,
        n_expert=8, n_expert_used=2, expert_ffn=256, shared_expert_ffn=256,
    ),
    # Qwen/Qwen3.5-35B-A3B and Qwen3.6-35B-A3B (models.md 1.2).
    "35b-a3b": Qwen35MoeConfig(
        n_layer=40, hidden=2048, n_head=16, n_head_kv=2, head_dim=256,
        ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32, ssm_d_inner=4096, tied_output=False,
        n_expert=256, n_expert_used=8, expert_ffn=512, shared_expert_ffn=512,
    ),
}


def size(name: str) -> Qwen35Config:
    return named_size(MOE_SIZES, name, MOE_ARCH)
