"""Run-time compilation of the shared kernel sources with hiprtc (through `hip-python`), a disk cache, launches.

The sources are the CUDA backend's (`lucebox_cuda/kernels`): the ones written without tensor-core PTX build
for HIP through `portable.cuh` (`HIP_SOURCES`). Each program is compiled to a code object for the device's
exact target (`gfx1100`, `gfx1151`, `gfx1201` ...), cached under `$LUCEBOX_HOME/hip-cache` and named by a hash
of everything that decides its bytes: the source and every header it can include, the instantiation lines,
the options, the target and the hiprtc version. Compiling needs no GPU, but hiprtc itself (ROCm's
libhiprtc); loading and launching need the GPU, and launches go on torch's current stream, so they order with
torch's own work and are captured by HIP graphs (`torch.cuda.CUDAGraph` on a ROCm build).

`hip-python` is imported on first use only: without ROCm it imports but its first call fails, and listing
plugins must never get that far.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from lucebox_core.errors import LuceboxError
from lucebox_cuda.nvrtc import KernelProgram, _write_atomically, kernel_sources

# The CUDA backend's `.cu` files that build for HIP: the CUDA-core (plain FMA) matrix-vector kernel, the
# mixture-of-experts product on the same body, the dequantize-tile kernel and RMSNorm. The tensor-core ones
# (matvec_mma.cu, matvec_pipe.cu, moe_matvec_mma.cu: mma.sync, cp.async) stop with an #error under HIP.
HIP_SOURCES: tuple[str, ...] = ("dequant.cu", "matvec.cu", "moe_matvec.cu", "rms_norm.cu")
DEFAULT_OPTIONS: tuple[str, ...] = ("-std=c++17", "-O3")
# The targets CI compiles every source for (RDNA3, RDNA3.5, RDNA4); the backend runs on these families.
CHECKED_TARGETS: tuple[str, ...] = ("gfx1100", "gfx1151", "gfx1201")


class HipError(LuceboxError):
    """A HIP or hiprtc call failed; the message names the call and the error."""


class HipCompileError(HipError):
    """hiprtc rejected a kernel source; the message holds the compiler's log."""


def _check(result: Any, call: str) -> None:
    code = int(getattr(result, "value", result))
    if code != 0:
        raise HipError(f"{call} failed: {getattr(result, 'name', code)} ({code})")


def compile_check_programs() -> dict[str, KernelProgram]:
    """The CUDA backend's compile-check programs of the shared sources: every weight format with every
    activation type, and the largest batch (the register-pressure extreme)."""
    from lucebox_cuda import catalogue

    return {name: program for name, program in catalogue.compile_check_programs().items() if name in HIP_SOURCES}


def target_of(arch_name: str) -> str:
    """The compile target of a device's `gcnArchName`: `gfx90a:sramecc+:xnack-` -> `gfx90a`."""
    return arch_name.split(":", 1)[0].strip()


# -- compilation -----------------------------------------------------------------------------------------


def _hiprtc() -> Any:
    from hip import hiprtc

    return hiprtc


@cache
def hiprtc_version() -> tuple[int, int]:
    result, major, minor = _hiprtc().hiprtcVersion()
    _check(result, "hiprtcVersion")
    return int(major), int(minor)


def cache_dir() -> Path:
    from lucebox_core.loading import lucebox_home

    return lucebox_home() / "hip-cache"


def cache_key(program: KernelProgram, arch: str, options: Sequence[str] = DEFAULT_OPTIONS,
              compiler: str | None = None) -> str:
    """Hash of what decides a code object's bytes; `compiler` defaults to this process's hiprtc version."""
    digest = hashlib.sha256()
    compiler = compiler or "hiprtc %d.%d" % hiprtc_version()
    parts = [program.source(), *(f"{n}\0{t}" for n, t in sorted(program.headers().items())), *options, arch, compiler]
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0\1")
    return digest.hexdigest()[:32]


