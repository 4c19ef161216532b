"""Random weights for synthetic GGUF files: the bytes of each planned tensor, streamed chunk by chunk.

Matrices get random quantized blocks at a real initialisation's scale (`kquants.random_blocks`); the small
per-channel tensors (norms, scalars, the family's own) get values from the family's `small_tensor(name,
shape, rng)` rule. Up to a size every tensor gets its own random data; beyond it, blocks are drawn from a
pool per ggml type, so writing a 27B file takes minutes, not hours, and no two rows repeat in practice.

A MoE file may have skewed routers (`with_router_skew`, `lucebox synth --router-skew F`): random routers send
tokens to experts close to uniformly, the worst case for an expert cache (Spark), while real models route most
tokens to a minority of their experts. A skewed router's rows of a fixed hot set of experts (`SKEW_HOT_SHARE`
of them, chosen per layer by the seed) are scaled up, so that about F of the top-k picks land in the hot set.
Scaling rows changes the logits' spread, not their mean: a router without a bias is odd in its input, so a hot
expert wins when its large logit is positive, which is why the reachable F has a ceiling (near 1 with many
experts, lower with few: a clear error past it). Any engine reading the file (llama.cpp too) routes the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .filetypes import stays_f32
from .gguf_out import TensorPlan, add_file_type, write_gguf
from .kquants import random_blocks

WEIGHT_STD = 0.02
INDEPENDENT_LIMIT = 1 << 30  # total weights up to which every tensor gets its own random data
POOL_WEIGHTS = 1 << 24  # weights per pool (per ggml type) for larger files
CHUNK_WEIGHTS = 1 << 20  # weights produced / copied per write

SmallTensorRule = Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray]

SKEW_HOT_SHARE = 0.35  # of a layer's experts, the hot set a skewed router favours
ROUTER_SUFFIX = "ffn_gate_inp.weight"  # MoE routers, [experts, hidden], kept F32
_SKEW_DRAWS = 4096  # simulated tokens when choosing a skew's row scale
_MAX_SCALE = 1000.0


def hot_count(experts: int, top_k: int) -> int:
    """Experts in a skewed layer's hot set: `SKEW_HOT_SHARE` of them, at least `top_k`."""
    return min(experts, max(top_k, round(SKEW_HOT_SHARE * experts)))


def hot_share(scale: float, experts: int, top_k: int, draws: np.ndarray | None = None) -> float:
    """The share of top-k picks in the hot set when its router rows are `scale` times the others.

    Given a token's input x, random router rows give independent normal logits of one spread; the hot
    rows' spread is `scale` times larger. The share depends on nothing else (not x's size, not the width)."""
    if draws is None:
        draws = np.random.default_rng(0).standard_normal((_SKEW_DRAWS, experts))
    hot = hot_count(experts, top_k)
    logits = draws.copy()
    logits[:, :hot] *= scale
    picks = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
    return float((picks < hot).mean())


@functools.lru_cache(maxsize=32)
def router_skew_scale(skew: float, experts: int, top_k: int) -> float:
    """The hot rows' scale that puts about `skew` of the top-k picks in the hot set (a ValueError when
    `skew` is below the hot set's share, which no skew reaches, or above what scaling can reach)."""
    hot = hot_count(experts, top_k)
    draws = np.random.default_rng(0).standard_normal((_SKEW_DRAWS, experts))
    floor, ceiling = hot / experts, hot_share(_MAX_SCALE, experts, top_k, draws)
    if not floor <= skew < ceiling:
        raise ValueError(f"router skew {skew:g} is out of reach for {experts} experts top-{top_k} (hot set "
                         f"{hot}): choose a value in [{floor:.3f}, {ceiling - 0.005:.3f}]")
    low, high = 0.0, float(np.log(_MAX_SCALE))  # bisection on log(scale): the share grows with it
    for _ in range(40):
        middle = (low + high) / 2
        if hot_share(float(np.exp(middle)), experts, top_k, draws) < skew:
            low = middle
        else:
            high = middle
    return float(np.exp(high))


