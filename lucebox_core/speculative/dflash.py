"""DFlash block-diffusion drafter (z-lab, arXiv 2602.06036): draft GGUF loader, forward, converter.

A drafter is a small stack of Qwen3-style decoder layers with no embedding and no output head of its
own: it reads the target's embedding table and output head, and is conditioned on hidden states the
target captured at a few of its layers. One draft step is one forward pass over a block
`[last token, MASK x (block - 1)]`:

    context = hidden_norm(fc(concat(captured target features)))         # per committed position
    x = target.embed(block)
    per layer:  h = attn_norm(x); q from h; K, V from [context ; h]; RoPE at absolute positions;
                attention non-causal over context + block (sliding-window layers: context limited to
                the window, block causal); x += o(attn); x += SwiGLU(ffn_norm(x))
    logits = target.output_logits(output_norm(x))[1:]                   # one row per drafted position

Context K/V rows depend only on their own position, so they are projected once per committed position
into the drafter's own ring cache (`DraftState`) and never hold anything of a rejected branch.

GGUF layout (Lucebox's draft files; the architecture is `dflash-draft`, or a family's own name ending in
`dflash-draft` that its plugin registers for this drafter, e.g. `qwen35-dflash-draft`): standard
`<arch>.*` hyper-parameter keys plus `<arch>.dflash.{block_size, n_target_layers, target_layer_ids,
mask_token_id}`; tensors `dflash.fc.weight`, `dflash.hidden_norm.weight`, `output_norm.weight` and per
layer `blk.i.{attn_norm, ffn_norm | post_attention_norm, attn_q, attn_k, attn_v, attn_output,
attn_q_norm, attn_k_norm, ffn_gate, ffn_up, ffn_down}.weight`. Weights are ground truth: head sizes and
the capture count are derived from tensor shapes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from ..errors import GGUFError, LuceboxError
from ..static_step import StaticStep

ARCHITECTURE_SUFFIX = "dflash-draft"  # every DFlash draft architecture ends so
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CONTEXT_WINDOW = 4096  # committed positions the drafter attends to (Lucebox's draft_ctx_max)
# The context sync of up to RECORDED_SYNC_MAX new positions runs as a recording per count (the eager sync is ~110
# small launches a step from Python: 2.7 ms of a 27B speculative step on the H100, 0.46 ms recorded, session 34);
# `LUCEBOX_RECORDED_DRAFT_SYNC=0` syncs eagerly (an A/B).
RECORDED_SYNC_SWITCH = "LUCEBOX_RECORDED_DRAFT_SYNC"
RECORDED_SYNC_MAX = 64


def default_target_layers(target_layers: int, taps: int) -> list[int]:
    """Lucebox's capture rule when a draft names none: evenly spaced from layer 1."""
    if taps == 1:
        return [1]
    step = (target_layers - 2) // (taps - 1)
    return [1 + k * step for k in range(taps)]


