"""Does a verified node get, bit for bit, the logits plain decoding gives the same token? The question behind
`--force-accept` holding on a GPU, and behind speculative output equalling plain greedy output there.

Forced acceptance compares the target's greedy token at each verified node with plain greedy decoding. With
random weights nearly every step is a near-tie in bf16, so it holds only if the verify pass computes a
token's logits to the same bits as the one-token decode step does after the same path, whatever the node's
depth, the node count and the window. This script measures exactly that, on a synthetic model:

    python3 scripts/verify_determinism.py MODEL.gguf [--nodes 16] [--prefix 300] [--json OUT.json]

After a random prefix (prefilled once), for a chain of N random tokens and for a bushy tree of N nodes:
verify the whole candidate set in one pass (the static pass, graph-recorded on a GPU), then for each node
decode its path token by token from the prefix (the engine's decode step) and compare the last step's
logits with the node's: max |difference| and whether the argmax agrees. On the CPU reference backend the
differences are at rounding level; on lucebox-cuda they must be 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch


def clone_state(state):
    """A deep copy of a qwen35 sequence state, without its recordings (they hold the original's buffers)."""
    decode, verify = state.decode, state.verify
    state.decode, state.verify = None, None
    try:
        return copy.deepcopy(state)
    finally:
        state.decode, state.verify = decode, verify


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--nodes", type=int, default=16)
    # 1000: the decode windows (1024) and the verify windows (1280) differ, so split counts differ too.
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from lucebox_core.loading import load_model

    loaded = load_model(args.model, backend=args.backend, device=args.device)
    model = loaded.model
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.vocab_size, (args.prefix,), generator=generator)
    chain = torch.randint(0, model.vocab_size, (args.nodes,), generator=generator)
    base = model.new_state(args.prefix + 4 * args.nodes)
    model.forward(base, prefix)

    shapes = {"chain": list(range(-1, args.nodes - 1)),
              # Two children per node, breadth first: every depth holds siblings that sit between a node and
              # its ancestors in the verify pass's rows.
              "tree": [-1] + [(i - 1) // 2 for i in range(1, args.nodes)]}
    rows = []
    for shape, parents in shapes.items():
        tokens = chain if shape == "chain" else torch.randint(0, model.vocab_size, (args.nodes,), generator=generator)
        verified = model.verify(clone_state(base), tokens, parents).logits.float().clone()
        for node in range(args.nodes):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path.reverse()
            state = clone_state(base)
            for index in path:  # plain decoding, one decode step per token
                decoded = model.forward(state, tokens[index : index + 1])[-1].float()
            row = {"shape": shape, "node": node, "depth": len(path) - 1,
                   "max_abs": (verified[node] - decoded).abs().max().item(),
                   "argmax_same": int(verified[node].argmax()) == int(decoded.argmax()),
                   "logit_scale": decoded.abs().max().item()}
            rows.append(row)
            print(f"{shape} node {node:2d} depth {row['depth']:2d}: verify vs decode {row['max_abs']:.3e} "
                  f"(argmax {'same' if row['argmax_same'] else 'DIFFERS'})", flush=True)
    summary = {
        "model": args.model, "backend": loaded.backend_name, "nodes": args.nodes, "prefix": args.prefix,
        "bit_identical": all(r["max_abs"] == 0 for r in rows),
        "argmax_agrees": all(r["argmax_same"] for r in rows),
        "rows": rows,
    }
    print("verified logits equal decoded logits bit for bit: " + ("yes" if summary["bit_identical"] else "NO")
          + f"; argmax agrees at {sum(r['argmax_same'] for r in rows)}/{len(rows)} nodes")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
