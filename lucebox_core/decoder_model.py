"""What every decoder-only family's model does alike: hold its weights, resolve its KV storage types against
its KV policy, make and empty sequence states, snapshot them (`StateSnapshots`), and say how it prefers to
prefill. A family subclasses `DecoderModel`, names its state class, and writes its forward pass.

Its layers each have an `index` and, where they cache K/V, a `self_attn` with a `kv_shape` (a
`KVLayerShape`); a family whose layers differ (hybrid models: some layers carry recurrent state instead)
overrides `kv_layer_shapes` and `new_state`. A pre-norm decoder (`input_layernorm`, attention,
`post_attention_layernorm`, `mlp`) runs its stack through `_run_layers`; a family whose layers are shaped
otherwise (Gemma-4's sandwich norms, Qwen3.5's split parts) writes its own. The decode step is
`run_decode_step` over the family's `_static_step`.
"""

from __future__ import annotations

from typing import Any

import torch

from .kv import K_FLAG, V_FLAG, KVLayerShape, kv_cache_type
from .state_snapshot import StateSnapshots
from .static_step import MIN_WINDOW, run_decode_step

Weight = Any  # a QuantTensor (weights stay in their GGUF type) or a torch tensor


def mlp_after_residual(ops: Any, mlp: Any, x: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's MLP after the residual add and its norm: `(mlp(rms_norm(residual + x)), residual + x)`. A SwiGLU
    MLP (`swiglu` true) whose gate and up rows the backend fused (`gate_up_proj`, beside `down_proj`) goes through
    the one op `add_rms_norm_swiglu`, a MoE block that can say what it is (`routing()`, see `moe_routing`)
    through `add_rms_norm_moe`: a backend may run either as one launch; their references are the same ops."""
    gate_up = getattr(mlp, "gate_up_proj", None)
    if getattr(mlp, "swiglu", False) and gate_up is not None:
        return ops.add_rms_norm_swiglu(x, residual, norm, eps, gate_up, mlp.down_proj)
    if callable(getattr(mlp, "routing", None)):
        return ops.add_rms_norm_moe(x, residual, norm, eps, mlp)
    normed, summed = ops.add_rms_norm(x, residual, norm, eps)
    return mlp(normed), summed


class DecoderModel(StateSnapshots):
    state_class: type  # the family's per-sequence state (fields `kv`, `length`, `captured`, `features`)
    # Whether the family's attention reads a bounded KV policy's pool (`KVPolicy.bounded`): causal offsets
    # from the rows `append` returns, static windows masked at `kv.attention_position`.
    reads_bounded_kv = False

    def __init__(self, config: Any, ops: Any, embed_tokens: Weight, layers: list[Any], norm: torch.Tensor,
                 lm_head: Weight, *, kv_policy: Any, kv_dtype: torch.dtype | None = None,
                 cache_type_k: str | torch.dtype | None = None, cache_type_v: str | torch.dtype | None = None,
                 source: str = "") -> None:
        """`ops`: the backend with the family's ops bound; `kv_policy`: the `KVPolicy` whose caches the
        sequences use. KV storage types (`-ctk`/`-ctv`) default to `kv_dtype`, else the backend's dtype."""
        self.config = config
        self.ops = ops
        self.kv_policy = kv_policy
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.tied_embeddings = lm_head is embed_tokens
        self.kv_dtype = kv_dtype or ops.dtype
        self.cache_type_k = kv_cache_type(cache_type_k if cache_type_k is not None else self.kv_dtype, K_FLAG)
        self.cache_type_v = kv_cache_type(cache_type_v if cache_type_v is not None else self.kv_dtype, V_FLAG)
        kv_policy.check_types(self.cache_type_k, self.cache_type_v)
        if getattr(kv_policy, "bounded", False) and not self.reads_bounded_kv:
            from .errors import LuceboxError

            raise LuceboxError(f"the {kv_policy.name!r} KV policy keeps a bounded resident set, which "
                               f"{type(self).__name__}'s attention does not read yet; use --kv-policy full")
        self.vocab_size = int(lm_head.shape[0])
        self.context_length = int(config.context_length)
        self.source = source
        # One-token forward calls take the static decode step, replayed as a graph where the backend records.
        self.decode_graphs = ops.graphs_enabled()
        self.decode_min_window = MIN_WINDOW
        # Prefill chunk the engine uses: on a GPU a chunk's cost is mostly reading every weight once, so large
        # chunks amortise it; on the CPU smaller ones bound the activations.
        self.prefill_chunk = 4096 if torch.device(ops.device).type == "cuda" else 512

    @property
    def hidden_size(self) -> int:
        return self.config.hidden

    def kv_layer_shapes(self) -> dict[int, KVLayerShape]:
        return {layer.index: layer.self_attn.kv_shape for layer in self.layers}

    def new_state(self, max_tokens: int | None = None) -> Any:
        """A fresh sequence that can hold `max_tokens` positions (default: the model's context length)."""
        max_tokens = self.context_length if max_tokens is None else max_tokens
        return self.state_class(kv=self.kv_policy.create(self.kv_layer_shapes(), max_tokens, dtype=self.ops.dtype,
                                                         device=self.ops.device, k_type=self.cache_type_k,
                                                         v_type=self.cache_type_v))

    def reset_state(self, state: Any) -> None:
        """Empty `state` for a new sequence, keeping its buffers and recordings (the engine reuses finished
        sequences' states, so a new request replays the graphs recorded on them)."""
        state.kv.rollback(0)
        state.length = 0
        state.captured = {}
        if getattr(state, "features", None) is not None:
            state.features.zero_()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `[T, hidden]`, unscaled (a family that scales them overrides this)."""
        return self.ops.embedding(token_ids.reshape(-1).to(self.ops.device), self.embed_tokens)

    def _run_layers(self, hidden: torch.Tensor, attend: Any, tap: Any = None, *,
                    last_only: bool = False) -> torch.Tensor:
        """A pre-norm decoder stack from embeddings `[1, T, hidden]` to the final-normed hidden states;
        `attend(layer, x)` runs a layer's attention (the forward pass and the decode step differ only there),
        `tap(layer, hidden)` sees each layer's output. Each residual add is fused with the norm after it
        (`ops.add_rms_norm`)."""
        ops, eps = self.ops, self.config.eps
        normed = ops.rms_norm(hidden, self.layers[0].input_layernorm, eps)
        for i, layer in enumerate(self.layers):
            out, hidden = mlp_after_residual(ops, layer.mlp, attend(layer, normed), hidden,
                                             layer.post_attention_layernorm, eps)
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            normed, hidden = ops.add_rms_norm(out, hidden, next_norm, eps)
            if tap is not None:
                tap(layer, hidden)
        return normed[:, -1:] if last_only else normed

    def decode_step(self, state: Any, token: int | torch.Tensor, *, graphs: bool | None = None,
                    sampler: Any = None) -> Any:
        """One token at position `state.length` through the family's static-shape step (`_static_step`,
        recorded as a graph per KV window where the backend records); the same logits and state as `forward`
        for one token (see `static_step.run_decode_step`)."""
        return run_decode_step(self, state, token, self._static_step, graphs=graphs, sampler=sampler)