@attrs.frozen(kw_only=True)
class DraftConfig:
    architecture: str
    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float = 1e-6
    rope_theta: float = 1e6
    block_size: int = DEFAULT_BLOCK_SIZE
    target_layer_ids: tuple[int, ...] = attrs.field(converter=tuple)
    mask_token_id: int | None = None  # None: take the target's
    sliding_window: int = 0
    sliding_window_pattern: tuple[bool, ...] = attrs.field(default=(), converter=tuple)  # True: SWA layer
    vocab: int = 0
    context_length: int = 262144

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and layer < len(self.sliding_window_pattern) and self.sliding_window_pattern[layer]

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of a draft GGUF and its shape (torch order), in file order."""
        h = self.hidden
        shapes: dict[str, tuple[int, ...]] = {
            "dflash.fc.weight": (h, len(self.target_layer_ids) * h),
            "dflash.hidden_norm.weight": (h,),
        }
        for i in range(self.n_layer):
            b = f"blk.{i}."
            shapes[b + "attn_norm.weight"] = (h,)
            shapes[b + "attn_q.weight"] = (self.n_head * self.head_dim, h)
            shapes[b + "attn_k.weight"] = (self.n_head_kv * self.head_dim, h)
            shapes[b + "attn_v.weight"] = (self.n_head_kv * self.head_dim, h)
            shapes[b + "attn_output.weight"] = (h, self.n_head * self.head_dim)
            shapes[b + "attn_q_norm.weight"] = (self.head_dim,)
            shapes[b + "attn_k_norm.weight"] = (self.head_dim,)
            shapes[b + "ffn_norm.weight"] = (h,)
            shapes[b + "ffn_gate.weight"] = (self.ffn, h)
            shapes[b + "ffn_up.weight"] = (self.ffn, h)
            shapes[b + "ffn_down.weight"] = (h, self.ffn)
        shapes["output_norm.weight"] = (h,)
        return shapes


def add_metadata(writer: Any, cfg: DraftConfig) -> None:
    """Write `cfg` as the `<arch>.*` keys of a draft GGUF into a `gguf.GGUFWriter`."""
    from gguf import GGUFValueType as V

    k = f"{cfg.architecture}."
    u32 = [
        ("embedding_length", cfg.hidden), ("block_count", cfg.n_layer), ("feed_forward_length", cfg.ffn),
        ("attention.head_count", cfg.n_head), ("attention.head_count_kv", cfg.n_head_kv),
        ("attention.key_length", cfg.head_dim), ("attention.value_length", cfg.head_dim),
        ("vocab_size", cfg.vocab), ("context_length", cfg.context_length),
        ("dflash.block_size", cfg.block_size), ("dflash.n_target_layers", len(cfg.target_layer_ids)),
    ]
    for key, value in u32:
        writer.add_key_value(k + key, int(value), V.UINT32)
    writer.add_key_value(k + "attention.layer_norm_rms_epsilon", float(cfg.eps), V.FLOAT32)
    writer.add_key_value(k + "rope.freq_base", float(cfg.rope_theta), V.FLOAT32)
    writer.add_key_value(k + "dflash.target_layer_ids", [int(i) for i in cfg.target_layer_ids], V.ARRAY, V.INT32)
    if cfg.mask_token_id is not None:
        writer.add_key_value(k + "dflash.mask_token_id", int(cfg.mask_token_id), V.UINT32)
    if cfg.sliding_window:
        writer.add_key_value(k + "attention.sliding_window", int(cfg.sliding_window), V.UINT32)
        writer.add_key_value(
            k + "attention.sliding_window_pattern", [bool(b) for b in cfg.sliding_window_pattern], V.ARRAY, V.BOOL
        )


# -- per-sequence state ----------------------------------------------------------------------------


@attrs.define
class DraftState:
    """The drafter's cache of context K/V rows for one sequence: a ring indexed by position."""

    keys: list[torch.Tensor]  # per layer [capacity, kv_heads, head_dim]
    values: list[torch.Tensor]
    positions: torch.Tensor  # [capacity] long: the position each slot holds, -1 when empty
    length: int = 0  # committed positions projected so far
    block_ids: dict[int, torch.Tensor] = attrs.Factory(dict)  # per block size: [last token, MASK, ...] [B]
    step: StaticStep | None = None  # the block forward's static inputs and recordings
    # With the drafter on another device than the target's head (whose output layer it borrows): the output
    # layer's own static step there, so each device records its part (one graph records one device).
    head_step: StaticStep | None = None

    @property
    def capacity(self) -> int:
        return int(self.positions.shape[0])

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (the target rolled back)."""
        self.positions[self.positions >= length] = -1
        self.length = min(self.length, length)


# -- the drafter ------------------------------------------------------------------------------------


@attrs.define
class _Layer:
    attn_norm: torch.Tensor
    q: Any
    k: Any
    v: Any
    o: Any
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate: Any
    up: Any
    down: Any


class DFlashDrafter:
    """A loaded DFlash drafter bound to one target model (it shares the target's embedding and head)."""

    name = "dflash"
    # Record the block as two parts (layers, then the target's output layer) even on one device: what a drafter
    # on another device than the target's head always does (tests run that path on the CPU).
    split_head = False

    def __init__(self, config: DraftConfig, ops: Any, fc: Any, hidden_norm: torch.Tensor, layers: list[_Layer],
                 output_norm: torch.Tensor, *, mask_token_id: int, source: str = "",
                 context_window: int = DEFAULT_CONTEXT_WINDOW) -> None:
        self.config = config
        self.ops = ops
        self.fc = fc
        self.hidden_norm = hidden_norm
        self.layers = layers
        self.output_norm = output_norm
        self.mask_token_id = mask_token_id
        self.source = source
        self.context_window = context_window
        self.block_size = config.block_size

    def __repr__(self) -> str:
        c = self.config
        return (f"DFlashDrafter({self.source or 'in memory'}: {c.n_layer} layers, hidden {c.hidden}, block "
                f"{c.block_size}, target layers {list(c.target_layer_ids)}, mask id {self.mask_token_id})")

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"kind": self.name, "path": self.source, "architecture": c.architecture, "layers": c.n_layer,
                "block_size": self.block_size, "target_layer_ids": list(c.target_layer_ids),
                "mask_token_id": self.mask_token_id}

    # -- sequences ---------------------------------------------------------------------------------

    def prepare_target(self, target: Any, target_state: Any, ctx_size: int) -> None:
        """Make the target capture this drafter's layers for `target_state` from now on."""
        target.enable_capture(target_state, self.config.target_layer_ids, min(ctx_size, self.context_window))

    def new_state(self) -> DraftState:
        c, ops = self.config, self.ops
        capacity = self.context_window

        def buffer() -> torch.Tensor:
            return torch.zeros(capacity, c.n_head_kv, c.head_dim, device=ops.device, dtype=ops.dtype)

        return DraftState(
            keys=[buffer() for _ in self.layers], values=[buffer() for _ in self.layers],
            positions=torch.full((capacity,), -1, dtype=torch.long, device=ops.device),
        )

    # -- forward -----------------------------------------------------------------------------------

    def _context_kv(self, layer: _Layer, context: torch.Tensor, positions: torch.Tensor) -> tuple:
        c, ops = self.config, self.ops
        n = context.shape[0]
        k = ops.rms_norm(ops.linear(context, layer.k).reshape(1, n, c.n_head_kv, c.head_dim), layer.k_norm, c.eps)
        k = ops.rope_neox(k, positions, c.head_dim, c.rope_theta)
        v = ops.linear(context, layer.v).reshape(n, c.n_head_kv, c.head_dim)
        return k[0], v

    def sync(self, target: Any, target_state: Any, state: DraftState) -> None:
        """Project the features of positions committed since the last call into the context cache."""
        committed = target_state.length
        if committed < state.length:
            state.crop(committed)
        start = max(state.length, committed - state.capacity, committed - target_state.features.shape[0])
        if start >= committed:
            return
        ops = self.ops
        ring = target_state.features
        if (os.environ.get(RECORDED_SYNC_SWITCH, "1") != "0" and committed - start <= RECORDED_SYNC_MAX
                and ring.device == torch.device(ops.device)):
            self._make_steps(target, state)
            inputs = state.step.inputs(sync_start=start)
            state.step.run(("sync", committed - start, ring.data_ptr(), ring.shape[0]),
                           lambda step_inputs: self._sync_step(ring, state, step_inputs, committed - start), inputs)
            state.length = committed
            return
        # The one copy a step makes from the target's device to the drafter's (`--draft-device`).
        features = target.read_features(target_state, start, committed).to(ops.device, ops.dtype, non_blocking=True)
        self._project_context(features, state, torch.arange(start, committed, device=ops.device))
        state.length = committed

    def _project_context(self, features: torch.Tensor, state: DraftState, positions: torch.Tensor) -> None:
        """The context K/V rows of `positions` (device long) from the target's `features` of them, into the ring."""
        ops = self.ops
        context = ops.rms_norm(ops.linear(features, self.fc), self.hidden_norm, self.config.eps)
        slots = positions % state.capacity
        for i, layer in enumerate(self.layers):
            state.keys[i][slots], state.values[i][slots] = self._context_kv(layer, context, positions)
        state.positions[slots] = positions

    def _sync_step(self, ring: torch.Tensor, state: DraftState, inputs: Any, count: int) -> None:
        """`sync` of `count` positions from `inputs.sync_start` (on the device), read from the target's feature
        `ring` (on the drafter's device): a function of its static inputs and `count` alone, so it can be recorded."""
        positions = inputs.sync_start + torch.arange(count, device=ring.device)
        features = ring.index_select(0, positions % ring.shape[0]).to(self.ops.dtype)
        self._project_context(features, state, positions)

    def draft(self, target: Any, target_state: Any, state: DraftState, tokens: list[int],
              block_size: int | None = None) -> torch.Tensor:
        """Logits `[block - 1, vocab]` for the positions after `tokens[-1]` (the pending token, at position
        `target_state.length`; the tokens before it are the committed sequence, which DFlash reads through
        the target's captured features instead).

        The context sync is recorded once per count of new positions (up to RECORDED_SYNC_MAX; eager past it or
        across devices); the block's forward reads only fixed device buffers, so on a GPU it is recorded once per
        block size as a graph."""
        ops = self.ops
        block = block_size or self.block_size
        self.sync(target, target_state, state)
        ids = state.block_ids.get(block)
        if ids is None:
            ids = state.block_ids[block] = torch.full((block,), self.mask_token_id, dtype=torch.long, device=ops.device)
        ids[:1].fill_(int(tokens[-1]))
        self._make_steps(target, state)
        inputs = state.step.inputs(start=target_state.length)
        # The embedding lookup decodes GGUF rows with small host constants: eagerly, outside the recording.
        inputs.set("embedded", target.embed(ids)[None].to(ops.dtype))
        if state.head_step is None:
            return state.step.run(block, lambda step_inputs: self._draft_block(target, state, step_inputs), inputs,
                                  clone=True)
        hidden = state.step.run(block, lambda step_inputs: self._draft_layers(state, step_inputs), inputs)
        head_inputs = state.head_step.inputs(hidden=hidden)  # copied into the head's buffer, across devices too
        return state.head_step.run(block, lambda step_inputs: target.output_logits(step_inputs.hidden).float(),
                                   head_inputs, clone=True)

    def _make_steps(self, target: Any, state: DraftState) -> None:
        """The drafter's static steps, made by the first sync or draft block of a state: the block's (and the
        context sync's) on this device, and the head's on the target head's device where the two differ."""
        if state.step is not None:
            return
        state.step = StaticStep(self.ops, "draft block")
        head = torch.device(getattr(target, "feature_device", None) or target.ops.device)
        if self.split_head or head != torch.device(self.ops.device):
            # A graph records one device: the layers here, the borrowed output layer on its own device.
            state.head_step = StaticStep(getattr(target, "head_ops", target.ops), "draft head")

    def _draft_block(self, target: Any, state: DraftState, inputs: Any) -> torch.Tensor:
        """The block's forward as a function of its static inputs and the block size alone."""
        return target.output_logits(self._draft_layers(state, inputs)).float()

    def _draft_layers(self, state: DraftState, inputs: Any) -> torch.Tensor:
        """The block's layers and final norm: the hidden states `[block - 1, hidden]` the output layer reads."""
        c, ops = self.config, self.ops
        block = inputs.embedded.shape[1]
        x = inputs.embedded  # [1, B, hidden]
        positions = inputs.start + torch.arange(block, device=ops.device)
        valid = state.positions >= 0
        causal = torch.ones(block, block, dtype=torch.bool, device=ops.device).tril()
        for i, layer in enumerate(self.layers):
            h = ops.rms_norm(x, layer.attn_norm, c.eps)
            q = ops.linear(h, layer.q).reshape(1, block, c.n_head, c.head_dim)
            k = ops.linear(h, layer.k).reshape(1, block, c.n_head_kv, c.head_dim)
            v = ops.linear(h, layer.v).reshape(1, block, c.n_head_kv, c.head_dim)
            q, k = ops.qk_norm_rope(q, k, layer.q_norm, layer.k_norm, positions, c.head_dim, c.rope_theta, c.eps)
            if c.is_sliding(i):
                context_mask = valid & (state.positions >= inputs.start - c.sliding_window)
                block_mask = causal
            else:
                context_mask, block_mask = valid, torch.ones_like(causal)
            mask = torch.cat([context_mask[None].expand(block, -1), block_mask], dim=1)
            keys = torch.cat([state.keys[i], k[0]])[None]
            values = torch.cat([state.values[i], v[0]])[None]
            out = ops.attention(q, keys, values, scale=c.head_dim**-0.5, mask=mask)
            x_normed, x = ops.add_rms_norm(ops.linear(out.reshape(1, block, -1), layer.o), x, layer.ffn_norm, c.eps)
            x = x + ops.linear(ops.silu_mul(ops.linear(x_normed, layer.gate), ops.linear(x_normed, layer.up)),
                               layer.down)
        return ops.rms_norm(x[0, 1:], self.output_norm, c.eps)