def compile_program(program: KernelProgram, arch: str, options: Sequence[str] = DEFAULT_OPTIONS, *,
                    use_cache: bool = True) -> bytes:
    """The code object of `program` for target `arch` (`gfx1100`...), from the disk cache if there."""
    if program.file not in HIP_SOURCES:
        raise HipCompileError(f"{program.file} is not one of the sources that build for HIP ({', '.join(HIP_SOURCES)})")
    path = cache_dir() / f"{program.file.removesuffix('.cu')}-{arch}-{cache_key(program, arch, options)}.hsaco"
    if use_cache and path.is_file():
        return path.read_bytes()
    code = _compile(program, arch, options)
    if use_cache:
        _write_atomically(path, code)
    return code


def _compile(program: KernelProgram, arch: str, options: Sequence[str]) -> bytes:
    hiprtc = _hiprtc()
    headers = program.headers()
    result, handle = hiprtc.hiprtcCreateProgram(
        program.source().encode(), program.file.encode(), len(headers),
        [text.encode() for text in headers.values()], [name.encode() for name in headers])
    _check(result, "hiprtcCreateProgram")
    try:
        flags = [f"--offload-arch={arch}".encode(), *(option.encode() for option in options)]
        (result,) = hiprtc.hiprtcCompileProgram(handle, len(flags), flags)
        if int(getattr(result, "value", result)) != 0:
            result_size, size = hiprtc.hiprtcGetProgramLogSize(handle)
            log = bytearray(int(size)) if int(getattr(result_size, "value", result_size)) == 0 else bytearray()
            if log:
                hiprtc.hiprtcGetProgramLog(handle, log)
            text = bytes(log).rstrip(b"\0 ").decode(errors="replace")
            raise HipCompileError(f"hiprtc {'%d.%d' % hiprtc_version()} could not compile {program.file} for {arch}:\n"
                                  f"{text}")
        result, size = hiprtc.hiprtcGetCodeSize(handle)
        _check(result, "hiprtcGetCodeSize")
        code = bytearray(int(size))
        _check(hiprtc.hiprtcGetCode(handle, code)[0], "hiprtcGetCode")
        return bytes(code)
    finally:
        hiprtc.hiprtcDestroyProgram(handle.createRef())  # takes a hiprtcProgram*, as in C


# -- loading and launching (needs an AMD GPU) ------------------------------------------------------------


def _hip() -> Any:
    from hip import hip

    return hip


class HipModule:
    """A loaded code object and the kernels looked up in it so far."""

    def __init__(self, code: bytes, device_index: int) -> None:
        import torch

        self._code = code  # kept alive for the module's lifetime
        with torch.cuda.device(device_index):  # a module belongs to the device current when it is loaded
            result, self.handle = _hip().hipModuleLoadData(code)
        _check(result, "hipModuleLoadData")
        self.device_index = device_index
        self._functions: dict[str, Any] = {}

    def function(self, name: str) -> Any:
        found = self._functions.get(name)
        if found is None:
            result, found = _hip().hipModuleGetFunction(self.handle, name.encode())
            _check(result, f"hipModuleGetFunction({name})")
            self._functions[name] = found
        return found


def launch(function: Any, grid: int | tuple[int, int, int], block: int | tuple[int, int, int],
           args: Iterable[ctypes._SimpleCData], *, stream: int, shared_bytes: int = 0) -> None:
    """Launch `function` with ctypes-typed `args` on `stream` (torch's `cuda_stream`, a hipStream_t).

    The arguments go as the kernel-parameter array (one pointer to each argument), as the CUDA backend
    passes them to cuLaunchKernel; hipModuleLaunchKernel takes the same convention."""
    grid = (grid, 1, 1) if isinstance(grid, int) else grid
    block = (block, 1, 1) if isinstance(block, int) else block
    values = list(args)
    pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(value) for value in values))
    (result,) = _hip().hipModuleLaunchKernel(function, *grid, *block, shared_bytes, stream,
                                             ctypes.addressof(pointers), None)
    _check(result, "hipModuleLaunchKernel")
