"""Run-time compilation of the CUDA C++ kernels with NVRTC, a disk cache of the results, and launches.

Kernels are compiled to machine code (cubin) for the device's exact architecture, so the driver never
JIT-compiles PTX (which would also tie the NVRTC version to the driver's). A cubin is cached under
`$LUCEBOX_HOME/cuda-cache`, named by a hash of everything that decides its bytes: the source and the
headers it can include, the instantiation lines appended to it, the options, the architecture and the
NVRTC version. Compiling needs no GPU; loading and launching do (through the CUDA driver API, on torch's
current stream, so launches order with torch's own work and are captured by CUDA graphs).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from lucebox_core.errors import LuceboxError

KERNEL_PACKAGE = "lucebox_cuda.kernels"
DEFAULT_OPTIONS = ("--std=c++17",)


class CudaError(LuceboxError):
    """A CUDA driver or NVRTC call failed; the message names the call and the error."""


class CudaCompileError(CudaError):
    """NVRTC rejected a kernel source; the message holds the compiler's log."""


def _check(result: Any, call: str) -> None:
    code = int(result)
    if code != 0:
        raise CudaError(f"{call} failed: {getattr(result, 'name', code)} ({code})")


# -- sources ---------------------------------------------------------------------------------------------


@cache
def kernel_sources() -> dict[str, str]:
    """Every `.cu` and `.cuh` file of the kernel package, by file name."""
    folder = resources.files(KERNEL_PACKAGE)
    return {
        entry.name: entry.read_text(encoding="utf-8")
        for entry in folder.iterdir()
        if entry.name.endswith((".cu", ".cuh"))
    }


def kernel_files() -> list[str]:
    """The compilable `.cu` sources (the `.cuh` files are headers they include)."""
    return sorted(name for name in kernel_sources() if name.endswith(".cu"))


@attrs.frozen
class KernelProgram:
    """One compilation unit: a `.cu` file plus instantiation lines (macro calls) appended to it."""

    file: str
    instantiations: tuple[str, ...] = attrs.field(converter=tuple, default=())

    def source(self) -> str:
        body = kernel_sources()[self.file]
        return body + "\n" + "\n".join(self.instantiations) + "\n"

    def headers(self) -> dict[str, str]:
        """The `.cuh` headers, and the `.cu` files this program's file includes (the megakernel composes the
        persistent kernels' bodies)."""
        sources = kernel_sources()
        included = set(re.findall(r'#include "([^"]+\.cu)"', sources[self.file]))
        return {name: text for name, text in sources.items() if name.endswith(".cuh") or name in included}


# -- compilation -----------------------------------------------------------------------------------------


def _nvrtc() -> Any:
    from cuda.bindings import nvrtc

    return nvrtc


@cache
def nvrtc_version() -> tuple[int, int]:
    result, major, minor = _nvrtc().nvrtcVersion()
    _check(result, "nvrtcVersion")
    return int(major), int(minor)


def cache_dir() -> Path:
    from lucebox_core.loading import lucebox_home

    return lucebox_home() / "cuda-cache"


def cache_key(program: KernelProgram, arch: str, options: Sequence[str] = DEFAULT_OPTIONS) -> str:
    digest = hashlib.sha256()
    parts = [program.source(), *(f"{n}\0{t}" for n, t in sorted(program.headers().items())), *options, arch,
             "nvrtc %d.%d" % nvrtc_version()]
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0\1")
    return digest.hexdigest()[:32]


def _program_log(nvrtc: Any, program: Any) -> str:
    result, size = nvrtc.nvrtcGetProgramLogSize(program)
    _check(result, "nvrtcGetProgramLogSize")
    log = b" " * size
    _check(nvrtc.nvrtcGetProgramLog(program, log)[0], "nvrtcGetProgramLog")
    return log.rstrip(b"\0 ").decode(errors="replace")


def compile_program(
    program: KernelProgram, arch: str, options: Sequence[str] = DEFAULT_OPTIONS, *, use_cache: bool = True
) -> bytes:
    """The cubin of `program` for `arch` (`sm_90`, `sm_90a`, `sm_86`...), from the disk cache if there."""
    path = cache_dir() / f"{program.file.removesuffix('.cu')}-{arch}-{cache_key(program, arch, options)}.cubin"
    if use_cache and path.is_file():
        return path.read_bytes()
    cubin = _compile(program, arch, options)
    if use_cache:
        _write_atomically(path, cubin)
    return cubin


