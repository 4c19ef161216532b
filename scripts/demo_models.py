"""Differentiable torch twins of what Lucebox runs: a qwen35 target and a DFlash drafter for it, in the GGUF's
own conventions, so that export is a renaming and the file computes what was trained.

The target (`Qwen35Trainable`) is `lucebox_qwen35.model` for a batch of sequences: Gated DeltaNet layers
(short causal convolution, the chunked gated delta rule of `lucebox_qwen35.ops`, which is differentiable, and
its one-token recurrence for generation) and gated attention layers (q/k RMSNorm, partial NeoX RoPE, sigmoid
output gate) in Qwen3.5's pattern, SwiGLU MLPs, tied embeddings. Conventions are the GGUF's, not
transformers': norm weights are the multipliers themselves (the file's "+1" form, initialised to 1), GDN value
head `h` reads key head `h % key_heads` (the tiled order), and `A_log` is exported as `ssm_a = -exp(A_log)`.

The drafter (`DFlashTrainable`) is `lucebox_core.speculative.dflash` for many blocks at once: for each anchor
position `a` of a sequence, the block `[token a, MASK x 15]` at positions `a .. a + 15` attends to the
context rows (the fused target features of positions `< a`, projected by every layer's k/v) and to its own
block, both ways. It reads the target's embedding and output head, frozen.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lucebox_core.speculative.dflash import DraftConfig
from lucebox_qwen35.layout import Qwen35Config
from lucebox_qwen35.ops import gated_delta_rule_chunked, gated_delta_rule_recurrent

INIT_STD = 0.02


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As the backends compute it: in fp32, times the weight, back to the input's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def rope_neox(x: torch.Tensor, positions: torch.Tensor, rot_dim: int, theta: float) -> torch.Tensor:
    """NeoX rotary embedding of the first `rot_dim` dims of each head: x `[B, T, H, D]`, positions `[T]` or
    `[B, T]`."""
    half = rot_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) * 2 / rot_dim))
    angles = positions.to(device=x.device, dtype=torch.float32)[..., None] * inv_freq
    if angles.dim() == 2:
        angles = angles[None]
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    x32 = x.float()
    first, second, rest = x32[..., :half], x32[..., half:rot_dim], x32[..., rot_dim:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1).to(x.dtype)


def _linear(rows: int, cols: int, std: float = INIT_STD) -> nn.Linear:
    layer = nn.Linear(cols, rows, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """KV heads `[B, Hkv, T, D]` for `group` query heads each, consecutive (query head h reads h // group)."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


@attrs.frozen
class OutputVocabulary:
    """The tokens the corpus uses, and the softmax over them that equals the full vocabulary's.

    The real vocabulary has 248,320 entries; the stdlib corpus uses a small fraction. The embedding rows of the
    others start at zero and, never an input and never in a training softmax, stay there (AdamW moves no
    parameter whose gradient is zero), so their logits are exactly 0. Their `unused` terms of the partition
    function are then one column of value log(unused): the cross-entropy over `[used rows, that column]` is the
    full vocabulary's, at a fraction of its cost. The file stores the zero rows, so it computes what was trained."""

    ids: torch.Tensor  # [U] long, sorted: the used token ids
    index_of: torch.Tensor  # [vocab] long: position of a token among `ids`, -1 where unused
    unused_logit: float  # log(vocab - U): the unused tokens' share of the partition function

    @classmethod
    def of(cls, used: torch.Tensor, vocab: int) -> OutputVocabulary:
        ids = torch.unique(used.long())
        if ids.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab})")
        index_of = torch.full((vocab,), -1, dtype=torch.long, device=ids.device)
        index_of[ids] = torch.arange(ids.numel(), device=ids.device)
        unused = vocab - ids.numel()
        return cls(ids, index_of, math.log(unused) if unused else float("-inf"))

    def zero_unused_rows_(self, embedding: torch.Tensor) -> None:
        keep = torch.zeros(embedding.shape[0], dtype=torch.bool, device=embedding.device)
        keep[self.ids.to(embedding.device)] = True
        with torch.no_grad():
            embedding[~keep] = 0


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          token_weights: torch.Tensor | None = None, chunk: int = 4096,
                          vocabulary: OutputVocabulary | None = None,
                          skip_outside: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of `hidden @ weight.T` against `labels` without holding the logits of every row: each
    chunk's logits are recomputed in the backward pass. With `vocabulary`, only its used rows of `weight` are
    multiplied and the unused ones enter as one column (exact while their rows are zero); every label must be
    a used token, or with `skip_outside` the others weigh nothing (a drafter's label is the target's greedy
    token, which can, rarely, be an unused one). Returns (weighted sum of losses, sum of weights)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    token_weights = torch.ones_like(labels, dtype=torch.float32) if token_weights is None else token_weights.reshape(-1)
    unused_logit = None
    if vocabulary is not None:
        weight = weight[vocabulary.ids.to(weight.device)]
        labels = vocabulary.index_of.to(labels.device)[labels]
        outside = labels < 0
        if skip_outside:
            token_weights = token_weights * (~outside)
            labels = labels.clamp(min=0)
        elif bool(outside.any()):
            raise ValueError("a label is outside the output vocabulary (a token the corpus does not use)")
        unused_logit = vocabulary.unused_logit

    def part(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, w).float()
        if unused_logit is not None and math.isfinite(unused_logit):
            logits = torch.cat([logits, logits.new_full((logits.shape[0], 1), unused_logit)], dim=1)
        return (F.cross_entropy(logits, y, reduction="none") * tw).sum()

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, labels.shape[0], chunk):
        rows = slice(start, start + chunk)
        args = (hidden[rows], weight, labels[rows], token_weights[rows])
        total = total + (checkpoint(part, *args, use_reentrant=False) if torch.is_grad_enabled() else part(*args))
    return total, token_weights.sum()


