"""`CudaBackend`: the torch reference ops, with the hot ones replaced by NVRTC-compiled CUDA kernels.

Anything without a kernel yet (or a shape or dtype a kernel does not take) falls through to
`TorchBackend`, which stays the oracle every kernel is checked against (`scripts/cuda_check.py`).

Weights stay in their GGUF block formats on the GPU: the raw bytes of each `QuantTensor` are uploaded
once and kept; the matrix-vector kernels dequantize them in registers. Batches of more than `MAX_BATCH`
activation rows (prefill) dequantize a bounded tile of weight rows at a time into a scratch buffer and
multiply it with torch (tensor cores through cuBLAS).
"""

from __future__ import annotations

import functools
import warnings
import os
from types import ModuleType
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from lucebox_core.errors import LuceboxError
from lucebox_core.quants import QuantTensor
from lucebox_core.torch_backend import STREAM_BLOCK_BYTES, TorchBackend, Weight, concat_rows

from . import catalogue
from .nvrtc import CudaModule, Float, Int, KernelProgram, Pointer, compile_program, ensure_context, launch

ALIGNMENT = 16  # the kernels read weights and activations with up-to-16-byte vector loads
# Short Gated DeltaNet prefills (speculative verify chunks, short prompts) take the token-by-token Triton
# kernel: as fast there, and the chunk-scan kernel faulted on a lone 16-token chunk on the H200 (run 3).
SEQUENTIAL_PREFILL_TOKENS = 256
# A matvec variant every product uses where it exists (bisecting, benchmarking); empty: the measured defaults.
_FORCED_MATVEC_VARIANT = os.environ.get("LUCEBOX_MATVEC_VARIANT", "")
# Rows `linear` still runs on the matrix-vector kernels (in slices of catalogue.MAX_BATCH) rather than the
# tiled prefill product: every speculative verify pass (at most a 64-draft tree plus its root).
VERIFY_ROWS = 2 * catalogue.MAX_BATCH


def device_arch(device: torch.device) -> str:
    """The NVRTC architecture name of a CUDA device: `sm_90` for compute capability 9.0."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _aligned(tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() % ALIGNMENT == 0


@functools.cache
def _triton_ops() -> ModuleType | None:
    """`lucebox_cuda.triton_ops` if Triton imports here, else None (the torch ops then serve)."""
    try:
        from . import triton_ops
    except ImportError:
        return None
    return triton_ops


@functools.cache
def _triton_attention() -> ModuleType | None:
    """`lucebox_cuda.triton_attention` (prefill and tree-verify attention) if Triton imports here, else None."""
    try:
        from . import triton_attention
    except ImportError:
        return None
    return triton_attention


@functools.cache
def _triton_gdn() -> ModuleType | None:
    """`lucebox_cuda.triton_gdn` (Gated DeltaNet prefill and tree kernels) if Triton imports here, else None."""
    try:
        from . import triton_gdn
    except ImportError:
        return None
    return triton_gdn


@functools.cache
def _triton_fused() -> ModuleType | None:
    """`lucebox_cuda.triton_fused` (the fused decode-step ops) if Triton imports here, else None."""
    try:
        from . import triton_fused
    except ImportError:
        return None
    return triton_fused


def _rows_indexable(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can index these as rows: last dim contiguous, leading dims one stride."""
    fused = _triton_fused()
    return fused is not None and all(t.stride(-1) == 1 and fused._mergeable(t) for t in tensors)


