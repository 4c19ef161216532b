"""Time the tiled-layout matrix-vector kernel (matvec_tiled.cu) against the row-major ones on the decode shapes.

For each shape (the 27B's and the 0.8B's K-quant products, the 27B's Q6_K head) and batch: random GGUF blocks, bf16
activations; the catalogue's default variant, `mma` (the register-prefetch kernel of the same arithmetic class) and
the tiled kernel with 1, 2 and 3 blocks in flight a warp (`tiled_a1`..`a3`; at batches above 1 also two row tiles
a block, `tiled_r2_a1`). Each kernel runs on enough copies of the weight (cycled) that the copies outweigh the L2
twice, so every call reads its weight from memory as a decode step does; REPEAT calls are recorded in one CUDA graph
and replayed (median over REPLAYS), and the weight's bytes over the time give GB/s beside the copy bandwidth
measured here. The tiled outputs must equal `mma`'s to the bit (`equal`): same class, same bits.

    python3 scripts/tiled_probe.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import json
import statistics

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from lucebox_core.kquants import random_blocks
from lucebox_core.quants import QuantTensor
from lucebox_cuda import catalogue, tiled_weights
from lucebox_cuda.backend import CudaBackend
from lucebox_cuda.nvrtc import Int, KernelProgram, Pointer
from lucebox_cuda.tiled_weights import tile_rows
from persistent_probe import copy_bandwidth  # scripts/ is the path's first entry when run as a script
from router_probe import replay_us

FORMATS = {"q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}
# (format, out, in, label): the 27B's decode products (gate | up, down as Q6_K and Q4_K, the GDN qkv, attention's
# q | gate, a Q6_K attention-output-sized one), its Q6_K head; the 0.8B's gate | up, down, qkv.
SHAPES = [("q4_k", 34816, 5120, "27b gate|up"), ("q6_k", 5120, 17408, "27b down q6_k"),
          ("q4_k", 5120, 17408, "27b down q4_k"), ("q4_k", 10240, 5120, "27b gdn qkv"),
          ("q4_k", 12288, 5120, "27b attn q|gate"), ("q6_k", 6144, 5120, "27b q6_k 6144"),
          ("q6_k", 248320, 5120, "27b head"), ("q4_k", 7168, 1024, "0.8b gate|up"),
          ("q4_k", 1024, 3584, "0.8b down"), ("q6_k", 1024, 3584, "0.8b down q6_k"),
          ("q4_k", 6144, 1024, "0.8b qkv")]
BATCHES = (1, 16)
L2_BYTES = 50 << 20
os.environ.setdefault(tiled_weights.ENV_SWITCH, "0")  # the row-major baselines: the tiled kernels are launched here
REPEAT, REPLAYS = 40, 15


def weight_bytes(fmt: str, rows: int, cols: int) -> torch.Tensor:
    """[rows, row bytes] of valid random blocks on the GPU (4096 distinct rows, repeated: content does not time)."""
    distinct = min(rows, 4096)
    raw = random_blocks(FORMATS[fmt], distinct * cols, 0.05, np.random.default_rng(rows + cols))
    block = torch.from_numpy(raw.copy()).cuda().view(distinct, -1)
    return block.repeat(-(-rows // distinct), 1)[:rows].contiguous()


def time_calls(calls: list) -> float:
    """Median microseconds a call, the calls cycled REPEAT times in one graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPEAT):
            calls[i % len(calls)]()
    return replay_us(graph, REPEAT, REPLAYS)


def launch_once(calls: list) -> float:
    """One launch, untimed (NaN): Nsight Compute measures it."""
    calls[0]()
    torch.cuda.synchronize()
    return float("nan")


# (kind, warps, row tiles, blocks ahead, tile order, thread blocks an SM must hold): batch 1, then larger batches.
# "block": the tiled kernel, four warps a thread block (LUCEBOX_MATVEC_TILED, _BOUNDED where the last is above 1);
# "units": one warp a thread block, partial sums added by the group's last warp; "rowmajor": the row-major `mma` kernel
# with its registers capped (LUCEBOX_MATVEC_MMA_BOUNDED); "pp": `mma` with two register sets in turn
# (LUCEBOX_MATVEC_MMA_PP, _PP_BOUNDED where the last is above 1). Session 27 also timed warp units at 1-3 blocks
# ahead, both orders and 8 warps: never faster (results doc); session 28 listed the tiled kernel 2 blocks ahead and
# `mma` capped at 6 blocks (80 registers).
# Session 29 (ptxas 13, sm_90, Q4_K batch 1; SASS instructions a block a warp, registers): mma 432/115, mma_b4 413/122,
# mma_b5 580/96 (spills, addresses recomputed: dropped), mma_pp 378/143, mma_pp_b4 376/128, mma_pp_b5 391/96.
# "bulk": the bulk-copy ring (LUCEBOX_MATVEC_BULK, sm_90), its depth in the blocks-ahead place (session 36).
TILED_ONE = [("block", 4, 1, 1, 0, 1), ("pp", 4, 1, 1, 0, 1), ("bulk", 4, 1, 3, 0, 1), ("bulk", 4, 1, 4, 0, 1),
             ("bulk", 4, 1, 6, 0, 1), ("bulk", 4, 1, 8, 0, 1)]