# -- the target ---------------------------------------------------------------------------------------


class GatedDeltaNet(nn.Module):
    def __init__(self, c: Qwen35Config, generator: torch.Generator) -> None:
        super().__init__()
        self.c = c
        hidden, heads = c.hidden, c.ssm_dt_rank
        self.in_proj_qkv = _linear(c.gdn_conv_dim, hidden)
        self.in_proj_z = _linear(c.ssm_d_inner, hidden)
        self.in_proj_b = _linear(heads, hidden)
        self.in_proj_a = _linear(heads, hidden)
        bound = 1 / math.sqrt(c.ssm_d_conv)  # torch's Conv1d default for a depthwise kernel
        self.conv1d = nn.Parameter(torch.empty(c.gdn_conv_dim, c.ssm_d_conv).uniform_(-bound, bound, generator=generator))
        # Qwen3.5's initial ranges: A in [1, 16], dt in [1e-3, 0.1] (log-uniform), dt_bias = softplus^-1(dt).
        self.A_log = nn.Parameter(torch.empty(heads).uniform_(0, math.log(16), generator=generator))
        dt = torch.exp(torch.empty(heads).uniform_(math.log(1e-3), math.log(0.1), generator=generator))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.norm = nn.Parameter(torch.ones(c.ssm_d_state))
        self.out_proj = _linear(hidden, c.ssm_d_inner)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        """x `[B, T, hidden]`; `state` (generation): {"conv", "recurrent"}, continued and updated."""
        c = self.c
        batch, tokens, _ = x.shape
        mixed = self.in_proj_qkv(x)
        kernel = c.ssm_d_conv
        previous = mixed.new_zeros(batch, kernel - 1, mixed.shape[-1]) if state is None else state["conv"].to(mixed.dtype)
        window = torch.cat([previous, mixed], dim=1)
        conv = F.conv1d(window.transpose(1, 2), self.conv1d.to(mixed.dtype)[:, None], groups=mixed.shape[-1])
        conv = F.silu(conv.transpose(1, 2))
        key_dim = c.gdn_key_dim
        q, k, v = conv.split([key_dim, key_dim, c.ssm_d_inner], dim=-1)
        q = l2norm(q.reshape(batch, tokens, c.ssm_n_group, c.ssm_d_state))
        k = l2norm(k.reshape(batch, tokens, c.ssm_n_group, c.ssm_d_state))
        v = v.reshape(batch, tokens, c.ssm_dt_rank, c.ssm_d_state)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        initial = None if state is None else state["recurrent"]
        # The rule in fp32 whatever the autocast: its state accumulates over the whole sequence.
        with torch.autocast(x.device.type, enabled=False):
            q, k, v = q.float(), k.float(), v.float()
            if tokens == 1 and initial is not None:
                core, final = gated_delta_rule_recurrent(None, q, k, v, g, beta, initial)
            else:
                core, final = gated_delta_rule_chunked(None, q, k, v, g, beta, initial, chunk_size=64)
        if state is not None:
            state["conv"], state["recurrent"] = window[:, -(kernel - 1):].detach(), final.detach()
        z = self.in_proj_z(x).reshape(batch, tokens, c.ssm_dt_rank, c.ssm_d_state)
        core = rms_norm(core.to(z.dtype), self.norm, c.eps) * F.silu(z)
        return self.out_proj(core.reshape(batch, tokens, -1))


