"""Gemma-4 on the GPU: the CUDA kernels Gemma-4 runs, at the real models' shapes, against their references, and
whole tiny models on lucebox-cuda against the torch reference on the CPU.

usage: python scripts/gemma4_gpu_check.py [--workdir DIR] [--json OUT.json] [--checks tree,fused,moe,attention,models]

1. `moe_experts` (the routed-expert products reading only the chosen experts' GGUF blocks, ids on the device)
   with the 26B-A4B's stacks (128 experts, gate|up 1408 x 2816 Q4_K, down 2816 x 704 Q5_0) at 1, 4 and 600
   tokens, against the family's reference; its decode time per layer.
2. `tree_attention` as the decode step and the verify pass run it (node rows beside the cache, the 1024-slot
   ring), each of 23 verified nodes against the decode step after its path, to the bit; `decode_attention` at Gemma-4's head dims (512 with 4 KV heads over a full cache, 256 with 16 over a
   1024-row ring), against the reference.
3. The norm-chain kernels (post-norm residual, norm sum, GeGLU, soft-cap, q/k/v norm + RoPE, router) in bf16.
4. Tiny dense and MoE files (f32 and q8_0): logits of a 48-token prompt and 24 greedy tokens (the static decode
   step, recorded as a CUDA graph) on lucebox-cuda in f32, against the CPU reference.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from lucebox_core.kquants import random_blocks
from lucebox_core.quants import QuantTensor
from lucebox_core.torch_backend import TorchBackend
from lucebox_cuda.backend import CudaBackend
from lucebox_gemma4 import synth
from lucebox_gemma4.loader import load
from lucebox_gemma4.ops import GEMMA4_OPS


def _stack(name: str, ggml_type: str, shape: tuple[int, ...], seed: int) -> QuantTensor:
    from gguf import GGMLQuantizationType

    t = GGMLQuantizationType[ggml_type]
    blocks = random_blocks(t, int(np.prod(shape)), 0.02, np.random.default_rng(seed))
    return QuantTensor(name, t, shape, torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1).view(np.uint8).copy()))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def check_moe(results: dict) -> None:
    ops = GEMMA4_OPS.bind(CudaBackend(dtype=torch.bfloat16))
    gate_up = _stack("ffn_gate_up_exps", "Q4_K", (128, 1408, 2816), 1)
    down = _stack("ffn_down_exps", "Q5_0", (128, 2816, 704), 2)
    reference = GEMMA4_OPS.references["moe_experts"]
    for tokens in (1, 4, 600):
        g = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, 2816, device="cuda", generator=g).to(torch.bfloat16)
        scores = torch.randn(tokens, 128, device="cuda", generator=g)
        weights, ids = torch.topk(torch.softmax(scores, -1), 8, dim=-1)
        got = ops.moe_experts(x, gate_up, down, weights, ids)
        expected = reference(ops, x, gate_up, down, weights, ids)
        results[f"moe_experts T={tokens} rel err"] = _rel(got, expected)
        print(f"moe_experts T={tokens}: {ops.moe_experts.choice(x, gate_up, down, weights, ids)}, "
              f"rel err {results[f'moe_experts T={tokens} rel err']:.2e}")
    x = torch.randn(1, 2816, device="cuda").to(torch.bfloat16)
    for _ in range(5):
        ops.moe_experts(x, gate_up, down, weights[:1], ids[:1])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        ops.moe_experts(x, gate_up, down, weights[:1], ids[:1])
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 200
    read = 8 * (gate_up.nbytes + down.nbytes) / 128
    results["moe_experts decode us"] = seconds * 1e6
    results["moe_experts decode GB/s"] = read / seconds / 1e9
    print(f"moe_experts one token, top-8 of 128: {seconds * 1e6:.1f} us, {read / seconds / 1e9:.0f} GB/s of expert blocks")


def check_attention(results: dict) -> None:
    ops = GEMMA4_OPS.bind(CudaBackend(dtype=torch.bfloat16))
    for name, heads, kv_heads, dim, rows, position in (("full 512", 32, 4, 512, 4096, 3000),
                                                       ("sliding 256 ring", 32, 16, 256, 1024, 5000)):
        g = torch.Generator(device="cuda").manual_seed(dim)
        q = torch.randn(1, 1, heads, dim, device="cuda", generator=g).to(torch.bfloat16)
        k = torch.randn(rows, kv_heads, dim, device="cuda", generator=g).to(torch.bfloat16)
        v = torch.randn(rows, kv_heads, dim, device="cuda", generator=g).to(torch.bfloat16)
        pos = torch.tensor([position], device="cuda")
        got = ops.decode_attention(q, k, v, pos, scale=1.0 / 16)
        expected = TorchBackend.decode_attention(ops, q.float(), k.float(), v.float(), pos, scale=1.0 / 16)
        results[f"decode_attention {name} rel err"] = _rel(got, expected)
        print(f"decode_attention {name}: {ops.decode_attention.choice(q, k, v, pos, scale=1.0 / 16)}, "
              f"rel err {results[f'decode_attention {name} rel err']:.2e}")
    # Prefill at the full layers' 512-dim heads (causal) and the sliding layers' 256 (a window mask).
    for name, heads, kv_heads, dim, window in (("full 512", 32, 4, 512, 0), ("sliding 256", 32, 16, 256, 1024)):
        g = torch.Generator(device="cuda").manual_seed(dim + 1)
        tokens = 2048
        q = torch.randn(1, tokens, heads, dim, device="cuda", generator=g).to(torch.bfloat16)
        k = torch.randn(1, tokens, kv_heads, dim, device="cuda", generator=g).to(torch.bfloat16)
        v = torch.randn(1, tokens, kv_heads, dim, device="cuda", generator=g).to(torch.bfloat16)
        age = torch.arange(tokens, device="cuda")[:, None] - torch.arange(tokens, device="cuda")[None, :]
        mask = (age >= 0) & (age < window) if window else None
        kwargs = dict(scale=1.0 / 16, mask=mask) if window else dict(scale=1.0 / 16, causal_offset=0)
        got = ops.attention(q, k, v, **kwargs)
        expected = TorchBackend.attention(ops, q[:, -256:].float(), k.float(), v.float(), scale=1.0 / 16,
                                          **({"mask": mask[-256:]} if window else {"causal_offset": tokens - 256}))
        results[f"attention prefill {name} rel err"] = _rel(got[:, -256:], expected)
        print(f"attention prefill {name}: {ops.attention.choice(q, k, v, **kwargs)}, "
              f"rel err {results[f'attention prefill {name} rel err']:.2e}")


def check_tree_attention(results: dict) -> None:
    """The decode step's and the verify pass's attention at the 31B's shapes in bf16 (`tree_attention` with the
    nodes' rows beside the cache; a sliding layer's 1024-slot ring): against the reference, and each verified
    node against the one-node decode step over the cache its committed path leaves, to the bit (what the forced
    DDTree row and exact speculative output need); the 23-node pass's time."""
    from lucebox_core.speculative.trees import TreeIndex

    ops = GEMMA4_OPS.bind(CudaBackend(dtype=torch.bfloat16))
    parents = [-1] + [(i - 1) // 2 for i in range(1, 23)]  # 23 nodes, a binary tree of depth 4
    visible = TreeIndex.build(parents).visibility().to("cuda")
    one = torch.ones(1, 1, dtype=torch.bool, device="cuda")
    for name, heads, kv_heads, dim, ring, start in (("sliding 256 ring, wrapping", 32, 16, 256, 1024, 1010),
                                                    ("sliding 256 ring, wrapped", 32, 16, 256, 1024, 5000),
                                                    ("full 512", 32, 4, 512, 0, 3000)):
        g = torch.Generator(device="cuda").manual_seed(start)
        rows = ring or 4096
        k, v = (torch.randn(rows, kv_heads, dim, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        q = torch.randn(1, 23, heads, dim, device="cuda", generator=g).to(torch.bfloat16)
        node_k, node_v = (torch.randn(23, kv_heads, dim, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        pos = torch.tensor([start], device="cuda")
        extra = {"node_k": node_k, "node_v": node_v, "ring": ring}
        got = ops.tree_attention(q, k, v, pos, visible, scale=1.0, **extra)
        expected = TorchBackend.tree_attention(ops, q.float(), k.float(), v.float(), pos, visible, scale=1.0,
                                               node_k=node_k.float(), node_v=node_v.float(), ring=ring)
        exact = 0
        for node in range(23):
            path = visible[node].nonzero().flatten().tolist()
            dk, dv = k.clone(), v.clone()
            for depth, index in enumerate(path):  # committed in their slots (the node's own row too)
                slot = (start + depth) % ring if ring else start + depth
                dk[slot], dv[slot] = node_k[index], node_v[index]
            at = torch.tensor([start + len(path) - 1], device="cuda")
            decoded = ops.tree_attention(q[:, node : node + 1], dk, dv, at, one, scale=1.0, node_k=node_k[node : node + 1],
                                         node_v=node_v[node : node + 1], ring=ring)
            exact += bool(torch.equal(decoded[0, 0], got[0, node]))
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(100):
            ops.tree_attention(q, k, v, pos, visible, scale=1.0, **extra)
        torch.cuda.synchronize()
        microseconds = (time.perf_counter() - begin) / 100 * 1e6
        results[f"tree_attention {name} rel err"] = _rel(got, expected)
        results[f"tree_attention {name} nodes equal to decode"] = exact
        results[f"tree_attention {name} 23 nodes us"] = microseconds
        print(f"tree_attention {name}: {ops.tree_attention.choice(q, k, v, pos, visible, scale=1.0, **extra)}, rel err "
              f"{_rel(got, expected):.2e}, {exact}/23 nodes bit-equal to the decode step, 23 nodes {microseconds:.0f} us")
        if exact != 23:
            raise AssertionError(f"tree_attention {name}: only {exact}/23 verified nodes equal the decode step")


def check_fused(results: dict) -> None:
    """The norm-chain kernels (`lucebox_cuda.triton_norms`) in bf16 at the 31B's shapes against the family's
    references on the GPU: the share of outputs equal to the bit (the kernels round where the references do)
    and the largest relative difference."""
    kernels = GEMMA4_OPS.bind(CudaBackend(dtype=torch.bfloat16))
    reference = GEMMA4_OPS.bind(TorchBackend("cuda", torch.bfloat16, kernel_table_for={}))
    g = torch.Generator(device="cuda").manual_seed(7)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    def norm_weight(n):
        return (torch.rand(n, device="cuda", generator=g) + 0.5).to(torch.bfloat16)

    hidden = 5376
    stacked = rand(1, 1, 2 * hidden, scale=3)
    q = rand(1, 1, 32 * 512).reshape(1, 1, 32, 512)
    k = rand(1, 1, 4 * 512).reshape(1, 1, 4, 512)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 512, 2, device="cuda", dtype=torch.float32) / 512))
    inv_freq[64:] /= 1e30
    positions = torch.tensor([30000], device="cuda")
    cases = {
        "post_norm_residual": ("post_norm_residual", (stacked[..., :hidden], rand(1, 1, hidden), norm_weight(hidden),
                                                      1e-6, rand(1), norm_weight(hidden))),
        "norm_sum": ("norm_sum", (stacked[..., :hidden], norm_weight(hidden), stacked[..., hidden:],
                                  norm_weight(hidden), 1e-6)),
        "gelu_tanh_mul": ("gelu_tanh_mul", (stacked[..., :hidden], stacked[..., hidden:])),
        "softcap": ("softcap", (rand(1, 262144, scale=40), 30.0)),
        "qkv_norm_rope full": ("qkv_norm_rope", (q, k, k, norm_weight(512), norm_weight(512),
                                                 torch.ones(512, device="cuda", dtype=torch.bfloat16), positions,
                                                 inv_freq, 1e-6)),
    }
    for label, (op, args) in cases.items():
        got, want = getattr(kernels, op)(*args), getattr(reference, op)(*args)
        got = [t for t in (got if isinstance(got, tuple) else (got,)) if t is not None]
        want = [t for t in (want if isinstance(want, tuple) else (want,)) if t is not None]
        equal = sum(int((a == b).sum()) for a, b in zip(got, want)) / sum(b.numel() for b in want)
        error = max(_rel(a, b) for a, b in zip(got, want))
        results[f"{label} bit-equal share"], results[f"{label} rel err"] = equal, error
        print(f"{label}: {getattr(kernels, op).choice(*args)}, {100 * equal:.2f}% bit-equal, rel err {error:.2e}")
    h, scale = rand(3, 2816, scale=4), norm_weight(2816)
    proj = rand(128, 2816, scale=0.05)
    per_expert = torch.rand(128, device="cuda", generator=g) + 0.5
    (w1, i1), (w2, i2) = (ops.moe_route(h, proj, scale, per_expert, 8, 1e-6) for ops in (kernels, reference))
    # bf16 router logits tie often (8 mantissa bits over 128 experts), and torch.topk orders equals its own
    # way: compare each token's chosen experts as a set, weights matched by expert.
    o1, o2 = i1.sort(-1), i2.sort(-1)
    same = torch.equal(o1.values, o2.values)
    results["moe_route expert sets equal"] = bool(same)
    results["moe_route weights rel err"] = _rel(w1.gather(-1, o1.indices), w2.gather(-1, o2.indices)) if same else None
    print(f"moe_route: {kernels.moe_route.choice(h, proj, scale, per_expert, 8, 1e-6)}, expert sets equal {same}, "
          f"weights rel err {results['moe_route weights rel err']}, ids equal in order {torch.equal(i1, i2)}")


def check_models(results: dict, workdir: Path) -> None:
    for size, kind in (("tiny", "f32"), ("tiny-moe", "f32"), ("tiny", "q8_0"), ("tiny-moe", "q8_0")):
        path = workdir / f"gemma4-{size}-{kind}.gguf"
        if not path.exists():
            synth.write(path, size=size, type=kind, seed=5)
        cpu = load(path)
        gpu = load(path, backend=CudaBackend(dtype=torch.float32))
        prompt = torch.arange(1000, 1048)
        a, b = cpu.forward(cpu.new_state(128), prompt), gpu.forward(gpu.new_state(128), prompt).cpu()
        tokens = {}
        for label, model in (("cpu", cpu), ("cuda", gpu)):
            state = model.new_state(128)
            logits, out = model.forward(state, prompt, last_only=True), []
            for _ in range(24):
                out.append(int(logits[-1].argmax()))
                logits = model.forward(state, torch.tensor([out[-1]]))  # the static step (graphs on CUDA)
            tokens[label] = out
        key = f"{size} {kind}"
        # The static verify pass (recorded as a graph) against the eager one, on a branching tree past the
        # rings' wrap: the same logits, as plain decoding of each node would give them.
        state = gpu.new_state(128)
        gpu.forward(state, prompt)
        tree_tokens, parents = [7, 8, 9, 10, 11, 12, 13], [-1, 0, 0, 1, 1, 2, 5]
        eager = gpu.verify(state, tree_tokens, parents, static=False).logits.clone()
        recorded = [gpu.verify(state, tree_tokens, parents, static=True, graphs=True).logits.clone() for _ in range(2)]
        results[f"{key} static verify rel err"] = max(_rel(r, eager) for r in recorded)
        print(f"{key}: static verify (graph, replayed) vs eager rel err {results[f'{key} static verify rel err']:.2e}")
        results[f"{key} logits rel err"] = _rel(b, a)
        results[f"{key} greedy equal"] = tokens["cpu"] == tokens["cuda"]
        print(f"{key}: prefill logits rel err {_rel(b, a):.2e}; 24 greedy tokens equal: {tokens['cpu'] == tokens['cuda']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/w")
    parser.add_argument("--json")
    parser.add_argument("--checks", default="tree,fused,moe,attention,models",
                        help="comma-separated subset of tree,fused,moe,attention,models")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    failures = []
    checks = {"tree": check_tree_attention, "fused": check_fused, "moe": check_moe, "attention": check_attention,
              "models": lambda r: check_models(r, workdir)}
    for name in args.checks.split(","):
        check = checks[name]
        try:
            check(results)
        except Exception as exc:  # report every check, then fail
            failures.append(repr(exc))
            print(f"FAILED: {exc!r}")
    results["failures"] = failures
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
