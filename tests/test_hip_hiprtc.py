"""The backend's own compile path (`lucebox_hip.hiprtc`: hip-python's hiprtc calls, the headers handed over as
in-memory includes, the options, the code object, the disk cache) against a real hiprtc, with no GPU.

Debian's ROCm 5.2 runtime (`libamdhip64-5`, which `.ci/run` installs with the HIP headers) carries hiprtc in
libamdhip64; hip-python looks for `libhiprtc.so`, so a link of that name is put on LD_LIBRARY_PATH of a child
process. This hiprtc knows targets up to RDNA2 (`gfx1030`): its device library predates gfx11 (it aborts on
gfx1100), so the RDNA3/3.5/4 targets are `test_hip_compile.py`'s (clang 19). What this adds: the shared
sources compile under hiprtc's own built-in declarations (no hip_runtime.h) through the exact Python code a
user's machine runs. Skips only with `LUCEBOX_HIP_TOOLCHAIN=absent`, as the clang check does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lucebox_hip", reason="lucebox-hip is not installed")
if importlib.util.find_spec("hip") is None:
    pytest.skip("hip-python is not installed", allow_module_level=True)

RUNTIME = Path("/usr/lib/x86_64-linux-gnu/libamdhip64.so.5")
TARGET = "gfx1030"  # the newest target ROCm 5.2's hiprtc compiles for

PROBE = r"""
import json, sys
from lucebox_cuda import catalogue
from lucebox_hip import hiprtc
report = {"version": list(hiprtc.hiprtc_version()), "sources": {}}
for name, program in hiprtc.compile_check_programs().items():
    code = hiprtc.compile_program(program, sys.argv[1], use_cache=False)
    report["sources"][name] = {"elf": code[:4] == b"\x7fELF", "missing": [
        line for line in program.instantiations if _name(line).encode() not in code]}
# The disk cache: a second compile of the same program is the file (planted bytes prove it).
program, _ = catalogue.rms_norm("bf16", "f32")
first = hiprtc.compile_program(program, sys.argv[1])
[entry] = list(hiprtc.cache_dir().glob("*.hsaco"))
entry.write_bytes(b"planted")
report["cache"] = [entry.name, hiprtc.compile_program(program, sys.argv[1]) == b"planted", len(first)]
try:
    hiprtc.compile_program(catalogue.KernelProgram("matvec.cu", ["LUCEBOX_MATVEC(q3_k, bf16, 1)"]), sys.argv[1],
                           use_cache=False)
except hiprtc.HipCompileError as error:
    report["error"] = str(error)
print(json.dumps(report))
"""
NAMES = r"""
def _name(line):
    macro, args = line.split("(", 1)
    prefix = {"LUCEBOX_MATVEC": "matvec", "LUCEBOX_DEQUANT": "dequant", "LUCEBOX_DEQUANT_ROWS": "dequant_rows",
              "LUCEBOX_RMS_NORM": "rms_norm",
              "LUCEBOX_MOE_MATVEC": "moe_matvec", "LUCEBOX_MOE_MATVEC_PAGED": "moe_matvec_paged",
              "LUCEBOX_MOE_MATVEC_PAIR": "moe_matvec_pair", "LUCEBOX_MOE_MATVEC_PAIR_PAGED": "moe_matvec_pair_paged",
              "LUCEBOX_UNTILE_ROWS": "untile_rows"}[macro]
    return "_".join([prefix, *(part.strip() for part in args.rstrip(")").split(",") if part.strip())])
"""


@pytest.fixture(scope="module")
def library_path(tmp_path_factory) -> Path:
    if not RUNTIME.is_file():
        if os.environ.get("LUCEBOX_HIP_TOOLCHAIN") == "absent":
            pytest.skip(f"LUCEBOX_HIP_TOOLCHAIN=absent: {RUNTIME} is missing")
        pytest.fail(f"{RUNTIME} is missing (apt-get install libamdhip64-dev, as .ci/run does)")
    folder = tmp_path_factory.mktemp("hiprtc")
    (folder / "libhiprtc.so").symlink_to(RUNTIME)
    return folder


@pytest.mark.slow
def test_every_shared_source_compiles_through_hiprtc(library_path, tmp_path):
    env = {**os.environ, "LD_LIBRARY_PATH": f"{library_path}:{os.environ.get('LD_LIBRARY_PATH', '')}",
           "LUCEBOX_HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", NAMES + PROBE, TARGET], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(report["sources"]) == {"dequant.cu", "matvec.cu", "moe_matvec.cu", "rms_norm.cu"}
    for name, result in report["sources"].items():
        assert result["elf"] and not result["missing"], (name, result)
    cache_name, planted_returned, size = report["cache"]
    assert cache_name.startswith(f"rms_norm-{TARGET}-") and planted_returned and size > 1000
    assert f"could not compile matvec.cu for {TARGET}:" in report["error"] and "W_q3_k" in report["error"]
