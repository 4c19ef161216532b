"""GPU sweep of the matrix-vector kernel variants: correctness of every variant, then timings on the 27B
decode shapes, and the best variant per shape (ready to paste into `matvec_table.MATVEC_TUNED`).

    python3 scripts/matvec_sweep.py --out DIR [--budget-s 170] [--skip-correctness] [--model gemma4]

1. Compiles every program the run needs, in parallel worker processes (forked before any CUDA call).
2. Correctness: each streamed configuration (catalogue.PIPE_SWEEP_CONFIGS, with 1 and 3 K-slices) and the
   register-prefetch `mma` kernel, for Q4_K/Q5_K/Q6_K x bf16/f16/f32 activations x batch 1, 2, 4, 8, 16, 33,
   64 (fp32 up to 8) on fresh random GGUF blocks, outputs NaN-poisoned, against a float64 reference with
   the bounds of scripts/cuda_check.py. Rows 1001 (a part-filled last row group) x 5120, and at batch 1
   also 517 x 1280 (5 blocks a row: some warps of a slice get none).
3. Timing (bf16 activations): µs per launch from CUDA-graph replays of many launches that rotate through
   more than 4x the L2 of distinct weight copies, as % of the measured device-to-device copy bandwidth;
   batch 1 on every 27B layer shape in Q4_K and Q6_K, batches 2..64 on the main ones.
4. Prints, per case, every variant sorted by time; then a summary (best, the current default, `mma`), and
   the `MATVEC_TUNED` table of winners. Writes `matvec_sweep.json` under --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from lucebox_cuda import catalogue, nvrtc, tiled_weights
from lucebox_cuda.backend import CudaBackend

from lucebox_core import quants
from lucebox_core.quants import QuantTensor

os.environ.setdefault(tiled_weights.ENV_SWITCH, "0")  # the explicit variants here read GGUF's rows: none tiled


def _load_cuda_check():
    path = Path(__file__).resolve().parent / "cuda_check.py"
    spec = importlib.util.spec_from_file_location("lucebox_cuda_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses there look their module up by name
    spec.loader.exec_module(module)
    return module


check = _load_cuda_check()  # random GGUF blocks, error measure and bounds, copy bandwidth, graph timing
log = check.log

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
CHECK_BATCHES = (1, 2, 4, 8, 16, 33, 64)
CHECK_SLICES = (1, 3)
TIME_SLICES = (1, 2, 4)

# The Qwen3.5-27B Q4_K_M decode products, [out, in], as the model runs them: projections of one input fused
# into one product where their GGUF types agree (`fuse_rows`). Q4_K_M gives Q6_K to the output head and, on
# half the layers (`use_more_bits`), to ffn_down and the attn_v-like tensor (attn_qkv in GDN layers, attn_v in
# attention layers), which then stays apart from its Q4_K neighbours.
SHAPES_27B: dict[str, tuple[int, int]] = {
    "gdn_qkvz": (16384, 5120),
    "gdn_qkv": (10240, 5120),
    "gdn_z": (6144, 5120),
    "gdn_ba": (96, 5120),
    "gdn_out/attn_o": (5120, 6144),
    "ffn_gate_up": (34816, 5120),
    "ffn_down": (5120, 17408),
    "attn_qkv": (14336, 5120),
    "attn_qk": (13312, 5120),
    "attn_v": (1024, 5120),
    "head": (248320, 5120),
}
BATCH1_CASES = [("q4_k", name) for name in ("gdn_qkvz", "gdn_z", "gdn_ba", "gdn_out/attn_o", "ffn_gate_up",
                                             "ffn_down", "attn_qkv", "attn_qk")]
BATCH1_CASES += [("q6_k", name) for name in ("gdn_qkv", "ffn_down", "attn_v", "head")]
SMALL_BATCHES = (23, 2, 4, 8, 16, 64)  # the DDTree verify batch first: the table's class choice needs it
SMALL_BATCH_CASES = [("q4_k", name) for name in ("ffn_gate_up", "gdn_qkvz", "ffn_down", "gdn_out/attn_o", "gdn_z",
                                                  "attn_qkv")]
SMALL_BATCH_CASES += [("q6_k", "ffn_down"), ("q6_k", "gdn_qkv"), ("q6_k", "head")]
TIMING_CASES = [(fmt, name, 1) for fmt, name in BATCH1_CASES]
TIMING_CASES += [(fmt, name, batch) for batch in SMALL_BATCHES for fmt, name in SMALL_BATCH_CASES]

# Gemma-4's decode products (31B hidden 5376, 26B-A4B hidden 2816), named by model: sliding layers fuse
# [q | k | v] (or [q | k] beside a Q6_K v), full layers [q | k] (V is the raw K); Q6_K: the tied head and the
# `use_more_bits` layers' ffn_down and attn_v. (The 26B's ffn_down, 2112 columns, is not a K-quant.)
SHAPES_GEMMA4: dict[str, tuple[int, int]] = {
    "31b_qkv_swa": (16384, 5376), "31b_qk_swa": (12288, 5376), "31b_v_swa": (4096, 5376),
    "31b_qk_full": (18432, 5376), "31b_o_swa": (5376, 8192), "31b_o_full": (5376, 16384),
    "31b_gate_up": (43008, 5376), "31b_down": (5376, 21504), "31b_head": (262144, 5376),
    "26b_qkv_swa": (8192, 2816), "26b_qk_swa": (6144, 2816), "26b_v_swa": (2048, 2816),
    "26b_qk_full": (9216, 2816), "26b_o_swa": (2816, 4096), "26b_o_full": (2816, 8192),
    "26b_gate_up": (4224, 2816), "26b_head": (262144, 2816),
}
GEMMA4_Q6K = ("31b_v_swa", "31b_down", "31b_head", "26b_v_swa", "26b_head")
GEMMA4_TIMING_CASES = [("q4_k", name, 1) for name in SHAPES_GEMMA4 if not name.endswith("head") and
                       name not in ("31b_v_swa", "26b_v_swa")]
GEMMA4_TIMING_CASES += [("q6_k", name, 1) for name in GEMMA4_Q6K]
# The verify batch the table's class choice weighs (VERIFY_BATCH), on the products that carry the time.
GEMMA4_TIMING_CASES += [(fmt, name, 23) for fmt, name in (
    ("q4_k", "31b_gate_up"), ("q4_k", "31b_down"), ("q4_k", "31b_qkv_swa"), ("q4_k", "31b_qk_swa"),
    ("q4_k", "31b_o_swa"), ("q4_k", "31b_qk_full"), ("q4_k", "31b_o_full"), ("q6_k", "31b_down"),
    ("q6_k", "31b_head"), ("q6_k", "31b_v_swa"), ("q4_k", "26b_qkv_swa"), ("q4_k", "26b_qk_swa"),
    ("q4_k", "26b_o_swa"), ("q4_k", "26b_gate_up"), ("q4_k", "26b_qk_full"), ("q4_k", "26b_o_full"),
    ("q6_k", "26b_head"), ("q6_k", "26b_v_swa"))]
# Laguna-XS.2's (hidden 2048, heads of 128, 8 KV heads; 64 query heads on sliding layers, 48 on full ones):
# [q | k | v | g] fused, or [q | k] beside a Q6_K v; the output projection (few rows, long rows: the shape
# the profile found slowest per byte), the shared expert's [gate | up] and down, the dense first layer's MLP.
SHAPES_LAGUNA: dict[str, tuple[int, int]] = {
    "xs2_qkvg_swa": (10304, 2048), "xs2_qkvg_full": (8240, 2048), "xs2_qk_swa": (9216, 2048),
    "xs2_qk_full": (7168, 2048), "xs2_v": (1024, 2048), "xs2_o_swa": (2048, 8192), "xs2_o_full": (2048, 6144),
    "xs2_shared_gate_up": (1024, 2048), "xs2_shared_down": (2048, 512), "xs2_dense_gate_up": (16384, 2048),
    "xs2_dense_down": (2048, 8192), "xs2_head": (100352, 2048),
}
LAGUNA_TIMING_CASES = [("q4_k", name, 1) for name in SHAPES_LAGUNA if name not in ("xs2_v", "xs2_head")]
LAGUNA_TIMING_CASES += [("q6_k", name, 1) for name in ("xs2_v", "xs2_head", "xs2_o_swa", "xs2_dense_down")]
MODELS = {"qwen35-27b": (SHAPES_27B, TIMING_CASES), "gemma4": (SHAPES_GEMMA4, GEMMA4_TIMING_CASES),
          "laguna": (SHAPES_LAGUNA, LAGUNA_TIMING_CASES)}
SHAPES = SHAPES_27B  # the --model's table (set by main)

RESULTS: dict = {"correctness": [], "timing": [], "best": []}


# -- which variants serve a case ---------------------------------------------------------------------------


def pipe_variants(batch: int, slices: tuple[int, ...], rows: int | None = None) -> list[str]:
    names = []
    for warps, depth, groups in catalogue.PIPE_SWEEP_CONFIGS:
        if groups > 1 and catalogue.batch_tile(batch) > catalogue.PIPE_MAX_BATCH_TWO_GROUPS:
            continue
        for count in slices:
            # K-slices only help where row groups are few; the output head has thousands.
            if count > 1 and rows is not None and rows // (16 * groups) > 4000:
                continue
            names.append(catalogue.PipeVariant(warps, depth, groups, count).name)
    return names


def check_variants(fmt: str, act: str, batch: int) -> list[str]:
    if not catalogue.has_mma_kernel(fmt, act, batch):
        return []
    return ["mma", "mma_r2", *pipe_variants(batch, CHECK_SLICES)]


def time_variants(fmt: str, batch: int, rows: int) -> list[str]:
    names = ["mma", "mma8", "mma_r2"] + (["simt"] if batch <= 8 else [])
    return names + pipe_variants(batch, TIME_SLICES, rows)


def check_cases() -> list[tuple[str, str, int]]:
    return [(fmt, act, batch) for fmt in catalogue.MMA_FORMATS for act in DTYPES for batch in CHECK_BATCHES
            if catalogue.has_mma_kernel(fmt, act, batch)]


# -- compile first, in parallel ----------------------------------------------------------------------------


def _compile_one(args: tuple[nvrtc.KernelProgram, str]) -> float:
    program, arch = args
    start = time.perf_counter()
    nvrtc.compile_program(program, arch)
    return time.perf_counter() - start


def precompile(arch: str, max_shared: int, correctness: bool) -> None:
    wanted = set()
    if correctness:
        for fmt, act, batch in check_cases():
            wanted |= {(fmt, act, batch, v, 16) for v in check_variants(fmt, act, batch)}
    for fmt, name, batch in TIMING_CASES:
        rows = SHAPES[name][0]
        wanted |= {(fmt, "bf16", batch, v, rows) for v in time_variants(fmt, batch, rows)}
    programs = set()
    for fmt, act, batch, variant, rows in wanted:
        try:
            programs.add(catalogue.matvec_kernel(fmt, act, batch, rows, variant, max_shared_bytes=max_shared).program)
        except ValueError:
            pass  # over this device's shared memory: reported when timed
    start = time.perf_counter()
    context = multiprocessing.get_context("fork")  # before any CUDA call in this process
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=context) as pool:
        times = list(pool.map(_compile_one, [(p, arch) for p in programs], chunksize=4))
    wall = time.perf_counter() - start
    log(f"compiled {len(programs)} programs for {arch} in {wall:.1f} s wall (median {statistics.median(times):.2f} s, "
        f"max {max(times):.2f} s)")
    RESULTS["compile"] = {"programs": len(programs), "wall_s": wall}


def device_max_shared(index: int) -> int:
    """The opt-in shared memory per block, from the driver without creating a CUDA context (fork-safe)."""
    from cuda.bindings import driver

    driver.cuInit(0)
    result, value = driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, index)
    return (int(value) if int(result) == 0 else catalogue.STATIC_SHARED_LIMIT) - 1024  # as CudaBackend.matvec


# -- correctness -------------------------------------------------------------------------------------------


def check_all(backend: CudaBackend, gen: torch.Generator) -> None:
    device = backend.device
    for fmt, act, batch in check_cases():
        dtype = DTYPES[act]
        shapes = ((1001, 5120), (517, 1280)) if batch == 1 else ((1001, 5120),)
        for rows, cols in shapes:
            case = f"{fmt} {act} batch {batch} [{rows}x{cols}]"
            try:
                weight = check.random_weight(fmt, rows, cols, gen, device)
                x = torch.randn(batch, cols, generator=gen, device=device).to(dtype)
                dense64 = quants.dequantize(weight.data, weight.ggml_type, weight.shape).double()
                ref = x.double() @ dense64.T
            except Exception as exc:
                log(f"FAIL {case}: setup raised {type(exc).__name__}: {exc}")
                RESULTS["correctness"].append({"case": case, "variant": None, "ok": False, "note": repr(exc)})
                continue
            worst = (0.0, "")
            for variant in check_variants(fmt, act, batch):
                entry = {"case": case, "variant": variant, "bound": check.MATVEC_BOUND[dtype]}
                try:
                    out = torch.full((batch, rows), float("nan"), dtype=dtype, device=device)
                    backend.matvec(x, weight, out=out, variant=variant)
                    torch.cuda.synchronize()
                    error = check.relative_error(out, ref)
                    entry.update(error=error, ok=not math.isnan(error) and error <= entry["bound"])
                except Exception as exc:
                    entry.update(error=None, ok=False, note=f"{type(exc).__name__}: {exc}")
                RESULTS["correctness"].append(entry)
                if not entry["ok"]:
                    log(f"FAIL {case} {variant}: err {entry.get('error')} (bound {entry['bound']:.0e}) "
                        f"{entry.get('note', '')}")
                elif entry["error"] > worst[0]:
                    worst = (entry["error"], variant)
            log(f"checked {case}: worst passing err {worst[0]:.2e} ({worst[1]}), bound {check.MATVEC_BOUND[dtype]:.0e}")
    bad = [r for r in RESULTS["correctness"] if not r["ok"]]
    log(f"\ncorrectness: {len(RESULTS['correctness']) - len(bad)}/{len(RESULTS['correctness'])} variant runs pass")


# -- timing ------------------------------------------------------------------------------------------------


def weight_copies(fmt: str, rows: int, cols: int, device: torch.device, l2: int) -> tuple[list[QuantTensor], int]:
    """Distinct copies of a random `[rows, cols]` weight, together over 4x the L2 (or 600 copies), views of
    one buffer."""
    ggml_type = check.FORMATS[fmt]
    nbytes = rows * cols // quants.block_size(ggml_type) * quants.type_size(ggml_type)
    stride = -(-nbytes // 256) * 256
    # Tiny weights (48 x 5120) would need thousands of copies; 600 still exceed the L2 by far.
    copies = max(1, min(600, -(-4 * l2 // nbytes)))
    buffer = torch.randint(0, 256, (copies * stride,), dtype=torch.uint8, device=device)
    # Sane fp16 super-scales are not needed for timing (values do not change the work), only valid bytes.
    return [QuantTensor(f"w{i}", ggml_type, (rows, cols), buffer[i * stride : i * stride + nbytes])
            for i in range(copies)], nbytes


def time_all(backend: CudaBackend, gen: torch.Generator, copy_gbs: float, deadline: float) -> None:
    device = backend.device
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    for fmt, name, batch in TIMING_CASES:
        rows, cols = SHAPES[name]
        if time.perf_counter() > deadline:
            log(f"skipped {fmt} {name} batch {batch}: time budget spent")
            continue
        try:
            weights, nbytes = weight_copies(fmt, rows, cols, device, l2)
            copies = len(weights)
            launches = copies * max(1, -(-(8 if nbytes > 256 * 2**20 else 24) // copies))
            x = torch.randn(batch, cols, generator=gen, device=device).to(torch.bfloat16)
            out = torch.empty(batch, rows, dtype=torch.bfloat16, device=device)
            default = catalogue.matvec_kernel(fmt, "bf16", batch, rows, in_features=cols,
                                              max_shared_bytes=backend.__dict__.get("_matvec_state", {}).get(
                                                  "max_shared", catalogue.PORTABLE_SHARED_LIMIT)).variant
            timings = []
            for variant in time_variants(fmt, batch, rows):

                def launch_all(variant=variant, launches=launches, x=x, weights=weights, out=out) -> None:
                    for i in range(launches):
                        backend.matvec(x, weights[i % len(weights)], out=out, variant=variant)

                try:
                    us = check.graph_time_us(launch_all, launches, replays=10)
                except Exception as exc:
                    log(f"  {variant}: {type(exc).__name__}: {exc}")
                    continue
                gbs = nbytes / (us * 1e-6) / 1e9
                timings.append((us, variant))
                RESULTS["timing"].append({"format": fmt, "shape": name, "rows": rows, "cols": cols, "batch": batch,
                                          "variant": variant, "us": us, "gb_s": gbs,
                                          "pct_copy": 100 * gbs / copy_gbs, "weight_bytes": nbytes,
                                          "copies": copies, "launches": launches})
            report_case(fmt, name, rows, cols, batch, nbytes, copy_gbs, timings, default)
            backend._device_weights.clear()  # the copies are views of one buffer: let it go
        except Exception as exc:
            log(f"timing {fmt} {name} batch {batch} raised {type(exc).__name__}: {exc}")
            traceback.print_exc()


def report_case(fmt: str, name: str, rows: int, cols: int, batch: int, nbytes: int, copy_gbs: float,
                timings: list[tuple[float, str]], default: str) -> None:
    if not timings:
        return
    timings.sort()
    def pct(us: float) -> float:
        return 100 * nbytes / (us * 1e-6) / 1e9 / copy_gbs

    by_variant = {variant: us for us, variant in timings}
    log(f"\n{fmt} {name} [{rows}x{cols}] batch {batch}: {nbytes / 2**20:.1f} MiB")
    for us, variant in timings[:8]:
        log(f"  {variant:22s} {us:9.2f} us {pct(us):6.1f}%")
    for variant in ("mma", "mma8", "mma_r2", "simt"):
        if variant in by_variant and all(variant != v for _, v in timings[:8]):
            log(f"  {variant:22s} {by_variant[variant]:9.2f} us {pct(by_variant[variant]):6.1f}%")
    best_us, best = timings[0]
    RESULTS["best"].append({"format": fmt, "shape": name, "rows": rows, "cols": cols, "batch": batch,
                            "tile": catalogue.batch_tile(batch), "best": best, "us": best_us, "pct_copy": pct(best_us),
                            "default": default, "default_us": by_variant.get(default),
                            "mma_us": by_variant.get("mma")})


def summary() -> None:
    log(f"\n{'format':6s} {'shape':16s} {'batch':>5s} {'best variant':22s} {'us':>8s} {'%copy':>6s} "
        f"{'default':22s} {'us':>8s} {'mma us':>8s}")
    def cell(us: float | None) -> str:
        return f"{us:8.2f}" if us else f"{'-':>8s}"

    for entry in RESULTS["best"]:
        log(f"{entry['format']:6s} {entry['shape']:16s} {entry['batch']:5d} {entry['best']:22s} {entry['us']:8.2f} "
            f"{entry['pct_copy']:5.1f}% {entry['default']:22s} {cell(entry['default_us'])} {cell(entry['mma_us'])}")
    table = tuned_table(RESULTS["timing"])
    log("\n# matvec_table.py: measured defaults (paste over MATVEC_TUNED)")
    log("MATVEC_TUNED: dict[tuple[str, int, int, int], str] = {")
    for key in sorted(table):
        log(f"    {key!r}: {table[key]!r},")
    log("}")
    RESULTS["tuned_table"] = [[*key, value] for key, value in sorted(table.items())]


# The verify batch that weighs with batch 1 in a shape's choice of arithmetic class: a DDTree of the default
# budget (22 nodes and the root).
VERIFY_BATCH = 23


def tuned_table(timing: list[dict]) -> dict[tuple[str, int, int, int], str]:
    """MATVEC_TUNED from timing records: per shape, the arithmetic class (catalogue.arithmetic_class: the
    variants that give the same bits) with the least batch-1 plus batch-23 time (each the class's best
    variant at that batch), then per measured batch the fastest variant of that class, keyed by batch tile.
    One class per shape keeps decode and verify bit-identical; the CUDA-core kernel never anchors a shape
    (a verify on it costs several times a tensor-core one)."""
    times: dict[tuple[str, int, int], dict[int, dict[str, float]]] = {}
    for record in timing:
        if record["variant"] == "simt" or catalogue.PipeVariant.parse(record["variant"]) is None and \
                record["variant"] not in catalogue.MMA_VARIANTS:
            continue
        shape = (record["format"], record["rows"], record["cols"])
        times.setdefault(shape, {}).setdefault(record["batch"], {})[record["variant"]] = record["us"]
    table = {}
    for (fmt, rows, cols), by_batch in times.items():
        if 1 not in by_batch:
            continue

        def best_in(cls: tuple, batch: int) -> tuple[float, str] | None:
            found = [(us, v) for v, us in by_batch.get(batch, {}).items() if catalogue.arithmetic_class(v) == cls]
            return min(found) if found else None

        classes = {catalogue.arithmetic_class(v) for v in by_batch[1]}
        scores = []
        for cls in classes:
            score = best_in(cls, 1)[0]
            if VERIFY_BATCH in by_batch:
                verify = best_in(cls, VERIFY_BATCH)
                if verify is None:
                    continue
                score += verify[0]
            scores.append((score, cls))
        if not scores:  # no class timed at both batches
            continue
        anchor = min(scores)[1]
        for batch in by_batch:
            best = best_in(anchor, batch)
            if best is not None:
                table[(fmt, catalogue.batch_tile(batch), rows, cols)] = best[1]
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--budget-s", type=float, default=160.0, help="stop timing new cases after this many s")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--table-from", type=Path, metavar="JSON",
                        help="only print MATVEC_TUNED from an earlier run's matvec_sweep.json (no GPU needed)")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen35-27b",
                        help="whose decode shapes to time (default: the Qwen3.5-27B's)")
    args = parser.parse_args(argv)
    global SHAPES, TIMING_CASES
    SHAPES, TIMING_CASES = MODELS[args.model]
    if args.table_from:
        table = tuned_table(json.loads(args.table_from.read_text())["timing"])
        print("MATVEC_TUNED: dict[tuple[str, int, int, int], str] = {")
        for key in sorted(table):
            print(f"    {key!r}: {table[key]!r},")
        print("}")
        return 0
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)

    max_shared = device_max_shared(0)
    major, minor = torch.cuda.get_device_capability(0)  # the forked compile workers never touch CUDA
    precompile(f"sm_{major}{minor}", max_shared, not args.skip_correctness)
    device = torch.device("cuda", 0)
    RESULTS["environment"] = check.environment(device, os.environ.get("LUCEBOX_COMMIT", "unknown"))
    RESULTS["environment"]["max_shared_per_block"] = max_shared
    log(json.dumps(RESULTS["environment"]))
    backend = CudaBackend(device, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(int(time.time()))  # fresh inputs every run
    if not args.skip_correctness:
        check_all(backend, gen)
        log(f"(correctness done at {time.perf_counter() - started:.0f} s)")
    copy_gbs = check.copy_bandwidth(device)
    RESULTS["copy_gb_s"] = copy_gbs
    log(f"\ndevice-to-device copy: {copy_gbs:.0f} GB/s (read + write); timings below: bf16 activations")
    time_all(backend, gen, copy_gbs, started + args.budget_s)
    summary()
    failures = [r for r in RESULTS["correctness"] if not r["ok"]]
    RESULTS["wall_s"] = time.perf_counter() - started
    (args.out / "matvec_sweep.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    log(f"\ncorrectness failures: {len(failures)}; wall {RESULTS['wall_s']:.0f} s")
    for failure in failures[:40]:
        log(f"  {failure['case']} {failure['variant']}: {failure.get('error')} {failure.get('note', '')}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
