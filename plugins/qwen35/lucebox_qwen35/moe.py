"""The mixture-of-experts FFN of Qwen3.5 / Qwen3.6 MoE (GGUF `qwen35moe`; transformers' `Qwen3_5MoeSparseMoeBlock`).

    weights, experts = top_k(softmax(router(x)))   renormalised to sum 1
    y = sum_k weights_k * expert_k(x) + sigmoid(shared_expert_gate . x) * shared_expert(x)

Every expert, routed or shared, is a SwiGLU MLP. The model is the dense one (`model.py`) with this block in
place of each layer's `MLP`: the decoder stack calls `layer.mlp(x)` either way. The routed products are the
core's generic `moe_experts_swiglu` (separate gate and up stacks, as in the GGUF), the router the family's
`softmax_topk_route`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from lucebox_core.moe_routing import SOFTMAX, MoERouting
from lucebox_core.spark import SWIGLU_EXPERTS, ExpertLayout, run_experts

from .model import MLP, Weight

# transformers name -> GGUF tensor name of the MoE block's tensors (the model's `GGUF_NAMES` has the rest).
MOE_GGUF_NAMES: dict[str, str] = {
    "layers.{i}.mlp.gate": "blk.{i}.ffn_gate_inp.weight",
    "layers.{i}.mlp.experts.gate_proj": "blk.{i}.ffn_gate_exps.weight",  # the first half of `gate_up_proj`
    "layers.{i}.mlp.experts.up_proj": "blk.{i}.ffn_up_exps.weight",  # the second half
    "layers.{i}.mlp.experts.down_proj": "blk.{i}.ffn_down_exps.weight",
    "layers.{i}.mlp.shared_expert_gate": "blk.{i}.ffn_gate_inp_shexp.weight",
    "layers.{i}.mlp.shared_expert.gate_proj": "blk.{i}.ffn_gate_shexp.weight",
    "layers.{i}.mlp.shared_expert.up_proj": "blk.{i}.ffn_up_shexp.weight",
    "layers.{i}.mlp.shared_expert.down_proj": "blk.{i}.ffn_down_shexp.weight",
}


@attrs.define
class SparseMoeBlock:
    """Softmax top-k routed SwiGLU experts plus one shared expert behind a per-token sigmoid gate."""

    ops: Any
    router: Weight  # [n_expert, hidden]
    gate_exps: Weight  # [n_expert, expert_ffn, hidden]
    up_exps: Weight  # [n_expert, expert_ffn, hidden]
    down_exps: Weight  # [n_expert, hidden, expert_ffn]
    shared_expert: MLP
    shared_expert_gate: Weight  # [1, hidden]: one logit per token, a one-row product on the backend's kernels
    top_k: int
    offload: Any = None  # Spark's `OffloadedExperts` for this layer's stacks (`spark.attach_spark`), or None
    expert_layout: ClassVar[ExpertLayout] = SWIGLU_EXPERTS  # its stacks and ops, as Spark reads them

    def fuse_projections(self) -> None:
        self.shared_expert.fuse_projections()

    def routing(self) -> MoERouting | None:
        """This block as data, for a backend that runs it as one kernel (`lucebox_core.moe_routing`); None with
        Spark's paged stacks, or before the backend fused the shared expert's gate and up rows."""
        shared = self.shared_expert
        if self.offload is not None or shared.gate_up_proj is None:
            return None
        return MoERouting(SOFTMAX, self.router, self.top_k, self.gate_exps, self.up_exps, self.down_exps,
                          shared.gate_up_proj, shared.down_proj, shared_gate=self.shared_expert_gate)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        flat = x.reshape(-1, x.shape[-1])
        # The gate's logit as transformers' `nn.Linear(hidden, 1)` gives it, in the activations' dtype, beside the
        # router's choice (a backend reads both matrices in one launch; the fp32 `@` a one-row `linear` replaced
        # cost a cuBLAS split-K product and two casts a layer, 0.67 ms of a 4.6 ms 35B-A3B step on the H200).
        weights, ids, gate = ops.softmax_topk_route_gated(flat, self.router, self.shared_expert_gate, self.top_k)
        # The gated shared expert goes into the op, which adds it (`add_sigmoid_gated(routed, shared(x), gate)`; a
        # backend may run it in the routed experts' launches).
        return run_experts(ops, self, flat, weights, ids, shared=self.shared_expert, shared_logit=gate).reshape(x.shape)
