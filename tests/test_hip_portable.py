"""The portability header's generic arithmetic (what the HIP build runs) is exact, and builds under NVRTC too.

1. The 16-bit conversions of `portable.cuh`'s generic path, compiled for the host from the header itself,
   agree with torch's conversions bit for bit: every fp16 bit pattern to fp32, and fp32 values around every
   rounding boundary (ties, subnormals, overflow, infinities; NaN stays NaN) to fp16 and bf16.
2. NVRTC compiles every shared source with `LUCEBOX_PORTABLE_GENERIC` (the HIP build's arithmetic in a CUDA
   build: what `scripts/hip_shared_source_check.py` runs against torch on an NVIDIA GPU), into code that
   differs from the default build's.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from importlib import resources

import pytest
import torch

pytest.importorskip("lucebox_hip", reason="lucebox-hip is not installed")

from lucebox_hip import hiprtc, offline  # noqa: E402

HOST_HARNESS = r"""
#include <cstring>
#define __device__
#define __forceinline__ inline
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
#define LUCEBOX_PORTABLE_GENERIC 1
#include "portable.cuh"
extern "C" void half_to_float(const unsigned short* in, float* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = lucebox_half_bits_to_float(in[i]);
}
extern "C" void float_to_half(const float* in, unsigned short* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = lucebox_float_to_half_bits(in[i]);
}
extern "C" void float_to_bf16(const float* in, unsigned short* out, long n) {
    for (long i = 0; i < n; ++i) out[i] = lucebox_float_to_bf16_bits(in[i]);
}
"""


@pytest.fixture(scope="module")
def conversions(tmp_path_factory) -> ctypes.CDLL:
    found = offline.find_toolchain()
    if isinstance(found, str):
        if os.environ.get("LUCEBOX_HIP_TOOLCHAIN") == "absent":
            pytest.skip(f"LUCEBOX_HIP_TOOLCHAIN=absent: {found}")
        pytest.fail(f"the portability check needs clang: {found}")
    folder = tmp_path_factory.mktemp("portable")
    header = resources.files("lucebox_cuda.kernels").joinpath("portable.cuh").read_text(encoding="utf-8")
    (folder / "portable.cuh").write_text(header, encoding="utf-8")
    (folder / "harness.cpp").write_text(HOST_HARNESS, encoding="utf-8")
    library = folder / "harness.so"
    subprocess.run([found.clang, "-x", "c++", "-std=c++17", "-O2", "-shared", "-fPIC", str(folder / "harness.cpp"),
                    "-o", str(library)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(library))


def _call(function, values: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    values = values.contiguous()
    out = torch.empty(values.numel(), dtype=out_dtype)
    function(ctypes.c_void_p(values.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_long(values.numel()))
    return out


def _boundary_floats() -> torch.Tensor:
    """fp32 values at and around every fp16 and bf16 rounding boundary, plus random bit patterns."""
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    halves = halves[torch.isfinite(halves)]
    bits = halves.view(torch.int32)
    # Each fp16 value, the midpoints to its neighbours (the ties) and one fp32 ulp either side of them.
    midpoints = (bits + (1 << 12)).view(torch.float32)
    around = torch.cat([bits + d for d in (-1, 0, 1)] + [midpoints.view(torch.int32) + d for d in (-1, 0, 1)])
    bf16_ties = torch.arange(0, 1 << 16, dtype=torch.int32) << 16
    bf16_around = torch.cat([bf16_ties + d for d in (0x7FFF, 0x8000, 0x8001, 0xFFFF)])
    generator = torch.Generator().manual_seed(7)
    random_bits = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 20,), generator=generator, dtype=torch.int64)
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 6.1035156e-05, 5.9604645e-08,
                            2.9802322e-08, 2.9802326e-08, 3.4028235e38, float("inf"), float("-inf"), float("nan"),
                            1e-45, -1e-45])
    everything = torch.cat([around.view(torch.float32), -around.view(torch.float32), bf16_around.view(torch.float32),
                            random_bits.to(torch.int32).view(torch.float32), special])
    return everything


def _same_bits(ours: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor) -> None:
    ours_bits, expected_bits = ours.view(torch.int16), expected.view(torch.int16)
    nan = torch.isnan(inputs)
    assert torch.isnan(ours[nan].float()).all()  # NaN stays NaN (the bits are PTX's canonical 0x7FFF)
    wrong = (ours_bits != expected_bits) & ~nan
    assert not wrong.any(), [(inputs[i].item(), hex(ours_bits[i].item() & 0xFFFF), hex(expected_bits[i].item() & 0xFFFF))
                             for i in wrong.nonzero().flatten()[:5]]


def test_every_half_converts_to_float_exactly(conversions):
    patterns = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    ours = _call(conversions.half_to_float, patterns, torch.float32)
    expected = patterns.view(torch.float16).float()
    nan = torch.isnan(expected)
    assert torch.isnan(ours[nan]).all()
    assert torch.equal(ours[~nan].view(torch.int32), expected[~nan].view(torch.int32))  # -0.0 and subnormals too


def test_float_to_half_rounds_to_nearest_even(conversions):
    values = _boundary_floats()
    _same_bits(_call(conversions.float_to_half, values, torch.float16), values.to(torch.float16), values)


def test_float_to_bf16_rounds_to_nearest_even(conversions):
    values = _boundary_floats()
    _same_bits(_call(conversions.float_to_bf16, values, torch.bfloat16), values.to(torch.bfloat16), values)


def test_nan_is_the_canonical_ptx_nan(conversions):
    nan = torch.tensor([float("nan"), -float("nan")])
    assert (_call(conversions.float_to_half, nan, torch.float16).view(torch.int16) == 0x7FFF).all()
    assert (_call(conversions.float_to_bf16, nan, torch.bfloat16).view(torch.int16) == 0x7FFF).all()


def test_generic_build_compiles_under_nvrtc_and_differs_from_the_default(tmp_path, monkeypatch):
    nvrtc_module = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    del nvrtc_module
    from lucebox_cuda import nvrtc

    monkeypatch.setenv("LUCEBOX_HOME", str(tmp_path))
    generic = (*nvrtc.DEFAULT_OPTIONS, "-DLUCEBOX_PORTABLE_GENERIC")
    for name, program in hiprtc.compile_check_programs().items():
        cubin = nvrtc.compile_program(program, "sm_90", generic, use_cache=False)
        assert cubin[:4] == b"\x7fELF", name
        if name == "rms_norm.cu":  # bf16 and f16 stores: software rounding instead of `cvt`
            assert cubin != nvrtc.compile_program(program, "sm_90", use_cache=False)
