"""Cross-check synthetic files of a family (qwen35 by default, or `--arch qwen35moe` / `--arch laguna` / `--arch qwen3`) against llama.cpp (run on the
GPU machine, see README there).

1. Writes synthetic files with `lucebox synth` (tiny f32/q8_0/q4_k_m, 0.8b q4_k_m, 27b q4_k_m; timed).
2. Loads each in llama.cpp's `llama-server` (f32 KV cache, flash attention off, greedy; `--ngl 0`: on the CPU)
   and asks for 24 tokens on several prompts given as token ids.
3. Runs the same prompts through Lucebox's engine (torch reference backend) and compares the tokens.
   Where the two part, it prints Lucebox's top-two logit gap at that step (a near-tie is not a bug).
   `--every-id`: Lucebox's side is the model's argmax over every output row, as llama.cpp's greedy is (the
   engine never samples a vocabulary's padding placeholders; a random model's argmax often is one).

usage: python scripts/llamacpp_crosscheck.py OUTDIR [--server /tmp/llamacpp/build/bin/llama-server]
       [--arch laguna --ngl 0 --every-id --files tiny:f32,tiny:q8_0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

PROMPTS = [
    [9707, 11, 1879, 0],  # "Hello, world!"
    [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13],
    [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198],
    list(range(1000, 1040)),
]
# Laguna-style vocabulary ids: 〈|EOS|〉 <user> "Hello ..." </user> <assistant>, and runs of ordinary tokens.
PROMPTS_BY_ARCH = {
    "qwen35": PROMPTS,
    "qwen35moe": PROMPTS,  # the same Qwen3.5 vocabulary
    "qwen3": PROMPTS,  # Qwen3's vocabulary has the same ids for these (the Qwen-family BPE, <|im_start|> 151644)
    "laguna": [[2, 12, 300, 301, 302, 13, 23], list(range(500, 540)), [2] + list(range(1000, 1100, 7))],
}
N_TOKENS = 24


def synth(out: Path, size: str, type_: str, arch: str = "qwen35") -> tuple[Path, float]:
    path = out / f"{arch}-{size}-{type_}.gguf"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "lucebox_core.cli", "synth", "--arch", arch, "--size", size, "--type", type_,
         "--seed", "1", "-o", str(path)],
        check=True,
    )
    return path, time.perf_counter() - start


def llama_tokens(server: str, model: Path, prompts: list[list[int]], port: int = 8931,
                 ngl: int = 99) -> list[list[int]]:
    process = subprocess.Popen(
        [server, "-m", str(model), "-ngl", str(ngl), "-fa", "off", "-ctk", "f32", "-ctv", "f32", "-c", "4096",
         "--port", str(port), "-np", "1", "--no-warmup"]
        + (["--no-repack"] if ngl == 0 else []),  # llama.cpp's CPU AMX repacking crashes on some processors
        stdout=subprocess.DEVNULL, stderr=open(model.with_suffix(".server.log"), "w"),
    )
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.5)
        results = []
        for prompt in prompts:
            body = json.dumps({"prompt": prompt, "n_predict": N_TOKENS, "temperature": 0, "top_k": 1,
                               "samplers": ["top_k"], "cache_prompt": False, "return_tokens": True,
                               "ignore_eos": True}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as r:
                results.append(json.loads(r.read())["tokens"])
        return results
    finally:
        process.terminate()
        process.wait()


def lucebox_tokens(model: Path, prompts: list[list[int]], device: str) -> tuple[list[list[int]], list[list[float]]]:
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.loading import load_model
    from lucebox_core.sampling import SamplingParams

    loaded = load_model(model, device=device)
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=4096)
    tokens, gaps = [], []
    for prompt in prompts:
        sequence = engine.new_sequence()
        request = GenerationRequest(prompt_ids=prompt, max_tokens=N_TOKENS, sampling=SamplingParams(temperature=0),
                                    ignore_eos=True, logprobs=2)
        ids, gap = [], []
        for step in engine.stream(sequence, request):
            if step.token_id is not None:
                ids.append(step.token_id)
                (_, a), (_, b) = step.top_logprobs[:2]
                gap.append(a - b)
        tokens.append(ids)
        gaps.append(gap)
    return tokens, gaps


def argmax_tokens(model: Path, prompts: list[list[int]], device: str) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy over every output row (llama.cpp's greedy), through the model's own forward: prefill, then one
    token at a time."""
    from lucebox_core.loading import load_model

    loaded = load_model(model, device=device, backend="torch" if device == "cpu" else None)  # the reference on the CPU
    tokens, gaps = [], []
    for prompt in prompts:
        state = loaded.model.new_state(4096)
        logits = loaded.model.forward(state, torch.tensor(prompt, device=device))[-1]
        ids, gap = [], []
        for _ in range(N_TOKENS):
            top = torch.topk(logits.float(), 2)
            ids.append(int(top.indices[0]))
            gap.append(float(top.values[0] - top.values[1]))
            logits = loaded.model.forward(state, top.indices[:1])[-1]
        tokens.append(ids)
        gaps.append(gap)
    return tokens, gaps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--server", default="/tmp/llamacpp/build/bin/llama-server")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--files", default="tiny:f32,tiny:q8_0,tiny:q4_k_m,0.8b:q4_k_m")
    parser.add_argument("--arch", default="qwen35", choices=sorted(PROMPTS_BY_ARCH))
    parser.add_argument("--ngl", type=int, default=99, help="llama.cpp's GPU layers (0: llama.cpp on the CPU)")
    parser.add_argument("--every-id", action="store_true", help="Lucebox's greedy over every output row")
    args = parser.parse_args()
    prompts = PROMPTS_BY_ARCH[args.arch]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = []
    for item in args.files.split(","):
        size, type_ = item.split(":")
        path, seconds = synth(out, size, type_, args.arch)
        row = {"file": path.name, "size_bytes": path.stat().st_size, "synth_seconds": round(seconds, 2)}
        try:
            theirs = llama_tokens(args.server, path, prompts, ngl=args.ngl)
            ours, gaps = (argmax_tokens if args.every_id else lucebox_tokens)(path, prompts, args.device)
            row["prompts"] = []
            for prompt, a, b, gap in zip(prompts, theirs, ours, gaps):
                first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                row["prompts"].append({
                    "prompt_len": len(prompt), "llama_cpp": a, "lucebox": b, "identical": a == b,
                    "first_difference": first_diff,
                    "lucebox_top2_logprob_gap_there": None if first_diff is None else round(gap[first_diff], 6),
                })
        except Exception as exc:  # keep going: one failing file must not hide the others
            row["error"] = f"{type(exc).__name__}: {exc}"
        report.append(row)
        print(json.dumps(row), flush=True)
        if size != "tiny":
            path.unlink()
    (out / "crosscheck.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
