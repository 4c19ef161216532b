"""The pure-torch reference backend: the generic ops every model family needs, written for clarity, on any
torch device, and the device services the engine uses (synchronisation, events, pinned memory, graphs).

This file is the contract of the generic ops, and their reference. A fast backend (CUDA, HIP) extends this
class for its device and weights, and offers kernels for any op by name through the `lucebox_op_kernels`
hook (`lucebox_core.ops`): each kernel is tested against the reference here on random inputs, and runs
wherever its check accepts the arguments. A family's own ops (a recurrent scan, a convolution) live with
the family, in an `OpSet` written against these. Model code is written once against the ops.

Conventions shared by every op:

- Sequence tensors are batch-first and token-major: `[B, T, H, D]` (batch, tokens, heads, head dim), as in
  flash-attention and flash-linear-attention. Models that serve one sequence pass `B = 1`.
- Activations are in the backend's compute `dtype`; each op computes in fp32 internally where precision
  matters (norms, softmax, RoPE angles) and returns the input's dtype.
- Ops are functional: they return new tensors instead of mutating what they are given, so a caller can
  keep an old state for speculative rollback. (A family's ops ending in `_` update a state in place: the
  fused one-token ops of a decode step, which a CUDA graph replays over fixed buffers.)
- Weights are either torch tensors or `lucebox_core.quants.QuantTensor`s (raw GGUF blocks, dequantized on
  the fly), in torch order: `[out_features, in_features]` for matrices.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F

from .static_step import graphs_enabled

Weight = Any  # torch.Tensor or lucebox_core.quants.QuantTensor

# Uncached matrices bigger than this are dequantized a block of rows at a time, so a 1 GB output head never
# needs a second 1 GB transient buffer.
STREAM_BLOCK_BYTES = 64 * 1024 * 1024


def concat_rows(weights: list[Weight], device: torch.device | str | None = None) -> Weight | None:
    """The rows of `weights` stacked into one weight, on `device` (default: where the first is), or None
    when they cannot share one: GGUF weights of different types or row lengths, dense ones of different
    dtypes, or a mix. GGUF rows are whole blocks, so stacking raw bytes stacks rows."""
    from .quants import QuantTensor

    first = weights[0]
    if len(weights) < 2 or any(len(w.shape) != 2 or w.shape[1] != first.shape[1] for w in weights):
        return None
    device = torch.device(device) if device is not None else first.data.device if isinstance(
        first, QuantTensor) else first.device
    if all(isinstance(w, QuantTensor) and w.ggml_type == first.ggml_type for w in weights):
        data = torch.empty(sum(w.nbytes for w in weights), dtype=torch.uint8, device=device)
        offset = 0
        for w in weights:  # straight from each source (a file map) into the one buffer: no host copy
            data[offset : offset + w.nbytes].copy_(w.data)
            offset += w.nbytes
        rows = sum(w.shape[0] for w in weights)
        return QuantTensor("+".join(w.name for w in weights), first.ggml_type, (rows, first.shape[1]), data)
    if all(isinstance(w, torch.Tensor) and w.dtype == first.dtype for w in weights):
        return torch.cat([w.to(device) for w in weights])
    return None


def _default_cache_budget(device: torch.device) -> int:
    """Half of the memory the device has: leaves room for activations, KV and everything else."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 4 * 1024**3


def _available_ram() -> int:
    """The RAM the OS can give without swapping: `MemAvailable` on Linux, else the free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 * 1024**3


def host_memory(shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """Host memory (pinned where `pinned`: device copies to and from it do not block the host)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned)


def add_shared_expert(ops: Any, routed: torch.Tensor, x: torch.Tensor, shared: Any,
                      shared_logit: torch.Tensor | None) -> torch.Tensor:
    """A MoE block's routed sum plus its always-on shared expert (`shared(x)`, None: none), behind
    `sigmoid(shared_logit)` where given: what `moe_experts_swiglu` adds wherever the shared expert runs apart."""
    if shared is None:
        return routed
    out = shared(x)
    return routed + out if shared_logit is None else ops.add_sigmoid_gated(routed, out, shared_logit)


