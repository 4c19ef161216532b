"""The matrix-vector products of the shared sources only: `matvec.cu`, the CUDA-core kernel (one 32-lane warp
per output row, plain FMA), at every batch.

The CUDA backend's default products run its tensor-core kernels (mma.sync, cp.async), which have no HIP
form; this mixin replaces `matvec` with the kernel both backends build. `HipBackend` uses it, and so does the
NVIDIA check of the shared sources (`scripts/hip_shared_source_check.py`), which is how the arithmetic an AMD
card runs is proven on a GPU here. Imports nothing of HIP.
"""

from __future__ import annotations

import torch

from lucebox_core.errors import LuceboxError
from lucebox_core.quants import QuantTensor
from lucebox_cuda import catalogue
from lucebox_cuda.backend import matvec_operands
from lucebox_cuda.nvrtc import Int, Pointer


class SharedSourceProducts:
    """`matvec` on `matvec.cu` for a backend with `device`, `device_weight` and `_launch` (a `CudaBackend`)."""

    tensor_core_moe = False  # the expert products on moe_matvec.cu, the shared source (no mma.sync under HIP)
    tiles_weights = False  # the tiled layout's kernel (matvec_tiled.cu) is tensor-core CUDA: every weight row-major

    def matvec(self, x: torch.Tensor, weight: QuantTensor, weight_format: str | None = None, *,
               out: torch.Tensor | None = None, variant: str | None = None) -> torch.Tensor:
        """`x @ weight.T` for x `[rows, in]`, 1 <= rows <= `catalogue.MAX_BATCH`, each weight byte read once.

        `variant`: None or "simt" (the only one these sources have); anything else is an error naming it."""
        if variant not in (None, "simt"):
            raise LuceboxError(f"the {self.name} backend has only the CUDA-core matvec ('simt'), not {variant!r}")
        weight_format = weight_format or catalogue.WEIGHT_FORMATS[weight.ggml_type]
        out_features = weight.shape[0]
        x, out = matvec_operands(x, out, out_features, self.device)
        rows, in_features = x.shape
        data = self.device_weight(weight).data
        kernel = catalogue.matvec_kernel(weight_format, catalogue.ACTIVATIONS[x.dtype], rows, out_features, "simt",
                                         in_features=in_features)
        self._launch((kernel.program, kernel.name), kernel.grid, kernel.block, Pointer(data.data_ptr()),
                     Pointer(x.data_ptr()), Pointer(out.data_ptr()), Int(out_features), Int(in_features), Int(rows))
        return out
