"""What a routed SwiGLU mixture-of-experts block is, for a backend that runs the whole block as one kernel.

A family's MoE block is code (`LagunaMoE`, Qwen3.5-MoE's `SparseMoeBlock`): its router, its choice of experts, the
experts and their combine, written with named ops. A backend that runs all of that in one launch (the CUDA
backend's persistent MoE kernel, for a decode step) needs the block as data instead: which router and which
choice, which stacks, which shared expert. `MoERouting` is that record; a block offers it through `routing()`
(None when it cannot be run so, e.g. with Spark's paged stacks), and the core's `add_rms_norm_moe` op hands the
block to the backend together with the add + norm before it (`decoder_model.mlp_after_residual`). The op's
reference runs the block's own code, so a backend without such a kernel, or a call it refuses, computes exactly
what the block always did.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

Weight = Any  # a QuantTensor or a torch tensor

SIGMOID = "sigmoid"  # scores sigmoid(logit), ranked with a selection bias, renormalised, times a scale (Laguna)
SOFTMAX = "softmax"  # softmax over the experts, the top k renormalised (Qwen3.5-MoE)


@attrs.frozen(eq=False)
class MoERouting:
    """A routed SwiGLU MoE block with one always-on shared expert, as data.

    - `choice`: SIGMOID (with `selection_bias` `[E]` fp32, which only ranks, and `scale`) or SOFTMAX;
    - `router` `[E, hidden]`, `top_k`;
    - `gate_exps`, `up_exps` `[E, inter, hidden]` and `down_exps` `[E, hidden, inter]`: the experts' stacks;
    - `shared_gate_up` `[2 * inter, hidden]` (the shared expert's gate rows then its up rows, as `fuse_rows`
      makes them) and `shared_down` `[hidden, inter]`;
    - `shared_gate` `[1, hidden]`: the shared expert's sigmoid gate (Qwen3.5-MoE's), or None (added with weight 1).
    """

    choice: str = attrs.field(validator=attrs.validators.in_((SIGMOID, SOFTMAX)))
    router: Weight
    top_k: int
    gate_exps: Weight
    up_exps: Weight
    down_exps: Weight
    shared_gate_up: Weight
    shared_down: Weight
    selection_bias: torch.Tensor | None = None
    scale: float = 1.0
    shared_gate: Weight | None = None
