"""Time the persistent kernels (add + norm + SwiGLU MLP; add + norm + MoE block) against the kernels they replace.

For each MLP shape (Qwen3.5-0.8B's, Laguna-XS.2's leading dense one, the 27B's; gate | up Q4_K, down Q6_K as a
Q4_K_M file has them on its `use_more_bits` layers, and Q4_K), random operands, bf16 activations: the op
`add_rms_norm_swiglu` on the CUDA backend inside a static step (PDL as in a decode step) with
LUCEBOX_PERSISTENT_FFN=0 (`four`) and =1 at 2 blocks an SM (`persistent`, the default), 1 and 4
(`persistent_b1`, `persistent_b4`; LUCEBOX_PERSISTENT_FFN_BLOCKS), and with 32-row tiles at 1 and 2 blocks an SM
(`persistent_r2_b1`, `persistent_r2_b2`; LUCEBOX_PERSISTENT_FFN_ROW_TILES=2; `r2_equal`: their outputs are the
16-row tiles' to the bit). Each is warmed up, REPEAT calls are recorded in one CUDA graph and the graph is
replayed; the figure is the median per call over REPLAYS, with the weights' bytes a call over that time (GB/s)
beside the copy bandwidth measured here (a device-to-device copy of 1 GiB). Outputs are compared (max abs
difference, share of equal values).

Then the MoE block (`add_rms_norm_moe`, LUCEBOX_PERSISTENT_MOE=0 / 1) on Laguna-XS.2's and Qwen3.5-35B-A3B's
decode shapes (random blocks of each family's class: 256 experts, top-8, hidden 2048, intermediate 512), timed
alike; the weights' bytes are the routed and shared experts' and the fp32 router's.

Then the Gated DeltaNet mixer (`gated_delta_net_decode_`, LUCEBOX_PERSISTENT_GDN=0 / 1) at the 0.8B's and the 27B's
shapes; its bytes are the five products' weights and the recurrent state read and written.

    python3 scripts/persistent_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from lucebox_core.kquants import random_blocks
from lucebox_core.quants import QuantTensor
from lucebox_core.static_step import running_static_step
from lucebox_cuda import ffn_persistent
from lucebox_cuda.backend import CudaBackend
from router_probe import replay_us  # scripts/ is the path's first entry when run as a script

# The persistent kernels read GGUF's rows (each switch A/B on the same weights): every weight stays row-major.
os.environ.setdefault("LUCEBOX_TILED_WEIGHTS", "0")
SHAPES = {"0.8b": (1024, 3584), "laguna-dense": (2048, 8192), "27b": (5120, 17408)}
REPEAT, REPLAYS = 50, 20


def quant(ggml_type: T, rows: int, cols: int, seed: int) -> QuantTensor:
    raw = random_blocks(ggml_type, rows * cols, 0.05, np.random.default_rng(seed))
    return QuantTensor(f"w{seed}", ggml_type, (rows, cols), torch.from_numpy(raw.copy()))


def measure(row: dict, label: str, weight_bytes: int, call) -> torch.Tensor:
    """`call` (one op, inside a static step as a decode step runs it) warmed up, then REPEAT of it recorded in one
    graph and timed (`router_probe.replay_us`): `<label>_us` and `<label>_gb_s` into `row`; returns the warm-up's output."""
    with running_static_step(decode_only=True):
        for _ in range(3):
            out = call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(REPEAT):
                call()
        us = replay_us(graph, REPEAT, REPLAYS)
    row[f"{label}_us"] = round(us, 2)
    row[f"{label}_gb_s"] = round(weight_bytes / us / 1e3, 1)
    return out


