"""GPU memory a model takes at a context size and KV type (issue #15: "256K of the 27B with TQ3_0 in 24 GiB").

One process a row (so that each starts from an empty device): the model is loaded, one sequence of the whole
context is made (its KV allocated in full, as the engine allocates it), a 512-token prompt is prefilled and 8
tokens decoded (every weight is then on the device, the step's workspace allocated), and the device's memory
is read: torch's peak allocation, and the driver's used memory (what `nvidia-smi` shows: torch's reserve,
the CUDA context and the kernels' modules).

    python scripts/memory_at_context.py -m qwen35-27b-q4_k_m.gguf -c 262144 -ctk tq3_0 -ctv tq3_0 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from lucebox_core.assembly import EngineOptions, build_engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-c", "--ctx-size", type=int, required=True)
    p.add_argument("-ctk", "--cache-type-k", default="f16")
    p.add_argument("-ctv", "--cache-type-v", default="f16")
    p.add_argument("--kv-policy", default="full")
    p.add_argument("--json", help="append the row to this JSON-lines file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("memory_at_context measures a CUDA device", file=sys.stderr)
        return 2
    free_before, total = torch.cuda.mem_get_info()
    assembled = build_engine(EngineOptions(model=args.model, ctx_size=args.ctx_size, cache_type_k=args.cache_type_k,
                                           cache_type_v=args.cache_type_v, kv_policy=args.kv_policy, no_draft=True))
    engine, model = assembled.engine, assembled.loaded.model
    sequence = engine.new_sequence()
    ids = torch.randint(10, model.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.prefill(sequence, ids)
    for token in ids[:8]:
        model.forward(sequence.state, torch.tensor([token]))
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    kv = sequence.state.kv
    row = {"model": args.model, "ctx_size": args.ctx_size, "cache_type_k": args.cache_type_k,
           "cache_type_v": args.cache_type_v, "kv_policy": args.kv_policy,
           "kv_bytes": int(kv.nbytes), "weights_on_device_bytes": int(getattr(assembled.loaded.backend,
                                                                              "device_weight_bytes", 0)),
           "torch_peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "torch_reserved_GiB": round(torch.cuda.memory_reserved() / 2**30, 2),
           "device_used_by_run_GiB": round((free_before - free_after) / 2**30, 2),
           # Everything in use on the device (this process alone runs there): the CUDA context included.
           "device_used_GiB": round((total - free_after) / 2**30, 2),
           "fits_24GiB": (total - free_after) <= 24 * 2**30}
    print(json.dumps(row))
    if args.json:
        with open(args.json, "a") as handle:
            handle.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