# -- loading ----------------------------------------------------------------------------------------


def _config_from_gguf(gguf_file: Any, target: Any) -> DraftConfig:
    path = gguf_file.path
    arch = gguf_file.architecture
    if not str(arch).endswith(ARCHITECTURE_SUFFIX):
        raise GGUFError(f"{path}: general.architecture is {arch!r}; a DFlash draft's ends in {ARCHITECTURE_SUFFIX!r}")

    def shape(name: str) -> tuple[int, ...]:
        info = gguf_file.tensors.get(name)
        if info is None:
            raise GGUFError(f"{path}: missing tensor {name!r} (not a DFlash draft?)")
        return tuple(info.shape)

    hidden = shape("output_norm.weight")[0]
    fc_out, fc_in = shape("dflash.fc.weight")
    if fc_out != hidden or fc_in % hidden:
        raise GGUFError(f"{path}: tensor 'dflash.fc.weight' has shape {(fc_out, fc_in)}; expected ({hidden}, N x {hidden})")
    taps = fc_in // hidden
    head_dim = shape("blk.0.attn_q_norm.weight")[0]
    n_layer = int(gguf_file.arch_get("block_count", int))
    ids_key = f"{arch}.dflash.target_layer_ids"
    ids = gguf_file.get(ids_key, list, default=None)
    if ids is None or len(ids) != taps:
        ids = default_target_layers(len(target.layers), taps)
    bad = [i for i in ids if not 0 <= int(i) < len(target.layers)]
    if bad:
        raise GGUFError(f"{path}: metadata key {ids_key!r} names layers {bad}; the target has {len(target.layers)}")
    if hidden != target.hidden_size:
        raise GGUFError(f"{path}: tensor 'output_norm.weight': the draft's hidden size {hidden} does not match the "
                        f"target's {target.hidden_size}")
    window = int(gguf_file.arch_get("attention.sliding_window", int, default=0))
    pattern = gguf_file.arch_get("attention.sliding_window_pattern", list, default=None)
    if window and pattern is None:
        pattern = [True] * (n_layer - 1) + [False]  # Lucebox's [T, T, T, T, F]
    return DraftConfig(
        architecture=arch, n_layer=n_layer, hidden=hidden, ffn=shape("blk.0.ffn_gate.weight")[0],
        n_head=shape("blk.0.attn_q.weight")[0] // head_dim, n_head_kv=shape("blk.0.attn_k.weight")[0] // head_dim,
        head_dim=head_dim, eps=float(gguf_file.arch_get("attention.layer_norm_rms_epsilon", float, default=1e-6)),
        rope_theta=float(gguf_file.arch_get("rope.freq_base", float, default=1e6)),
        block_size=int(gguf_file.arch_get("dflash.block_size", int, default=DEFAULT_BLOCK_SIZE)),
        target_layer_ids=[int(i) for i in ids],
        mask_token_id=gguf_file.arch_get("dflash.mask_token_id", int, default=None),
        sliding_window=window, sliding_window_pattern=[bool(b) for b in (pattern or [])],
        vocab=int(gguf_file.arch_get("vocab_size", int, default=0)),
    )


