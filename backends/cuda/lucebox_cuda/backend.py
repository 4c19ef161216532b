"""`CudaBackend`: one NVIDIA GPU, its weights and its NVRTC-compiled CUDA kernels.

The ops the GPU runs as kernels are registered by name in `op_kernels.py` (the `lucebox_op_kernels` hook): each
with the check of which arguments it takes; anything else (a shape or dtype a kernel does not take, an op
without a kernel) runs the reference, `TorchBackend`'s or a family's, which stays the oracle every kernel
is checked against (`scripts/cuda_check.py`). This class holds what those kernels share: the device, the
weights uploaded in their GGUF formats, the compiled modules and their launches, the matrix-vector products.

Weights stay in their GGUF block formats on the GPU: the raw bytes of each `QuantTensor` are uploaded
once and kept; the matrix-vector kernels dequantize them in registers. Batches of more than `MAX_BATCH`
activation rows (prefill) dequantize a bounded tile of weight rows at a time into a scratch buffer and
multiply it with torch (tensor cores through cuBLAS).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from lucebox_core.errors import LuceboxError
from lucebox_core.quants import QuantTensor
from lucebox_core.torch_backend import TorchBackend, Weight

from . import catalogue, pdl, tiled_weights
from .nvrtc import (DEFAULT_OPTIONS, CudaModule, Float, Int, Int64, KernelProgram, Pointer, compile_program, ensure_context,
                    launch)

ALIGNMENT = 16  # the kernels read weights and activations with up-to-16-byte vector loads
# A matvec variant every product uses where it exists (bisecting, benchmarking); empty: the measured defaults.
_FORCED_MATVEC_VARIANT = os.environ.get("LUCEBOX_MATVEC_VARIANT", "")
# "1": products of GIVEN_SUMS_MIN_TILE rows or more take their activations' sub-block sums from a kernel run once a
# product (`catalogue.with_given_sums`: the same bits). Off by default: the 27B's verify passes measured no faster
# (session 37: the 24-row products 8-24% faster, the sums kernels' launches as much again).
_GIVEN_SUMS = os.environ.get("LUCEBOX_GIVEN_SUMS", "0") == "1"
GIVEN_SUMS_FLOATS = 1 << 18  # the sums scratch, 1 MiB: a 64-row product of 65,536-column Q6_K rows needs 1 << 18
# A prefill product's weight rows are dequantized into a scratch tile of at most this many bytes, then
# multiplied by cuBLAS: 192 MiB holds the 27B's largest matrix (17408 x 5120 in bf16) whole, so each product is
# one dequant and one GEMM. At 64 MiB a 256-token piece of the 27B took 888 of each for 336 products (the
# H200, session 14: ~180 ms of host time against 75 ms of GPU work).
PREFILL_TILE_BYTES = 192 * 1024 * 1024


def _current_raw_stream(device_index: int) -> int:
    """The handle of torch's current stream on the device (a capture's stream while recording a graph)."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is None:  # not a private name every torch build keeps: the public way
        return torch.cuda.current_stream(device_index).cuda_stream
    return getter(device_index)


def _fused_prefill() -> bool:
    """`LUCEBOX_FUSED_PREFILL=1`: Q4_K prefill products through `triton_quant_matmul` (read at each call)."""
    return os.environ.get("LUCEBOX_FUSED_PREFILL", "0") not in ("", "0")


def device_arch(device: torch.device) -> str:
    """The NVRTC architecture name of a CUDA device: `sm_90` for compute capability 9.0."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _aligned(tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() % ALIGNMENT == 0


def matvec_operands(x: torch.Tensor, out: torch.Tensor | None, out_features: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A product's activations contiguous and 16-byte aligned (copied where not), and its output: `out` checked
    (contiguous, [rows, out_features], x's dtype) or a new one."""
    x = x.contiguous()
    if not _aligned(x):
        x = x.clone()
    shape = (x.shape[0], out_features)
    if out is None:
        return x, torch.empty(shape, dtype=x.dtype, device=device)
    if out.shape != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {shape}")
    return x, out


# The shared memory a paged tensor-core expert kernel stages a missed expert's 16 rows in (moe_matvec_mma.cu's
# `staged_expert`), at most: the 48 KiB a block may have without an opt-in, less 4 KiB for the kernel's own
# static shared memory (the body's partial sums: up to 2.3 KiB), which counts against the same limit (a Q4_K row
# of 2,048 columns takes 18 KiB). Longer rows are read in place.
STAGED_LIMIT = 44 * 1024


def _staged_bytes(kernel: Any, row_bytes: int) -> int | None:
    """The paged kernel's `staged_bytes` (and its dynamic shared memory): 16 rows of the stack where they fit,
    else 0 (read in place); None for the CUDA-core kernel, which takes no such argument."""
    if kernel.program.file != "moe_matvec_mma.cu":
        return None
    staged = kernel.rows_per_block * row_bytes
    # The SwiGLU kinds hold the pair's activation row in static shared memory beside the staged rows.
    limit = STAGED_LIMIT - (2 * catalogue.MOE_SWIGLU_MAX_COLS if "swiglu" in kernel.name else 0)
    return staged if staged <= limit else 0


