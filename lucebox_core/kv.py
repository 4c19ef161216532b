"""KV caches: the interface a KV policy implements, and the built-in `full` policy.

A KV policy (`--kv-policy NAME`, the `lucebox_kv_policies` hook) decides how one sequence's attention K and V
are stored and kept resident. It owns the allocation and the storage types (`-ctk` / `-ctv`), and gives the
model the interface of `KVCache` below, in terms of *logical positions* (a token's place in the sequence):
where a position's row physically sits (a slot of a contiguous buffer, a page, a resident set) is the
policy's business, so paged and bounded-residency policies implement the same calls.

The built-in `full` policy (`FullKVCache`): every position's K and V, contiguous per sequence, slot =
position. For each attention layer it holds a K buffer `[max_context, kv_heads, ...]` and a V buffer,
allocated once, so appending never reallocates and rolling back (speculative decoding) is only a move of
the fill pointer. It knows nothing of a model family: each layer declares its own head count and head dims.

K and V each have a storage type of their own (llama.cpp's `-ctk` / `-ctv`): `f32`, `f16`, `bf16` are
plain dtypes; `q8_0` is GGUF's Q8_0 block layout along the head dim (per 32 values, an fp16 scale and 32
int8s: 34 bytes, 1.0625 bytes a value), quantized like ggml's `quantize_row_q8_0_ref`; `q4_0` is GGUF's Q4_0
(18 bytes per 32 values) and `tq3_0` Lucebox's TurboQuant blocks (14 bytes per 32 values, groups of 128
rotated by a fixed orthogonal transform), both in `kv_quant`. Not every pair goes: a `tq3_0` K takes V
`f16`, `bf16`, `q4_0`, `q8_0` or `tq3_0` (Lucebox's table; `check_kv_pair`).

Reads for eager attention (`append`, `read`, `as_stored`) hand back floats in the original domain (a
quantized store decodes to the cache's `dtype`; TQ3_0 rows are rotated back), so a family's attention needs
no knowledge of any type. `gather` hands the rows as stored to kernels that read the blocks themselves: a
Q8_0 window is uint8 `[N, H, D / 32 * 34]`, Q4_0 and TQ3_0 windows uint8 `[N, H, D / 32, 18 | 14]` (the block
dim names the format: `kv_quant.stored_format`). The attention ops' references decode such a window
(`kv_quant.decode_stored`); a kernel reading TQ3_0 in place scores the forward-rotated query against the
rotated-domain K and rotates a TQ3_0 V's output back (`kv_quant.rotate_tq3`): both are inside the attention
op, so the families pass windows along as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import torch

from .errors import LuceboxError
from .kv_quant import (  # noqa: F401  (the Q8_0 helpers are this module's API too)
    Q8_0_BLOCK,
    Q8_0_BLOCK_BYTES,
    block_bytes,
    check_kv_pair,
    dequantize_q4_0,
    dequantize_q8_0,
    dequantize_tq3_0,
    head_dim_multiple,
    quantize_q4_0,
    quantize_q8_0,
    quantize_tq3_0,
)


# Cache type name -> its plain dtype (None: block-quantized).
KV_CACHE_TYPES: dict[str, torch.dtype | None] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "q8_0": None,
    "q4_0": None,
    "tq3_0": None,
}
_NAME_OF_DTYPE = {dtype: name for name, dtype in KV_CACHE_TYPES.items() if dtype is not None}

# The user-facing flags, named in errors about each role.
K_FLAG = "-ctk/--cache-type-k"
V_FLAG = "-ctv/--cache-type-v"


def kv_cache_type(value: str | torch.dtype, flag: str = "KV cache type") -> str:
    """The cache type name (`f32`, `f16`, `bf16`, `q8_0`, `q4_0`, `tq3_0`) for a name or a torch dtype; a
    LuceboxError naming `flag` for anything else."""
    if isinstance(value, torch.dtype):
        if value in _NAME_OF_DTYPE:
            return _NAME_OF_DTYPE[value]
    elif isinstance(value, str) and value.strip().lower() in KV_CACHE_TYPES:
        return value.strip().lower()
    raise LuceboxError(f"{flag}: unknown KV cache type {value!r}; choose one of {', '.join(KV_CACHE_TYPES)}")


def row_bytes(cache_type: str, values: int) -> int:
    """Bytes that `values` numbers take in `cache_type` (for a block type, `values` is a multiple of 32)."""
    name = kv_cache_type(cache_type)
    dtype = KV_CACHE_TYPES[name]
    if dtype is None:
        return values // Q8_0_BLOCK * block_bytes(name)
    return values * dtype.itemsize


def attention_position(kv: "KVCache", position: torch.Tensor) -> torch.Tensor:
    """What a static attention op masks the window at for a query at device `position` (it sees rows
    `0 .. attention_position`): the position itself for a cache whose slot is the position, the query's
    slot for a policy that keeps a compact resident set (`kvflash`). A policy says so by having the method."""
    mapped = getattr(kv, "attention_position", None)
    return position if mapped is None else mapped(position)


def window_limit(kv: "KVCache") -> int:
    """The largest window a static step need read: the context, or a bounded policy's `max_window` (its pool),
    so steps past the pool replay one recording instead of one per window size."""
    return min(kv.max_context, getattr(kv, "max_window", kv.max_context))


def bind_tokens(kv: "KVCache", source: Any, tokenizer: Any) -> None:
    """Tell a policy that ranks chunks by reading the sequence (`kvflash --kvflash-policy drafter`) where its
    tokens are (`source()`) and whose vocabulary they are in; a no-op for policies without `bind_tokens`."""
    bind = getattr(kv, "bind_tokens", None)
    if bind is not None:
        bind(source, tokenizer)


def write_rows(kv: "KVCache", ops: Any, layer: int, positions: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """`kv.write`, through the backend's `write_kv_rows` (one launch on a GPU backend, where the cache's own write
    is two index copies and a ring's modulo) when the policy lends its plain buffers (`plain_rows`); otherwise the
    policy's `write` (quantized types, a paged pool, a split cache)."""
    lend = getattr(kv, "plain_rows", None)
    buffers = None if lend is None else lend(layer)
    if buffers is None:
        kv.write(layer, positions, k, v)
        return
    keys, values, ring = buffers
    ops.write_kv_rows(keys, values, positions, ring, k, v)