TILED_MORE = [("block", 4, 1, 1, 0, 1), ("block", 4, 2, 1, 0, 1), ("bulk", 4, 1, 4, 0, 1), ("bulk", 4, 1, 6, 0, 1)]


def tiled_kernel(fmt: str, batch: int, kind: str, warps: int, row_tiles: int, ahead: int,
                 order: int, min_blocks: int = 1) -> tuple[KernelProgram, str]:
    tile = catalogue.batch_tile(batch)
    if kind == "bulk":
        program, name, _ = catalogue.matvec_bulk(fmt, "bf16", batch, ahead)
        return program, name
    if kind == "pp":
        prefix = "matvec_mma_pp" + (f"_b{min_blocks}" if min_blocks > 1 else "")
        line = (f"LUCEBOX_MATVEC_MMA_PP_BOUNDED({prefix}, {min_blocks}, {fmt}, bf16, {tile})" if min_blocks > 1
                else f"LUCEBOX_MATVEC_MMA_PP({fmt}, bf16, {tile})")
        return KernelProgram("matvec_mma.cu", [line]), f"{prefix}_{fmt}_bf16_{tile}"
    if kind == "rowmajor":
        prefix = f"matvec_mma_b{min_blocks}"
        line = f"LUCEBOX_MATVEC_MMA_BOUNDED({prefix}, {warps}, {row_tiles}, {min_blocks}, {fmt}, bf16, {tile})"
        return KernelProgram("matvec_mma.cu", [line]), f"{prefix}_{fmt}_bf16_{tile}"
    if kind == "units":
        line = f"LUCEBOX_MATVEC_TILED_UNITS({fmt}, bf16, {tile}, {warps}, {ahead}, {order})"
        name = f"matvec_tiled_units_w{warps}_a{ahead}_o{order}_{fmt}_bf16_{tile}"
    elif min_blocks > 1:
        line = (f"LUCEBOX_MATVEC_TILED_BOUNDED({fmt}, bf16, {tile}, {warps}, {row_tiles}, {ahead}, {order}, "
                f"{min_blocks})")
        name = f"matvec_tiled_w{warps}_r{row_tiles}_a{ahead}_o{order}_b{min_blocks}_{fmt}_bf16_{tile}"
    else:
        line = f"LUCEBOX_MATVEC_TILED({fmt}, bf16, {tile}, {warps}, {row_tiles}, {ahead}, {order})"
        name = f"matvec_tiled_w{warps}_r{row_tiles}_a{ahead}_o{order}_{fmt}_bf16_{tile}"
    return KernelProgram("matvec_tiled.cu", [line]), name


