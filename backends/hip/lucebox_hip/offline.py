"""Ahead-of-time compilation of the HIP sources with clang, on a machine with no AMD GPU and no ROCm runtime.

CI's check that every shared source builds for each RDNA target: clang (19 or newer knows gfx1100, gfx1151
and gfx1201) in HIP mode, device code only, with the HIP headers (`hip/hip_runtime.h`, force-included as
hipcc does; hiprtc provides the same declarations built in), the options hiprtc gets, down to the target's
assembly: parsing, templates, instruction selection and register allocation for that exact gfx target.
What it leaves out is the final link against ROCm's device library (ocml: `rsqrtf`, the work-item ids),
which hiprtc does on the user's machine: Debian's ROCm 5.2 device library predates gfx11, so `-nogpulib`.

`LUCEBOX_HIP_CLANG` names the compiler (default `clang++-19`), `LUCEBOX_HIP_PATH` the prefix holding
`include/hip/hip_runtime.h` (default `/usr`, Debian's `libamdhip64-dev`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs

from lucebox_cuda.nvrtc import KernelProgram

from .hiprtc import DEFAULT_OPTIONS, HipCompileError

CLANG_ENV = "LUCEBOX_HIP_CLANG"
HIP_PATH_ENV = "LUCEBOX_HIP_PATH"
DEFAULT_CLANG = "clang++-19"


@attrs.frozen
class Toolchain:
    clang: str
    hip_path: Path

    def version(self) -> str:
        first = subprocess.run([self.clang, "--version"], capture_output=True, text=True, check=True).stdout
        return first.splitlines()[0].strip()


def find_toolchain() -> Toolchain | str:
    """The configured clang and HIP headers, or a sentence saying what is missing."""
    clang = os.environ.get(CLANG_ENV, DEFAULT_CLANG)
    found = shutil.which(clang)
    if found is None:
        return f"{clang} is not on PATH (apt-get install clang-19, or set {CLANG_ENV})"
    hip_path = Path(os.environ.get(HIP_PATH_ENV, "/usr"))
    if not (hip_path / "include" / "hip" / "hip_runtime.h").is_file():
        return f"{hip_path}/include/hip/hip_runtime.h is missing (apt-get install libamdhip64-dev, or set {HIP_PATH_ENV})"
    return Toolchain(found, hip_path)


@attrs.frozen
class Assembly:
    """A program's device assembly for one target, and what it says about each kernel."""

    text: str

    def target(self) -> str:
        found = re.search(r'\.amdgcn_target "amdgcn-amd-amdhsa--([\w]+)', self.text)
        return found.group(1) if found else ""

    def kernels(self) -> list[str]:
        return re.findall(r"^\s*\.amdhsa_kernel (\S+)", self.text, re.MULTILINE)

    def wave_size(self, kernel: str) -> int:
        return 32 if self._field(kernel, "amdhsa_wavefront_size32") == 1 else 64

    def private_bytes(self, kernel: str) -> int:
        """Scratch per work item: > 0 means registers spilled (or a stack array) for this kernel."""
        return self._field(kernel, "amdhsa_private_segment_fixed_size")

    def vgprs(self, kernel: str) -> int:
        return self._field(kernel, "amdhsa_next_free_vgpr")

    def _field(self, kernel: str, field: str) -> int:
        block = self.text.split(f".amdhsa_kernel {kernel}\n", 1)[1].split(".end_amdhsa_kernel", 1)[0]
        found = re.search(rf"\.{field} (\d+)", block)
        return int(found.group(1)) if found else 0


def compile_to_assembly(program: KernelProgram, target: str, toolchain: Toolchain,
                        options: Sequence[str] = DEFAULT_OPTIONS) -> Assembly:
    """Compile `program` (a shared source and its instantiation lines) for `target`; the compiler's error
    output is the exception's message."""
    with tempfile.TemporaryDirectory(prefix="lucebox-hip-") as folder:
        root = Path(folder)
        for name, text in program.headers().items():
            (root / name).write_text(text, encoding="utf-8")
        source = root / program.file
        source.write_text(program.source(), encoding="utf-8")
        output = root / f"{program.file}.{target}.s"
        command = [toolchain.clang, "-x", "hip", f"--offload-arch={target}", f"--hip-path={toolchain.hip_path}",
                   "-nogpulib", "--cuda-device-only", "-include", "hip/hip_runtime.h", *options, "-S", str(source),
                   "-o", str(output)]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise HipCompileError(f"{Path(toolchain.clang).name} could not compile {program.file} for {target}:\n"
                                  f"{run.stderr.strip()}")
        return Assembly(output.read_text(encoding="utf-8"))
