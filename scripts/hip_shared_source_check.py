"""The HIP backend's kernels, checked on an NVIDIA GPU: the shared sources built with the HIP build's arithmetic.

    python scripts/hip_shared_source_check.py [--device cuda:0] [--seed 0]
    python scripts/hip_shared_source_check.py --compile-only [--arch sm_90] [--formats q4_k] [--dtypes bf16]

No AMD card is reachable from here, so this proves what can be proven without one. The HIP backend runs the
CUDA backend's own `.cu` files (dequant, matvec, moe_matvec, rms_norm) through `kernels/portable.cuh`; built
by NVRTC with `-DLUCEBOX_PORTABLE_GENERIC`, the same files take the HIP build's code paths wherever the header
has two (16-bit conversions in integer and fp32 arithmetic instead of PTX `cvt`), and the backend's products
are the HIP backend's (`lucebox_hip.products`: the CUDA-core matvec at every batch, no tensor cores). Each
kernel runs on fresh random GGUF blocks and is compared with a float64 torch reference, one line per case:

    PASS matvec    q4_k bf16 batch 8 [1001x5120]              err 1.1e-03 (bound 6e-03)

The 16-bit stores and loads are also checked bit for bit against torch's conversions (`convert` lines: an
f32 weight dequantized to f16/bf16 must equal torch's `.to()`, every fp16 pattern dequantized to f32 must
equal torch's `.float()`). What this does not prove: the HIP launch path, the wave scheduling of a real RDNA
card, and the compiler (hiprtc's clang instead of NVRTC). Exits 1 if any case fails.

`--compile-only` needs no GPU: it compiles, with NVRTC for `--arch`, exactly the programs the chosen cases
would launch (the tests run it on the CPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # cuda_check: random GGUF blocks, error bounds
if importlib.util.find_spec("lucebox_hip") is None:  # run from a checkout where only lucebox-cuda is installed
    sys.path.insert(0, str(ROOT / "backends" / "hip"))

import cuda_check  # noqa: E402
from lucebox_core import quants  # noqa: E402
from lucebox_core.quants import QuantTensor  # noqa: E402
from lucebox_cuda import catalogue, nvrtc  # noqa: E402
from lucebox_cuda.backend import CudaBackend  # noqa: E402
from lucebox_hip.hiprtc import HIP_SOURCES  # noqa: E402
from lucebox_hip.products import SharedSourceProducts  # noqa: E402

GENERIC_OPTIONS = (*nvrtc.DEFAULT_OPTIONS, "-DLUCEBOX_PORTABLE_GENERIC")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
FORMATS = tuple(catalogue.WEIGHT_FORMATS.values())
BATCHES = (1, 3, 8, 13, 64)
MOE_EXPERTS, MOE_TOP_K = 8, 2


class SharedSourceBackend(SharedSourceProducts, CudaBackend):
    """The CUDA backend with the HIP backend's kernels: the shared sources in their generic arithmetic and
    the CUDA-core matvec for every product."""

    compile_options = GENERIC_OPTIONS


@attrs.frozen
class Case:
    kind: str  # matvec, moe, dequant, rms_norm, convert
    fmt: str  # weight format (rms_norm: the weight's dtype)
    dtype: str  # activation / output dtype
    batch: int = 1

    @property
    def label(self) -> str:
        shape = {"matvec": f" batch {self.batch} [1001x5120]", "moe": f" {MOE_EXPERTS} experts top-{MOE_TOP_K} [517x2048]",
                 "dequant": " rows 3:203 of [517x2048]", "rms_norm": " [7x5120]", "convert": ""}[self.kind]
        if self.kind == "rms_norm":
            return f"x {self.dtype} w {self.fmt}{shape}"
        arrow = " ->" if self.kind in ("dequant", "convert") else ""
        return f"{self.fmt}{arrow} {self.dtype}{shape}"

    def program(self) -> tuple[nvrtc.KernelProgram, str]:
        if self.kind == "matvec":
            kernel = catalogue.matvec_kernel(self.fmt, self.dtype, self.batch, 1001, "simt", in_features=5120)
            return kernel.program, kernel.name
        if self.kind == "moe":
            return catalogue.moe_matvec(self.fmt, self.dtype)
        if self.kind == "rms_norm":
            return catalogue.rms_norm(self.dtype, self.fmt)
        return catalogue.dequant(self.fmt, self.dtype)  # dequant and convert


def plan(formats: tuple[str, ...], dtypes: tuple[str, ...], batches: tuple[int, ...]) -> list[Case]:
    cases = [Case("matvec", f, d, b) for f in formats for d in dtypes for b in batches]
    cases += [Case("moe", f, d) for f in formats for d in dtypes]
    cases += [Case("dequant", f, d) for f in formats for d in dtypes]
    cases += [Case("rms_norm", w, d) for d in dtypes for w in sorted({d, "f32"})]
    cases += [Case("convert", "f32", d) for d in dtypes if d != "f32"]
    if "f32" in dtypes:
        cases.append(Case("convert", "f16", "f32"))
    return cases


# -- the checks: each returns (error, bound); a bound of 0 asks for bit-identical results --------------------


def random_weight(fmt: str, rows: int, cols: int, gen: torch.Generator, device: torch.device) -> QuantTensor:
    """cuda_check's random GGUF blocks, with Q5_0's fp16 scale (random bits there) made sane too."""
    weight = cuda_check.random_weight(fmt, rows, cols, gen, device)
    if fmt == "q5_0":
        blocks = weight.data.view(-1, quants.type_size(weight.ggml_type))
        scales = torch.rand(blocks.shape[0], generator=gen, device=device) * 6e-4 + 2e-4
        blocks[:, 0:2] = cuda_check._fp16_bytes(scales)
    return weight


def _matvec(backend: SharedSourceBackend, case: Case, gen: torch.Generator) -> tuple[float, float]:
    dtype, device = DTYPES[case.dtype], backend.device
    weight = random_weight(case.fmt, 1001, 5120, gen, device)
    x = torch.randn(case.batch, 5120, generator=gen, device=device).to(dtype)
    ref = x.double() @ quants.dequantize(weight.data, weight.ggml_type, weight.shape).double().T
    out = torch.full((case.batch, 1001), float("nan"), dtype=dtype, device=device)
    backend.matvec(x, weight, out=out)
    torch.cuda.synchronize()
    return cuda_check.relative_error(out, ref), cuda_check.MATVEC_BOUND[dtype]


def _moe(backend: SharedSourceBackend, case: Case, gen: torch.Generator) -> tuple[float, float]:
    dtype, device, rows, cols, tokens = DTYPES[case.dtype], backend.device, 517, 2048, 3
    flat = random_weight(case.fmt, MOE_EXPERTS * rows, cols, gen, device)
    stack = QuantTensor("experts", flat.ggml_type, (MOE_EXPERTS, rows, cols), flat.data)
    dense = quants.dequantize(flat.data, flat.ggml_type, flat.shape).double().view(MOE_EXPERTS, rows, cols)
    ids = torch.randint(0, MOE_EXPERTS, (tokens * MOE_TOP_K,), generator=gen, device=device)
    x = torch.randn(tokens, cols, generator=gen, device=device).to(dtype)
    ref = torch.stack([x[s // MOE_TOP_K].double() @ dense[ids[s]].T for s in range(ids.numel())])
    out = backend.expert_matvec(x, stack, ids, MOE_TOP_K)
    torch.cuda.synchronize()
    return cuda_check.relative_error(out, ref), cuda_check.MATVEC_BOUND[dtype]


def _dequant(backend: SharedSourceBackend, case: Case, gen: torch.Generator) -> tuple[float, float]:
    dtype, device = DTYPES[case.dtype], backend.device
    weight = random_weight(case.fmt, 517, 2048, gen, device)
    ref = quants.dequantize(weight.data, weight.ggml_type, weight.shape)[3:203].double()
    out = torch.full((200, 2048), float("nan"), dtype=dtype, device=device)
    backend.dequantize_rows(weight, 3, 203, dtype, out=out)
    torch.cuda.synchronize()
    return cuda_check.relative_error(out, ref), {torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}[dtype]


def _rms_norm(backend: SharedSourceBackend, case: Case, gen: torch.Generator) -> tuple[float, float]:
    dtype, device = DTYPES[case.dtype], backend.device
    x = (torch.randn(7, 5120, generator=gen, device=device) * 3 + 0.5).to(dtype)
    w = (torch.rand(5120, generator=gen, device=device) + 0.5).to(DTYPES[case.fmt])
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    out = torch.full_like(x, float("nan"))
    backend.rms_norm_kernel(x, w, 1e-6, out=out)
    torch.cuda.synchronize()
    return cuda_check.relative_error(out, ref), cuda_check.NORM_BOUND[dtype]


def _convert(backend: SharedSourceBackend, case: Case, gen: torch.Generator) -> tuple[float, float]:
    """Bit-exact 16-bit conversions in a kernel: the number of elements that differ from torch's (bound 0)."""
    device = backend.device
    if case.fmt == "f16":  # every fp16 bit pattern, loaded and widened to fp32
        values = torch.arange(0, 1 << 16, dtype=torch.int32, device=device).to(torch.int16).view(torch.float16)
        expected = values.float()
    else:  # fp32 values from 1e-9 to 1e6: fp16 subnormals, ties, overflow to infinity
        magnitude = torch.pow(10.0, torch.rand(1 << 16, generator=gen, device=device) * 15 - 9)
        values = torch.where(torch.rand(1 << 16, generator=gen, device=device) < 0.5, magnitude, -magnitude)
        expected = values.to(DTYPES[case.dtype])
    weight = QuantTensor(f"w_{case.fmt}", catalogue_type(case.fmt), (64, 1024), values.view(torch.uint8).reshape(-1))
    out = backend.dequantize_rows(weight, 0, 64, DTYPES[case.dtype]).reshape(-1)
    torch.cuda.synchronize()
    same = (out == expected) | (torch.isnan(out) & torch.isnan(expected))
    if out.element_size() == 2:
        same &= out.view(torch.int16) == expected.view(torch.int16)  # -0.0 and +0.0 differ in bits
    return float((~same).sum().item()), 0.0