def summary(r: dict) -> str:
    checks = [v for k, v in r.items() if k.endswith("_equal")]
    equal = all(checks) if checks else "n/a (no candidate compared)"  # --basic times the catalogue's variants only
    rates = " ".join(f"{k[:-5].replace('tiled_', '')}={v:.0f}" for k, v in r.items() if k.endswith("_gb_s")
                     and k not in ("copy_gb_s", "default_gb_s"))
    return (f"{r['shape']} b{r['batch']}: default({r['default_variant']})={r['default_gb_s']:.0f} {rates} | best "
            f"{r['best']} x{r['speedup_vs_default']} | bits {equal} | mma {r['mma_sha1'][:8]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--quick", action="store_true", help="batch 1 only")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="activation rows, comma-separated")
    parser.add_argument("--shapes", default="", help="only the shapes whose label contains one of these "
                        "(comma-separated)")
    parser.add_argument("--basic", action="store_true", help="the catalogue's variants only (default, mma, mma8): "
                        "for kernels of another tree copied over the installed ones, which may lack the candidates")
    parser.add_argument("--ncu", action="store_true", help="each kernel launched once on one copy, untimed: for "
                        "Nsight Compute (ncu --kernel-name regex:matvec ... python3 scripts/tiled_probe.py --ncu)")
    args = parser.parse_args()
    timer = launch_once if args.ncu else time_calls
    backend = CudaBackend(dtype=torch.bfloat16)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    rows_out = []
    wanted = [w for w in args.shapes.split(",") if w]
    for fmt, out_features, in_features, label in SHAPES:
        if wanted and not any(w in label for w in wanted):
            continue
        raw = weight_bytes(fmt, out_features, in_features)
        nbytes = raw.numel()
        copies = 1 if args.ncu else max(1, -(-2 * L2_BYTES // nbytes))
        row_major = [raw] + [raw.clone() for _ in range(copies - 1)]
        tiled = {order: [tile_rows(r, fmt, out_features, in_features, bool(order)) for r in row_major]
                 for order in (0, 1)}
        weights = [QuantTensor(f"w{i}", FORMATS[fmt], (out_features, in_features), r.reshape(-1))
                   for i, r in enumerate(row_major)]
        for batch in ((1,) if args.quick else [int(b) for b in args.batches.split(",")]):
            gen = torch.Generator(device="cuda").manual_seed(batch)
            x = torch.randn(batch, in_features, device="cuda", generator=gen).to(torch.bfloat16)
            row = {"shape": label, "format": fmt, "out": out_features, "in": in_features, "batch": batch,
                   "weight_bytes": nbytes, "copies": copies, "copy_gb_s": round(bandwidth)}
            outs = {}
            variants = {"default": None, "mma": "mma", **({"mma8": "mma8"} if batch == 1 else {"mma_r2": "mma_r2"})}
            for name, variant in variants.items():
                ys = [torch.empty(batch, out_features, dtype=torch.bfloat16, device="cuda") for _ in weights]
                calls = [lambda w=w, y=y, v=variant: backend.matvec(x, w, out=y, variant=v)
                         for w, y in zip(weights, ys)]
                us = timer(calls)
                row[f"{name}_us"], row[f"{name}_gb_s"] = round(us, 2), round(nbytes / us / 1e3, 1)
                outs[name] = ys[0]
            # The same seeded weights and activations in every run: kernels of two trees compare through this.
            row["mma_sha1"] = hashlib.sha1(outs["mma"].view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16]
            row["default_variant"] = catalogue.matvec_kernel(fmt, "bf16", batch, out_features,
                                                              in_features=in_features).variant
            candidates = [] if args.basic else TILED_ONE if batch == 1 else TILED_MORE
            for kind, warps, row_tiles, ahead, order, min_blocks in candidates:
                bound = f"_b{min_blocks}" if min_blocks > 1 else ""
                name = {"units": f"units_w{warps}_a{ahead}_o{order}", "rowmajor": f"mma{bound}",
                        "pp": f"mma_pp{bound}", "bulk": f"bulk_d{ahead}"}.get(
                    kind, f"tiled_w{warps}_r{row_tiles}_a{ahead}_o{order}{bound}")
                kernel = tiled_kernel(fmt, batch, kind, warps, row_tiles, ahead, order, min_blocks)
                groups = -(-out_features // 16)
                grid, threads = (groups * warps, 32) if kind == "units" else (-(-groups // row_tiles), 32 * warps)
                extra, shared = [], 0
                if kind == "bulk":
                    shared = catalogue.matvec_bulk(fmt, "bf16", batch, ahead)[2]
                    backend.ring_kernel(*kernel, shared)
                if kind == "units":
                    tiles_n = -(-batch // 8)
                    partials = torch.empty(groups * warps * 16 * 8 * tiles_n, dtype=torch.float32, device="cuda")
                    counters = torch.zeros(groups, dtype=torch.int32, device="cuda")
                    extra = [Pointer(partials.data_ptr()), Pointer(counters.data_ptr())]
                held = row_major if kind in ("rowmajor", "pp") else tiled[order]
                ys = [torch.empty(batch, out_features, dtype=torch.bfloat16, device="cuda") for _ in held]
                calls = [lambda t=t, y=y, e=extra: backend._launch(kernel, grid, threads, Pointer(t.data_ptr()),
                                                                  Pointer(x.data_ptr()), Pointer(y.data_ptr()),
                                                                  Int(out_features), Int(in_features), Int(batch), *e,
                                                                  shared_bytes=shared)
                         for t, y in zip(held, ys)]
                us = timer(calls)
                row[f"{name}_us"], row[f"{name}_gb_s"] = round(us, 2), round(nbytes / us / 1e3, 1)
                row[f"{name}_equal"] = bool(torch.equal(ys[0], outs["mma8" if warps == 8 else "mma"]))
            best = min((k for k in row if k.endswith("_us")), key=lambda k: row[k])
            row["best"] = best[:-3]
            row["speedup_vs_default"] = round(row["default_us"] / row[best], 3)
            rows_out.append(row)
            print(summary(row), flush=True)
        del row_major, tiled, weights
        torch.cuda.empty_cache()
    print("GB/s; tiled_w<warps>_r<row tiles>_a<blocks ahead>_o<order: 0 group-major, 1 block-major>: four warps a "
          "thread block; units_...: a warp a thread block")
    print(f"copy {bandwidth:.0f} GB/s; median of the per-shape ratios best/default: "
          f"{statistics.median(r['speedup_vs_default'] for r in rows_out):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
