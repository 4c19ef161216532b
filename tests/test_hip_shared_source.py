"""`scripts/hip_shared_source_check.py`: the HIP backend's kernels (the shared sources in their HIP arithmetic)
against torch on an NVIDIA GPU. Here, without one, its compile route: the very programs it would launch, built
by NVRTC with `-DLUCEBOX_PORTABLE_GENERIC`; on a CUDA machine, the whole check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("cuda.bindings.nvrtc", reason="lucebox-cuda's dependencies (cuda-bindings) are not installed")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hip_shared_source_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("hip_shared_source_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # Registered under its own name, as a script's module is importable by it: the worker processes that
    # precompile unpickle its functions by that name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEBOX_HOME", str(tmp_path))


def test_the_plan_covers_every_shared_source_and_no_other(check):
    from lucebox_hip.hiprtc import HIP_SOURCES

    cases = check.plan(check.FORMATS, tuple(check.DTYPES), check.BATCHES)
    assert {case.program()[0].file for case in cases} == set(HIP_SOURCES)
    kinds = {case.kind for case in cases}
    assert kinds == {"matvec", "moe", "dequant", "rms_norm", "convert"}
    # Every weight format meets every activation dtype in each product.
    assert {(c.fmt, c.dtype) for c in cases if c.kind == "matvec"} == {(f, d) for f in check.FORMATS for d in check.DTYPES}


def test_compile_only_builds_the_generic_programs(check, capsys):
    assert check.main(["--compile-only", "--formats", "q6_k", "--dtypes", "f16", "--batches", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # matvec, moe, dequant, two rms_norm weights, the f32 -> f16 store: each its own program, each built.
    assert len(lines) == 6 and all(line.startswith("PASS compile") for line in lines), lines
    assert any("matvec_q6_k_f16_3" in line for line in lines)
    assert all("-DLUCEBOX_PORTABLE_GENERIC" in line for line in lines)


def test_bad_arguments_are_named(check, capsys):
    with pytest.raises(SystemExit) as exit_info:
        check.main(["--compile-only", "--formats", "q3_k"])
    assert exit_info.value.code == 2 and "unknown format or dtype: q3_k" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check.main(["--compile-only", "--batches", "65"])


@pytest.mark.skipif(torch.cuda.is_available() and not getattr(torch.version, "hip", None),
                    reason="an NVIDIA GPU is here: the next test runs the check")
def test_without_an_nvidia_gpu_the_check_says_so(check, capsys):
    assert check.main(["--formats", "q4_k"]) == 2
    assert "runs on an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available() or bool(getattr(torch.version, "hip", None)),
                    reason="needs an NVIDIA GPU")
def test_the_hip_arithmetic_matches_torch_on_the_gpu(check, capsys):
    assert check.main(["--batches", "1,8,64"]) == 0, capsys.readouterr().out


def test_precompile_fills_the_cache_the_backend_reads(check, tmp_path, capsys):
    """The GPU run compiles every program first, in worker processes, into the disk cache; the backend's
    compile (same program, architecture and options) is then a cache hit."""
    from lucebox_cuda import nvrtc

    cases = check.plan(("q8_0",), ("bf16",), (2,))
    check.precompile(cases, "sm_90")
    cached = sorted((tmp_path / "cuda-cache").glob("*.cubin"))
    programs = {case.program()[0] for case in cases}
    assert len(cached) == len(programs) == 6
    program = next(iter(programs))
    key = nvrtc.cache_key(program, "sm_90", check.GENERIC_OPTIONS)
    [entry] = [path for path in cached if key in path.name]
    entry.write_bytes(b"planted")  # a cache hit returns the file's bytes
    assert nvrtc.compile_program(program, "sm_90", check.SharedSourceBackend.compile_options) == b"planted"
    assert "compiled 6 programs for sm_90" in capsys.readouterr().out
