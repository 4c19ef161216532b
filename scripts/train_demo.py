"""Train Lucebox's demo pair (issue #22): a small qwen35 code model on the Python standard library's source, then
its DFlash drafter, and write both as GGUF with the project's writers.

    python3 scripts/train_demo.py --out DIR --budget-s 480          # on a GPU: the real pair, in one run
    python3 scripts/train_demo.py --out DIR --device cpu --hidden 32 --layers 4 ... --target-steps 3  # smoke

1. Corpus (`demo_corpus`): every `.py` of the stdlib but the test suites, codec tables and generated docs; a
   fixed ~5 % of files held out by a hash of their path; 2,000 documented training functions also as chat
   turns (signature and docstring asked, the function answered), so that a chat request gets code back.
   Tokenized once with the real Qwen3.5 tokenizer (the synthetic vocabulary every `lucebox synth` file
   carries), cached under `--cache-dir` (default DIR/cache).
2. Target (`demo_models.Qwen35Trainable`): the qwen35 layout (three Gated DeltaNet layers then one gated
   attention layer, repeated), the real 248,320-token vocabulary, tied embeddings, sized so the Q8_0 file stays
   under `--max-bytes`. AdamW, warm-up then cosine, bf16 autocast on CUDA, random windows of the training
   stream, dropout on the residual branches while training (the corpus is small: many epochs). The step count
   comes from the time budget (measured after a few steps) unless `--target-steps` fixes it; then the weights
   take their round trip through the file's types, and the held-out loss is measured on the model as the file
   stores it. Its file is written before the drafter's phase starts.
3. Drafter (`demo_models.DFlashTrainable`), as the DFlash paper trains one: the target generates greedy
   continuations of training-stream prompts (batched, with its own caches), its captured layers over the
   whole sequence are the context, and blocks `[token, MASK x 15]` anchored at random positions of the
   continuation learn the target's next 15 tokens, the loss weighted by exp(-(k-1)/gamma) over block
   position k. Held-out: per-position accuracy and the mean accepted length a chain verifier would get.
4. Files: both GGUFs (seed, hyper-parameters, corpus and results under `lucebox.train.*`), `results.json`, the
   greedy texts Lucebox itself gives for a few held-out prompts (CPU, fp32: what the test suite checks), and
   `parts/` (pieces under 16 MiB and a manifest with checksums).

Time: after the corpus, what remains of `--budget-s` less `--finish-reserve-s` is shared by the target and the
drafter as `--target-share` to `--draft-share` (35:65 by default). Each phase keeps the weights of its best quick
held-out measure (the corpus is small and seen for many epochs: the held-out loss turns up before the end).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_corpus  # noqa: E402
import demo_export  # noqa: E402
import demo_models  # noqa: E402
import demo_training  # noqa: E402

TARGET_FILE = "lucebox-demo-qwen35-stdlib-{type}.gguf"
DRAFT_FILE = "lucebox-demo-qwen35-stdlib-dflash-draft-{type}.gguf"
VOCAB_METADATA_BYTES = 8_300_000  # the synthetic vocabulary's keys in a written file (measured: 8.16 MB)


def log(message: str, *, _start: list = []) -> None:  # noqa: B006 (the start time, kept across calls)
    if not _start:
        _start.append(time.perf_counter())
    print(f"[{time.perf_counter() - _start[0]:7.1f}s] {message}", flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for everything the run writes")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run")
    p.add_argument("--finish-reserve-s", type=float, default=45.0,
                   help="time kept for the final evaluations, the files and the greedy records")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=22)
    p.add_argument("--type", default="q8_0", choices=["q8_0", "f32", "f16"], help="GGUF file type of both files")
    p.add_argument("--max-bytes", type=int, default=40_000_000, help="the target file's size limit")
    g = p.add_argument_group("corpus")
    g.add_argument("--without-tests", action="store_true",
                   help="leave the stdlib's test suites out (they are two thirds of its source: more data, less "
                        "over-fitting of a model trained for many epochs)")
    g.add_argument("--heldout-permille", type=int, default=50)
    g.add_argument("--max-files", type=int, default=0, help="only this many files (smoke tests)")
    g.add_argument("--cache-dir", type=Path, help="where the token arrays are cached (default: OUT/cache)")
    g.add_argument("--chat-docs", type=int, default=2000,
                   help="training functions also given as chat turns (asked for, answered with the code); 0: none")
    g = p.add_argument_group("target shape")
    g.add_argument("--hidden", type=int, default=96)
    g.add_argument("--layers", type=int, default=12)
    g.add_argument("--ffn", type=int, default=1024)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--gdn-key-heads", type=int, default=2)
    g.add_argument("--gdn-value-heads", type=int, default=4)
    g.add_argument("--gdn-head-dim", type=int, default=64)
    g.add_argument("--rope-theta", type=float, default=1e7)
    g = p.add_argument_group("target training")
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--batch", type=int, default=64)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--dropout", type=float, default=0.1, help="on the target's residual branches, in training only")
    g.add_argument("--warmup", type=int, default=100, help="warm-up steps (of either model)")
    g.add_argument("--full-softmax", action="store_true",
                   help="train over the whole vocabulary's softmax, not the corpus's tokens only (same loss, slower)")
    g.add_argument("--target-steps", type=int, default=0, help="fix the step count (0: from the time budget)")
    g.add_argument("--target-share", type=float, default=0.35)
    g.add_argument("--eval-tokens", type=int, default=262_144, help="held-out tokens of the final evaluation")
    g.add_argument("--eval-every-s", type=float, default=15.0,
                   help="a quick held-out measure every so often (the best one's weights are kept)")
    g.add_argument("--quick-eval-tokens", type=int, default=65_536, help="held-out tokens of a quick measure")
    g = p.add_argument_group("drafter")
    g.add_argument("--draft-layers", type=int, default=3)
    g.add_argument("--draft-ffn", type=int, default=1024)
    g.add_argument("--draft-heads", type=int, default=8)
    g.add_argument("--draft-kv-heads", type=int, default=2)
    g.add_argument("--draft-head-dim", type=int, default=64)
    g.add_argument("--draft-taps", type=int, default=5, help="target layers captured (Lucebox's default rule)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gamma", type=float, default=7.0, help="loss weight decay over block positions")
    g.add_argument("--draft-lr", type=float, default=2e-3)
    g.add_argument("--draft-steps", type=int, default=0, help="fix the step count (0: from the time budget)")
    g.add_argument("--draft-share", type=float, default=0.65)
    g.add_argument("--draft-batch", type=int, default=32, help="sequences per drafter step")
    g.add_argument("--anchors", type=int, default=32, help="blocks per sequence per drafter step")
    g.add_argument("--gen-seqs", type=int, default=32768, help="target continuations to train the drafter on")
    g.add_argument("--gen-batch", type=int, default=8192)
    g.add_argument("--gen-tokens", type=int, default=256)
    g.add_argument("--prompt-lens", type=_ints, default=[32, 64, 128, 256])
    g.add_argument("--function-prompt-share", type=float, default=0.5,
                   help="share of the drafter's training prompts that end just after a training function's docstring "
                        "(the acceptance benchmark's kind of prompt); the rest end at random positions")
    g.add_argument("--heldout-gen-seqs", type=int, default=64)
    g = p.add_argument_group("records")
    g.add_argument("--record-prompts", type=int, default=3, help="held-out prompts whose greedy text is recorded")
    g.add_argument("--record-tokens", type=int, default=32)
    return p


def target_config(args: argparse.Namespace):
    from lucebox_qwen35.layout import Qwen35Config

    rope_dim = args.head_dim // 4  # Qwen3.5's partial rotary factor 0.25
    # mRoPE sections over the rotated pairs, split as Qwen3.5's [11, 11, 10] splits 32 (text-only positions make
    # them irrelevant to the result, but llama.cpp reads them).
    base, extra = divmod(rope_dim // 2, 3)
    sections = (base + (extra > 0), base + (extra > 1), base, 0)
    return Qwen35Config(
        n_layer=args.layers, hidden=args.hidden, ffn=args.ffn, n_head=args.heads, n_head_kv=args.kv_heads,
        head_dim=args.head_dim, ssm_d_state=args.gdn_head_dim, ssm_n_group=args.gdn_key_heads,
        ssm_dt_rank=args.gdn_value_heads, ssm_d_inner=args.gdn_value_heads * args.gdn_head_dim,
        rope_theta=args.rope_theta, rope_dim=rope_dim, rope_sections=sections, tied_output=True,
        context_length=32768,
    )


def draft_config(args: argparse.Namespace, target):
    from lucebox_core.speculative.dflash import DraftConfig, default_target_layers
    from lucebox_qwen35.model import QWEN35_MASK_TOKEN_ID

    return DraftConfig(
        architecture="qwen35-dflash-draft", n_layer=args.draft_layers, hidden=target.hidden, ffn=args.draft_ffn,
        n_head=args.draft_heads, n_head_kv=args.draft_kv_heads, head_dim=args.draft_head_dim, eps=target.eps,
        rope_theta=1e6, block_size=args.block_size,
        target_layer_ids=default_target_layers(target.n_layer, min(args.draft_taps, target.n_layer)),
        mask_token_id=QWEN35_MASK_TOKEN_ID, vocab=target.vocab, context_length=target.context_length,
    )


def load_tokenizer():
    """The tokenizer and chat template of the files written here (the synthetic qwen35 vocabulary)."""
    from lucebox_core.chat_template import ChatTemplate
    from lucebox_core.tokenizer import Tokenizer
    from lucebox_qwen35 import vocab as qwen_vocab

    vocab = qwen_vocab.synthetic(None, 248320)
    metadata = {"tokenizer.ggml.tokens": vocab.tokens, "tokenizer.ggml.token_type": vocab.token_types,
                "tokenizer.ggml.merges": vocab.merges, **{k: v[0] for k, v in vocab.keys.items()}}
    if vocab.scores is not None:
        metadata["tokenizer.ggml.scores"] = vocab.scores
    identity = demo_export.sha256_of(qwen_vocab.packaged_vocab_path()) + str(len(vocab.tokens))
    return Tokenizer.from_metadata(metadata, source="synthetic qwen35 vocabulary"), ChatTemplate.from_metadata(metadata), identity


def record_greedy(target_path: Path, draft_path: Path, prompts: list, tokens: int) -> list[dict]:
    """Lucebox's own greedy text for each prompt, on the CPU in fp32 (what the test suite reruns), and the
    same through the trained drafter with the chain and DDTree verifiers."""
    from lucebox_core.assembly import load_drafter
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.loading import load_model
    from lucebox_core.sampling import SamplingParams
    from lucebox_core.speculative import SpeculativeDecoder

    loaded = load_model(target_path, backend="torch", device="cpu")
    drafter = load_drafter(str(draft_path), loaded.model, loaded.backend)
    plain = Engine(loaded.model, loaded.tokenizer, ctx_size=2048)
    speculative = {spec: Engine(loaded.model, loaded.tokenizer, ctx_size=2048,
                                speculative=SpeculativeDecoder(loaded.model, drafter, spec, budget=22))
                   for spec in ("chain", "ddtree")}
    records = []
    for prompt in prompts:
        ids = loaded.tokenizer.encode(prompt.prompt, add_bos=False)
        request = GenerationRequest(prompt_ids=ids, max_tokens=tokens, sampling=SamplingParams(temperature=0))
        result = plain.generate(request)
        record = {"file": prompt.file, "function": prompt.name, "prompt": prompt.prompt, "prompt_ids": ids,
                  "token_ids": list(result.token_ids), "text": result.text, "finish_reason": result.finish_reason}
        for spec, engine in speculative.items():
            spec_result = engine.generate(request)
            record[f"{spec}_equals_plain"] = list(spec_result.token_ids) == list(result.token_ids)
            record[f"{spec}_accepted_lengths"] = list(spec_result.timings.accepted_lengths)
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gen_tokens < args.block_size:
        parser.error(f"--gen-tokens {args.gen_tokens} must be at least --block-size {args.block_size}: every "
                     "label of a block is a generated token")
    if not args.prompt_lens or min(args.prompt_lens) < 1:
        parser.error("--prompt-lens must be positive lengths")
    start = time.perf_counter()
    log(f"train_demo: device {args.device}, budget {args.budget_s:.0f} s, seed {args.seed}, torch {torch.__version__}, "
        f"Python {platform.python_version()}")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    target_cfg = target_config(args)
    draft_cfg = draft_config(args, target_cfg)
    plans = demo_export.target_plans(target_cfg, args.type)
    estimate = demo_export.file_bytes(plans, VOCAB_METADATA_BYTES)
    log(f"target: {target_cfg.n_layer} layers (attention at {target_cfg.full_layers}), hidden {target_cfg.hidden}, "
        f"FFN {target_cfg.ffn}, {sum(int(np.prod(p.shape)) for p in plans):,} weights; {args.type} file ~{estimate / 1e6:.1f} MB")
    if args.max_bytes and estimate > args.max_bytes:
        raise SystemExit(f"error: the target file would be ~{estimate / 1e6:.1f} MB, over --max-bytes "
                         f"{args.max_bytes / 1e6:.1f} MB: choose a smaller --hidden, --layers or --ffn")

    tokenizer, chat_template, tokenizer_id = load_tokenizer()

    def chat_prompt(user: str) -> str:
        return chat_template.render([{"role": "user", "content": user}], add_generation_prompt=True,
                                    enable_thinking=False)

    corpus = demo_corpus.Corpus.build(
        tokenizer, args.cache_dir or out / "cache", include_tests=not args.without_tests, heldout_permille=args.heldout_permille,
        max_files=args.max_files, chat=chat_prompt, chat_count=args.chat_docs, log=log, tokenizer_id=tokenizer_id)
    log(f"corpus: {corpus.info['files']} files of Python {corpus.info['python']}, {len(corpus.heldout_files)} held "
        f"out; {corpus.train.size:,} training tokens ({corpus.chat_documents} chat turns), {corpus.heldout.size:,} held out")

    setup_s = time.perf_counter() - start
    shared = max(0.0, args.budget_s - setup_s - args.finish_reserve_s)
    target_s = shared * args.target_share / (args.target_share + args.draft_share)
    draft_s = shared - target_s
    log(f"time: setup {setup_s:.0f} s; target {target_s:.0f} s, drafter {draft_s:.0f} s, finishing {args.finish_reserve_s:.0f} s")

    trainer = demo_training.Trainer(args, device, log)
    target = demo_models.Qwen35Trainable(target_cfg, args.seed, dropout=args.dropout).to(device)
    if not args.full_softmax:
        target.use_vocabulary(demo_models.OutputVocabulary.of(torch.from_numpy(corpus.train.astype(np.int64)).to(device),
                                                              target_cfg.vocab))
        log(f"output softmax over the corpus's {target.vocabulary.ids.numel():,} tokens (the other "
            f"{target_cfg.vocab - target.vocabulary.ids.numel():,} rows stay zero: one column of the partition function)")
    target_report = trainer.train_target(target, corpus, target_s)
    changed = demo_export.quantize_roundtrip_(target.gguf_tensors(), plans)
    quantized = trainer.heldout_loss(target, corpus.heldout, args.eval_tokens)
    target_report["heldout_quantized"] = quantized
    log(f"target as stored ({args.type}, {changed} tensors rounded): held-out loss {quantized['loss']:.4f}, "
        f"perplexity {quantized['perplexity']:.2f}")

    # The target's file first: a failure in the drafter's phase leaves it (and its parts) written.
    hyper = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    common = {"seed": args.seed, "hyperparameters": hyper, "python": platform.python_version(),
              "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "corpus": "Python standard library source (PSF-2.0)", "corpus_files": corpus.info["files"],
              "corpus_tokens": int(corpus.train.size), "chat_documents": corpus.chat_documents,
              "heldout_files": corpus.heldout_files}
    target_path = out / TARGET_FILE.format(type=args.type)
    draft_path = out / DRAFT_FILE.format(type=args.type)
    description = (f"A small code model trained in {target_report['seconds']:.0f} s on the Python "
                   f"{corpus.info['python']} standard library's source ({corpus.train.size:,} tokens, "
                   f"{target_report['steps']} steps): it continues Python code and answers a chat request with a "
                   f"function. Held-out loss {quantized['loss']:.3f} (perplexity {quantized['perplexity']:.2f}). "
                   f"Lucebox's demo model, with a DFlash drafter trained for it.")
    demo_export.write_target(
        target_path, target, args.type, description=description,
        name=f"Lucebox demo qwen35 stdlib code model ({target_cfg.n_layer} layers, hidden {target_cfg.hidden})",
        training={**common, "role": "target", "steps": target_report["steps"],
                  "heldout_loss": quantized["loss"], "heldout_perplexity": quantized["perplexity"]})
    torch.save({"config": target_cfg, "state": {k: v.cpu() for k, v in target.state_dict().items()}},
               out / "target_state.pt")
    results: dict[str, Any] = {
        "target": {"file": target_path.name, "bytes": target_path.stat().st_size, "config": str(target_cfg),
                   **target_report},
        "corpus": {k: v for k, v in corpus.info.items() if k != "train_files"},
        "hyperparameters": hyper,
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "device": common["device"]},
    }

    def save_results() -> None:
        written = [target_path] + ([draft_path] if "drafter" in results else [])
        results["manifest"] = demo_export.split_into_parts(written, out / "parts")
        results["seconds"] = time.perf_counter() - start
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    save_results()
    log(f"wrote {target_path.name} ({target_path.stat().st_size / 1e6:.2f} MB)")

    drafter = demo_models.DFlashTrainable(draft_cfg, args.seed + 1).to(device)
    draft_report = trainer.train_drafter(drafter, target, corpus, draft_s)
    draft_plans = demo_export.draft_writer.tensor_plans(draft_cfg, args.type)
    demo_export.quantize_roundtrip_(drafter.gguf_tensors(), draft_plans)
    draft_report["heldout_quantized"] = trainer.drafter_accuracy(drafter, target, trainer.heldout_pool)
    log(f"drafter as stored: held-out mean chain acceptance {draft_report['heldout_quantized']['chain_length']:.2f}")
    demo_export.write_drafter(
        draft_path, drafter, args.type, name=f"Lucebox demo DFlash drafter for {target_path.name}",
        training={**common, "role": "drafter", "target": target_path.name, "steps": draft_report["steps"],
                  "gamma": args.gamma, "heldout_chain_length": draft_report["heldout_quantized"]["chain_length"]})
    torch.save({"config": draft_cfg, "state": {k: v.cpu() for k, v in drafter.state_dict().items()}},
               out / "draft_state.pt")
    results["drafter"] = {"file": draft_path.name, "bytes": draft_path.stat().st_size, "config": str(draft_cfg),
                          **draft_report}
    save_results()
    log(f"wrote {draft_path.name} ({draft_path.stat().st_size / 1e6:.2f} MB)")

    # Lucebox's own greedy text for a few held-out functions (a small corpus, a smoke test's, may need training
    # ones too). A failure here is reported and leaves the files and results written.
    root = demo_corpus.stdlib_root()
    prompts = demo_corpus.function_prompts(root, corpus.heldout_files, args.record_prompts)
    prompts += demo_corpus.function_prompts(root, corpus.train_files, args.record_prompts - len(prompts))
    try:
        records = record_greedy(target_path, draft_path, prompts, args.record_tokens)
    except Exception as exc:  # noqa: BLE001 -- the trained files matter more than their records
        log(f"error: recording the greedy texts failed: {type(exc).__name__}: {exc}")
        results["records_error"] = f"{type(exc).__name__}: {exc}"
        save_results()
        return 1
    for r in records:
        log(f"greedy {r['file']}:{r['function']}: {r['text'][:80]!r}... chain = plain {r['chain_equals_plain']}, "
            f"ddtree = plain {r['ddtree_equals_plain']}")
    (out / "expected_greedy.json").write_text(json.dumps({"target": target_path.name,
                                                          "target_sha256": demo_export.sha256_of(target_path),
                                                          "records": records}, indent=1) + "\n")
    results["records"] = records
    save_results()
    log(f"done in {results['seconds']:.0f} s: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