def catalogue_type(fmt: str):
    return {name: ggml_type for ggml_type, name in catalogue.WEIGHT_FORMATS.items()}[fmt]


CHECKS: dict[str, Callable[[SharedSourceBackend, Case, torch.Generator], tuple[float, float]]] = {
    "matvec": _matvec, "moe": _moe, "dequant": _dequant, "rms_norm": _rms_norm, "convert": _convert}


def run_case(backend: SharedSourceBackend, case: Case, gen: torch.Generator) -> bool:
    try:
        error, bound = CHECKS[case.kind](backend, case, gen)
    except Exception as exc:
        print(f"FAIL {case.kind:9s} {case.label:42s} raised {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        return False
    ok = error == error and error <= bound  # NaN fails
    measure = f"{int(error)} differ (bound 0)" if bound == 0 else f"err {error:.1e} (bound {bound:.0e})"
    print(f"{'PASS' if ok else 'FAIL'} {case.kind:9s} {case.label:42s} {measure}", flush=True)
    return ok


def _compile_into_cache(job: tuple[nvrtc.KernelProgram, str]) -> str:
    program, arch = job
    nvrtc.compile_program(program, arch, GENERIC_OPTIONS)
    return program.file


def precompile(cases: list[Case], arch: str) -> None:
    """Every program the cases launch, compiled in parallel into the disk cache the backend then reads."""
    programs = list(dict.fromkeys(case.program()[0] for case in cases))
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")  # children that never touch the parent's CUDA context
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=context) as pool:
        list(pool.map(_compile_into_cache, [(program, arch) for program in programs]))
    print(f"compiled {len(programs)} programs for {arch} in {time.perf_counter() - start:.1f} s", flush=True)