def with_router_skew(rule: SmallTensorRule, skew: float | None, top_k: int) -> SmallTensorRule:
    """`rule`, with every MoE router's hot rows scaled so about `skew` of the picks land in its hot set
    (a set per layer, drawn from the tensor's own generator after its values: the rest of the file is the
    unskewed file's). `skew` None: `rule` itself."""
    if skew is None:
        return rule

    def skewed(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        values = rule(name, shape, rng)
        if not name.endswith(ROUTER_SUFFIX):
            return values
        experts = shape[0]
        rows = np.array(values, dtype=np.float64).reshape(experts, -1)
        hot = rng.choice(experts, hot_count(experts, top_k), replace=False)
        rows[hot] *= router_skew_scale(skew, experts, top_k)
        return rows.reshape(-1)

    return skewed


def named_size(sizes: Mapping[str, Any], name: str, arch: str) -> Any:
    """The config of the size `name` among a family's named `sizes`, or a ValueError listing them."""
    try:
        return sizes[name]
    except KeyError:
        raise ValueError(f"unknown {arch} size {name!r}; choose one of {', '.join(sizes)}") from None


class RandomWeights:
    """Streams the bytes of each planned tensor."""

    def __init__(self, seed: int, independent: bool, small_tensor: SmallTensorRule,
                 weight_std: float = WEIGHT_STD) -> None:
        self.seed = seed
        self.small_tensor = small_tensor
        self.weight_std = weight_std
        self.independent = independent
        self.pools: dict[GGMLQuantizationType, np.ndarray] = {}
        self.index = 0

    def __call__(self, plan: TensorPlan) -> Iterator[np.ndarray]:
        # One generator per tensor, seeded by (seed, position): the file is a function of the seed.
        rng = np.random.default_rng([self.seed, self.index])
        self.index += 1
        if stays_f32(plan.name, plan.shape):
            yield self.small_tensor(plan.name, plan.shape, rng).astype(np.float32)
            return
        n = int(np.prod(plan.shape))
        if self.independent:
            for start in range(0, n, CHUNK_WEIGHTS):
                yield random_blocks(plan.ggml_type, min(CHUNK_WEIGHTS, n - start), self.weight_std, rng)
            return
        # Each chunk gathers randomly chosen blocks of the pool: a row repeats another only if all
        # its blocks were drawn the same (about pool_blocks ** -blocks_per_row).
        pool = self._pool(plan.ggml_type)
        weights_per_block = GGML_QUANT_SIZES[plan.ggml_type][0]
        chunk_blocks = CHUNK_WEIGHTS // weights_per_block
        remaining = n // weights_per_block
        while remaining:
            take = min(chunk_blocks, remaining)
            yield np.take(pool, rng.integers(0, len(pool), take), axis=0)
            remaining -= take

    def _pool(self, ggml_type: GGMLQuantizationType) -> np.ndarray:
        if ggml_type not in self.pools:
            rng = np.random.default_rng([self.seed, 1 << 31, int(ggml_type)])
            blocks = random_blocks(ggml_type, POOL_WEIGHTS, self.weight_std, rng)
            self.pools[ggml_type] = blocks.reshape(-1, GGML_QUANT_SIZES[ggml_type][1])  # one row per block
        return self.pools[ggml_type]


def write_random_model(path: str | Path, tensors: Sequence[TensorPlan], *, arch: str, title: str, size: str,
                       type: str, seed: int, small_tensor: SmallTensorRule,
                       add_metadata: Callable[[Any], None]) -> Path:
    """Write a random-weight file of `tensors` to `path`: general keys that say it is no model (`title` names
    the family's layout), the file type, the family's own keys (`add_metadata(writer)`), then random data."""
    total = sum(int(np.prod(plan.shape)) for plan in tensors)

    def add_all_metadata(writer: Any) -> None:
        writer.add_name(f"{title} {size} RANDOM WEIGHTS (synthetic, seed {seed})")
        writer.add_description(f"Random weights with the {title} layout, for tests and benchmarks; not a model")
        add_file_type(writer, type)
        add_metadata(writer)

    return write_gguf(path, arch=arch, add_metadata=add_all_metadata, tensors=tensors,
                      data=RandomWeights(seed, total <= INDEPENDENT_LIMIT, small_tensor),
                      description=f"{arch} {size} {type}")