def load(path: str | os.PathLike | Any, target: Any, backend: Any = None, *,
         context_window: int = DEFAULT_CONTEXT_WINDOW) -> DFlashDrafter:
    """Load a DFlash draft GGUF for `target` (a model with `embed`, `output_logits`, `enable_capture`,
    `hidden_size`, `layers`, `vocab_size` and `draft_mask_token_id`)."""
    from ..ggufio import GGUFFile

    gguf_file = path if hasattr(path, "tensors") else GGUFFile(path)
    ops = backend if backend is not None else target.ops
    cfg = _config_from_gguf(gguf_file, target)
    shapes = cfg.tensor_shapes()

    def tensor(name: str, fallback: str | None = None) -> Any:
        stored = fallback if fallback and name not in gguf_file.tensors and fallback in gguf_file.tensors else name
        return gguf_file.tensor(stored, shapes[name])

    def vector(name: str, fallback: str | None = None) -> torch.Tensor:
        return tensor(name, fallback).dequantize(ops.dtype, ops.device)

    layers = []
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        layers.append(_Layer(
            attn_norm=vector(b + "attn_norm.weight"), q=tensor(b + "attn_q.weight"), k=tensor(b + "attn_k.weight"),
            v=tensor(b + "attn_v.weight"), o=tensor(b + "attn_output.weight"),
            q_norm=vector(b + "attn_q_norm.weight"), k_norm=vector(b + "attn_k_norm.weight"),
            ffn_norm=vector(b + "ffn_norm.weight", fallback=b + "post_attention_norm.weight"),
            gate=tensor(b + "ffn_gate.weight"), up=tensor(b + "ffn_up.weight"), down=tensor(b + "ffn_down.weight"),
        ))
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else target.draft_mask_token_id
    if not 0 <= mask_id < target.vocab_size:
        key = f"{cfg.architecture}.dflash.mask_token_id"
        raise GGUFError(f"{gguf_file.path}: mask token id {mask_id} (metadata key {key!r} or the target's default) "
                        f"is outside the target's vocabulary of {target.vocab_size}")
    return DFlashDrafter(
        cfg, ops, tensor("dflash.fc.weight"), vector("dflash.hidden_norm.weight"), layers,
        vector("output_norm.weight"), mask_token_id=mask_id, source=str(gguf_file.path),
        context_window=context_window,
    )


