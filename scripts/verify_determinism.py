"""Does a verified node's result depend on where in the tree it sits? The question behind `--force-accept`
holding on a GPU.

Forced acceptance compares the target's greedy token at each verified node with a reference sequence. With
random weights nearly every step is a near-tie in bf16, so the comparison holds only if the verify pass
computes a token's logits to the same bits whatever its depth in the tree, the node count and the window.
This script measures exactly that, on a synthetic model:

    python3 scripts/verify_determinism.py MODEL.gguf [--nodes 16] [--prefix 300] [--json OUT.json]

1. prefill a random prefix; verify a chain of N random tokens (the static pass, graph-recorded on a GPU);
2. for each depth i, on a copy of the state that committed the first i tokens of that chain, verify a chain
   whose root is token i, and compare its root logits with node i's from step 1;
3. the same for the plain decode step (what the engine's non-speculative path computes).

It prints, per depth, the max |difference| of the logits and whether the argmax agrees. Run it under
`LUCEBOX_MATVEC_VARIANT=mma` (or `simt`, `mma8`) to see whether a matvec kernel is the cause; on the CPU
reference backend every difference should be 0 or at rounding level.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch


def clone_state(state):
    """A deep copy of a qwen35 sequence state, without its recordings (they hold the original's buffers)."""
    decode, verify_graphs, verify_inputs = state.decode, state.verify_graphs, state.verify_inputs
    state.decode, state.verify_graphs, state.verify_inputs = None, None, {}
    try:
        return copy.deepcopy(state)
    finally:
        state.decode, state.verify_graphs, state.verify_inputs = decode, verify_graphs, verify_inputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=300)
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
    parents = list(range(-1, args.nodes - 1))
    base = model.new_state(args.prefix + 4 * args.nodes)
    model.forward(base, prefix)

    state = clone_state(base)
    whole = model.verify(state, chain, parents).logits.float().clone()
    rows = []
    for depth in range(args.nodes):
        moved = clone_state(base)
        if depth:
            model.forward(moved, chain[:depth])  # commit the first `depth` tokens by plain prefill
        rooted = model.verify(clone_state(moved), chain[depth:], list(range(-1, args.nodes - depth - 1)))
        root_logits = rooted.logits[0].float()
        decoded = model.forward(clone_state(moved), chain[depth : depth + 1])[-1].float()
        node = whole[depth]
        rows.append({
            "depth": depth,
            "verify_node_vs_root_max_abs": (node - root_logits).abs().max().item(),
            "verify_node_vs_root_argmax_same": int(node.argmax()) == int(root_logits.argmax()),
            "verify_root_vs_decode_max_abs": (root_logits - decoded).abs().max().item(),
            "verify_root_vs_decode_argmax_same": int(root_logits.argmax()) == int(decoded.argmax()),
            "logit_scale": node.abs().max().item(),
        })
        row = rows[-1]
        print(f"depth {depth:2d}: node vs root {row['verify_node_vs_root_max_abs']:.3e} "
              f"(argmax {'same' if row['verify_node_vs_root_argmax_same'] else 'DIFFERS'}), root vs decode "
              f"{row['verify_root_vs_decode_max_abs']:.3e} "
              f"(argmax {'same' if row['verify_root_vs_decode_argmax_same'] else 'DIFFERS'})", flush=True)
    summary = {
        "model": args.model, "backend": loaded.backend_name, "nodes": args.nodes, "prefix": args.prefix,
        "node_vs_root_bit_identical": all(r["verify_node_vs_root_max_abs"] == 0 for r in rows[1:]),
        "rows": rows,
    }
    print("node logits independent of depth: " + ("yes" if summary["node_vs_root_bit_identical"] else "NO"))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
