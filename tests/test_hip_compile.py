"""Every HIP kernel source compiles for RDNA3 (gfx1100), RDNA3.5 (gfx1151) and RDNA4 (gfx1201), with no AMD GPU.

The sources are the CUDA backend's own (`lucebox_cuda/kernels`), built for HIP through `portable.cuh`; the
CUDA build of the same files is `test_cuda_compile.py`, so the two cannot drift apart unnoticed. The compiler
is clang 19 in HIP mode with Debian's HIP headers (`lucebox_hip.offline`), which `.ci/run` installs: this test
fails when they are missing, and skips only when `LUCEBOX_HIP_TOOLCHAIN=absent` says they are left out on
purpose.
"""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("lucebox_hip", reason="lucebox-hip is not installed")

from lucebox_cuda import nvrtc  # noqa: E402
from lucebox_hip import hiprtc, offline  # noqa: E402

ABSENT_ENV = "LUCEBOX_HIP_TOOLCHAIN"


@pytest.fixture(scope="module")
def toolchain() -> offline.Toolchain:
    found = offline.find_toolchain()
    if isinstance(found, str):
        if os.environ.get(ABSENT_ENV) == "absent":
            pytest.skip(f"{ABSENT_ENV}=absent: {found}")
        pytest.fail(f"the HIP compile check needs its toolchain: {found}; .ci/run installs it "
                    f"(or set {ABSENT_ENV}=absent to leave the check out on purpose)")
    return found


# One compile per (source, target), shared by the tests that read its assembly.
_assemblies: dict[tuple[str, str], offline.Assembly] = {}


def _assembly(source: str, target: str, toolchain: offline.Toolchain) -> offline.Assembly:
    key = (source, target)
    if key not in _assemblies:
        _assemblies[key] = offline.compile_to_assembly(hiprtc.compile_check_programs()[source], target, toolchain)
    return _assemblies[key]


def _instantiated_names(program: nvrtc.KernelProgram) -> list[str]:
    prefixes = {"LUCEBOX_MATVEC": "matvec", "LUCEBOX_DEQUANT": "dequant", "LUCEBOX_DEQUANT_ROWS": "dequant_rows",
                "LUCEBOX_RMS_NORM": "rms_norm",
                "LUCEBOX_MOE_MATVEC": "moe_matvec", "LUCEBOX_MOE_MATVEC_PAGED": "moe_matvec_paged",
                "LUCEBOX_MOE_MATVEC_PAIR": "moe_matvec_pair", "LUCEBOX_MOE_MATVEC_PAIR_PAGED": "moe_matvec_pair_paged",
                "LUCEBOX_UNTILE_ROWS": "untile_rows"}
    names = []
    for line in program.instantiations:
        macro, args = line.split("(", 1)
        parts = [part.strip() for part in args.rstrip(")").split(",") if part.strip()]
        names.append("_".join([prefixes[macro], *parts]))
        if macro == "LUCEBOX_UNTILE_ROWS":  # the range's kernel and the ids' one
            names.append("untile_rows_at")
    return names


def test_the_hip_sources_are_the_cuda_sources_without_tensor_cores():
    assert set(hiprtc.HIP_SOURCES) <= set(nvrtc.kernel_files())
    assert set(nvrtc.kernel_files()) - set(hiprtc.HIP_SOURCES) == {"matvec_mma.cu", "matvec_pipe.cu", "moe_matvec_mma.cu",
                                                                   "matvec_tiled.cu",
                                                                   "ffn_persistent.cu", "moe_persistent.cu",
                                                                   "gdn_persistent.cu", "attention_persistent.cu",
                                                                   "qwen35_megakernel.cu"}
    assert set(hiprtc.compile_check_programs()) == set(hiprtc.HIP_SOURCES)


@pytest.mark.slow
@pytest.mark.parametrize("target", hiprtc.CHECKED_TARGETS)
@pytest.mark.parametrize("source", hiprtc.HIP_SOURCES)
def test_source_compiles_for_the_target(source, target, toolchain):
    program = hiprtc.compile_check_programs()[source]
    assembly = _assembly(source, target, toolchain)
    assert assembly.target() == target
    # Every instantiated kernel is in the code object under its extern "C" name, as hipModuleGetFunction asks.
    assert sorted(assembly.kernels()) == sorted(_instantiated_names(program))
    for kernel in assembly.kernels():
        # RDNA runs HIP in wave32: one hardware wave is the kernels' 32-lane warp.
        assert assembly.wave_size(kernel) == 32, kernel
        # Decode-sized products (batch <= 8), norms and dequantization keep everything in registers.
        batch = re.search(r"_(\d+)$", kernel)
        if not kernel.startswith("matvec_") or (batch and int(batch.group(1)) <= 8):
            assert assembly.private_bytes(kernel) == 0, (kernel, assembly.vgprs(kernel))


def test_tensor_core_sources_refuse_to_build_for_hip(toolchain):
    program = nvrtc.KernelProgram("matvec_mma.cu", ["LUCEBOX_MATVEC_MMA(q4_k, bf16, 1)"])
    with pytest.raises(hiprtc.HipCompileError, match="the tensor-core kernels .* are CUDA-only"):
        offline.compile_to_assembly(program, "gfx1100", toolchain)


def test_compile_error_carries_the_log(toolchain):
    broken = nvrtc.KernelProgram("matvec.cu", ["LUCEBOX_MATVEC(q3_k, bf16, 1)"])  # no such format
    with pytest.raises(hiprtc.HipCompileError, match=r"matvec\.cu for gfx1201:\n.*W_q3_k"):
        offline.compile_to_assembly(broken, "gfx1201", toolchain)


def test_hiprtc_refuses_a_cuda_only_source_before_compiling():
    program = nvrtc.KernelProgram("matvec_pipe.cu", [])
    with pytest.raises(hiprtc.HipCompileError, match="not one of the sources that build for HIP"):
        hiprtc.compile_program(program, "gfx1100", use_cache=False)


def test_cache_key_depends_on_source_target_options_and_compiler():
    from lucebox_cuda import catalogue

    program, _ = catalogue.rms_norm("bf16", "f32")
    other, _ = catalogue.rms_norm("f16", "f32")
    keys = {hiprtc.cache_key(program, "gfx1100", compiler="hiprtc 7.2"),
            hiprtc.cache_key(program, "gfx1201", compiler="hiprtc 7.2"),
            hiprtc.cache_key(other, "gfx1100", compiler="hiprtc 7.2"),
            hiprtc.cache_key(program, "gfx1100", ("-std=c++17",), compiler="hiprtc 7.2"),
            hiprtc.cache_key(program, "gfx1100", compiler="hiprtc 6.4")}
    assert len(keys) == 5
    assert hiprtc.cache_key(program, "gfx1100", compiler="hiprtc 7.2") in keys  # and it is deterministic


@pytest.mark.parametrize(("arch_name", "target"), [("gfx1100", "gfx1100"), ("gfx90a:sramecc+:xnack-", "gfx90a"),
                                                    ("gfx1201 ", "gfx1201")])
def test_target_of_a_device_arch_name(arch_name, target):
    assert hiprtc.target_of(arch_name) == target
