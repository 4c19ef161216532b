"""Time the expert-product kernels (`expert_matvec_pair`, gate and up, and `expert_matvec`, down) of a batch-1
MoE decode on the GPU: each variant (`LUCEBOX_MOE_MATVEC`: the CUDA-core "simt" kernel and the tensor-core
"mma<warps>" ones) over the shapes of Laguna-XS.2 / Qwen3.5-35B-A3B (256 experts of 512 x 2048, top-8) or any
given. Each row is a recorded graph of one launch per layer over `--layers` distinct stacks (so the chosen
experts come from DRAM, not L2, as in a decode step), replayed after a warm-up; µs per launch, and GB/s of the
chosen experts' bytes against the device's measured copy bandwidth.

    python scripts/moe_matvec_bench.py [--experts 256 --inter 512 --hidden 2048 --top-k 8 --layers 40]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

from lucebox_core.kquants import random_blocks
from lucebox_core.quants import QuantTensor
from lucebox_cuda.backend import CudaBackend
from lucebox_cuda.catalogue import MOE_MATVEC_VARIANTS
from lucebox_cuda.timing import median_ms
from gguf import GGMLQuantizationType as Q


def random_stack(ggml_type: Q, shape: tuple[int, int, int], rng: np.random.Generator) -> QuantTensor:
    """A stack of random blocks: one expert's worth generated, tiled (the bytes' values do not change the time)."""
    one = random_blocks(ggml_type, shape[1] * shape[2], 0.02, rng).reshape(-1).view(np.uint8)
    data = torch.from_numpy(one.copy()).repeat(shape[0])
    return QuantTensor("experts", ggml_type, shape, data)


def copy_bandwidth_gb_s() -> float:
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), 10)
    return 2 * source.numel() / ms / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--format", default="q4_k", choices=["q4_k", "q5_k", "q6_k"])
    parser.add_argument("--variants", default=",".join(MOE_MATVEC_VARIANTS))
    parser.add_argument("--json", default=None, help="write the rows here too")
    args = parser.parse_args()
    ggml_type = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}[args.format]
    ops = CudaBackend(dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    layers = []
    for _ in range(args.layers):
        gate = ops.device_weight(random_stack(ggml_type, (args.experts, args.inter, args.hidden), rng))
        up = ops.device_weight(random_stack(ggml_type, (args.experts, args.inter, args.hidden), rng))
        down = ops.device_weight(random_stack(ggml_type, (args.experts, args.hidden, args.inter), rng))
        ids = torch.from_numpy(rng.choice(args.experts, args.top_k, replace=False)).cuda()
        layers.append((gate, up, down, ids))
    x = torch.randn(1, args.hidden, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(args.top_k, args.inter, device="cuda", dtype=torch.bfloat16)
    expert_bytes = {name: layers[0][i].data.numel() // args.experts for i, name in enumerate(("gate", "up", "down"))}
    pair_bytes = args.top_k * (expert_bytes["gate"] + expert_bytes["up"])
    down_bytes = args.top_k * expert_bytes["down"]
    copy = copy_bandwidth_gb_s()
    print(f"copy bandwidth {copy:.0f} GB/s; per launch: pair {pair_bytes / 1e6:.2f} MB, down {down_bytes / 1e6:.2f} MB")
    rows = []
    for variant in args.variants.split(","):
        os.environ["LUCEBOX_MOE_MATVEC"] = variant
        for kind in ("pair", "down"):
            def step() -> None:
                for gate, up, down, ids in layers:
                    if kind == "pair":
                        ops.expert_matvec_pair(x, gate, up, ids, args.top_k)
                    else:
                        ops.expert_matvec(act, down, ids, 1)
            step()  # compiles and loads the kernel outside the recording
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            ms = median_ms(graph.replay, 20)
            us = ms * 1e3 / args.layers
            moved = pair_bytes if kind == "pair" else down_bytes
            gb_s = moved / (us * 1e-6) / 1e9
            row = {"variant": variant, "kind": kind, "us_per_launch": us, "GB_per_s": gb_s, "of_copy": gb_s / copy}
            rows.append(row)
            print(f"{variant:>5} {kind:>5}: {us:7.2f} us/launch  {gb_s:7.0f} GB/s  ({gb_s / copy:.0%} of copy)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"shape": vars(args), "copy_GB_per_s": copy, "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