def compare(row: dict, unfused: torch.Tensor, persistent: torch.Tensor, unfused_us: float) -> None:
    """The persistent kernel's speedup and how far its output is from the unfused kernels', into `row`."""
    row["speedup"] = round(unfused_us / row["persistent_us"], 3)
    row["max_abs_diff"] = float((unfused.float() - persistent.float()).abs().max())
    row["equal_share"] = round(float((unfused == persistent).float().mean()), 4)


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted), median of 10."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(10):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return 2 * a.numel() / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    backend = CudaBackend(dtype=torch.bfloat16)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth:.0f} GB/s")
    rows = []
    for name, (hidden, inter) in SHAPES.items():
        for down_type in (T.Q6_K, T.Q4_K):
            gen = torch.Generator(device="cuda").manual_seed(1)
            x = torch.randn(1, 1, hidden, device="cuda", generator=gen).to(torch.bfloat16)
            residual = torch.randn(1, 1, hidden, device="cuda", generator=gen).to(torch.bfloat16)
            norm = torch.rand(hidden, device="cuda", generator=gen) + 0.5
            gate_up, down = quant(T.Q4_K, 2 * inter, hidden, 2), quant(down_type, hidden, inter, 3)
            weight_bytes = gate_up.nbytes + down.nbytes
            row = {"shape": name, "hidden": hidden, "inter": inter, "down": down_type.name,
                   "weight_bytes": weight_bytes, "copy_gb_s": round(bandwidth)}
            outs = {}
            # (switch, label, blocks an SM, row tiles): 32-row tiles at 1 and 2 blocks an SM test session 26's
            # reading that a block's tiles one after another, nothing in flight between them, are the cost.
            for switch, label, blocks, tiles in (("0", "four", "2", "1"), ("1", "persistent", "2", "1"),
                                                 ("1", "persistent_b1", "1", "1"), ("1", "persistent_b4", "4", "1"),
                                                 ("1", "persistent_r2_b1", "1", "2"),
                                                 ("1", "persistent_r2_b2", "2", "2")):
                os.environ[ffn_persistent.ENV_SWITCH] = switch
                os.environ[ffn_persistent.BLOCKS_ENV] = blocks
                os.environ[ffn_persistent.ROW_TILES_ENV] = tiles
                outs[label] = measure(row, label, weight_bytes,
                                      lambda: backend.add_rms_norm_swiglu(x, residual, norm, 1e-6, gate_up, down)[0])
            compare(row, outs["four"], outs["persistent"], row["four_us"])
            row["r2_equal"] = all(bool(torch.equal(outs["persistent"], outs[label]))
                                  for label in ("persistent_r2_b1", "persistent_r2_b2"))
            os.environ[ffn_persistent.BLOCKS_ENV] = "2"
            os.environ[ffn_persistent.ROW_TILES_ENV] = "1"
            row["grid"] = ffn_persistent.grid_size(backend, *_program(gate_up, down), max(hidden, inter) // 16)
            rows.append(row)
            print(json.dumps(row))
    os.environ.pop(ffn_persistent.ENV_SWITCH, None)
    rows += moe_rows(backend, bandwidth)
    rows += gdn_rows(backend, bandwidth)
    os.environ.pop(ffn_persistent.BLOCKS_ENV, None)
    os.environ.pop(ffn_persistent.ROW_TILES_ENV, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def moe_rows(backend: CudaBackend, bandwidth: float) -> list[dict]:
    """The MoE block of each family, unfused and persistent (2 and 4 blocks an SM)."""
    import sys

    sys.path.insert(0, "tests")
    from test_moe_persistent_gpu import EXPERTS, HIDDEN, INTER, TOP_K, _block, _inputs

    from lucebox_cuda import moe_persistent

    rows = []
    for arch in ("laguna", "qwen35moe"):
        block = _block(backend, arch, seed=5)
        x, residual, norm = _inputs(5)
        routing = block.routing()
        expert_bytes = sum(w.nbytes // EXPERTS for w in (routing.gate_exps, routing.up_exps, routing.down_exps))
        weight_bytes = (TOP_K + 1) * expert_bytes + EXPERTS * HIDDEN * 4
        row = {"shape": f"moe-{arch}", "hidden": HIDDEN, "inter": INTER, "weight_bytes": weight_bytes,
               "copy_gb_s": round(bandwidth)}
        outs = {}
        for switch, label, blocks in (("0", "unfused", "2"), ("1", "persistent", "2"), ("1", "persistent_b4", "4")):
            os.environ[moe_persistent.ENV_SWITCH] = switch
            os.environ[ffn_persistent.BLOCKS_ENV] = blocks
            outs[label] = measure(row, label, weight_bytes,
                                  lambda: backend.add_rms_norm_moe(x, residual, norm, 1e-6, block)[0])
        compare(row, outs["unfused"], outs["persistent"], row["unfused_us"])
        rows.append(row)
        print(json.dumps(row))
    os.environ.pop(moe_persistent.ENV_SWITCH, None)
    return rows


def gdn_rows(backend: CudaBackend, bandwidth: float) -> list[dict]:
    """The Gated DeltaNet mixer (`gated_delta_net_decode_`, LUCEBOX_PERSISTENT_GDN=0 / 1) at the 0.8B's and the
    27B's shapes (qkv Q6_K as a `use_more_bits` layer has it, the rest Q4_K): the six kernels, then the persistent
    one at 2, 1 and 4 blocks an SM; the outputs compared on the first call from one state."""
    import sys

    sys.path.insert(0, "tests")
    from test_gdn_persistent_gpu import _copy, _mixer

    from lucebox_cuda import gdn_persistent
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(backend)
    rows = []
    for name, shape in (("0.8b", (1024, 16, 16)), ("27b", (5120, 16, 48))):
        mixer, state, x = _mixer(ops, *shape, T.Q6_K, 7)
        weights = [mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a, mixer.out_proj]
        weight_bytes = sum(w.nbytes for w in weights) + state.recurrent.numel() * 4 * 2  # the state read and written
        row = {"shape": f"gdn-{name}", "hidden": shape[0], "value_heads": shape[2], "weight_bytes": weight_bytes,
               "copy_gb_s": round(bandwidth)}
        firsts = {}
        for switch, label, blocks in (("0", "unfused", "2"), ("1", "persistent", "2"), ("1", "persistent_b1", "1"),
                                      ("1", "persistent_b4", "4")):
            os.environ[gdn_persistent.ENV_SWITCH] = switch
            os.environ[ffn_persistent.BLOCKS_ENV] = blocks
            with running_static_step(decode_only=True):
                firsts[label] = ops.gated_delta_net_decode_(x, mixer, _copy(state))
            running = _copy(state)
            measure(row, label, weight_bytes, lambda: ops.gated_delta_net_decode_(x, mixer, running))
        compare(row, firsts["unfused"], firsts["persistent"], row["unfused_us"])
        rows.append(row)
        print(json.dumps(row))
    os.environ.pop(gdn_persistent.ENV_SWITCH, None)
    return rows


def _program(gate_up: QuantTensor, down: QuantTensor):
    from lucebox_cuda import catalogue

    return catalogue.ffn_persistent(catalogue.WEIGHT_FORMATS[gate_up.ggml_type], catalogue.WEIGHT_FORMATS[down.ggml_type],
                                    "bf16", "f32")


if __name__ == "__main__":
    main()