class GatedAttention(nn.Module):
    def __init__(self, c: Qwen35Config) -> None:
        super().__init__()
        self.c = c
        self.q_proj = _linear(2 * c.n_head * c.head_dim, c.hidden)  # per head [query | gate]
        self.k_proj = _linear(c.n_head_kv * c.head_dim, c.hidden)
        self.v_proj = _linear(c.n_head_kv * c.head_dim, c.hidden)
        self.o_proj = _linear(c.hidden, c.n_head * c.head_dim)
        self.q_norm = nn.Parameter(torch.ones(c.head_dim))
        self.k_norm = nn.Parameter(torch.ones(c.head_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        """`cache` (generation): {"k", "v"} `[B, T, Hkv, D]` of the positions before; extended."""
        c = self.c
        batch, tokens, _ = x.shape
        query_gate = self.q_proj(x).reshape(batch, tokens, c.n_head, 2 * c.head_dim)
        query, gate = query_gate[..., : c.head_dim], query_gate[..., c.head_dim:]
        key = self.k_proj(x).reshape(batch, tokens, c.n_head_kv, c.head_dim)
        value = self.v_proj(x).reshape(batch, tokens, c.n_head_kv, c.head_dim)
        query = rope_neox(rms_norm(query, self.q_norm, c.eps), positions, c.rope_dim, c.rope_theta)
        key = rope_neox(rms_norm(key, self.k_norm, c.eps), positions, c.rope_dim, c.rope_theta)
        causal = True
        if cache is not None:
            if "k" in cache:
                if tokens != 1:
                    raise ValueError("a cached attention layer takes one token at a time")
                key, value = torch.cat([cache["k"], key], dim=1), torch.cat([cache["v"], value], dim=1)
                causal = False  # the one new query sees every cached key
            cache["k"], cache["v"] = key.detach(), value.detach()
        group = c.n_head // c.n_head_kv
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), _repeat_kv(key.transpose(1, 2).to(query.dtype), group),
            _repeat_kv(value.transpose(1, 2).to(query.dtype), group), is_causal=causal, scale=c.head_dim**-0.5)
        out = out.transpose(1, 2) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(batch, tokens, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, out_std: float) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(ffn, hidden), _linear(ffn, hidden)
        self.down_proj = _linear(hidden, ffn, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen35Config, index: int, generator: torch.Generator, dropout: float = 0.0) -> None:
        super().__init__()
        self.index, self.eps = index, c.eps
        self.dropout = nn.Dropout(dropout)  # training only: `eval()` turns it off, and the file has no trace of it
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden))
        out_std = INIT_STD / math.sqrt(2 * c.n_layer)  # residual branches scaled by depth (GPT-2's rule)
        if c.is_recurrent(index):
            self.linear_attn, self.self_attn = GatedDeltaNet(c, generator), None
            nn.init.normal_(self.linear_attn.out_proj.weight, std=out_std)
        else:
            self.linear_attn, self.self_attn = None, GatedAttention(c)
            nn.init.normal_(self.self_attn.o_proj.weight, std=out_std)
        self.mlp = MLP(c.hidden, c.ffn, out_std)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: dict | None) -> torch.Tensor:
        x = rms_norm(h, self.input_layernorm, self.eps)
        if self.linear_attn is not None:
            h = h + self.dropout(self.linear_attn(x, cache))
        else:
            h = h + self.dropout(self.self_attn(x, positions, cache))
        return h + self.dropout(self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps)))