def observe_query(kv: "KVCache", layer: int, query: torch.Tensor) -> None:
    """Show a policy that ranks chunks by attention (`kvflash --kvflash-policy qk`) a layer's query; a no-op
    for policies without `observe_query`."""
    observe = getattr(kv, "observe_query", None)
    if observe is not None:
        observe(layer, query)


# -- one role's storage (K or V) -------------------------------------------------------------------------


@attrs.frozen
class _Codec:
    """How one role (K or V) is stored: `encode` float rows to buffer rows, `decode` them back."""

    cache_type: str
    read_dtype: torch.dtype  # what reads hand back

    @property
    def quantized(self) -> bool:
        return KV_CACHE_TYPES[self.cache_type] is None

    @property
    def storage_dtype(self) -> torch.dtype:
        return KV_CACHE_TYPES[self.cache_type] or torch.uint8

    def stored_shape(self, head_dim: int) -> tuple[int, ...]:
        """A head's row as stored: values, Q8_0 bytes, or (Q4_0, TQ3_0) blocks x block bytes."""
        if not self.quantized:
            return (head_dim,)
        if self.cache_type == "q8_0":
            return (row_bytes("q8_0", head_dim),)
        return (head_dim // Q8_0_BLOCK, block_bytes(self.cache_type))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quantized:
            return x.to(self.storage_dtype)
        if self.cache_type == "q8_0":
            return quantize_q8_0(x)
        blocks = quantize_q4_0(x) if self.cache_type == "q4_0" else quantize_tq3_0(x)
        return blocks.unflatten(-1, (-1, block_bytes(self.cache_type)))

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        if not self.quantized:
            return stored
        if self.cache_type == "q8_0":
            return dequantize_q8_0(stored, self.read_dtype)
        decoder = dequantize_q4_0 if self.cache_type == "q4_0" else dequantize_tq3_0
        return decoder(stored.flatten(-2), self.read_dtype)


@attrs.frozen
class KVLayerShape:
    """What one attention layer stores per position, and how far back its queries look.

    `window`: a sliding-window layer's queries see only the last `window` positions (theirs included), so
    a policy may keep only those (0: every position is seen)."""

    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    window: int = 0


def window_start(shape: KVLayerShape, past: int) -> int:
    """The first position whose rows `append` returns for a layer holding `past` positions: 0, or for a
    sliding-window layer the oldest position the next query still sees."""
    return max(0, past - shape.window + 1) if shape.window else 0


def kv_bytes_per_token(shape: KVLayerShape, k_type: str, v_type: str) -> int:
    """Bytes one position of one layer takes: its K row plus its V row, each in its cache type."""
    return row_bytes(k_type, shape.kv_heads * shape.k_head_dim) + row_bytes(v_type, shape.kv_heads * shape.v_head_dim)


class KVCache(Protocol):
    """One sequence's attention K/V, as a KV policy stores it. Positions are logical; all but the host-side
    bookkeeping (`commit`, `rollback`, `length`) work on device tensors without a host sync, so the static
    steps that call them can be recorded as graphs.

    Two ways in:
    - eager (prefill, a dynamic verify pass): `append` stores the next positions and returns every visible
      row, decoded, for attention;
    - static (a recorded decode step or verify pass): `write` stores rows at device-held positions,
      attention reads `gather(layer, size)` (the first `size` positions, in position order, as stored), and
      afterwards the host declares them held with `commit(length)`.
    Speculative decoding: `move` copies accepted rows to their final positions, `rollback` forgets the rest.

    Sliding-window layers (`KVLayerShape.window`): `append` returns the rows from `window_start(shape, past)`
    on, not from 0; `read` likewise. A policy may keep such a layer in a ring of `window` slots (position p
    in slot p % window): then `gather(layer, size)` returns at most `window` rows in slot order, which a
    query at position p reads with the plain mask "slot <= p" (once p >= window every slot holds one of
    the last `window` positions), and `rollback` can go back at most one position (or to 0).

    Two rules a policy must keep, because static steps are recorded once and replayed:
    - `write`, `gather` and `move` depend only on their arguments and on device tensors the policy updates
      in place (a page table, a slot map), never on host state read at call time (`length`, a Python
      list of pages): a replay repeats the recorded work on whatever those device tensors hold then;
    - a static verify pass writes its N candidate rows at scratch positions `length .. length + N - 1`
      (insertion order, not their tree positions) before anything is committed, then `move`s the
      accepted ones into place and `commit`s: a policy keeps those positions writable (within
      `max_context`) and treats rows past `length` as uncommitted.
    """

    max_context: int  # the most positions the sequence may hold
    k_type: str
    v_type: str
    dtype: torch.dtype  # what quantized types decode to
    shapes: dict[int, KVLayerShape]  # cached layer -> what it stores per position

    @property
    def length(self) -> int: ...  # positions held

    @property
    def nbytes(self) -> int: ...  # device bytes held

    @property
    def bytes_per_token(self) -> int: ...

    def ensure_room(self, new_tokens: int) -> None: ...
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def gather(self, layer: int, size: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None: ...
    def commit(self, length: int) -> None: ...
    def rollback(self, length: int) -> None: ...
    # Optional (the prefix cache uses them when a policy has them): the rows of the first `length`
    # positions as stored, by name, and writing such rows back into an empty cache.
    def export_rows(self, length: int) -> dict[str, torch.Tensor]: ...
    # Optional (the families call them through `attention_position` / `observe_query` of this module): the
    # slot a static attention op masks at, for a policy whose slot is not the position, and the queries,
    # for a policy that ranks what stays resident by attention.
    def attention_position(self, position: torch.Tensor) -> torch.Tensor: ...
    # Optional (`write_rows` of this module): a layer's K and V buffers and ring size, for a policy that stores
    # plain values at slot = position (or position % ring), so the backend may store a step's rows itself.
    def plain_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int] | None: ...
    def observe_query(self, layer: int, query: torch.Tensor) -> None: ...
    def import_rows(self, rows: Mapping[str, torch.Tensor], length: int, *, check_only: bool = False) -> None: ...


class FullKVCache:
    """K and V of every position of one sequence, for the attention layers named in `layers`.

    `layers` maps a layer index (the model's numbering, sparse for hybrid models) to its `KVLayerShape`.
    `k_type` / `v_type` are the storage types of K and V (a name of `KV_CACHE_TYPES` or a torch dtype;
    default `dtype`). `dtype` is also what a quantized type decodes to; plain types read back in their own
    dtype.

    A sliding-window layer (`KVLayerShape.window`) is kept in a ring of `window` slots, position p in slot
    p % window: what makes long contexts of sliding-window models fit (Gemma-4: 1024 rows a sliding
    layer, whatever the context).
    """

    def __init__(
        self,
        layers: Mapping[int, KVLayerShape],
        max_context: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        k_type: str | torch.dtype | None = None,
        v_type: str | torch.dtype | None = None,
    ) -> None:
        if max_context <= 0:
            raise LuceboxError(f"the context size must be positive, got {max_context}")
        self.max_context = max_context
        self.dtype = dtype
        self.device = torch.device(device)
        self.shapes = dict(layers)
        self.k_type = kv_cache_type(dtype if k_type is None else k_type, K_FLAG)
        self.v_type = kv_cache_type(dtype if v_type is None else v_type, V_FLAG)
        self._k_codec, self._v_codec = _Codec(self.k_type, dtype), _Codec(self.v_type, dtype)
        check_kv_pair(self.k_type, self.v_type, tuple(KV_CACHE_TYPES))
        for layer, s in self.shapes.items():
            for codec, role, dim, flag in ((self._k_codec, "K", s.k_head_dim, K_FLAG),
                                           (self._v_codec, "V", s.v_head_dim, V_FLAG)):
                multiple = head_dim_multiple(codec.cache_type)
                if dim % multiple:
                    unit = "rotation groups" if codec.cache_type == "tq3_0" else "blocks"
                    raise LuceboxError(
                        f"{flag} {codec.cache_type}: quantizes {unit} of {multiple} along the head dim, but "
                        f"layer {layer}'s {role} head dim is {dim}; choose another type (f16, bf16, f32"
                        f"{', q8_0 or q4_0' if dim % Q8_0_BLOCK == 0 else ''})"
                    )
        # Rows per layer: every position, or a sliding layer's ring.
        self._rows = {layer: min(max_context, s.window) if s.window else max_context for layer, s in self.shapes.items()}
        # The K and V buffers of layers alike (rows, shape, storage dtype, ring or not) are the entries of one
        # stack, so `move` is two launches for all of them (a 27B commit moved 16 layers' K and V in 64).
        alike: dict[tuple, list[tuple[dict, int]]] = {}
        self._keys, self._values = {}, {}
        for layer, s in self.shapes.items():
            for buffers, codec, dim in ((self._keys, self._k_codec, s.k_head_dim),
                                        (self._values, self._v_codec, s.v_head_dim)):
                shape = (self._rows[layer], s.kv_heads, *codec.stored_shape(dim))
                alike.setdefault((shape, codec.storage_dtype, bool(s.window)), []).append((buffers, layer))
        self._stacks: list[tuple[torch.Tensor, int]] = []  # (stack, ring rows or 0)
        for (shape, storage_dtype, ring), members in alike.items():
            stack = torch.zeros(len(members), *shape, dtype=storage_dtype, device=self.device)
            self._stacks.append((stack, shape[0] if ring else 0))
            for index, (buffers, layer) in enumerate(members):
                buffers[layer] = stack[index]
        # Each layer has its own fill pointer: layers append one after another within a forward pass.
        self._lengths = {layer: 0 for layer in self.shapes}

    def __repr__(self) -> str:
        return (f"FullKVCache({len(self.shapes)} layers, {self.length}/{self.max_context} positions, "
                f"K {self.k_type}, V {self.v_type}, {self.nbytes / 2**20:.1f} MiB)")

    @property
    def length(self) -> int:
        """Positions stored (between forward passes every layer holds the same number)."""
        return max(self._lengths.values(), default=0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._keys.values(), *self._values.values()))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more position takes over all layers (K and V): sliding layers' rings do not grow."""
        return sum(kv_bytes_per_token(s, self.k_type, self.v_type) for s in self.shapes.values() if not s.window)

    def ensure_room(self, new_tokens: int) -> None:
        """Raise a LuceboxError, before anything is written, if `new_tokens` more positions do not fit."""
        if self.length + new_tokens > self.max_context:
            raise LuceboxError(
                f"context overflow: the sequence holds {self.length} tokens and {new_tokens} more do not fit "
                f"in the context size {self.max_context}; raise -c/--ctx-size or shorten the conversation"
            )

    def _slots(self, layer: int, start: int, end: int) -> torch.Tensor | slice:
        """Where positions `start .. end-1` of `layer` sit: a slice, or ring slots in position order."""
        rows = self._rows[layer]
        if not self.shapes[layer].window or end <= rows:
            return slice(start, end)
        return torch.arange(start, end, device=self.device) % rows

    def _decoded(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self._slots(layer, start, end)
        return self._k_codec.decode(self._keys[layer][slots]), self._v_codec.decode(self._values[layer][slots])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k` `[T, kv_heads, k_head_dim]` and `v` `[T, kv_heads, v_head_dim]` at the positions after
        what `layer` holds; return all of that layer's K and V, `[length + T, ...]` in position order (views
        for plain types, decoded copies for quantized ones)."""
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
        if shape.window:
            return self._append_ring(layer, start, k, v)
        self._keys[layer][start:end] = self._k_codec.encode(k)
        self._values[layer][start:end] = self._v_codec.encode(v)
        self._lengths[layer] = end
        return self._decoded(layer, 0, end)

    def _append_ring(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        # The rows the new queries see are read before the ring is written over: a chunk longer than the
        # ring still attends to the positions it evicts.
        first = window_start(self.shapes[layer], start)
        held_k, held_v = self._decoded(layer, first, start)  # views of the ring for plain types
        new_k, new_v = self._k_codec.encode(k), self._v_codec.encode(v)
        visible = (torch.cat([held_k, self._k_codec.decode(new_k)]), torch.cat([held_v, self._v_codec.decode(new_v)]))
        rows, end = self._rows[layer], start + k.shape[0]
        kept = slice(max(0, k.shape[0] - rows), None)  # what the ring keeps of this chunk: its last rows
        slots = torch.arange(max(start, end - rows), end, device=self.device) % rows
        self._keys[layer][slots] = new_k[kept]
        self._values[layer][slots] = new_v[kept]
        self._lengths[layer] = end
        return visible

    def as_stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What reading `k` and `v` back would give once stored, without storing them (speculative verify:
        the nodes must see their own K/V exactly as plain decoding will). Appending the result again
        stores the same values (Q8_0 and Q4_0 re-quantize their own output to the same bits, but the sign of
        an all-zero Q4_0 block's scale; TQ3_0 too but for float rounding in the rotation, which can move a value
        sitting on a threshold)."""
        return self._k_codec.decode(self._k_codec.encode(k)), self._v_codec.decode(self._v_codec.encode(v))

    # -- the static path (recorded steps) ---------------------------------------------------------------
    # A recorded step may not depend on host values, so it writes at positions held in a device tensor and
    # reads a fixed-size window of the buffers (masked by the caller); the host fill pointers are moved
    # afterwards with `commit`.

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k` `[N, kv_heads, k_head_dim]` and `v` at the logical positions named by the device long
        tensor `positions` `[N]` (the slot is the position, or for a ring position % window); the fill
        pointer does not move."""
        slots = positions % self._rows[layer] if self.shapes[layer].window else positions
        self._keys[layer].index_copy_(0, slots, self._k_codec.encode(k))
        self._values[layer].index_copy_(0, slots, self._v_codec.encode(v))

    def plain_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For `write_rows`: a layer's K and V buffers and its ring size (0: slot = position) when both are
        stored as plain values (what `write` does then is a copy at the slots); None for quantized types."""
        if self._k_codec.quantized or self._v_codec.quantized:
            return None
        ring = self._rows[layer] if self.shapes[layer].window else 0
        return self._keys[layer], self._values[layer], ring

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy the rows of positions `source` to positions `destination` (device long tensors) in every
        layer, all reads before any write: a verified tree's accepted nodes, from the positions they were
        written at (insertion order) to their places on the accepted path."""
        for stack, ring_rows in self._stacks:
            src, dst = (source % ring_rows, destination % ring_rows) if ring_rows else (source, destination)
            stack.index_copy_(1, dst, stack.index_select(1, src))

    def _check_window(self, size: int) -> None:
        if not 0 < size <= self.max_context:
            raise ValueError(f"a window of {size} rows does not fit the context size {self.max_context}")

    def gather(self, layer: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions `0 .. size - 1` as stored, whatever they hold (the caller masks those past
        its own): a plain dtype `[size, heads, dim]`, uint8 Q8_0 blocks `[size, heads, dim / 32 * 34]`, or
        uint8 Q4_0 / TQ3_0 blocks `[size, heads, dim / 32, 18 | 14]`, for kernels that decode them themselves.
        Here views of the buffers, no copy. A ring gives at most its `window` slots (see `KVCache`)."""
        self._check_window(size)
        size = min(size, self._rows[layer])
        return self._keys[layer][:size], self._values[layer][:size]

    def commit(self, length: int) -> None:
        """Declare positions below `length` held in every layer (after `write`)."""
        if length > self.max_context:
            raise LuceboxError(f"context overflow: {length} positions do not fit in the context size {self.max_context}")
        for layer in self._lengths:
            self._lengths[layer] = max(self._lengths[layer], length)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V `layer` holds now, in position order, as floats (a sliding layer: from the oldest
        position the next query sees)."""
        held = self._lengths[layer]
        return self._decoded(layer, window_start(self.shapes[layer], held), held)

    def rollback(self, length: int) -> None:
        """Forget every position from `length` on: a pointer move, nothing is cleared."""
        if length < 0:
            raise ValueError(f"cannot crop to a negative length ({length})")
        for layer, held in self._lengths.items():
            # A ring has written over what a query at `length` would need if it goes back further.
            if self.shapes[layer].window and 0 < length < held - 1 and held > self._rows[layer]:
                raise LuceboxError(
                    f"cannot roll layer {layer} back from {held} to {length} positions: it keeps a ring of the last "
                    f"{self._rows[layer]} (sliding window), which no longer holds what position {length} sees"
                )
        for layer, held in self._lengths.items():
            self._lengths[layer] = min(held, length)

    # -- snapshots (the prefix cache) --------------------------------------------------------------------

    def export_rows(self, length: int) -> dict[str, torch.Tensor]:
        """The rows positions `0 .. length - 1` occupy, as stored, per layer (`"<layer>.k"`, `"<layer>.v"`):
        views, which the caller copies. A ring layer gives its slots in slot order, all it holds."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot export {length} positions of a cache holding {self.length}")
        rows: dict[str, torch.Tensor] = {}
        for layer in self.shapes:
            held = min(length, self._rows[layer])
            rows[f"{layer}.k"], rows[f"{layer}.v"] = self._keys[layer][:held], self._values[layer][:held]
        return rows

    def import_rows(self, rows: Mapping[str, torch.Tensor], length: int, *, check_only: bool = False) -> None:
        """Write what `export_rows(length)` gave into this (empty) cache, in place, and hold `length`
        positions; with `check_only`, only check that it fits (a LuceboxError naming the tensor if not)."""
        expected = {f"{layer}.{role}" for layer in self.shapes for role in "kv"}
        if set(rows) != expected or length > self.max_context:
            raise LuceboxError(f"these KV rows ({len(rows)} tensors, {length} positions) are not this cache's "
                               f"({len(expected)} tensors, at most {self.max_context} positions)")
        for layer in self.shapes:
            held = min(length, self._rows[layer])
            for role, buffer in (("k", self._keys[layer]), ("v", self._values[layer])):
                saved = rows[f"{layer}.{role}"]
                if tuple(saved.shape) != (held, *buffer.shape[1:]) or saved.dtype != buffer.dtype:
                    raise LuceboxError(f"KV rows {layer}.{role} are {tuple(saved.shape)} {saved.dtype}; this cache "
                                       f"stores {(held, *buffer.shape[1:])} {buffer.dtype}")
        if check_only:
            return
        for layer in self.shapes:
            held = min(length, self._rows[layer])
            self._keys[layer][:held].copy_(rows[f"{layer}.k"], non_blocking=True)
            self._values[layer][:held].copy_(rows[f"{layer}.v"], non_blocking=True)
            self._lengths[layer] = length