def compile_only(cases: list[Case], arch: str) -> int:
    programs: dict[nvrtc.KernelProgram, str] = {}
    for case in cases:
        program, name = case.program()
        programs.setdefault(program, name)
    failed = 0
    for program, name in programs.items():
        assert program.file in HIP_SOURCES, program.file  # only the shared sources, never a tensor-core one
        try:
            cubin = nvrtc.compile_program(program, arch, GENERIC_OPTIONS, use_cache=False)
            ok = name.encode() in cubin
        except nvrtc.CudaError as exc:
            print(exc)
            ok = False
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} compile   {name:42s} {arch} -DLUCEBOX_PORTABLE_GENERIC", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default=",".join(FORMATS), help="weight formats (default: every one)")
    parser.add_argument("--dtypes", default="f32,f16,bf16", help="activation dtypes")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="matvec batch sizes")
    parser.add_argument("--compile-only", action="store_true", help="compile the cases' programs with NVRTC; no GPU")
    parser.add_argument("--arch", default="sm_90", help="the architecture --compile-only compiles for")
    args = parser.parse_args(argv)
    formats = tuple(f for f in args.formats.split(",") if f)
    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    unknown = sorted(set(formats) - set(FORMATS)) + sorted(set(dtypes) - set(DTYPES))
    if unknown:
        parser.error(f"unknown format or dtype: {', '.join(unknown)}")
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    if any(not 1 <= b <= catalogue.MAX_BATCH for b in batches):
        parser.error(f"batches are 1..{catalogue.MAX_BATCH}")
    cases = plan(formats, dtypes, batches)
    if args.compile_only:
        return compile_only(cases, args.arch)
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        print("error: this check runs on an NVIDIA GPU (a CUDA build of torch); --compile-only needs none",
              file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability(args.device)
    precompile(cases, f"sm_{major}{minor}")
    backend = SharedSourceBackend(args.device, torch.float32)
    print(f"{torch.cuda.get_device_name(backend.device)} ({backend.arch}), torch {torch.__version__}, "
          f"NVRTC {'%d.%d' % nvrtc.nvrtc_version()}, options {' '.join(GENERIC_OPTIONS)}", flush=True)
    gen = torch.Generator(device=backend.device).manual_seed(args.seed)
    failures = sum(not run_case(backend, case, gen) for case in cases)
    print(f"{len(cases) - failures}/{len(cases)} cases pass", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
