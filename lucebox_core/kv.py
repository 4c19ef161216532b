"""The built-in `full` KV policy: every position's K and V, contiguous per sequence.

One `FullKVCache` belongs to one sequence. It holds, for each attention layer that has a KV cache, a K
buffer `[max_context, kv_heads, k_head_dim]` and a V buffer `[max_context, kv_heads, v_head_dim]`,
allocated once, so appending never reallocates and rolling back (speculative decoding) is only a move of
the fill pointer. The cache knows nothing of a model family: each layer declares its own head count and
head dims.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from .errors import LuceboxError


@attrs.frozen
class KVLayerShape:
    """What one attention layer stores per position."""

    kv_heads: int
    k_head_dim: int
    v_head_dim: int


class FullKVCache:
    """K and V of every position of one sequence, for the attention layers named in `layers`.

    `layers` maps a layer index (the model's numbering, sparse for hybrid models) to its `KVLayerShape`.
    `dtype` is the storage type; K and V are converted to it on append and returned in it.
    """

    def __init__(
        self,
        layers: Mapping[int, KVLayerShape],
        max_context: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if max_context <= 0:
            raise LuceboxError(f"the context size must be positive, got {max_context}")
        self.max_context = max_context
        self.dtype = dtype
        self.device = torch.device(device)
        self.shapes = dict(layers)
        self._keys = {
            layer: torch.zeros(max_context, s.kv_heads, s.k_head_dim, dtype=dtype, device=self.device)
            for layer, s in self.shapes.items()
        }
        self._values = {
            layer: torch.zeros(max_context, s.kv_heads, s.v_head_dim, dtype=dtype, device=self.device)
            for layer, s in self.shapes.items()
        }
        # Each layer has its own fill pointer: layers append one after another within a forward pass.
        self._lengths = {layer: 0 for layer in self.shapes}

    @property
    def length(self) -> int:
        """Positions stored (between forward passes every layer holds the same number)."""
        return max(self._lengths.values(), default=0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._keys.values(), *self._values.values()))

    def ensure_room(self, new_tokens: int) -> None:
        """Raise a LuceboxError, before anything is written, if `new_tokens` more positions do not fit."""
        if self.length + new_tokens > self.max_context:
            raise LuceboxError(
                f"context overflow: the sequence holds {self.length} tokens and {new_tokens} more do not fit "
                f"in the context size {self.max_context}; raise -c/--ctx-size or shorten the conversation"
            )

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k` `[T, kv_heads, k_head_dim]` and `v` `[T, kv_heads, v_head_dim]` after what `layer`
        holds; return views of all of that layer's K and V, `[length + T, ...]`."""
        if layer not in self.shapes:
            raise KeyError(f"layer {layer} has no KV cache (cached layers: {sorted(self.shapes)})")
        start, tokens = self._lengths[layer], k.shape[0]
        if start + tokens > self.max_context:
            raise LuceboxError(
                f"context overflow: layer {layer} holds {start} tokens and {tokens} more do not fit in the "
                f"context size {self.max_context}; raise -c/--ctx-size or shorten the conversation"
            )
        shape = self.shapes[layer]
        expected_k, expected_v = (tokens, shape.kv_heads, shape.k_head_dim), (tokens, shape.kv_heads, shape.v_head_dim)
        if tuple(k.shape) != expected_k or tuple(v.shape) != expected_v:
            raise ValueError(
                f"layer {layer}: K {tuple(k.shape)} / V {tuple(v.shape)} do not match {expected_k} / {expected_v}"
            )
        end = start + tokens
        self._keys[layer][start:end] = k
        self._values[layer][start:end] = v
        self._lengths[layer] = end
        return self._keys[layer][:end], self._values[layer][:end]

    # -- the static-shape decode step (CUDA graphs) ------------------------------------------------------
    # A captured step may not depend on host values, so it writes at a position held in a device tensor
    # and reads a fixed-size window of the buffers (masked by that position); the host fill pointers are
    # moved afterwards with `extend_to`.

    def write_at(self, layer: int, position: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one position's `k` `[1, kv_heads, k_head_dim]` and `v` at the row named by the device tensor
        `position` `[1]` (long); the fill pointer does not move."""
        self._keys[layer].index_copy_(0, position, k.to(self.dtype))
        self._values[layer].index_copy_(0, position, v.to(self.dtype))

    def window(self, layer: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first `size` rows of `layer`'s K and V buffers, whatever they hold: the caller masks
        rows past its position."""
        if not 0 < size <= self.max_context:
            raise ValueError(f"a window of {size} rows does not fit the context size {self.max_context}")
        return self._keys[layer][:size], self._values[layer][:size]

    def extend_to(self, length: int) -> None:
        """Declare rows below `length` written in every layer (after `write_at`)."""
        if length > self.max_context:
            raise LuceboxError(f"context overflow: {length} positions do not fit in the context size {self.max_context}")
        for layer in self._lengths:
            self._lengths[layer] = max(self._lengths[layer], length)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the K and V `layer` holds now."""
        end = self._lengths[layer]
        return self._keys[layer][:end], self._values[layer][:end]

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (rollback): a pointer move, nothing is cleared."""
        if length < 0:
            raise ValueError(f"cannot crop to a negative length ({length})")
        for layer, held in self._lengths.items():
            self._lengths[layer] = min(held, length)