def _counts(pages: Any) -> Any:
    """The paged kernels' `counts` argument: the routing counts row of Spark's paged stack (int64 on the device,
    contiguous), or null."""
    counts = pages.counts
    if counts is None:
        return Pointer(0)
    if counts.dtype != torch.long or not counts.is_contiguous() or counts.device != pages.where.device:
        raise ValueError(f"a paged stack's counts must be a contiguous int64 row on {pages.where.device}, not "
                         f"{counts.dtype} on {counts.device}")
    return Pointer(counts.data_ptr())


class CudaBackend(TorchBackend):
    """Ops for one NVIDIA GPU. `dtype` is the activation dtype (bf16 by default; f16 and f32 work too)."""

    name = "cuda"
    # NVRTC options of every kernel (scripts/hip_shared_source_check.py adds -DLUCEBOX_PORTABLE_GENERIC).
    compile_options: tuple[str, ...] = DEFAULT_OPTIONS
    # The expert products on tensor cores (moe_matvec_mma.cu) for the K-quants; HIP's sources have no mma.sync.
    tensor_core_moe = True
    # Weights `tiled_weights.tiles_weight` picks are held in the tiled layout of matvec_tiled.cu (tensor cores too).
    tiles_weights = True

    def __init__(
        self,
        device: str | torch.device = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        weight_cache_bytes: int | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise LuceboxError(f"the {self.name} backend runs on a CUDA device, not {str(device)!r}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device, dtype, weight_cache_bytes)
        self.arch = self.device_arch()
        self._modules: dict[KernelProgram, CudaModule] = {}
        self._functions: dict[str, Any] = {}
        # id -> (host, device copy: a QuantTensor of GGUF's rows, or the tiled bytes of a weight held tiled)
        self._device_weights: dict[int, tuple[QuantTensor, QuantTensor | torch.Tensor]] = {}

    def device_arch(self) -> str:
        """The target the kernels are compiled for (`sm_90`; the HIP backend's: `gfx1100`)."""
        return device_arch(self.device)

    def __repr__(self) -> str:
        return f"CudaBackend(device={str(self.device)!r}, arch={self.arch}, dtype={self.dtype})"

    # -- kernels ---------------------------------------------------------------------------------------

    def kernel(self, program: KernelProgram, name: str) -> Any:
        """The loaded kernel `name` of `program`, compiled (or read from the disk cache) on first use."""
        function = self._functions.get(name)
        if function is None:
            module = self._modules.get(program)
            if module is None:
                cubin = compile_program(program, self.arch, self.compile_options)
                with torch.cuda.device(self.device):  # a module loads into the current context: this device's
                    module = self._modules[program] = CudaModule(cubin, self.device.index)
            function = self._functions[name] = module.function(name)
        return function

    def ring_kernel(self, program: KernelProgram, name: str, shared_bytes: int) -> Any:
        """`kernel(program, name)` allowed `shared_bytes` of dynamic shared memory (a ring of weight stages)."""
        function = self.kernel(program, name)
        ready = self.__dict__.setdefault("_ring_shared", {})
        if ready.get(name, -1) < shared_bytes:
            from cuda.bindings import driver

            attribute = driver.CUfunction_attribute
            # Beyond 48 KiB a kernel must opt in; a full shared-memory carve-out lets several blocks' rings
            # share an SM (the weight bypasses L1 anyway).
            for key, value in ((attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
                               (attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)):
                (result,) = driver.cuFuncSetAttribute(function, key, value)
                if int(result) != 0:
                    raise LuceboxError(f"cuFuncSetAttribute({key.name}) on {name} failed: {result}")
            ready[name] = shared_bytes
        return function

    def _launch(self, kernel: tuple[KernelProgram, str], grid: int | tuple[int, int, int], block: int,
                *args: Any, shared_bytes: int = 0) -> None:
        """Launch a kernel of `program` on the device's current torch stream, with `shared_bytes` of dynamic
        shared memory (the HIP backend's override launches through HIP; the kernels' Python callers are the
        same)."""
        function = self.kernel(*kernel)
        index = self.device.index
        ensure_context(index)
        # torch's raw getter, as Triton's launcher uses it: `torch.cuda.current_stream(device)` builds a
        # Stream object and normalises the device each call (~20 us of host time a launch on the H200's
        # host, a few hundred launches a prefill piece that the host, not the GPU, paces).
        stream = _current_raw_stream(index)
        # Every NVRTC kernel waits for the kernel ahead itself (`lucebox_wait_prior_grid`): PDL where it is on.
        dependent = pdl.enabled(self.device)
        if torch.cuda.current_device() == index:
            launch(function, grid, block, args, stream=stream, shared_bytes=shared_bytes, pdl=dependent)
            return
        # A model split over GPUs launches on a device other than the thread's current one: the driver needs
        # this device's (primary) context current, which making the device current gives; torch's scope
        # puts the thread's device back afterwards.
        with torch.cuda.device(self.device):
            launch(function, grid, block, args, stream=stream, shared_bytes=shared_bytes, pdl=dependent)

    # -- weights ---------------------------------------------------------------------------------------

    def holds_tiled(self, weight: Any) -> bool:
        """Whether this backend holds `weight` tiled (`device_tiles`), not as GGUF's rows (`device_weight`): decided
        once a weight (LUCEBOX_TILED_WEIGHTS is read then), as every product asks."""
        choices = self.__dict__.setdefault("_tiled_choices", {})
        entry = choices.get(id(weight))
        if entry is None or entry[0] is not weight:
            entry = choices[id(weight)] = (weight, self.tiles_weights and tiled_weights.tiles_weight(
                weight, bulk=tiled_weights.bulk_copies(self.arch)))
        return entry[1]

    def device_tiles(self, weight: QuantTensor) -> torch.Tensor:
        """`weight`'s tiled copy on this GPU (`tiled_weights`), made on first use and kept: the only copy held."""
        entry = self._device_weights.get(id(weight))
        if entry is not None and entry[0] is weight:
            return entry[1]
        tiles = tiled_weights.upload(weight, self.device)
        self._device_weights[id(weight)] = (weight, tiles)  # beside the row-major copies (`device_weight_bytes`)
        return tiles

    def device_weight(self, weight: QuantTensor) -> QuantTensor:
        """`weight`'s raw bytes on this GPU, 16-byte aligned, uploaded on first use and kept."""
        if self.holds_tiled(weight):
            raise LuceboxError(f"weight {weight.name!r} is held tiled on the GPU (for its products); its GGUF rows "
                               f"are read through dequantize_rows / lookup_rows (LUCEBOX_TILED_WEIGHTS=0 keeps every "
                               f"weight row-major)")
        entry = self._device_weights.get(id(weight))
        if entry is not None and entry[0] is weight:
            return entry[1]
        on_device = weight
        if weight.data.device != self.device or not _aligned(weight.data):
            # One device copy: the upload itself where it lands aligned (a fresh allocation does), a clone
            # only of data already here. Uploading and then cloning held two copies of each weight for a
            # moment: ~1 GiB more at the peak for 27B's output head, which is uploaded last.
            data = weight.data.to(self.device, non_blocking=False)
            if data.data_ptr() == weight.data.data_ptr() or not _aligned(data):
                data = data.clone()
            on_device = QuantTensor(weight.name, weight.ggml_type, weight.shape, data)
        # The entry holds `weight` itself so that its id cannot be reused by another object.
        self._device_weights[id(weight)] = (weight, on_device)
        return on_device

    @property
    def device_weight_bytes(self) -> int:
        """Bytes of raw GGUF weight data held on the GPU."""
        return sum(copy.nbytes for _, copy in self._device_weights.values())

    def kernel_format(self, x: torch.Tensor, weight: Weight) -> str | None:
        """The kernel weight-format name if the kernels take this (x, weight) pair, else None."""
        if not isinstance(weight, QuantTensor) or len(weight.shape) != 2:
            return None
        weight_format = catalogue.WEIGHT_FORMATS.get(weight.ggml_type)
        if weight_format is None or x.dtype not in catalogue.ACTIVATIONS or x.device != self.device:
            return None
        if x.shape[-1] != weight.shape[1] or weight.shape[1] % catalogue.ROW_MULTIPLE[weight_format]:
            return None
        return weight_format

    # -- matrix products on GGUF blocks (the `linear` kernel in op_kernels.py runs them) ---------------------

    def matvec(self, x: torch.Tensor, weight: QuantTensor, weight_format: str | None = None, *,
               out: torch.Tensor | None = None, variant: str | None = None) -> torch.Tensor:
        """`x @ weight.T` for x `[rows, in]` with 1 <= rows <= MAX_BATCH, reading each weight byte once.

        `out`: a contiguous `[rows, out_features]` tensor of x's dtype to write into (default: a new one).
        `variant`: one of `catalogue.MATVEC_VARIANTS` ("pipe": the streamed tensor-core kernel in its default
        shape; "mma"/"mma8": register-prefetch tensor-core kernels; "simt": CUDA cores, every format) or a
        streamed variant by name ("pipe_w4_d4_m1_k2"); by default `catalogue.default_variant`, or the variant
        named by `LUCEBOX_MATVEC_VARIANT` where it exists for the format (for bisecting a kernel's effect on a
        whole model: "mma" runs every K-quant product on the register-prefetch kernel).

        Graph-capturable: a split-K launch's scratch (fp32 partials and arrival counters, which the kernel
        leaves zeroed) is allocated on first use outside capture and kept; if a capture needs more than is
        held, the launch runs unsplit instead (same kernel, one K-slice).
        """
        weight_format = weight_format or catalogue.WEIGHT_FORMATS[weight.ggml_type]
        if self.holds_tiled(weight):
            return self._tiled_matvec(x, weight, weight_format, out, variant)
        if variant is None and _FORCED_MATVEC_VARIANT:
            # Decided by the shape, never the batch, as the default is (decode and verify stay alike): a
            # tensor-core variant where one serves every batch, two row groups in their one-group form.
            activation = catalogue.ACTIVATIONS[x.dtype]
            if _FORCED_MATVEC_VARIANT == "simt" or catalogue.has_mma_kernel(weight_format, activation,
                                                                           catalogue.MAX_BATCH):
                pipe = catalogue.PipeVariant.parse(_FORCED_MATVEC_VARIANT)
                variant = (attrs.evolve(pipe, row_groups=1).name if pipe is not None and pipe.row_groups > 1
                           else _FORCED_MATVEC_VARIANT)
        out_features = weight.shape[0]
        x, out = matvec_operands(x, out, out_features, self.device)
        rows, in_features = x.shape
        data = self.device_weight(weight).data
        state = self.__dict__.setdefault("_matvec_state", {"scratch": None, "counters": None})
        if "max_shared" not in state:
            from cuda.bindings import driver

            result, limit = driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self.device.index)
            # Less a margin for the kernels' own static shared memory (a few bytes), which counts too.
            state["max_shared"] = (int(limit) if int(result) == 0 else catalogue.STATIC_SHARED_LIMIT) - 1024
        # The choice is a function of these values alone; an eager forward asks it for every product (a 3-token
        # forward of the 27B: 337 products, ~30 ms of host time spent choosing on the H200 before this cache).
        choice = (weight_format, x.dtype, rows, out_features, variant, in_features, _GIVEN_SUMS)
        kernel = state.setdefault("chosen", {}).get(choice)
        if kernel is None:
            kernel = state["chosen"][choice] = catalogue.matvec_kernel(
                weight_format, catalogue.ACTIVATIONS[x.dtype], rows, out_features, variant,
                in_features=in_features, max_shared_bytes=state["max_shared"], given=_GIVEN_SUMS)
        args = [Pointer(data.data_ptr()), Pointer(x.data_ptr()), Pointer(out.data_ptr()), Int(out_features),
                Int(in_features), Int(rows)]
        given = []
        if kernel.sums is not None:
            sums = self._given_sums_scratch(state, kernel.sums.floats(in_features))
            if sums is None:  # captured before any eager product made the scratch: the same product without it
                kernel = catalogue.matvec_launch(weight_format, catalogue.ACTIVATIONS[x.dtype], rows, out_features,
                                                 variant, in_features=in_features, max_shared_bytes=state["max_shared"])
            else:
                self._launch((kernel.sums.program, kernel.sums.name), kernel.sums.grid(in_features), 128,
                             Pointer(x.data_ptr()), Pointer(sums.data_ptr()), Int(in_features), Int(rows))
                given = [Pointer(sums.data_ptr())]
        if not kernel.streamed:
            self._launch((kernel.program, kernel.name), kernel.grid, kernel.block, *args, *given)
            return out
        ensure_context(self.device.index)
        function = self.ring_kernel(kernel.program, kernel.name, kernel.shared_bytes)
        slices, partials, counters = kernel.slices, 0, 0
        if slices > 1:
            need_partials, need_counters = slices * rows * out_features, kernel.grid
            scratch, arrivals = state["scratch"], state["counters"]
            if scratch is None or scratch.numel() < need_partials or arrivals.numel() < need_counters:
                if torch.cuda.is_current_stream_capturing():
                    scratch = arrivals = None
                    slices = 1
                else:
                    size = max(need_partials, 0 if scratch is None else scratch.numel())
                    count = max(need_counters, 0 if arrivals is None else arrivals.numel())
                    # Earlier buffers stay alive: graphs captured before may still point at them.
                    state.setdefault("retired", []).append((scratch, arrivals))
                    scratch = torch.empty(size, dtype=torch.float32, device=self.device)
                    # Zeroed once; every launch leaves its counters at zero again.
                    arrivals = torch.zeros(count, dtype=torch.int32, device=self.device)
                    state["scratch"], state["counters"] = scratch, arrivals
            if slices > 1:
                partials, counters = scratch.data_ptr(), arrivals.data_ptr()
        launch(function, (kernel.grid, slices, 1), kernel.block, [*args, Pointer(partials), Pointer(counters), *given],
               stream=torch.cuda.current_stream(self.device).cuda_stream, shared_bytes=kernel.shared_bytes)
        return out

    def _given_sums_scratch(self, state: dict, floats: int) -> torch.Tensor | None:
        """The float scratch given sums go through (one, reused by every product: each sums kernel waits for the
        product ahead to finish before writing), made on first use outside a capture; None inside one."""
        sums = state.get("sums")
        if sums is None and not torch.cuda.is_current_stream_capturing():
            sums = state["sums"] = torch.empty(GIVEN_SUMS_FLOATS, dtype=torch.float32, device=self.device)
        if sums is None or sums.numel() < floats:
            return None
        return sums

    def _tiled_matvec(self, x: torch.Tensor, weight: QuantTensor, weight_format: str, out: torch.Tensor | None,
                      variant: str | None) -> torch.Tensor:
        """`matvec` of a weight held tiled: matvec_tiled.cu at every batch (one arithmetic class, so a verify row
        gets the decode step's bits), fp32 activations 8 rows a launch (the tensor-core tile's limit)."""
        if variant is not None:
            raise ValueError(f"weight {weight.name!r} is held tiled: matvec variant {variant!r} reads GGUF's rows "
                             f"(LUCEBOX_TILED_WEIGHTS=0 keeps every weight row-major)")
        out_features = weight.shape[0]
        x, out = matvec_operands(x, out, out_features, self.device)
        rows, in_features = x.shape
        tiles = self.device_tiles(weight)
        activation = catalogue.ACTIVATIONS[x.dtype]
        step = catalogue.MMA_MAX_BATCH[activation]
        bulk = tiled_weights.bulk_copies(self.arch)
        for first in range(0, rows, step):
            count, shared, given = min(step, rows - first), 0, []
            if bulk and count <= tiled_weights.BULK_MAX_BATCH:  # the same class and bits, tiles in flight in shared
                program, name, shared = catalogue.matvec_bulk(weight_format, activation, count,
                                                              tiled_weights.bulk_depth())
                self.ring_kernel(program, name, shared)
                rows_per_block = 16
            else:
                program, name, rows_per_block, sums = catalogue.matvec_tiled(weight_format, activation, count,
                                                                             _GIVEN_SUMS)
                scratch = None if sums is None else self._given_sums_scratch(
                    self.__dict__.setdefault("_matvec_state", {"scratch": None, "counters": None}),
                    sums.floats(in_features))
                if sums is not None and scratch is None:  # captured before the scratch was made: the plain form
                    program, name, rows_per_block, sums = catalogue.matvec_tiled(weight_format, activation, count)
                if sums is not None:
                    self._launch((sums.program, sums.name), sums.grid(in_features), 128, Pointer(x[first].data_ptr()),
                                 Pointer(scratch.data_ptr()), Int(in_features), Int(count))
                    given = [Pointer(scratch.data_ptr())]
            self._launch((program, name), -(-out_features // rows_per_block), 128, Pointer(tiles.data_ptr()),
                         Pointer(x[first].data_ptr()), Pointer(out[first].data_ptr()), Int(out_features),
                         Int(in_features), Int(count), *given, shared_bytes=shared)
        return out

    def expert_matvec(self, x: torch.Tensor, experts: Any, ids: torch.Tensor, x_group: int, *,
                      extra: QuantTensor | None = None, extra_pairs: int = 0, extra_x: int = 0,
                      up: torch.Tensor | None = None) -> torch.Tensor:
        """Mixture-of-experts products for few tokens: for each routed pair `s` (flat `ids` `[S]`, long, on the
        device), `x[s // x_group] @ experts[ids[s]].T`, from a stack `experts` `[E, rows, cols]` in its GGUF
        format, reading only the chosen experts' blocks. x `[S / x_group, cols]` -> `[S, rows]`.
        `experts` may be Spark's paged stack (`lucebox_core.spark.ExpertPages`: device slots, a pinned host copy
        of every expert and the device table expert -> slot): the paged kernel reads each expert where the table
        says, the same bytes and arithmetic, and adds each routed pair to its `counts` (Spark's routing counts,
        where set). Graph-capturable: no host value depends on the ids (or the table).

        `extra` (a shared expert `[rows, cols]` of the stack's format, where `takes_extra_expert` says so):
        `extra_pairs` more rows of output, row `S + j` = `x[extra_x + j] @ extra.T`, in the same launch.

        `up` (the down product of a SwiGLU block, where `takes_swiglu` says so): `x` is the gate products and `up`
        the up products of the same shape; the kernel computes each row `silu(x) * up` itself, rounded as
        `silu_mul` rounds it (one launch fewer)."""
        pages = None
        if not isinstance(experts, QuantTensor):
            pages, experts = experts, experts.pool
        weight_format = catalogue.WEIGHT_FORMATS[experts.ggml_type]
        n_experts, rows, cols = experts.shape
        x = x.contiguous()
        if not _aligned(x):
            x = x.clone()
        inputs = [x]
        if up is not None:
            if up.shape != x.shape or up.dtype != x.dtype:
                raise ValueError(f"up products {tuple(up.shape)} {up.dtype} beside gate {tuple(x.shape)} {x.dtype}")
            up = up.contiguous()
            inputs.append(up if _aligned(up) else up.clone())
        ids = ids.reshape(-1).to(torch.long).contiguous()
        routed = ids.numel()
        pairs = routed + (extra_pairs if extra is not None else 0)
        out = torch.empty(pairs, rows, dtype=x.dtype, device=self.device)
        if pairs == 0:
            return out
        data = self.device_weight(experts).data
        kind = ("" if pages is None else "paged") if up is None else ("swiglu" if pages is None else "paged_swiglu")
        kernel = catalogue.moe_matvec_kernel(weight_format, catalogue.ACTIVATIONS[x.dtype], cols, kind,
                                             tensor_cores=self.tensor_core_moe)
        grid = (-(-rows // kernel.rows_per_block), pairs, 1)
        tail = [*(Pointer(t.data_ptr()) for t in inputs), Pointer(out.data_ptr()), Pointer(ids.data_ptr()),
                Int64(data.numel() // n_experts), Int(rows), Int(cols), Int(x_group)]
        tail += self._extra_args(kernel, [extra], experts, routed, extra_x)
        if pages is None:
            self._launch((kernel.program, kernel.name), grid, kernel.threads, Pointer(data.data_ptr()), *tail)
        else:  # the host stack's pinned address is the device's too (unified addressing)
            staged = _staged_bytes(kernel, data.numel() // n_experts // rows)
            self._launch((kernel.program, kernel.name), grid, kernel.threads, Pointer(data.data_ptr()),
                         Pointer(pages.host.data_ptr()), Pointer(pages.where.data_ptr()), _counts(pages),
                         *([Int(staged)] if staged is not None else []), *tail, shared_bytes=staged or 0)
        return out

    def expert_matvec_pair(self, x: torch.Tensor, first: Any, second: Any, ids: torch.Tensor, x_group: int, *,
                           extra: tuple[QuantTensor, QuantTensor] | None = None, extra_pairs: int = 0,
                           extra_x: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`expert_matvec` over two stacks of one format and shape (a SwiGLU block's gate and up) in one launch,
        the same bits as two; None where the two cannot pair (formats or shapes differ, or one is Spark's paged
        stack and the other not, or their residency tables differ): the caller runs two launches then. Paged,
        the first stack's `counts` gets the routed pairs (as `expert_matvec`'s).
        `extra`: a shared expert's (gate, up), as `expert_matvec`'s `extra` for each stack."""
        paged = not isinstance(first, QuantTensor)
        if paged != (not isinstance(second, QuantTensor)):
            return None
        if paged:
            if first.where is not second.where:
                return None
            stacks = (first.pool, second.pool)
        else:
            stacks = (first, second)
        if stacks[0].ggml_type != stacks[1].ggml_type or tuple(stacks[0].shape) != tuple(stacks[1].shape):
            return None
        weight_format = catalogue.WEIGHT_FORMATS[stacks[0].ggml_type]
        n_experts, rows, cols = stacks[0].shape
        x = x.contiguous()
        if not _aligned(x):
            x = x.clone()
        ids = ids.reshape(-1).to(torch.long).contiguous()
        routed = ids.numel()
        pairs = routed + (extra_pairs if extra is not None else 0)
        out = torch.empty(2, pairs, rows, dtype=x.dtype, device=self.device)
        if pairs == 0:
            return out[0], out[1]
        data = [self.device_weight(stack).data for stack in stacks]
        expert_bytes = data[0].numel() // n_experts  # the same for both: one format and shape
        kernel = catalogue.moe_matvec_kernel(weight_format, catalogue.ACTIVATIONS[x.dtype], cols,
                                             "pair_paged" if paged else "pair", tensor_cores=self.tensor_core_moe)
        grid = (-(-rows // kernel.rows_per_block), pairs, 2)
        tail = [Pointer(x.data_ptr()), Pointer(out[0].data_ptr()), Pointer(out[1].data_ptr()),
                Pointer(ids.data_ptr()), Int64(expert_bytes), Int(rows), Int(cols), Int(x_group)]
        tail += self._extra_args(kernel, list(extra) if extra is not None else [None, None], stacks[0], routed,
                                 extra_x)
        if not paged:
            self._launch((kernel.program, kernel.name), grid, kernel.threads,
                         Pointer(data[0].data_ptr()), Pointer(data[1].data_ptr()), *tail)
        else:  # the host stacks' pinned addresses are the device's too (unified addressing)
            staged = _staged_bytes(kernel, expert_bytes // rows)
            self._launch((kernel.program, kernel.name), grid, kernel.threads,
                         Pointer(data[0].data_ptr()), Pointer(first.host.data_ptr()), Pointer(data[1].data_ptr()),
                         Pointer(second.host.data_ptr()), Pointer(first.where.data_ptr()), _counts(first),
                         *([Int(staged)] if staged is not None else []), *tail, shared_bytes=staged or 0)
        return out[0], out[1]

    def takes_swiglu(self, stack: Any, activation: torch.dtype) -> bool:
        """Whether `expert_matvec` over `stack` (or Spark's paged stack: a down stack) can take the gate and up
        products and compute the SwiGLU itself (`up`): switched on (`LUCEBOX_MOE_SWIGLU_DOWN=1`, off until
        measured on a GPU), a tensor-core format, 16-bit activations, rows the kernel holds."""
        stack = stack if isinstance(stack, QuantTensor) else getattr(stack, "pool", None)
        if os.environ.get("LUCEBOX_MOE_SWIGLU_DOWN", "0") != "1" or not isinstance(stack, QuantTensor):
            return False
        weight_format = catalogue.WEIGHT_FORMATS.get(stack.ggml_type)
        activation_name = catalogue.ACTIVATIONS.get(activation)
        if weight_format is None or activation_name is None or len(stack.shape) != 3:
            return False
        return catalogue.moe_swiglu_kernel(weight_format, activation_name, stack.shape[2],
                                           tensor_cores=self.tensor_core_moe)

    def takes_extra_expert(self, stack: Any, extra: Any, activation: torch.dtype) -> bool:
        """Whether the expert products over `stack` (or Spark's paged stack) can carry `extra` (a shared expert)
        as more pairs of the same launch: its format and shape are an expert's, and the launch is the
        tensor-core kernel (moe_matvec_mma.cu: the CUDA-core one has no extra pairs)."""
        stack = stack if isinstance(stack, QuantTensor) else getattr(stack, "pool", None)
        if not isinstance(stack, QuantTensor) or not isinstance(extra, QuantTensor):
            return False
        if extra.ggml_type != stack.ggml_type or tuple(extra.shape) != tuple(stack.shape[1:]):
            return False
        weight_format = catalogue.WEIGHT_FORMATS.get(stack.ggml_type)
        if weight_format is None or activation not in catalogue.ACTIVATIONS:
            return False
        return catalogue.moe_matvec_variant(weight_format, stack.shape[2], self.tensor_core_moe) != "simt"

    def _extra_args(self, kernel: Any, extras: list[QuantTensor | None], stack: QuantTensor, routed: int,
                    extra_x: int) -> list[Any]:
        """The tensor-core kernels' last arguments: the shared expert's weights (null: none), the routed pairs,
        the shared pairs' first activation row. The CUDA-core kernel has none (and takes no shared expert)."""
        if kernel.program.file != "moe_matvec_mma.cu":
            if any(extra is not None for extra in extras):
                raise ValueError(f"the {kernel.name} kernel takes no shared expert (see takes_extra_expert)")
            return []
        pointers = []
        for extra in extras:
            if extra is not None and (extra.ggml_type != stack.ggml_type or tuple(extra.shape) != tuple(stack.shape[1:])):
                raise ValueError(f"shared expert {extra.name!r} ({extra.ggml_type.name} {tuple(extra.shape)}) is not an "
                                 f"expert of {stack.name!r} ({stack.ggml_type.name} {tuple(stack.shape[1:])})")
            pointers.append(Pointer(self.device_weight(extra).data.data_ptr() if extra is not None else 0))
        return [*pointers, Int(routed), Int(extra_x)]

    def dequantize_rows(self, weight: QuantTensor, start: int, stop: int, dtype: torch.dtype | None = None,
                        weight_format: str | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `start:stop` of `weight` as a dense `[stop - start, in]` tensor, decoded on the GPU
        (into `out` if given: contiguous, that shape, `dtype`)."""
        weight_format = weight_format or catalogue.WEIGHT_FORMATS[weight.ggml_type]
        dtype = dtype or self.dtype
        out_features, in_features = weight.shape
        count = max(stop - start, 0)
        tile = torch.empty(count, in_features, dtype=dtype, device=self.device) if out is None else out
        if tile.shape != (count, in_features) or tile.dtype != dtype or not tile.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} tensor of shape {(count, in_features)}")
        if count == 0:
            return tile
        pieces = count * in_features // 8  # a piece is 8 or more values; the kernel loops over the rest
        grid = min(-(-pieces // 256), 65535)
        if self.holds_tiled(weight):  # the rows untiled first (a prefill's extra pass over their bytes)
            rows_data = self._untiled_rows(weight, weight_format, start, stop)
        else:
            data = self.device_weight(weight).data
            row_bytes = data.numel() // out_features
            rows_data = data[start * row_bytes : stop * row_bytes]
        self._launch(catalogue.dequant(weight_format, catalogue.ACTIVATIONS[dtype]), grid, 256,
                     Pointer(rows_data.data_ptr()), Pointer(tile.data_ptr()), Int(count), Int(in_features))
        return tile

    def _untiled_rows(self, weight: QuantTensor, weight_format: str, start: int, stop: int) -> torch.Tensor:
        """GGUF's bytes of rows start..stop-1 of a weight held tiled: one kernel (`untile_rows`), 2 bytes a thread."""
        in_features = weight.shape[1]
        blocks, half_block = in_features // 256, tiled_weights.block_bytes(weight_format) // 2
        rows = stop - start
        out = torch.empty(rows, blocks * half_block * 2, dtype=torch.uint8, device=self.device)
        grid = (-(-blocks * half_block // 256), min(rows, 65535), 1)
        self._launch(catalogue.untile_rows(), grid, 256, Pointer(self.device_tiles(weight).data_ptr()),
                     Pointer(tiled_weights.unit_offsets(weight_format, self.device).data_ptr()),
                     Pointer(out.data_ptr()), Int(start), Int(rows), Int(blocks), Int(half_block))
        return out

    def lookup_rows(self, weight: QuantTensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape, long, ideally on this device) of `weight` `[rows, cols]` decoded into
        `[*ids.shape, cols]` of the backend's dtype: one kernel (an embedding lookup), reading the ids on the
        device (no host value depends on them)."""
        weight_format = catalogue.WEIGHT_FORMATS[weight.ggml_type]
        flat = ids.reshape(-1).to(device=self.device, dtype=torch.long).contiguous()
        count, cols = flat.numel(), weight.shape[1]
        out = torch.empty(count, cols, dtype=self.dtype, device=self.device)
        if count:
            pieces = count * cols // 8
            grid = min(-(-pieces // 256), 65535)
            if self.holds_tiled(weight):  # the rows' bytes gathered from the tiles (one kernel), then decoded
                blocks, half_block = cols // 256, tiled_weights.block_bytes(weight_format) // 2
                rows_data = torch.empty(count, blocks * half_block * 2, dtype=torch.uint8, device=self.device)
                self._launch(catalogue.untile_rows(at_ids=True), (-(-blocks * half_block // 256), min(count, 65535), 1),
                             256, Pointer(self.device_tiles(weight).data_ptr()),
                             Pointer(tiled_weights.unit_offsets(weight_format, self.device).data_ptr()),
                             Pointer(flat.data_ptr()), Pointer(rows_data.data_ptr()), Int(count), Int(blocks),
                             Int(half_block))
                self._launch(catalogue.dequant(weight_format, catalogue.ACTIVATIONS[self.dtype]), grid, 256,
                             Pointer(rows_data.data_ptr()), Pointer(out.data_ptr()), Int(count), Int(cols))
                return out.reshape(*ids.shape, cols)
            data = self.device_weight(weight).data
            self._launch(catalogue.dequant_rows(weight_format, catalogue.ACTIVATIONS[self.dtype]), grid, 256,
                         Pointer(data.data_ptr()), Pointer(flat.data_ptr()), Pointer(out.data_ptr()), Int(count),
                         Int(cols))
        return out.reshape(*ids.shape, cols)

    def dequantize_experts(self, experts: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
        """A whole expert stack `[E, rows, cols]` decoded on the GPU into a dense tensor of `dtype` (the grouped
        prefill product's weights), as the `[E * rows, cols]` matrix it is in memory. The result is a view of
        one scratch buffer kept here and grown when needed (a 26B-A4B layer's stacks are ~1.5 GB in bf16):
        it holds until the next call, and a call on the same stream is ordered after the work queued on it."""
        return self.dequantize_expert_stacks([experts], dtype)[0]

    def dequantize_expert_stacks(self, stacks: list[QuantTensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """`dequantize_experts` for stacks read by one product (SwiGLU's gate and up), side by side in the
        scratch buffer: views that hold together until the next call."""
        sizes = [math.prod(stack.shape) * torch.empty(0, dtype=dtype).element_size() for stack in stacks]
        need = sum(sizes)
        scratch = self.__dict__.get("_expert_scratch")
        if scratch is None or scratch.numel() < need:
            self.__dict__["_expert_scratch"] = None  # freed before the larger one is taken
            scratch = self.__dict__["_expert_scratch"] = torch.empty(need, dtype=torch.uint8, device=self.device)
        dense_stacks, start = [], 0
        for stack, size in zip(stacks, sizes):
            n_experts, rows, cols = stack.shape
            count = n_experts * rows * cols
            dense = scratch[start : start + size].view(dtype).view(n_experts, rows, cols)
            start += size
            data = self.device_weight(stack).data
            grid = min(-(-count // 8 // 256), 65535)  # a piece is 8 or more values; the kernel loops over the rest
            self._launch(catalogue.dequant(catalogue.WEIGHT_FORMATS[stack.ggml_type], catalogue.ACTIVATIONS[dtype]),
                         grid, 256, Pointer(data.data_ptr()), Pointer(dense.data_ptr()), Int(n_experts * rows), Int(cols))
            dense_stacks.append(dense)
        return dense_stacks

    def tiled_linear(self, x: torch.Tensor, weight: QuantTensor, weight_format: str) -> torch.Tensor:
        """`x @ weight.T` for many rows (prefill): bounded tiles of weight rows dequantized on the GPU into
        a scratch buffer, each multiplied with cuBLAS."""
        out_features, in_features = weight.shape
        if weight_format == "q4_k" and _fused_prefill() and in_features % 256 == 0 and not self.holds_tiled(weight):
            # Tensor cores straight from the Q4_K blocks, no dequantized tile (LUCEBOX_FUSED_PREFILL=1: not yet
            # measured on a GPU, so off by default).
            from . import triton_quant_matmul

            return triton_quant_matmul.q4_k_matmul(x.contiguous(), self.device_weight(weight).data, out_features)
        rows_per_tile = max(1, PREFILL_TILE_BYTES // (in_features * x.element_size()))
        if rows_per_tile < out_features:
            # Tiles start on rows whose bytes stay 16-byte aligned (rows of 34- or 210-byte blocks may not be).
            rows_per_tile = max(8, rows_per_tile // 8 * 8)
        if rows_per_tile >= out_features:
            return F.linear(x, self.dequantize_rows(weight, 0, out_features, x.dtype, weight_format))
        # One scratch tile, reused, and each tile's product written by cuBLAS straight into its columns of the
        # output (a column block of a row-major matrix is a matrix with a leading dimension of its own: no
        # temporary). Assigning F.linear's result there instead was a strided copy of the whole output a
        # product: 35 ms of the 27B's pp4096 on the H100 (session 30). A list of products joined by
        # `torch.cat` held every product and the joined copy at once.
        out = x.new_empty(x.shape[0], out_features)
        scratch = torch.empty(rows_per_tile, in_features, dtype=x.dtype, device=self.device)
        for start in range(0, out_features, rows_per_tile):
            stop = min(start + rows_per_tile, out_features)
            tile = self.dequantize_rows(weight, start, stop, x.dtype, weight_format, out=scratch[: stop - start])
            torch.mm(x, tile.t(), out=out[:, start:stop])
        return out

    # -- normalisation ---------------------------------------------------------------------------------

    def rms_norm_kernel(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """The reference `rms_norm` in one kernel, for activations and weights of a kernel dtype on this
        device (`op_kernels.accepts_rms_norm`); `out` (contiguous, like x) is written if given."""
        n = x.shape[-1]
        x = x.contiguous()
        weight = weight.to(self.device).contiguous()
        if out is None:
            out = torch.empty_like(x)
        elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
        rows = x.numel() // n
        threads = min(1024, max(32, -(-n // 4 // 32) * 32))
        kernel = catalogue.rms_norm(catalogue.ACTIVATIONS[x.dtype], catalogue.ACTIVATIONS[weight.dtype])
        self._launch(kernel, rows, threads, Pointer(x.data_ptr()), Pointer(weight.data_ptr()),
                     Pointer(out.data_ptr()), Int(n), Float(eps))
        return out

    @functools.cache
    def rope_inv_freq(self, rot_dim: int, theta: float) -> torch.Tensor:
        """RoPE's inverse frequencies on this device, made once, outside any graph recording (the first eager
        call): the expression builds host values."""
        from . import triton_fused

        return triton_fused.rope_inv_freq(rot_dim, theta, self.device)