# -- z-lab safetensors -> draft GGUF ----------------------------------------------------------------

_HF_NAMES = {
    "fc.weight": "dflash.fc.weight",
    "hidden_norm.weight": "dflash.hidden_norm.weight",
    "norm.weight": "output_norm.weight",
}
_HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str | None:
    """The draft-GGUF name of a z-lab checkpoint tensor (None for tensors a draft GGUF does not keep)."""
    name = hf_name.removeprefix("model.")
    if name in _HF_NAMES:
        return _HF_NAMES[name]
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        module = rest.removesuffix(".weight")
        if module in _HF_LAYER_NAMES and rest.endswith(".weight"):
            return f"blk.{index}.{_HF_LAYER_NAMES[module]}.weight"
    return None


def config_from_hf(config: dict[str, Any], source: str, architecture: str = "dflash-draft") -> DraftConfig:
    def need(key: str) -> Any:
        if key not in config:
            raise LuceboxError(f"{source}: missing key {key!r}")
        return config[key]

    dflash = config.get("dflash_config") or {}
    n_layer = int(need("num_hidden_layers"))
    hidden = int(need("hidden_size"))
    n_head = int(need("num_attention_heads"))
    ids = dflash.get("target_layer_ids") or config.get("target_layer_ids")
    if ids is None:
        taps = int(config.get("num_target_features", 5 * hidden)) // hidden
        ids = default_target_layers(int(config.get("num_target_layers", 64)), taps)
    layer_types = config.get("layer_types") or []
    pattern = [t == "sliding_attention" for t in layer_types]
    rope = config.get("rope_parameters") or {}
    return DraftConfig(
        architecture=architecture, n_layer=n_layer, hidden=hidden, ffn=int(need("intermediate_size")),
        n_head=n_head, n_head_kv=int(config.get("num_key_value_heads", n_head)),
        head_dim=int(config.get("head_dim") or hidden // n_head), eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1e6))),
        block_size=int(config.get("block_size", dflash.get("block_size", DEFAULT_BLOCK_SIZE))),
        target_layer_ids=[int(i) for i in ids],
        mask_token_id=dflash.get("mask_token_id", config.get("mask_token_id")),
        sliding_window=int(config.get("sliding_window") or 0) if any(pattern) else 0,
        sliding_window_pattern=pattern if any(pattern) else (),
        vocab=int(config.get("vocab_size", 0)), context_length=int(config.get("max_position_embeddings", 262144)),
    )


def convert_zlab(hf_dir: str | os.PathLike, path: str | os.PathLike, *, type: str = "f16",
                 architecture: str = "dflash-draft") -> Path:
    """Convert a z-lab DFlash checkpoint folder (config.json + *.safetensors) to a draft GGUF.

    Norms stay F32; matrices become `type` (f32, f16, bf16 or q8_0). The whole model passes through
    memory once (a 27B drafter is ~3.5 GB in BF16)."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter, quants
    from safetensors import safe_open

    hf_dir, path = Path(hf_dir), Path(path)
    types = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}
    if type not in types:
        raise LuceboxError(f"--type {type!r} is not one of {', '.join(types)} for a DFlash draft")
    config_path = hf_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LuceboxError(f"{config_path}: cannot read: {exc}") from None
    cfg = config_from_hf(config, str(config_path), architecture)
    expected = cfg.tensor_shapes()
    found: dict[str, np.ndarray] = {}
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise LuceboxError(f"{hf_dir}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                name = gguf_name(key)
                if name is None:
                    continue
                if name not in expected:
                    raise LuceboxError(f"{file}: tensor {key!r} ({name}) does not belong to a {cfg.n_layer}-layer draft")
                value = f.get_tensor(key).float()
                if tuple(value.shape) != expected[name]:
                    raise LuceboxError(f"{file}: tensor {key!r} has shape {tuple(value.shape)}, expected {expected[name]}")
                found[name] = value.numpy()
    missing = [n for n in expected if n not in found]
    if missing:
        raise LuceboxError(f"{hf_dir}: the checkpoint lacks {', '.join(missing[:5])}")

    writer = GGUFWriter(str(path), architecture)
    writer.add_name(f"DFlash draft ({hf_dir.name})")
    add_metadata(writer, cfg)
    for name in expected:
        value = found[name]
        ggml_type = T.F32 if value.ndim == 1 else types[type]
        if ggml_type == T.Q8_0 and value.shape[-1] % 32:
            ggml_type = T.F16
        if ggml_type == T.F32:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
        elif ggml_type == T.F16:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float16))
        else:
            data = quants.quantize(np.ascontiguousarray(value, dtype=np.float32), ggml_type)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
