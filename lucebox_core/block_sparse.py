"""Block-sparse causal prefill attention (FlashPrefill's selection), the torch reference.

A long prompt's attention (PFlash's scorer at 32K-128K tokens) is mostly spent on key blocks that barely
matter to a query block. The sequence is cut into blocks of `block` tokens; for each query head, query
block m keeps key block n (n <= m, causal) when any of these holds:

- n < `sink`: the first blocks (attention sinks);
- m - n < `window`: the local window (the diagonal block, m - n = 0, is always kept);
- m is one of the last `last_full` query blocks: those rows (the prompt's question) see everything;
- the block's score is at least `alpha` times the best score of the row.

The block score, per (query head h, query block m, key block n), is formed as follows (our choice, stated
once here and used by the Triton path too): the mean of key block n's valid rows (K of the head's KV head),
`mean_k[n]`; the block logit is the largest, over query block m's valid rows i, of `q_i . mean_k[n] * scale`
(`scale` the attention's, 1/sqrt(d) by default): a block is as important as the query row that wants it
most, so one row that needs a distant block keeps it. The scores of a row are the softmax of its logits
over the causal blocks n <= m: non-negative, so `alpha = 0` keeps every causal block, and
`score >= alpha * max` is `logit >= max_logit + log(alpha)` (the test is on the scores as stated).

Attention itself then runs over exactly the kept blocks, with the causal rule inside the diagonal block
and the last block cut at the sequence's end. The reference walks the query blocks one at a time, so its
memory is O(S * block), never O(S^2). Shapes are one sequence: q `[T, Hq, D]`, k `[T, Hkv, D]`,
v `[T, Hkv, Dv]`, query head h reading KV head h // (Hq / Hkv) (as `TorchBackend.attention`).
"""

from __future__ import annotations

import attrs
import torch

# Elements of one [heads, rows, blocks] logit slab the selection materialises at a time (64 MiB of fp32).
_LOGIT_SLAB = 1 << 24


def _power_of_two(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"block_sparse: {attribute.name} must be a power of two, not {value!r}")


def _at_least(low: int) -> object:
    def check(instance: object, attribute: attrs.Attribute, value: int) -> None:
        if not isinstance(value, int) or value < low:
            raise ValueError(f"block_sparse: {attribute.name} must be an integer >= {low}, not {value!r}")
    return check


def _alpha_range(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"block_sparse: alpha must be a number in [0, 1], not {value!r}")


