"""`HipBackend`: one AMD GPU (RDNA3 / RDNA3.5 / RDNA4) through a ROCm build of torch, with the shared kernel
sources compiled by hiprtc for the device's gfx target.

Everything the CUDA backend does above the launch is reused as it is: the weights uploaded once in their GGUF
formats, the prefill product (tiles dequantized on the GPU, then torch's GEMM: rocBLAS / hipBLASLt), the
expert products, RMSNorm, and the op kernels with their accept checks (`lucebox_cuda.op_kernels`). What
differs is the compiler and the launch (`hiprtc.py`) and the matrix-vector kernel: the CUDA-core one both
backends build (`products.py`), since the tensor-core kernels are PTX.
"""

from __future__ import annotations

from typing import Any

import torch

from lucebox_core.errors import LuceboxError
from lucebox_cuda.backend import CudaBackend
from lucebox_cuda.nvrtc import KernelProgram

from . import hiprtc
from .products import SharedSourceProducts


def device_target(device: torch.device) -> str:
    """The hiprtc target of a ROCm device: `gfx1100` from its `gcnArchName`."""
    return hiprtc.target_of(torch.cuda.get_device_properties(device).gcnArchName)


class HipBackend(SharedSourceProducts, CudaBackend):
    """Ops for one AMD GPU seen through torch's ROCm build (`torch.cuda` with `torch.version.hip`)."""

    name = "hip"
    compile_options: tuple[str, ...] = hiprtc.DEFAULT_OPTIONS

    def __init__(self, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                 weight_cache_bytes: int | None = None) -> None:
        if not getattr(torch.version, "hip", None):
            raise LuceboxError(f"the hip backend needs a ROCm build of torch; torch {torch.__version__} is not one")
        super().__init__(device, dtype, weight_cache_bytes)
        self._hip_modules: dict[KernelProgram, hiprtc.HipModule] = {}

    def device_arch(self) -> str:
        return device_target(self.device)

    def __repr__(self) -> str:
        return f"HipBackend(device={str(self.device)!r}, arch={self.arch}, dtype={self.dtype})"

    def kernel(self, program: KernelProgram, name: str) -> Any:
        """The loaded kernel `name` of `program`, compiled by hiprtc (or read from the disk cache) on first use."""
        function = self._functions.get(name)
        if function is None:
            module = self._hip_modules.get(program)
            if module is None:
                code = hiprtc.compile_program(program, self.arch, self.compile_options)
                module = self._hip_modules[program] = hiprtc.HipModule(code, self.device.index)
            function = self._functions[name] = module.function(name)
        return function

    def _launch(self, kernel: tuple[KernelProgram, str], grid: int | tuple[int, int, int], block: int,
                *args: Any, shared_bytes: int = 0) -> None:
        function, stream = self.kernel(*kernel), torch.cuda.current_stream(self.device).cuda_stream
        if torch.cuda.current_device() == self.device.index:
            hiprtc.launch(function, grid, block, args, stream=stream, shared_bytes=shared_bytes)
            return
        with torch.cuda.device(self.device):  # a split model's other GPU (see CudaBackend._launch)
            hiprtc.launch(function, grid, block, args, stream=stream, shared_bytes=shared_bytes)