def _triton_takes(device: torch.device, *tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on these tensors: Triton importable, all on `device`, floats."""
    if _triton_ops() is None:
        return False
    floats = (torch.float16, torch.bfloat16, torch.float32)
    return all(t.device == device and (t.dtype in floats or not t.is_floating_point()) for t in tensors)


class CudaBackend(TorchBackend):
    """Ops for one NVIDIA GPU. `dtype` is the activation dtype (bf16 by default; f16 and f32 work too)."""

    name = "cuda"

    def __init__(
        self,
        device: str | torch.device = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        weight_cache_bytes: int | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise LuceboxError(f"the cuda backend runs on a CUDA device, not {str(device)!r}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device, dtype, weight_cache_bytes)
        self.arch = device_arch(self.device)
        self._modules: dict[KernelProgram, CudaModule] = {}
        self._functions: dict[str, Any] = {}
        self._device_weights: dict[int, tuple[QuantTensor, QuantTensor]] = {}  # id -> (host, device copy)

    def __repr__(self) -> str:
        return f"CudaBackend(device={str(self.device)!r}, arch={self.arch}, dtype={self.dtype})"

    # -- kernels ---------------------------------------------------------------------------------------

    def kernel(self, program: KernelProgram, name: str) -> Any:
        """The loaded kernel `name` of `program`, compiled (or read from the disk cache) on first use."""
        function = self._functions.get(name)
        if function is None:
            module = self._modules.get(program)
            if module is None:
                module = self._modules[program] = CudaModule(compile_program(program, self.arch), self.device.index)
            function = self._functions[name] = module.function(name)
        return function

    def _launch(self, kernel: tuple[KernelProgram, str], grid: int, block: int, *args: Any) -> None:
        function = self.kernel(*kernel)
        ensure_context(self.device.index)
        launch(function, grid, block, args, stream=torch.cuda.current_stream(self.device).cuda_stream)

    # -- weights ---------------------------------------------------------------------------------------

    def device_weight(self, weight: QuantTensor) -> QuantTensor:
        """`weight`'s raw bytes on this GPU, 16-byte aligned, uploaded on first use and kept."""
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

    def fuse_rows(self, weights: list[Weight]) -> Weight | None:
        """Projections of one input stacked into one weight on this GPU (one matvec launch instead of
        several, and a larger grid), where the kernels take it; the parts are never uploaded."""
        if not all(self._kernel_format(torch.empty(0, w.shape[-1], dtype=self.dtype, device=self.device), w)
                   for w in weights):
            return None
        return concat_rows(weights, self.device)

    @property
    def device_weight_bytes(self) -> int:
        """Bytes of raw GGUF weight data held on the GPU."""
        return sum(copy.nbytes for _, copy in self._device_weights.values())

    def _kernel_format(self, x: torch.Tensor, weight: Weight) -> str | None:
        """The kernel weight-format name if the kernels take this (x, weight) pair, else None."""
        if not isinstance(weight, QuantTensor) or len(weight.shape) != 2:
            return None
        weight_format = catalogue.WEIGHT_FORMATS.get(weight.ggml_type)
        if weight_format is None or x.dtype not in catalogue.ACTIVATIONS or x.device != self.device:
            return None
        if x.shape[-1] != weight.shape[1] or weight.shape[1] % catalogue.ROW_MULTIPLE[weight_format]:
            return None
        return weight_format

    # -- matmul and embedding --------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        weight_format = self._kernel_format(x, weight)
        if weight_format is None:
            return super().linear(x, weight)
        out_features, in_features = weight.shape
        rows = x.numel() // in_features
        x2 = x.reshape(rows, in_features)
        if rows == 0:
            out = x2.new_empty(0, out_features)
        elif rows <= catalogue.MAX_BATCH:
            out = self.matvec(x2, weight, weight_format)
        elif rows <= VERIFY_ROWS:
            # A speculative verify pass larger than one kernel batch (a 65-node tree): matvec kernels in
            # slices, which compute each row as the decode step does (tiled dequant + cuBLAS would not).
            out = x2.new_empty(rows, out_features)
            for start in range(0, rows, catalogue.MAX_BATCH):
                stop = min(start + catalogue.MAX_BATCH, rows)
                self.matvec(x2[start:stop], weight, weight_format, out=out[start:stop])
        else:
            out = self._tiled_linear(x2, weight, weight_format)
        return out.reshape(*x.shape[:-1], out_features)

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
        if variant is None and _FORCED_MATVEC_VARIANT:
            # Decided by the shape, never the batch, as the default is (decode and verify stay alike): a
            # tensor-core variant where one serves every batch, two row groups in their one-group form.
            activation = catalogue.ACTIVATIONS[x.dtype]
            if _FORCED_MATVEC_VARIANT == "simt" or catalogue.has_mma_kernel(weight_format, activation,
                                                                           catalogue.MAX_BATCH):
                pipe = catalogue.PipeVariant.parse(_FORCED_MATVEC_VARIANT)
                variant = (attrs.evolve(pipe, row_groups=1).name if pipe is not None and pipe.row_groups > 1
                           else _FORCED_MATVEC_VARIANT)
        x = x.contiguous()
        if not _aligned(x):
            x = x.clone()
        rows, in_features = x.shape
        out_features = weight.shape[0]
        if out is None:
            out = torch.empty(rows, out_features, dtype=x.dtype, device=self.device)
        elif out.shape != (rows, out_features) or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {(rows, out_features)}")
        data = self.device_weight(weight).data
        state = self.__dict__.setdefault("_matvec_state", {"scratch": None, "counters": None, "shared_ready": set()})
        if "max_shared" not in state:
            from cuda.bindings import driver

            result, limit = driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self.device.index)
            # Less a margin for the kernels' own static shared memory (a few bytes), which counts too.
            state["max_shared"] = (int(limit) if int(result) == 0 else catalogue.STATIC_SHARED_LIMIT) - 1024
        kernel = catalogue.matvec_kernel(weight_format, catalogue.ACTIVATIONS[x.dtype], rows, out_features, variant,
                                         in_features=in_features, max_shared_bytes=state["max_shared"])
        args = [Pointer(data.data_ptr()), Pointer(x.data_ptr()), Pointer(out.data_ptr()), Int(out_features),
                Int(in_features), Int(rows)]
        if not kernel.streamed:
            self._launch((kernel.program, kernel.name), kernel.grid, kernel.block, *args)
            return out
        ensure_context(self.device.index)
        function = self.kernel(kernel.program, kernel.name)
        if kernel.name not in state["shared_ready"]:
            from cuda.bindings import driver

            attribute = driver.CUfunction_attribute
            # Beyond 48 KiB a kernel must opt in; a full shared-memory carve-out lets several blocks' rings
            # share an SM (the weight bypasses L1 anyway).
            for name, value in ((attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kernel.shared_bytes),
                                (attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)):
                (result,) = driver.cuFuncSetAttribute(function, name, value)
                if int(result) != 0:
                    raise LuceboxError(f"cuFuncSetAttribute({name.name}) on {kernel.name} failed: {result}")
            state["shared_ready"].add(kernel.name)
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
        launch(function, (kernel.grid, slices, 1), kernel.block, [*args, Pointer(partials), Pointer(counters)],
               stream=torch.cuda.current_stream(self.device).cuda_stream, shared_bytes=kernel.shared_bytes)
        return out

    def dequantize_rows(self, weight: QuantTensor, start: int, stop: int, dtype: torch.dtype | None = None,
                        weight_format: str | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `start:stop` of `weight` as a dense `[stop - start, in]` tensor, decoded on the GPU
        (into `out` if given: contiguous, that shape, `dtype`)."""
        weight_format = weight_format or catalogue.WEIGHT_FORMATS[weight.ggml_type]
        dtype = dtype or self.dtype
        out_features, in_features = weight.shape
        data = self.device_weight(weight).data
        row_bytes = data.numel() // out_features
        count = max(stop - start, 0)
        tile = torch.empty(count, in_features, dtype=dtype, device=self.device) if out is None else out
        if tile.shape != (count, in_features) or tile.dtype != dtype or not tile.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} tensor of shape {(count, in_features)}")
        if count == 0:
            return tile
        pieces = count * in_features // 8  # a piece is 8 or more values; the kernel loops over the rest
        grid = min(-(-pieces // 256), 65535)
        rows_data = data[start * row_bytes : stop * row_bytes]
        self._launch(catalogue.dequant(weight_format, catalogue.ACTIVATIONS[dtype]), grid, 256,
                     Pointer(rows_data.data_ptr()), Pointer(tile.data_ptr()), Int(count), Int(in_features))
        return tile

    def _tiled_linear(self, x: torch.Tensor, weight: QuantTensor, weight_format: str) -> torch.Tensor:
        out_features, in_features = weight.shape
        rows_per_tile = max(1, STREAM_BLOCK_BYTES // (in_features * x.element_size()))
        if rows_per_tile < out_features:
            # Tiles start on rows whose bytes stay 16-byte aligned (rows of 34- or 210-byte blocks may not be).
            rows_per_tile = max(8, rows_per_tile // 8 * 8)
        if rows_per_tile >= out_features:
            return F.linear(x, self.dequantize_rows(weight, 0, out_features, x.dtype, weight_format))
        # One scratch tile, reused, and each tile's product written into its columns of the output: the
        # peak is the output, one tile and one tile's product (a list of products joined by `torch.cat`
        # held every product and the joined copy at once, ~0.3 GB more for 27B's 4096-token chunks).
        out = x.new_empty(x.shape[0], out_features)
        scratch = torch.empty(rows_per_tile, in_features, dtype=x.dtype, device=self.device)
        for start in range(0, out_features, rows_per_tile):
            stop = min(start + rows_per_tile, out_features)
            tile = self.dequantize_rows(weight, start, stop, x.dtype, weight_format, out=scratch[: stop - start])
            out[:, start:stop] = F.linear(x, tile)
        return out

    def embedding(self, ids: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, QuantTensor):
            # Gather the rows' raw bytes on the GPU and decode only those.
            return self.device_weight(weight).lookup_rows(ids.to(self.device), self.dtype)
        return super().embedding(ids, weight)

    # -- normalisation ---------------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The reference `rms_norm` in one kernel; `out` (contiguous, like x) is written if given."""
        n = x.shape[-1]
        if (
            x.device != self.device
            or x.dtype not in catalogue.ACTIVATIONS
            or weight.dtype not in catalogue.ACTIVATIONS
            or weight.numel() != n
            or x.numel() == 0
        ):
            result = super().rms_norm(x, weight, eps)
            return result if out is None else out.copy_(result)
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

    # -- Triton kernels (lucebox_cuda.triton_ops) ------------------------------------------------------

    def decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, *, scale: float
    ) -> torch.Tensor:
        """The reference `decode_attention` as a one-node tree verification (`triton_attention`): the decode
        step and a speculative verify pass share one kernel and one key partition, so a verified token gets
        the bits the decode step gives it. A Q8_0 window (uint8 rows) is decoded in registers."""
        if (_triton_attention() is None or not _triton_takes(self.device, q, k, v, position) or k.dim() != 3
                or q.shape[2] % k.shape[1]):
            return super().decode_attention(q, k, v, position, scale=scale)
        return self._cache_attention(lambda: _triton_attention().decode_attention(q, k, v, position, scale=scale),
                                     lambda: super(CudaBackend, self).decode_attention(q, k, v, position, scale=scale),
                                     k, v)

    def _cache_attention(self, kernel: Any, reference: Any, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        quantized = k.dtype == torch.uint8 or v.dtype == torch.uint8
        if quantized and self.__dict__.get("_q8_attention_failure"):
            return reference()
        try:
            return kernel()
        except Exception as exc:  # noqa: BLE001 -- first used eagerly (a graph's warm-up), so this is safe
            if not quantized or torch.cuda.is_current_stream_capturing():
                raise
            # The Q8_0 path is the newest kernel: if it does not build here, run through the reference.
            self.__dict__["_q8_attention_failure"] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"Q8_0 cache attention kernel unavailable, decoding the window instead: {exc}",
                          RuntimeWarning, stacklevel=3)
            return reference()

    def gated_delta_rule_recurrent(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference recurrence; one token (decode) runs as one Triton kernel, more fall through."""
        tensors = (q, k, v, g, beta) + (() if state is None else (state,))
        if q.shape[1] != 1 or v.shape[2] % k.shape[2] or not _triton_takes(self.device, *tensors):
            return super().gated_delta_rule_recurrent(q, k, v, g, beta, state, scale)
        return _triton_ops().gated_delta_rule_step(q, k, v, g, beta, state, scale)

    def causal_conv1d_step(
        self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference one-token convolution (no activation) as one Triton kernel."""
        if not _triton_takes(self.device, x, weight, state):
            return super().causal_conv1d_step(x, weight, state)
        return _triton_ops().causal_conv1d_step(x, weight, state)

    # -- fused decode-step ops (lucebox_cuda.triton_fused) --------------------------------------------

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if (not _triton_takes(self.device, x, residual, weight) or x.shape != residual.shape
                or not _rows_indexable(x, residual)):
            return super().add_rms_norm(x, residual, weight, eps)
        return _triton_fused().add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if (not _triton_takes(self.device, gate, up) or gate.shape != up.shape or gate.dtype != up.dtype
                or not _rows_indexable(gate, up)):
            return super().silu_mul(gate, up)
        return _triton_fused().silu_mul(gate, up)

    def sigmoid_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if (not _triton_takes(self.device, x, gate) or x.shape != gate.shape or x.dtype != gate.dtype
                or not _rows_indexable(x, gate)):
            return super().sigmoid_mul(x, gate)
        return _triton_fused().sigmoid_mul(x, gate)

    def gated_rms_norm(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if (not _triton_takes(self.device, x, z, weight) or x.shape != z.shape or x.dtype != z.dtype
                or not _rows_indexable(x, z)):
            return super().gated_rms_norm(x, z, weight, eps)
        return _triton_fused().gated_rms_norm(x, z, weight, eps)

    def qk_norm_rope(self, query: torch.Tensor, key: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                     positions: torch.Tensor, rot_dim: int, theta: float, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if (not _triton_takes(self.device, query, key, q_norm, k_norm, positions) or query.shape[0] != 1
                or query.stride(-1) != 1 or key.stride(-1) != 1):
            return super().qk_norm_rope(query, key, q_norm, k_norm, positions, rot_dim, theta, eps)
        return _triton_fused().qk_norm_rope(query, key, q_norm, k_norm, positions, rot_dim, theta, eps,
                                            inv_freq=self._rope_inv_freq(rot_dim, theta))

    @functools.cache
    def _rope_inv_freq(self, rot_dim: int, theta: float) -> torch.Tensor:
        # Made once, outside any graph recording (the first eager call): the expression builds host values.
        return _triton_fused().rope_inv_freq(rot_dim, theta, self.device)

    def conv_silu_update_(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        if not _triton_takes(self.device, x, weight, state) or state.dtype != x.dtype:
            return super().conv_silu_update_(x, weight, state)
        out, _ = _triton_ops().causal_conv1d_step(x, weight, state, activation="silu", new_state=state)
        return out

    def gated_delta_decode_(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor,
                            dt_bias: torch.Tensor, state: torch.Tensor, num_k_heads: int, head_k_dim: int
                            ) -> torch.Tensor:
        if (not _triton_takes(self.device, mixed, a, b, ssm_a, dt_bias, state) or not state.is_contiguous()
                or state.dtype != torch.float32 or any(t.stride(-1) != 1 for t in (mixed, a, b))):
            return super().gated_delta_decode_(mixed, a, b, ssm_a, dt_bias, state, num_k_heads, head_k_dim)
        return _triton_fused().gated_delta_decode_(mixed, a, b, ssm_a, dt_bias, state, num_k_heads, head_k_dim)

    # -- prefill and tree-verify attention (lucebox_cuda.triton_attention) ------------------------------

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  causal_offset: int | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The reference `attention` as a FlashAttention-2 forward in Triton (GQA, causal offset, bool mask):
        the reference materialises every score (14 GB for a 4096-token chunk at depth 32K). Other shapes
        (not 4-D, heads not a multiple, no keys, a negative offset) fall through."""
        tensors = (q, k, v) + (() if mask is None else (mask,))
        if (
            _triton_attention() is None
            or not _triton_takes(self.device, *tensors)
            or q.dim() != 4 or k.dim() != 4 or v.dim() != 4
            or q.shape[2] % k.shape[2]
            or k.shape[1] == 0
            or (causal_offset is not None and causal_offset < 0)
        ):
            return super().attention(q, k, v, scale=scale, causal_offset=causal_offset, mask=mask)
        return _triton_attention().attention(q, k, v, scale=scale, causal_offset=causal_offset, mask=mask)

    def tree_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor,
                       visible: torch.Tensor, *, scale: float) -> torch.Tensor:
        """The reference `tree_attention` in Triton: each node over its own path, split over the rows in the
        decode step's fixed partition (flash-decoding for N nodes); a Q8_0 window is decoded in registers."""
        if (
            _triton_attention() is None
            or not _triton_takes(self.device, q, k, v, position, visible)
            or q.dim() != 4 or k.dim() != 3
            or q.shape[2] % k.shape[1]
        ):
            return super().tree_attention(q, k, v, position, visible, scale=scale)
        return self._cache_attention(
            lambda: _triton_attention().tree_attention(q, k, v, position, visible, scale=scale),
            lambda: super(CudaBackend, self).tree_attention(q, k, v, position, visible, scale=scale), k, v)

    # -- Gated DeltaNet prefill and tree verification (lucebox_cuda.triton_gdn) ------------------------

    def gated_delta_rule_chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, state: torch.Tensor | None, chunk_size: int = 64,
                                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference chunked rule as two Triton kernels (chunk inverses, then the chunk scan)."""
        tensors = (q, k, v, g, beta) + (() if state is None else (state,))
        gdn = _triton_gdn()
        if (gdn is None or v.shape[2] % k.shape[2] or chunk_size not in gdn.CHUNK_SIZES
                or not _triton_takes(self.device, *tensors)):
            return super().gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size, scale)
        if q.shape[1] <= SEQUENTIAL_PREFILL_TOKENS:
            return gdn.gated_delta_rule_sequential(q, k, v, g, beta, state, scale)
        return gdn.gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size, scale)

    def gated_delta_rule_tree(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state: torch.Tensor, parents: torch.Tensor,
                              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference tree rule as one Triton launch walking the nodes (parents read on the device), so
        a verify pass can be recorded as a CUDA graph."""
        gdn = _triton_gdn()
        if (gdn is None or q.shape[0] != 1 or v.shape[2] % k.shape[2]
                or not _triton_takes(self.device, q, k, v, g, beta, state, parents)):
            return super().gated_delta_rule_tree(q, k, v, g, beta, state, parents, scale)
        return gdn.gated_delta_rule_tree(q, k, v, g, beta, state, parents, scale)

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference prefill convolution (no activation) as one Triton kernel."""
        gdn = _triton_gdn()
        if gdn is None or weight.shape[1] < 2 or not _triton_takes(self.device, x, weight, state):
            return super().causal_conv1d(x, weight, state)
        return gdn.causal_conv1d(x, weight, state)

    def causal_conv1d_tree(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference tree convolution as one Triton kernel walking each node's ancestry on the device
        (sums in fp32, as the decode step's convolution kernel does)."""
        gdn = _triton_gdn()
        if (gdn is None or weight.shape[1] < 2 or x.shape[0] != 1
                or not _triton_takes(self.device, x, weight, state, parents)):
            return super().causal_conv1d_tree(x, weight, state, parents)
        return gdn.causal_conv1d_tree(x, weight, state, parents)

    def conv_silu_tree(self, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, parents: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree convolution with SiLU in the same kernel, reduced and activated as the decode step's
        `conv_silu_update_` kernel does: a verified node's GDN input is the decode step's to the bit."""
        gdn = _triton_gdn()
        if (gdn is None or weight.shape[1] < 2 or x.shape[0] != 1 or state.dtype != x.dtype
                or not _triton_takes(self.device, x, weight, state, parents)):
            return super().conv_silu_tree(x, weight, state, parents)
        return gdn.causal_conv1d_tree(x, weight, state, parents, activation="silu")

    def gated_delta_tree(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ssm_a: torch.Tensor,
                         dt_bias: torch.Tensor, state: torch.Tensor, parents: torch.Tensor, num_k_heads: int,
                         head_k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference composition as one Triton kernel walking the nodes (parents read on the device)."""
        if (not _triton_takes(self.device, mixed, a, b, ssm_a, dt_bias, state, parents) or mixed.shape[0] != 1
                or not state.is_contiguous() or state.dtype != torch.float32
                or any(t.stride(-1) != 1 for t in (mixed, a, b))):
            return super().gated_delta_tree(mixed, a, b, ssm_a, dt_bias, state, parents, num_k_heads, head_k_dim)
        return _triton_fused().gated_delta_tree(mixed, a, b, ssm_a, dt_bias, state, parents, num_k_heads, head_k_dim)