class Qwen35Trainable(nn.Module):
    def __init__(self, config: Qwen35Config, seed: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        if not config.tied_output:
            raise ValueError("the demo target ties its output head to the embedding")
        self.config = config
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        nn.init.normal_(self.embed_tokens.weight, std=INIT_STD)
        self.layers = nn.ModuleList(DecoderLayer(config, i, generator, dropout) for i in range(config.n_layer))
        self.norm = nn.Parameter(torch.ones(config.hidden))
        self.vocabulary: OutputVocabulary | None = None

    def hidden_states(self, ids: torch.Tensor, *, start: int = 0, caches: list | None = None,
                      capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states `[B, T, hidden]` of `ids` `[B, T]` at positions `start ..`, and the
        outputs of the `capture` layers (in that order). `caches`: one dict per layer, for generation."""
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        h = self.embed_tokens(ids)
        taps = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, None if caches is None else caches[i])
            if i in capture:
                taps[i] = h
        return rms_norm(h, self.norm, self.config.eps), [taps[i] for i in capture]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embed_tokens.weight)

    def use_vocabulary(self, vocabulary: OutputVocabulary | None) -> None:
        """Train the output softmax over `vocabulary` only (its unused embedding rows zeroed here, for good)."""
        self.vocabulary = vocabulary
        if vocabulary is not None:
            vocabulary.zero_unused_rows_(self.embed_tokens.weight)

    def loss(self, ids: torch.Tensor, labels: torch.Tensor, *, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed next-token loss, token count). `exact`: over the whole vocabulary, whatever the labels (the
        held-out measure: a held-out file may use a token the training files never do)."""
        hidden, _ = self.hidden_states(ids)
        vocabulary = None if exact else self.vocabulary
        return chunked_cross_entropy(hidden, self.embed_tokens.weight, labels, vocabulary=vocabulary)

    @torch.no_grad()
    def generate_greedy(self, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuations `[B, new_tokens]` of equal-length prompts `[B, P]`, with per-layer caches (the
        GDN state and the attention K/V), one token per step after the prompt."""
        caches: list[dict] = [{} for _ in self.layers]
        for layer, cache in zip(self.layers, caches):
            if layer.linear_attn is not None:
                c = self.config
                cache["conv"] = prompts.new_zeros(prompts.shape[0], c.ssm_d_conv - 1, c.gdn_conv_dim, dtype=torch.float32)
                cache["recurrent"] = None
        hidden, _ = self.hidden_states(prompts, caches=caches)
        token = self.logits(hidden[:, -1]).argmax(-1)
        out = [token]
        for step in range(1, new_tokens):
            hidden, _ = self.hidden_states(token[:, None], start=prompts.shape[1] + step - 1, caches=caches)
            token = self.logits(hidden[:, -1]).argmax(-1)
            out.append(token)
        return torch.stack(out, dim=1)

    def gguf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(GGUF name, fp32 tensor as the file stores it), in `layout.tensor_shapes` order."""
        yield "token_embd.weight", self.embed_tokens.weight
        for i, layer in enumerate(self.layers):
            b = f"blk.{i}."
            yield b + "attn_norm.weight", layer.input_layernorm
            if layer.linear_attn is not None:
                g = layer.linear_attn
                yield from ((b + "attn_qkv.weight", g.in_proj_qkv.weight), (b + "attn_gate.weight", g.in_proj_z.weight),
                            (b + "ssm_conv1d.weight", g.conv1d), (b + "ssm_dt.bias", g.dt_bias),
                            (b + "ssm_a", -g.A_log.exp()), (b + "ssm_beta.weight", g.in_proj_b.weight),
                            (b + "ssm_alpha.weight", g.in_proj_a.weight), (b + "ssm_norm.weight", g.norm),
                            (b + "ssm_out.weight", g.out_proj.weight))
            else:
                a = layer.self_attn
                yield from ((b + "attn_q.weight", a.q_proj.weight), (b + "attn_k.weight", a.k_proj.weight),
                            (b + "attn_v.weight", a.v_proj.weight), (b + "attn_output.weight", a.o_proj.weight),
                            (b + "attn_q_norm.weight", a.q_norm), (b + "attn_k_norm.weight", a.k_norm))
            yield b + "post_attention_norm.weight", layer.post_attention_layernorm
            yield from ((b + "ffn_gate.weight", layer.mlp.gate_proj.weight), (b + "ffn_up.weight", layer.mlp.up_proj.weight),
                        (b + "ffn_down.weight", layer.mlp.down_proj.weight))
        yield "output_norm.weight", self.norm


# -- the drafter --------------------------------------------------------------------------------------


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig, out_std: float) -> None:
        super().__init__()
        self.attn_norm = nn.Parameter(torch.ones(c.hidden))
        self.q = _linear(c.n_head * c.head_dim, c.hidden)
        self.k = _linear(c.n_head_kv * c.head_dim, c.hidden)
        self.v = _linear(c.n_head_kv * c.head_dim, c.hidden)
        self.o = _linear(c.hidden, c.n_head * c.head_dim, out_std)
        self.q_norm = nn.Parameter(torch.ones(c.head_dim))
        self.k_norm = nn.Parameter(torch.ones(c.head_dim))
        self.ffn_norm = nn.Parameter(torch.ones(c.hidden))
        self.mlp = MLP(c.hidden, c.ffn, out_std)


class DFlashTrainable(nn.Module):
    def __init__(self, config: DraftConfig, seed: int) -> None:
        super().__init__()
        if config.sliding_window:
            raise ValueError("the demo drafter's layers are all full (non-causal) attention")
        self.config = config
        torch.manual_seed(seed)
        taps = len(config.target_layer_ids)
        self.fc = _linear(config.hidden, taps * config.hidden)
        self.hidden_norm = nn.Parameter(torch.ones(config.hidden))
        out_std = INIT_STD / math.sqrt(2 * config.n_layer)
        self.layers = nn.ModuleList(DraftLayer(config, out_std) for _ in range(config.n_layer))
        self.output_norm = nn.Parameter(torch.ones(config.hidden))

    def block_hidden(self, features: torch.Tensor, block_embeddings: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The drafter's normed output `[B, N, S, hidden]` for N blocks per sequence.

        features `[B, T, taps * hidden]`: the target's captured layers at positions `0 .. T-1`;
        block_embeddings `[B, N, S, hidden]`: the target's embeddings of `[token at anchor, MASK, ...]`;
        anchors `[B, N]`: each block's first position. Block n sees the context positions `< anchors[n]`
        and its own S rows (all of them: the drafter's attention is not causal)."""
        c = self.config
        batch, context_len, _ = features.shape
        _, blocks, size, hidden = block_embeddings.shape
        device = features.device
        context = rms_norm(self.fc(features), self.hidden_norm, c.eps)
        context_positions = torch.arange(context_len, device=device)
        block_positions = (anchors[:, :, None] + torch.arange(size, device=device)).reshape(batch, blocks * size)
        block_of_query = torch.arange(blocks * size, device=device) // size
        sees_context = context_positions[None, None, :] < anchors.repeat_interleave(size, dim=1)[:, :, None]
        sees_block = (block_of_query[:, None] == block_of_query[None, :]).expand(batch, -1, -1)
        mask = torch.cat([sees_context, sees_block], dim=2)[:, None]  # [B, 1, N*S, T + N*S]
        group = c.n_head // c.n_head_kv
        x = block_embeddings.reshape(batch, blocks * size, hidden)
        for layer in self.layers:
            h = rms_norm(x, layer.attn_norm, c.eps)
            q = layer.q(h).reshape(batch, blocks * size, c.n_head, c.head_dim)
            q = rope_neox(rms_norm(q, layer.q_norm, c.eps), block_positions, c.head_dim, c.rope_theta)
            k_block = layer.k(h).reshape(batch, blocks * size, c.n_head_kv, c.head_dim)
            k_block = rope_neox(rms_norm(k_block, layer.k_norm, c.eps), block_positions, c.head_dim, c.rope_theta)
            k_context = layer.k(context).reshape(batch, context_len, c.n_head_kv, c.head_dim)
            k_context = rope_neox(rms_norm(k_context, layer.k_norm, c.eps), context_positions, c.head_dim, c.rope_theta)
            v_block = layer.v(h).reshape(batch, blocks * size, c.n_head_kv, c.head_dim)
            v_context = layer.v(context).reshape(batch, context_len, c.n_head_kv, c.head_dim)
            keys = torch.cat([k_context, k_block], dim=1).transpose(1, 2).to(q.dtype)
            values = torch.cat([v_context, v_block], dim=1).transpose(1, 2).to(q.dtype)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), _repeat_kv(keys, group), _repeat_kv(values, group),
                                                 attn_mask=mask, scale=c.head_dim**-0.5)
            x = x + layer.o(out.transpose(1, 2).reshape(batch, blocks * size, -1))
            x = x + layer.mlp(rms_norm(x, layer.ffn_norm, c.eps))
        return rms_norm(x, self.output_norm, c.eps).reshape(batch, blocks, size, hidden)

    def gguf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(GGUF name, fp32 tensor), in `DraftConfig.tensor_shapes` order."""
        yield "dflash.fc.weight", self.fc.weight
        yield "dflash.hidden_norm.weight", self.hidden_norm
        for i, layer in enumerate(self.layers):
            b = f"blk.{i}."
            yield from ((b + "attn_norm.weight", layer.attn_norm), (b + "attn_q.weight", layer.q.weight),
                        (b + "attn_k.weight", layer.k.weight), (b + "attn_v.weight", layer.v.weight),
                        (b + "attn_output.weight", layer.o.weight), (b + "attn_q_norm.weight", layer.q_norm),
                        (b + "attn_k_norm.weight", layer.k_norm), (b + "ffn_norm.weight", layer.ffn_norm),
                        (b + "ffn_gate.weight", layer.mlp.gate_proj.weight), (b + "ffn_up.weight", layer.mlp.up_proj.weight),
                        (b + "ffn_down.weight", layer.mlp.down_proj.weight))
        yield "output_norm.weight", self.output_norm


def block_weights(size: int, gamma: float, device: Any = None) -> torch.Tensor:
    """DFlash's loss weights over a block's drafted positions 1 .. size-1: exp(-(k - 1) / gamma), so the
    first drafts, which decide most of the accepted length, weigh most."""
    k = torch.arange(1, size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)