def _compile(program: KernelProgram, arch: str, options: Sequence[str]) -> bytes:
    nvrtc = _nvrtc()
    headers = program.headers()
    result, handle = nvrtc.nvrtcCreateProgram(
        program.source().encode(),
        program.file.encode(),
        len(headers),
        [text.encode() for text in headers.values()],
        [name.encode() for name in headers],
    )
    _check(result, "nvrtcCreateProgram")
    try:
        flags = [f"--gpu-architecture={arch}".encode(), *(option.encode() for option in options)]
        (result,) = nvrtc.nvrtcCompileProgram(handle, len(flags), flags)
        if int(result) != 0:
            raise CudaCompileError(
                f"NVRTC {'%d.%d' % nvrtc_version()} could not compile {program.file} for {arch}:\n"
                f"{_program_log(nvrtc, handle)}"
            )
        result, size = nvrtc.nvrtcGetCUBINSize(handle)
        _check(result, "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(handle, cubin)[0], "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(handle)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write via a temporary file and a rename, so concurrent processes never read half a cubin."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only or full cache only costs a recompile next time


# -- loading and launching (needs a GPU) -----------------------------------------------------------------


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


_thread_state = threading.local()


def ensure_context(device_index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread, once per thread."""
    done = getattr(_thread_state, "devices", None)
    if done is None:
        done = _thread_state.devices = set()
    if device_index in done:
        return
    import torch

    torch.cuda.init()
    with torch.cuda.device(device_index):
        torch.cuda.current_stream()  # the runtime binds its primary context to this thread
    driver = _driver()
    _check(driver.cuInit(0)[0], "cuInit")
    result, device = driver.cuDeviceGet(device_index)
    _check(result, "cuDeviceGet")
    result, context = driver.cuDevicePrimaryCtxRetain(device)
    _check(result, "cuDevicePrimaryCtxRetain")
    _check(driver.cuCtxSetCurrent(context)[0], "cuCtxSetCurrent")
    done.add(device_index)


class CudaModule:
    """A loaded cubin and the kernels looked up in it so far."""

    def __init__(self, cubin: bytes, device_index: int) -> None:
        ensure_context(device_index)
        driver = _driver()
        self._cubin = cubin  # kept alive for the module's lifetime
        result, self.handle = driver.cuModuleLoadData(cubin)
        _check(result, "cuModuleLoadData")
        self.device_index = device_index
        self._functions: dict[str, Any] = {}

    def function(self, name: str) -> Any:
        found = self._functions.get(name)
        if found is None:
            result, found = _driver().cuModuleGetFunction(self.handle, name.encode())
            _check(result, f"cuModuleGetFunction({name})")
            self._functions[name] = found
        return found


# ctypes type for each Python argument kind a kernel takes.
Pointer = ctypes.c_void_p
Int = ctypes.c_int
Int64 = ctypes.c_longlong
Float = ctypes.c_float


def launch(
    function: Any,
    grid: int | tuple[int, int, int],
    block: int | tuple[int, int, int],
    args: Iterable[ctypes._SimpleCData],
    *,
    stream: int,
    shared_bytes: int = 0,
    pdl: bool = False,
) -> None:
    """Launch `function` with ctypes-typed `args` (e.g. `Pointer(t.data_ptr())`, `Int(n)`) on `stream`. `pdl`:
    as a programmatic dependent launch (`lucebox_cuda.pdl`: the kernel waits for the one ahead itself)."""
    grid = (grid, 1, 1) if isinstance(grid, int) else grid
    block = (block, 1, 1) if isinstance(block, int) else block
    values = list(args)
    pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(value) for value in values))
    if pdl:
        config = _pdl_config(tuple(grid), tuple(block), shared_bytes, int(stream))
        (result,) = _driver().cuLaunchKernelEx(config, function, ctypes.addressof(pointers), 0)
        _check(result, "cuLaunchKernelEx")
        return
    (result,) = _driver().cuLaunchKernel(
        function, *grid, *block, shared_bytes, stream, ctypes.addressof(pointers), 0
    )
    _check(result, "cuLaunchKernel")


@lru_cache(maxsize=4096)  # a few dozen shapes a model: built once each, not per launch (host time)
def _pdl_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int, stream: int) -> Any:
    """`cuLaunchKernelEx`'s configuration with the programmatic-stream-serialization attribute."""
    driver = _driver()
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_bytes
    config.hStream = driver.CUstream(stream)
    config.attrs = [attribute]
    config.numAttrs = 1
    return config