@attrs.frozen(kw_only=True)
class BlockSparseConfig:
    """FlashPrefill's selection parameters (Lucebox's defaults; PFlash's server runs alpha 0.85)."""

    block: int = attrs.field(default=128, validator=_power_of_two)  # tokens per block
    sink: int = attrs.field(default=2, validator=_at_least(0))  # first key blocks every query block keeps
    window: int = attrs.field(default=4, validator=_at_least(1))  # keep n when m - n < window (1: diagonal only)
    last_full: int = attrs.field(default=2, validator=_at_least(0))  # last query blocks that see every block
    alpha: float = attrs.field(default=0.12, validator=_alpha_range)  # keep score >= alpha * row max


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """A ValueError naming what is wrong unless q `[T, Hq, D]`, k `[T, Hkv, D]`, v `[T, Hkv, Dv]` fit."""
    tensors = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    for name, tensor in tensors.items():
        if tensor.dim() != 3:
            raise ValueError(f"block_sparse: {name} must be [tokens, heads, dim], not shape {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            raise ValueError(f"block_sparse: {name} must be a float tensor, not {tensor.dtype}")
    if q.shape[0] == 0:
        raise ValueError("block_sparse: q has no tokens")
    if k.shape[0] != q.shape[0] or (v is not None and v.shape[0] != q.shape[0]):
        lengths = f"q {q.shape[0]}, k {k.shape[0]}" + ("" if v is None else f", v {v.shape[0]}")
        raise ValueError(f"block_sparse: a prefill's q, k and v have one length each, not {lengths}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"block_sparse: q's head dim {q.shape[2]} differs from k's {k.shape[2]}")
    if v is not None and v.shape[1] != k.shape[1]:
        raise ValueError(f"block_sparse: k has {k.shape[1]} heads and v {v.shape[1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"block_sparse: {q.shape[1]} query heads cannot share {k.shape[1]} KV heads "
                         "(the query heads must be a multiple of the KV heads)")


def num_blocks(tokens: int, config: BlockSparseConfig) -> int:
    return -(-tokens // config.block)


def block_mean_k(k: torch.Tensor, config: BlockSparseConfig) -> torch.Tensor:
    """fp32 `[blocks, Hkv, D]`: the mean of each block's rows (the last block's valid rows only)."""
    tokens = k.shape[0]
    blocks = num_blocks(tokens, config)
    padded = torch.zeros(blocks * config.block, *k.shape[1:], dtype=torch.float32, device=k.device)
    padded[:tokens] = k.float()
    counts = torch.full((blocks,), config.block, dtype=torch.float32, device=k.device)
    counts[-1] = tokens - (blocks - 1) * config.block
    return padded.reshape(blocks, config.block, *k.shape[1:]).sum(dim=1) / counts[:, None, None]


def causal_blocks(blocks: int, device: torch.device | str | None = None) -> torch.Tensor:
    """bool `[blocks, blocks]`: True where key block n <= query block m."""
    index = torch.arange(blocks, device=device)
    return index[None, :] <= index[:, None]


def block_logits(q: torch.Tensor, k: torch.Tensor, config: BlockSparseConfig,
                 scale: float | None = None) -> torch.Tensor:
    """fp32 `[Hq, blocks, blocks]`: max over query block m's rows of `q_i . mean_k[n] * scale`; -inf above
    the diagonal. Computed a slab of query blocks at a time (memory O(S * blocks / slab))."""
    check_inputs(q, k)
    tokens, q_heads, head_dim = q.shape
    group = q_heads // k.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    blocks = num_blocks(tokens, config)
    mean_k = block_mean_k(k, config).repeat_interleave(group, dim=1)  # [blocks, Hq, D]
    logits = torch.empty(q_heads, blocks, blocks, dtype=torch.float32, device=q.device)
    slab = max(1, _LOGIT_SLAB // max(1, q_heads * config.block * blocks))
    for first in range(0, blocks, slab):
        last = min(blocks, first + slab)
        rows = q[first * config.block:last * config.block].float()  # [r, Hq, D]
        products = torch.einsum("thd,nhd->htn", rows, mean_k) * scale  # [Hq, r, blocks]
        pad = (last - first) * config.block - rows.shape[0]
        if pad:  # the sequence's last block: padding rows never win the max
            products = torch.cat([products, products.new_full((q_heads, pad, blocks), float("-inf"))], dim=1)
        logits[:, first:last] = products.reshape(q_heads, last - first, config.block, blocks).amax(dim=2)
    return logits.masked_fill(~causal_blocks(blocks, q.device), float("-inf"))


def block_scores(q: torch.Tensor, k: torch.Tensor, config: BlockSparseConfig,
                 scale: float | None = None) -> torch.Tensor:
    """fp32 `[Hq, blocks, blocks]`: each row's softmax of `block_logits` over its causal blocks (0 above)."""
    return torch.softmax(block_logits(q, k, config, scale), dim=-1)


def block_mask(q: torch.Tensor, k: torch.Tensor, config: BlockSparseConfig | None = None,
               scale: float | None = None) -> torch.Tensor:
    """bool `[Hq, q_blocks, k_blocks]`: the key blocks each query block of each head attends to."""
    config = config or BlockSparseConfig()
    scores = block_scores(q, k, config, scale)
    blocks = scores.shape[-1]
    index = torch.arange(blocks, device=q.device)
    distance = index[:, None] - index[None, :]  # m - n
    structural = ((index[None, :] < config.sink) | (distance < config.window)
                  | (index[:, None] >= blocks - config.last_full))
    chosen = scores >= config.alpha * scores.amax(dim=-1, keepdim=True)
    return (structural[None] | chosen) & causal_blocks(blocks, q.device)[None]


def _checked_mask(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, config: BlockSparseConfig,
                  scale: float | None) -> torch.Tensor:
    """The mask to run: `block_mask`'s when none is given; a given one is checked, cut to the causal blocks
    and given its diagonal (a query row always sees itself)."""
    if mask is None:
        return block_mask(q, k, config, scale)
    blocks = num_blocks(q.shape[0], config)
    if mask.shape != (q.shape[1], blocks, blocks) or mask.dtype != torch.bool:
        raise ValueError(f"block_sparse: mask must be bool [{q.shape[1]}, {blocks}, {blocks}] "
                         f"(heads, query blocks, key blocks), not {mask.dtype} {tuple(mask.shape)}")
    causal = causal_blocks(blocks, mask.device)
    return (mask & causal) | torch.eye(blocks, dtype=torch.bool, device=mask.device)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           config: BlockSparseConfig | None = None, mask: torch.Tensor | None = None, *,
                           scale: float | None = None) -> torch.Tensor:
    """Causal attention of q `[T, Hq, D]` over the kept key blocks only -> `[T, Hq, Dv]` in q's dtype.

    `mask`: bool `[Hq, blocks, blocks]` (default `block_mask(q, k, config)`); blocks above the diagonal are
    ignored and the diagonal is always kept. One query block at a time, each over the union of the blocks
    its heads keep, in fp32."""
    config = config or BlockSparseConfig()
    check_inputs(q, k, v)
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    mask = _checked_mask(mask, q, k, config, scale).to(q.device)
    size = config.block
    out = torch.empty(tokens, q_heads, v.shape[2], dtype=q.dtype, device=q.device)
    for m in range(mask.shape[1]):
        kept = torch.nonzero(mask[:, m].any(dim=0)).flatten()  # key blocks some head keeps
        positions = (kept[:, None] * size + torch.arange(size, device=q.device)[None]).flatten()
        positions = positions[positions < tokens]
        rows = torch.arange(m * size, min(tokens, (m + 1) * size), device=q.device)
        queries = q[rows].float().transpose(0, 1)  # [Hq, r, D]
        keys = k[positions].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, p, D]
        values = v[positions].float().repeat_interleave(group, dim=1).transpose(0, 1)
        visible = mask[:, m][:, positions // size][:, None, :] & (positions[None, :] <= rows[:, None])[None]
        scores = (queries @ keys.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        out[rows] = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1).to(q.dtype)
    return out


def dense_attention_with_block_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                                    block: int, scale: float | None = None) -> torch.Tensor:
    """Plain causal softmax attention with keys outside `mask`'s blocks hidden: O(S^2), for tests.

    `mask` bool `[Hq, blocks, blocks]` as given (not completed with the diagonal)."""
    check_inputs(q, k, v)
    tokens, q_heads, head_dim = q.shape
    group = q_heads // k.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    position = torch.arange(tokens, device=q.device)
    allowed = mask[:, position // block][:, :, position // block]  # [Hq, T, T]
    visible = allowed & (position[None, :] <= position[:, None])[None]
    keys = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    values = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.float().transpose(0, 1) @ keys.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ values).transpose(0, 1).to(q.dtype)


def kept_fraction(mask: torch.Tensor) -> float:
    """The share of the causal (head, query block, key block) triples a mask keeps."""
    blocks = mask.shape[-1]
    return mask.sum().item() / (mask.shape[0] * blocks * (blocks + 1) / 2)


__all__ = ["BlockSparseConfig", "block_logits", "block_mask", "block_mean_k", "block_scores",
           "block_sparse_attention", "causal_blocks", "check_inputs", "dense_attention_with_block_mask",
           "kept_fraction", "num_blocks"]
