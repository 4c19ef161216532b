"""Prefill attention at the 27B's heads (24 query heads, 4 KV heads, dim 256) deep in a long prompt: the
Triton kernel with several tile choices against torch's fused attention (SDPA), in TFLOP/s of useful work.

A 128K dense prefill spends about half its time here (`bench_pflash.py`'s chunk profile); this says which
tiles, or which kernel, gets closest to the tensor-core peak on this GPU. One JSON line per row on stdout.

    python scripts/attention_sweep.py [--offsets 0,61440,126976] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

Q_HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="query tokens (a prefill chunk)")
    p.add_argument("--offsets", default="0,61440,126976", help="cache positions before the chunk")
    args = p.parse_args(argv)
    from lucebox_cuda.timing import median_ms as event_median_ms
    from lucebox_cuda.triton_attention import BlockConfig, attention, prefill_config

    def median_ms(function) -> float:
        return event_median_ms(function, repeats=5)

    device = torch.device("cuda")
    candidates = [None, BlockConfig(128, 32, 8, 2), BlockConfig(128, 32, 8, 3), BlockConfig(64, 32, 4, 2),
                  BlockConfig(64, 32, 8, 3), BlockConfig(64, 32, 8, 4), BlockConfig(64, 64, 8, 3),
                  BlockConfig(128, 64, 8, 2), BlockConfig(32, 64, 4, 2)]
    scale = HEAD_DIM**-0.5
    for offset in (int(o) for o in args.offsets.split(",")):
        tokens, keys = args.tokens, offset + args.tokens
        torch.manual_seed(0)
        q = torch.randn(1, tokens, Q_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, keys, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        v = torch.randn(1, keys, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        flops = 4 * HEAD_DIM * Q_HEADS * (tokens * offset + tokens * (tokens + 1) // 2)
        reference = None
        for config in candidates:
            tiles = config or prefill_config(HEAD_DIM, HEAD_DIM, torch.bfloat16)
            label = f"triton {tiles.block_m}x{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}" + (
                " (default)" if config is None else "")
            try:
                ms = median_ms(lambda: attention(q, k, v, scale=scale, causal_offset=offset, out=out, config=config))
                if reference is None:
                    reference = out.clone()
                error = float((out.float() - reference.float()).abs().max())
            except Exception as exc:  # a tile that does not fit is a row, not the end
                print(json.dumps({"offset": offset, "kernel": label, "error": f"{type(exc).__name__}: {exc}"[:200]}))
                continue
            print(json.dumps({"offset": offset, "tokens": tokens, "kernel": label, "ms": round(ms, 3),
                              "tflops": round(flops / ms / 1e9, 1), "max_diff_vs_default": error}), flush=True)
        # torch's fused attention: [B, H, T, D], causal from the bottom right (the chunk sees all the cache).
        from torch.nn.attention.bias import causal_lower_right

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        bias = causal_lower_right(tokens, keys)
        for name, run in (
            ("sdpa gqa", lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=bias, scale=scale, enable_gqa=True)),
            ("sdpa repeated kv", lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt.repeat_interleave(Q_HEADS // KV_HEADS, 1), vt.repeat_interleave(Q_HEADS // KV_HEADS, 1),
                attn_mask=bias, scale=scale)),
        ):
            try:
                ms = median_ms(run)
                error = None if reference is None else float((run().transpose(1, 2).float() - reference.float()).abs().max())
            except Exception as exc:
                print(json.dumps({"offset": offset, "kernel": name, "error": f"{type(exc).__name__}: {exc}"[:200]}))
                continue
            print(json.dumps({"offset": offset, "tokens": tokens, "kernel": name, "ms": round(ms, 3),
                              "tflops": round(flops / ms / 1e9, 1), "max_diff_vs_default": error}), flush=True)
        del q, k, v, out, reference
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
