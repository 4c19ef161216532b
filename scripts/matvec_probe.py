"""Two GPU probes of the matrix-vector kernels that the sweep does not answer:

    python3 scripts/matvec_probe.py invariance [--json OUT]   # is column j of a batch-N product bit-identical
                                                               # to the batch-1 product of row j, per variant?
    python3 scripts/matvec_probe.py launch CASE...             # launch each case a few times (for ncu), CASE =
                                                               # format:rows:cols:batch:variant, e.g.
                                                               # q4_k:17408:5120:1:mma8

Batch invariance is what lets a speculative verify pass (16-64 rows) give a token exactly the logits the
batch-1 decode step gives it: without it, `--force-accept` stops holding at the first near-tie.
"""

from __future__ import annotations

import argparse
import os
import importlib.util
import json
import sys
from pathlib import Path

import torch
from lucebox_cuda import catalogue, tiled_weights
from lucebox_cuda.backend import CudaBackend

os.environ.setdefault(tiled_weights.ENV_SWITCH, "0")  # the explicit variants here read GGUF's rows: none tiled


def _load_cuda_check():
    path = Path(__file__).resolve().parent / "cuda_check.py"
    spec = importlib.util.spec_from_file_location("lucebox_cuda_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = _load_cuda_check()

INVARIANCE_SHAPES = [("q4_k", 17408, 5120), ("q4_k", 5120, 17408), ("q4_k", 10240, 5120), ("q4_k", 1024, 5120),
                     ("q4_k", 48, 5120), ("q6_k", 5120, 17408), ("q6_k", 4096, 5120), ("q6_k", 248320, 5120)]
INVARIANCE_BATCHES = (2, 4, 8, 16, 23, 33, 64)
# "default": the catalogue's choice, which may change variant with the batch within one arithmetic class.
INVARIANCE_VARIANTS = ("default", "simt", "mma", "mma_r2", "pipe_w4_d4_m1_k1", "pipe_w4_d3_m1_k1",
                       "pipe_w4_d4_m2_k1", "mma8", "pipe_w8_d3_m1_k1", "pipe_w8_d4_m1_k1", "pipe_w4_d3_m1_k2",
                       "pipe_w4_d4_m1_k2", "pipe_w8_d3_m1_k4", "pipe_w8_d4_m1_k4")


def invariance(backend: CudaBackend, out_json: str | None) -> int:
    device = backend.device
    gen = torch.Generator(device=device).manual_seed(3)
    rows_out = []
    for fmt, rows, cols in INVARIANCE_SHAPES:
        weight = check.random_weight(fmt, rows, cols, gen, device)
        x = torch.randn(64, cols, generator=gen, device=device).to(torch.bfloat16)
        first_of_class: dict[tuple, tuple[str, torch.Tensor]] = {}
        for variant in INVARIANCE_VARIANTS:
            chosen = None if variant == "default" else variant
            try:
                single = torch.cat([backend.matvec(x[j : j + 1], weight, variant=chosen) for j in range(64)])
            except Exception as exc:  # a variant that does not exist for the format
                print(f"{fmt} {rows}x{cols} {variant}: batch 1 unavailable ({type(exc).__name__}: {exc})")
                continue
            result = {"format": fmt, "rows": rows, "cols": cols, "variant": variant, "batches": {}}
            if chosen is not None:
                # Variants of one arithmetic class must agree bit for bit (what lets the default change
                # variant with the batch and keep decode and verify identical).
                cls = catalogue.arithmetic_class(variant)
                if cls in first_of_class:
                    other, reference = first_of_class[cls]
                    result["equals"] = [other, bool(torch.equal(single, reference))]
                    print(f"{fmt} {rows}x{cols} {variant} == {other} at batch 1 for 64 rows: {result['equals'][1]}")
                else:
                    first_of_class[cls] = (variant, single)
            for batch in INVARIANCE_BATCHES:
                try:
                    many = backend.matvec(x[:batch], weight, variant=chosen)
                except Exception as exc:
                    result["batches"][batch] = f"unavailable: {type(exc).__name__}"
                    continue
                torch.cuda.synchronize()
                diff = (many.float() - single[:batch].float()).abs().max().item()
                result["batches"][batch] = diff
            rows_out.append(result)
            cells = " ".join(f"{b}:{'=' if v == 0 else (v if isinstance(v, str) else f'{v:.1e}')}"
                             for b, v in result["batches"].items())
            print(f"{fmt} {rows}x{cols} {variant:18s} {cells}", flush=True)
        backend._device_weights.clear()
    if out_json:
        Path(out_json).write_text(json.dumps(rows_out, indent=1))
    differs = [r for r in rows_out if ("equals" in r and not r["equals"][1])
               or any(not isinstance(v, str) and v != 0 for v in r["batches"].values())]
    print(f"invariance: {'all bit-identical' if not differs else f'{len(differs)} variants differ'}")
    return 1 if differs else 0


def launch(backend: CudaBackend, cases: list[str]) -> int:
    device = backend.device
    gen = torch.Generator(device=device).manual_seed(5)
    for case in cases:
        fmt, rows, cols, batch, variant = case.split(":")
        rows, cols, batch = int(rows), int(cols), int(batch)
        weight = check.random_weight(fmt, rows, cols, gen, device)
        x = torch.randn(batch, cols, generator=gen, device=device).to(torch.bfloat16)
        kernel = catalogue.matvec_kernel(fmt, "bf16", batch, rows, None if variant == "default" else variant,
                                         in_features=cols)
        print(f"{case}: kernel {kernel.name} grid {kernel.grid} block {kernel.block}", flush=True)
        for _ in range(3):
            backend.matvec(x, weight, variant=None if variant == "default" else variant)
        torch.cuda.synchronize()
        backend._device_weights.clear()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("invariance", "launch"))
    parser.add_argument("cases", nargs="*")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    backend = CudaBackend(torch.device("cuda", 0))
    if args.mode == "invariance":
        return invariance(backend, args.json)
    return launch(backend, args.cases)


if __name__ == "__main__":
    sys.exit(main())