class SideCopier:
    """Copies between device rows and host memory on a side stream of a CUDA (or ROCm) device, synchronous
    elsewhere (KVFlash's paging: `kvflash_host`). A copy-out waits for the work queued so far on the current
    stream (the rows are final) and the current stream waits for it before anything may overwrite them; a
    copy-in waits likewise and the current stream waits for it before anything reads what it wrote. Copies
    are ordered among themselves on the one side stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copies = 0  # copies issued (for tests and the GPU check)

    def copy_out(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each `(host, rows)`; the compute stream will not touch `rows` again before the copies end."""
        self._copy(pairs)

    def copy_in(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each `(rows, host)`; the compute stream reads `rows` only after the copies end."""
        self._copy(pairs)

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return
        self.copies += len(pairs)
        if self.side is None:
            for destination, source in pairs:
                destination.copy_(source)
            return
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)  # the rows (or the slots a recall fills) are final on the compute stream
        with torch.cuda.stream(self.side):
            for destination, source in pairs:
                destination.copy_(source, non_blocking=True)
        compute.wait_stream(self.side)  # nothing on the compute stream overwrites / reads them before they land

    def copy_behind(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Copy each `(destination, source)` on the side stream after the work queued so far on the current
        stream, without making the current stream wait: `land(marker)` with the marker returned does (None:
        nothing to wait for)."""
        if not pairs:
            return None
        self.copies += len(pairs)
        if self.side is None:
            for destination, source in pairs:
                destination.copy_(source)
            return None
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            for destination, source in pairs:
                destination.copy_(source, non_blocking=True)
        return self.side.record_event()

    def land(self, marker: Any) -> None:
        """The current stream waits for the copies before `marker` (from `copy_behind`)."""
        if marker is not None:
            torch.cuda.current_stream(self.device).wait_event(marker)

    def synchronize(self) -> None:
        """Wait on the host for every copy issued (before reading host records on the host)."""
        if self.side is not None:
            self.side.synchronize()


class TorchBackend:
    """Reference ops in plain torch. Slow but obviously right: the oracle every kernel is tested against.

    `weight_cache_bytes` bounds how much dequantized weight data is kept between calls. Weights are cached
    first come, first kept, with no eviction: a forward pass touches every weight in the same order each
    time, and LRU eviction under that cyclic pattern would miss on every access, whereas keeping a fixed
    subset keeps a fixed hit ratio. `None` means half of the device's memory.
    """

    name = "torch"

    def __init__(
        self,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        weight_cache_bytes: int | None = None,
        *,
        kernel_table_for: dict | None = None,
    ) -> None:
        """`kernel_table_for`: the op kernels to use (`lucebox_core.ops.kernel_table`); default: those the
        installed plugins register for this backend's `name` ({} for none: the references alone)."""
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_cache_bytes = (
            _default_cache_budget(self.device) if weight_cache_bytes is None else int(weight_cache_bytes)
        )
        self._weight_cache: dict[int, tuple[Weight, torch.Tensor]] = {}  # id(weight) -> (weight, dense)
        self._cached_bytes = 0
        # The kernels plugins offer for this backend's ops, by name (`lucebox_core.ops`); its generic ops that
        # have one are routed through them from here on.
        from .ops import install_kernels, kernel_table

        install_kernels(self, kernel_table(self.name) if kernel_table_for is None else kernel_table_for)

    def __repr__(self) -> str:
        return f"TorchBackend(device={str(self.device)!r}, dtype={self.dtype})"

    # -- weights ---------------------------------------------------------------------------------------

    @property
    def cached_weight_bytes(self) -> int:
        """Bytes of dequantized weights held by the cache now."""
        return self._cached_bytes

    def clear_weight_cache(self) -> None:
        self._weight_cache.clear()
        self._cached_bytes = 0

    def _cached(self, weight: Weight) -> torch.Tensor | None:
        entry = self._weight_cache.get(id(weight))
        return entry[1] if entry is not None and entry[0] is weight else None

    def _dequantize(self, weight: Weight) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return weight.to(device=self.device, dtype=self.dtype)
        return weight.dequantize(self.dtype, self.device)

    def _dense_size(self, weight: Weight) -> int:
        return math.prod(weight.shape) * torch.finfo(self.dtype).bits // 8

    def dense(self, weight: Weight) -> torch.Tensor:
        """`weight` as a plain tensor in the compute dtype on the device, kept if the cache budget allows.

        A torch tensor already in the right dtype and device is returned as is and costs no budget.
        """
        if isinstance(weight, torch.Tensor) and weight.dtype == self.dtype and weight.device == self.device:
            return weight
        cached = self._cached(weight)
        if cached is not None:
            return cached
        tensor = self._dequantize(weight)
        size = tensor.numel() * tensor.element_size()
        if not getattr(weight, "volatile", False) and self._cached_bytes + size <= self.weight_cache_bytes:
            # The entry holds `weight` itself so that its id cannot be reused by another object.
            self._weight_cache[id(weight)] = (weight, tensor)
            self._cached_bytes += size
        return tensor

    def _fits_cache(self, weight: Weight) -> bool:
        if isinstance(weight, torch.Tensor) and weight.dtype == self.dtype and weight.device == self.device:
            return True
        return self._cached(weight) is not None or self._cached_bytes + self._dense_size(weight) <= self.weight_cache_bytes

    def _rows(self, weight: Weight, start: int, stop: int) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return weight[start:stop].to(device=self.device, dtype=self.dtype)
        return weight.dequantize_rows(start, stop, self.dtype, self.device)

    # -- the device: synchronisation, events, host memory, graphs --------------------------------------
    # The engine, the benchmark and the static-step runner reach the device only through these, so a
    # backend for other hardware says here how it waits, signals and records. torch runs CUDA and ROCm
    # devices through the same `torch.cuda` calls; on the CPU work is done when it is queued.

    def synchronize(self) -> None:
        """Wait until the work queued on this backend's device so far has run."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def record_event(self) -> Any:
        """A marker after the work queued so far on this device's current stream, for `wait_event` (None
        where queued work is already done)."""
        if self.device.type == "cuda":
            return torch.cuda.current_stream(self.device).record_event()
        return None

    def wait_event(self, event: Any) -> None:
        """Wait on the host until the work before `event` (from `record_event`) has run."""
        if event is not None:
            event.synchronize()

    def event_done(self, event: Any) -> bool:
        """Whether the work before `event` (from `record_event`) has run, without waiting."""
        return event is None or bool(event.query())

    def free_memory(self) -> int:
        """Bytes the device can still allocate: on a GPU the free memory plus what torch's caching allocator
        holds unused; on the CPU what the OS reports as available (`MemAvailable`)."""
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return _available_ram()

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory a device copy can land in without waiting for later work (pinned, on a GPU)."""
        return host_memory(shape, dtype, pinned=self.device.type == "cuda")

    def graphs_enabled(self) -> bool:
        """Whether static steps on this device are recorded as graphs and replayed (CUDA, unless
        `LUCEBOX_CUDA_GRAPHS=0`)."""
        return graphs_enabled(self.device)

    def new_graph_pool(self) -> Any:
        """A memory pool for the graphs of one set of static buffers (a sequence's), freed with them."""
        return torch.cuda.graph_pool_handle()

    def on_side_stream(self, function: Any) -> Any:
        """`function()` on a fresh stream ordered after, and before, the current one (a graph's warm-up
        must not run on the stream a recording will capture)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(side):
                return function()
        finally:  # also after a failure: work queued on the side stream must come before what follows
            current.wait_stream(side)

    def record_graph(self, function: Any, pool: Any) -> tuple[Any, Any]:
        """Record `function()` as a graph (which runs nothing) into `pool`: (the graph, whose `replay()`
        runs it, and the outputs it leaves in buffers of the recording).

        Recorded with this backend's device current and on a capture stream of that device: torch's default
        capture stream is made once, on whichever device was current then, and a split model records a
        graph per part on each part's device."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            with torch.cuda.graph(graph, pool=pool, stream=self._capture_stream()):
                outputs = function()
        return graph, outputs

    def _capture_stream(self) -> Any:
        stream = getattr(self, "_graph_capture_stream", None)
        if stream is None:
            stream = self._graph_capture_stream = torch.cuda.Stream(self.device)
        return stream

    # -- matmul and embedding --------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """`x @ weight.T`: x `[..., in]`, weight `[out, in]` -> `[..., out]` (no bias: no target model has one)."""
        if self._fits_cache(weight):
            return F.linear(x, self.dense(weight))
        # Too big for what is left of the budget: stream it through in row blocks.
        out_features, in_features = weight.shape
        rows_per_block = max(1, STREAM_BLOCK_BYTES // (in_features * torch.finfo(self.dtype).bits // 8))
        parts = [
            F.linear(x, self._rows(weight, start, min(start + rows_per_block, out_features)))
            for start in range(0, out_features, rows_per_block)
        ]
        return torch.cat(parts, dim=-1)

    def embedding(self, ids: torch.Tensor, weight: Weight) -> torch.Tensor:
        """Rows `ids` of `weight` `[vocab, dim]` -> `[*ids.shape, dim]`; dequantizes only the rows needed
        unless the whole table is cached already (a tied output head caches it)."""
        ids = ids.to(self.device)
        cached = self.dense(weight) if isinstance(weight, torch.Tensor) else self._cached(weight)
        if cached is not None:
            return F.embedding(ids, cached)
        return weight.lookup_rows(ids, self.dtype)

    # -- pointwise -------------------------------------------------------------------------------------

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x)

    # -- fused ops of the decode step ------------------------------------------------------------------
    # Compositions of the ops above, named so that a fast backend can run each as one kernel (a decode
    # step of a 64-layer model is otherwise thousands of tiny launches). The definitions here fix the
    # roundings: every intermediate the composition rounds to the activation dtype is rounded there.

    def fuse_rows(self, weights: list[Weight]) -> Weight | None:
        """One weight holding the rows of `weights` in order (so several products of the same input are
        one launch), or None where this backend gains nothing from it. The reference keeps them apart:
        its dense products are already one call each, and the results stay bit-identical."""
        return None

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual update and the next norm: `(rms_norm(residual + x), residual + x)`."""
        summed = residual + x
        return self.rms_norm(summed, weight, eps), summed

    def add_rms_norm_swiglu(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            gate_up: Weight, down: Weight) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm SwiGLU MLP after the residual add: `(down(silu(g) * u), residual + x)`, where `g | u` are the
        rows of `rms_norm(residual + x) @ gate_up.T` (the gate's first, as `fuse_rows([gate, up])` makes them).
        One op so that a backend may run the four steps in one launch; here they are the ops they always were."""
        normed, summed = self.add_rms_norm(x, residual, weight, eps)
        gate, up = self.linear(normed, gate_up).chunk(2, dim=-1)
        return self.linear(self.silu_mul(gate, up), down), summed

    def add_rms_norm_moe(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         block: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm MoE block after the residual add: `(block(rms_norm(residual + x)), residual + x)`, `block`
        a family's MoE block (callable, with `routing()`: `moe_routing.MoERouting`). One op so that a backend may
        run the add, the norm, the router and the experts in one launch; here the block runs its own code."""
        normed, summed = self.add_rms_norm(x, residual, weight, eps)
        return block(normed), summed

    def write_kv_rows(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, ring: int,
                      k: torch.Tensor, v: torch.Tensor) -> None:
        """A static step's K/V store (`kv.write_rows`): rows `k` `[N, heads, k_dim]` and `v` into a plain cache's
        buffers `keys` `[slots, heads, k_dim]` and `values` at the slots of the device positions `positions`
        `[N]`: the position, or in a ring of `ring` slots (a sliding layer) position % ring."""
        slots = positions % ring if ring else positions
        keys.index_copy_(0, slots, k.to(keys.dtype))
        values.index_copy_(0, slots, v.to(values.dtype))

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's middle: `silu(gate) * up`."""
        return self.silu(gate) * up

    def moe_experts_swiglu(self, x: torch.Tensor, gate_exps: Weight, up_exps: Weight, down_exps: Weight,
                           weights: torch.Tensor, ids: torch.Tensor, shared: Any = None,
                           shared_logit: torch.Tensor | None = None) -> torch.Tensor:
        """Routed SwiGLU experts over separate gate and up stacks `[E, inter, hidden]` and a down stack
        `[E, hidden, inter]`: `sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`, `e = ids[t, k]`,
        x `[T, hidden]`, weights `[T, k]` fp32. The reference dequantizes the stacks (kept by the weight cache)
        and runs each expert that any token picked on the tokens that picked it.

        `shared`: an always-on shared expert (a SwiGLU block with `gate_proj`, `up_proj` and `down_proj`,
        callable on x) added to the routed sum, behind `sigmoid(shared_logit)` (`[T, 1]`) where given: the sum
        is `add_sigmoid_gated(routed, shared(x), shared_logit)` or `routed + shared(x)`. In the op, so that a
        backend may run the shared expert in the routed experts' launches."""
        return add_shared_expert(self, self._routed_swiglu(x, gate_exps, up_exps, down_exps, weights, ids), x, shared,
                                 shared_logit)

    def _routed_swiglu(self, x: torch.Tensor, gate_exps: Weight, up_exps: Weight, down_exps: Weight,
                       weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.dense(gate_exps), self.dense(up_exps), self.dense(down_exps)
        out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
        for expert in torch.unique(ids).tolist():
            token, slot = torch.where(ids == expert)
            rows = x[token]
            y = F.linear(self.silu_mul(F.linear(rows, gate[expert]), F.linear(rows, up[expert])), down[expert])
            out.index_add_(0, token, y.float() * weights[token, slot, None])
        return out.to(x.dtype)

    def moe_experts_swiglu_paged(self, x: torch.Tensor, gate: Any, up: Any, down: Any, weights: torch.Tensor,
                                 ids: torch.Tensor, shared: Any = None,
                                 shared_logit: torch.Tensor | None = None) -> torch.Tensor:
        """`moe_experts_swiglu` over paged stacks (Spark's `ExpertPages`: a few experts in device slots, every
        expert in a host stack, a device table `where[e]`, the slot holding expert e or -1): expert e's blocks
        are slot `where[e]`'s where it is resident, else host row e; equal bit for bit to the op over the whole
        stack. The reference gathers the chosen experts' rows (a host sync: no graph records it) and runs the
        op on them, in the same expert order; it counts the routed pairs into the first stack's `counts`."""
        gate.count(ids)
        chosen, local = torch.unique(ids, return_inverse=True)
        return self.moe_experts_swiglu(x, gate.gather(chosen), up.gather(chosen), down.gather(chosen), weights,
                                       local.reshape(ids.shape), shared, shared_logit)

    def sigmoid_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """An output gate: `x * sigmoid(gate)`."""
        return x * self.sigmoid(gate)

    def add_sigmoid_gated(self, base: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """A gated branch joining a sum: `base + x * sigmoid(gate)`, `gate` one logit a row (`[..., 1]`)."""
        return base + x * self.sigmoid(gate)

    def gated_rms_norm(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """A gated output norm, norm before gate: `rms_norm(x) * silu(z)` over the last dim (linear-attention
        mixers' output norm)."""
        return self.rms_norm(x, weight, eps) * self.silu(z)

    def qk_norm_rope(
        self, query: torch.Tensor, key: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
        positions: torch.Tensor, rot_dim: int, theta: float, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm then NeoX RoPE of queries `[B, T, Hq, D]` and keys `[B, T, Hkv, D]`."""
        query = self.rope_neox(self.rms_norm(query, q_norm, eps), positions, rot_dim, theta)
        key = self.rope_neox(self.rms_norm(key, k_norm, eps), positions, rot_dim, theta)
        return query, key

    # -- normalisation ---------------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """`x / sqrt(mean(x^2) + eps) * weight` over the last dim, computed in fp32 (written into `out`, a
        tensor like x, if given).

        GGUF stores zero-centred norm weights (Qwen3.5's, Gemma's) with the 1 already added, so one op
        serves both.
        """
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        result = (normed * weight.float()).to(x.dtype)
        return result if out is None else out.copy_(result)

    def l2norm(self, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """`x / sqrt(sum(x^2) + eps)` over the last dim, in fp32 (eps inside the root, as fla does)."""
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)

    # -- positions -------------------------------------------------------------------------------------

    def rope_neox(self, x: torch.Tensor, positions: torch.Tensor, rot_dim: int, theta: float) -> torch.Tensor:
        """Rotary embedding, NeoX style, on the first `rot_dim` dims of each head; the rest pass through.

        x `[B, T, H, D]`, positions `[T]` or `[B, T]` (integers). Dim `i < rot_dim/2` is paired with
        `i + rot_dim/2` and rotated by `position * theta^(-2i/rot_dim)`.
        """
        half = rot_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) * 2 / rot_dim))
        angles = positions.to(device=x.device, dtype=torch.float32)[..., None] * inv_freq  # [(B,) T, half]
        if angles.dim() == 2:
            angles = angles[None]
        cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]  # broadcast over heads
        x32 = x.float()
        first, second, rest = x32[..., :half], x32[..., half:rot_dim], x32[..., rot_dim:]
        rotated = torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)
        return rotated.to(x.dtype)

    # -- attention -------------------------------------------------------------------------------------

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        causal_offset: int | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Softmax attention with grouped-query heads.

        q `[B, Tq, Hq, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]` -> `[B, Tq, Hq, Dv]`. Query head `h`
        reads KV head `h // (Hq / Hkv)` (consecutive groups, as in transformers and ggml).
        `causal_offset=p`: query `i` sits at cache position `p + i` and sees keys `j <= p + i`.
        `mask`: bool `[Tq, Tk]` or `[B, Tq, Tk]`, True where a query may see a key (tree verification).
        Both may be given (they are combined); with neither, every query sees every key. Every query must
        see at least one key.
        """
        batch, q_len, q_heads, _ = q.shape
        k_len, kv_heads = k.shape[1], k.shape[2]
        group = q_heads // kv_heads
        # [B, Hkv, group, Tq, D] against [B, Hkv, 1, Tk, D]: GQA without materialising repeated K and V.
        qh = q.float().transpose(1, 2).reshape(batch, kv_heads, group, q_len, -1)
        kh = k.float().transpose(1, 2)[:, :, None]
        vh = v.float().transpose(1, 2)[:, :, None]
        scores = (qh @ kh.transpose(-1, -2)) * scale  # [B, Hkv, group, Tq, Tk]
        visible = None
        if causal_offset is not None:
            query_pos = torch.arange(q_len, device=q.device)[:, None] + causal_offset
            visible = torch.arange(k_len, device=q.device)[None, :] <= query_pos
        if mask is not None:
            mask = mask.to(device=q.device, dtype=torch.bool)
            visible = mask if visible is None else visible & mask
        if visible is not None:
            if visible.dim() == 3:  # [B, Tq, Tk] -> [B, 1, 1, Tq, Tk]
                visible = visible[:, None, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ vh  # [B, Hkv, group, Tq, Dv]
        out = out.reshape(batch, q_heads, q_len, -1).transpose(1, 2)
        return out.to(q.dtype)

    def block_sparse_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, config: Any = None,
                               mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Causal prefill attention of one sequence over FlashPrefill's kept key blocks only: q `[T, Hq, D]`,
        k `[T, Hkv, D]`, v `[T, Hkv, Dv]` -> `[T, Hq, Dv]`. `config`: a `block_sparse.BlockSparseConfig`
        (default its defaults); `mask`: bool `[Hq, blocks, blocks]`, else the config's selection. See
        `lucebox_core.block_sparse`."""
        from . import block_sparse

        return block_sparse.block_sparse_attention(q, k, v, config, mask, scale=scale)

    def decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, *, scale: float
    ) -> torch.Tensor:
        """One query token against a fixed-size window of a KV buffer, masked on the device (the static
        decode step that a CUDA graph replays: no host value decides a shape or a mask).

        q `[1, 1, Hq, D]`; k `[N, Hkv, D]`, v `[N, Hkv, Dv]`, the first N rows of the cache (rows past
        `position` may hold anything), each either values or a quantized cache's raw rows (uint8 Q8_0, Q4_0
        or TQ3_0 blocks, see `kv_quant.stored_format`; decoded here, a kernel reads them as stored);
        `position` `[1]` long, on the device: the query's position, which sees keys `0 .. position`. Equals `attention(q, k[None], v[None], scale=scale, causal_offset=p)`.
        The products run in q's dtype, so the window is read once rather than upcast; softmax in fp32.
        """
        from .kv_quant import decode_stored

        # A quantized cache's raw rows (uint8, see `kv_quant.stored_format`) are decoded to q's dtype first.
        k, v = (decode_stored(t, q.dtype) for t in (k, v))
        rows, kv_heads, head_dim = k.shape
        q_heads = q.shape[2]
        # The query heads that share a KV head are the rows of one small matrix product against it.
        queries = q.reshape(kv_heads, q_heads // kv_heads, head_dim)
        keys = k.to(q.dtype).permute(1, 2, 0)  # [Hkv, D, N], a strided view: no copy
        values = v.to(q.dtype).permute(1, 0, 2)  # [Hkv, N, Dv]
        scores = torch.bmm(queries, keys).float() * scale  # [Hkv, group, N]
        unseen = torch.arange(rows, device=k.device) > position.reshape(1)
        probs = torch.softmax(scores.masked_fill(unseen, float("-inf")), dim=-1)
        out = torch.bmm(probs.to(q.dtype), values)  # [Hkv, group, Dv]
        return out.reshape(1, 1, q_heads, -1)

    def tree_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        position: torch.Tensor,
        visible: torch.Tensor,
        *,
        scale: float,
        node_k: torch.Tensor | None = None,
        node_v: torch.Tensor | None = None,
        ring: int = 0,
    ) -> torch.Tensor:
        """The nodes of a candidate tree against a fixed-size window of a KV buffer (static verification):
        `decode_attention` for N queries.

        q `[1, N, Hq, D]`; k `[W, Hkv, D]`, v `[W, Hkv, Dv]`, the first W rows of the cache, where rows
        `0 .. position-1` hold the committed prefix and rows `position + i` node i's K/V (insertion order);
        `position` `[1]` long on the device; `visible` bool `[N, N]`, True where node n may see node i
        (its ancestors and itself). Node n sees every committed row and the node rows `visible[n]` allows;
        rows from `position + N` on are never seen. Products in q's dtype, softmax in fp32. k and v may be
        a quantized cache's raw rows, as for `decode_attention`.

        `node_k`, `node_v` `[N, Hkv, D|Dv]` (values): the nodes' rows, when the tree is not written into the
        cache (which then holds committed rows only). `ring` (with them): the cache is a sliding layer's ring
        of `ring` slots, position p in slot p % ring; node n, at position `position + depth(n)`, sees the
        committed positions of the last `ring` (its own included). One node that sees itself, with its own
        rows, is the decode step over such a cache.
        """
        from .kv_quant import decode_stored

        k, v = (decode_stored(t, q.dtype) for t in (k, v))
        if (node_k is None) != (node_v is None) or (ring and node_k is None):
            raise ValueError("tree_attention: node_k and node_v come together, and a ring needs them")
        if node_k is not None:
            return self._tree_attention_node_rows(q, k, v, position, visible, scale, node_k, node_v, ring)
        rows, kv_heads, head_dim = k.shape
        _, nodes, q_heads, _ = q.shape
        group = q_heads // kv_heads
        queries = q[0].reshape(nodes, kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(kv_heads, nodes * group, head_dim)
        keys = k.to(q.dtype).permute(1, 2, 0)  # [Hkv, D, W]
        values = v.to(q.dtype).permute(1, 0, 2)  # [Hkv, W, Dv]
        scores = torch.bmm(queries, keys).float() * scale  # [Hkv, N * group, W]
        row = torch.arange(rows, device=k.device)
        start = position.reshape(1)
        node_of_row = row - start  # >= 0 on node rows
        in_tree = (node_of_row >= 0) & (node_of_row < nodes)
        tree_visible = visible.to(k.device)[:, node_of_row.clamp(0, nodes - 1)] & in_tree  # [N, W]
        seen = (row < start)[None, :] | tree_visible  # [N, W]
        seen = seen[:, None, :].expand(nodes, group, rows).reshape(nodes * group, rows)
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out = torch.bmm(probs.to(q.dtype), values)  # [Hkv, N * group, Dv]
        return out.reshape(kv_heads, nodes, group, -1).permute(1, 0, 2, 3).reshape(1, nodes, q_heads, -1)

    def _tree_attention_node_rows(self, q, k, v, position, visible, scale, node_k, node_v, ring):
        """`tree_attention` with the nodes' rows apart from the cache's: attention over [cache rows | node rows]
        with each node's mask (a ring slot's position by formula: the latest committed p with p % ring == s)."""
        rows = k.shape[0]
        nodes = q.shape[1]
        visible = visible.to(device=k.device, dtype=torch.bool)
        start = position.reshape(1).to(k.device)
        node_positions = start + visible.sum(dim=1) - 1  # a node's depth is its ancestors' count
        slots = torch.arange(rows, device=k.device)
        held = start - 1 - torch.remainder(start - 1 - slots, ring) if ring else slots
        seen = ((held >= 0) & (held < start))[None, :].expand(nodes, rows)
        if ring:
            seen = seen & (node_positions[:, None] - held[None, :] < ring)
        mask = torch.cat([seen, visible], dim=1)
        keys = torch.cat([k.to(q.dtype), node_k.to(q.dtype)])[None]
        values = torch.cat([v.to(q.dtype), node_v.to(q.dtype)])[None]
        return self.attention(q, keys, values, scale=scale, mask=mask)
