"""The flags that make an engine, shared by `generate`, `bench` and `serve` (llama.cpp's names where the
meaning matches). Every flag is defined once, here, with its help; `assembly.EngineOptions.from_args`
reads them back."""

from __future__ import annotations

import argparse
from typing import Any


def comma_ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def tree_budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"the tree budget must be at least 1, got {value}")
    return value


CTX_HELP = ("context to allocate (default: what fits: the model's trained context, capped by the memory left after "
            "the weights; on the CPU at most 32768; at least 32768 for the default model)")


def add_model_arguments(p: argparse.ArgumentParser, *, ctx_help: str = CTX_HELP) -> None:
    """The model, where it runs and how its KV is kept: -m, -c, --backend, --device, --kv-policy, -ctk,
    -ctv, -ub. Names (backend, KV policy, cache types) are checked against the installed plugins when the
    engine is assembled, so a wrong one is an error that lists the choices, not an argparse usage dump."""
    p.add_argument("-m", "--model", help="GGUF file (default: the embedded default model, random weights)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help=ctx_help)
    p.add_argument("--backend", help="kernel backend (default: the available one with the highest priority)")
    p.add_argument("--device", help="torch device for the backend, e.g. cpu, cuda:0 (the same as --target-device)")
    p.add_argument("--target-device", metavar="DEV", help="torch device of the target model, e.g. cpu, cuda:1")
    p.add_argument("--target-devices", metavar="DEV,DEV",
                   help="split the target's layers across these torch devices (e.g. cuda:0,cuda:1): each layer's "
                        "weights, KV and recurrent state on its own device, the hidden state handed over between "
                        "them; a step spanning two GPUs runs without CUDA graphs for now (qwen35 and qwen35moe)")
    p.add_argument("--target-layer-split", metavar="F,F",
                   help="with --target-devices: the share of layers per device, as fractions summing to 1 "
                        "(0.5,0.5) or layer counts summing to the layer count (14,10); default even")
    p.add_argument("--draft-device", metavar="DEV",
                   help="torch device of the drafter (-md): its weights and context there, the target's features "
                        "copied to it once per step (default: the target's first device)")
    p.add_argument("--kv-policy", default="full", metavar="NAME",
                   help="how attention K/V is stored and kept resident (default full: every position; "
                        "`lucebox plugins` lists the installed policies)")
    from .kv import KV_CACHE_TYPES

    types = ", ".join(KV_CACHE_TYPES)
    p.add_argument("-ctk", "--cache-type-k", metavar="TYPE",
                   help=f"KV cache type of K: {types}, as the KV policy stores them (default: the backend's dtype)")
    p.add_argument("-ctv", "--cache-type-v", metavar="TYPE",
                   help=f"KV cache type of V: {types}, as the KV policy stores them (default: the backend's dtype)")
    p.add_argument("--spark", action="store_true", default=None,
                   help="MoE models: keep only the most routed experts on the device, the rest in host memory, "
                        "brought into a bounded pool of slots on demand; the routing profile is kept beside the "
                        "model as MODEL.gguf.spark.csv")
    p.add_argument("--spark-vram", metavar="SIZE|P%",
                   help="device memory for the resident experts with --spark: bytes (24G, 512M) or a share of the "
                        "experts' bytes (60%%) (default: 50%%)")
    p.add_argument("--spark-promote", metavar="SIZE",
                   help="with --spark: expert bytes brought into the device slots between two decode steps at "
                        "most, the most routed misses first, each only where it is routed more than the least "
                        "routed resident it evicts (default 24M; 0: the placement stays as the profile and the "
                        "prefills left it, misses are read from host memory)")
    p.add_argument("--kvflash", metavar="N|auto",
                   help="KVFlash (implies --kv-policy kvflash): attention K/V in a pool of N tokens per layer (auto: "
                        "4096, or the context if smaller), 64-token chunks paged to host memory and back; the first "
                        "and the trailing chunks stay resident; a pool at least the context is exactly `full`")
    p.add_argument("--kvflash-policy", metavar="NAME",
                   help="which chunks stay resident with --kvflash: lru (least recently written or recalled out, "
                        "the default), qk (the current query against each chunk's mean key; host chunks come "
                        "back when they score above the weakest resident one) or drafter (PFlash's scorer model "
                        "reads the sequence; the chunks its tail attention ranks highest stay or come back)")
    p.add_argument("--kvflash-tau", type=int, metavar="N",
                   help="tokens between reselections with --kvflash (default 64; drafter: at least history/45)")
    p.add_argument("--kvflash-scorer", metavar="FILE",
                   help="the scorer GGUF of --kvflash-policy drafter, loaded at its first reselection (a qwen3 "
                        "model such as Qwen3-0.6B; default: --prefill-drafter's, else the one beside -m)")
    p.add_argument("-ub", "--ubatch-size", type=int, metavar="N",
                   help="prompt tokens per prefill forward pass (default: the model's, 4096 on a GPU, 512 on "
                        "the CPU); smaller takes less memory for activations and prefills more slowly")


def add_prefix_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The prefix cache's flags (`serve`): RAM slots, the smallest prefix kept, the disk tier and its budget."""
    from .prefix_cache import DEFAULT_MIN_TOKENS, DEFAULT_SLOTS

    p.add_argument("--prefix-cache-slots", type=int, default=DEFAULT_SLOTS, metavar="N",
                   help=f"conversation prefixes kept in RAM, their state snapshotted at a turn boundary, so the next "
                        f"turn prefills only its new tokens (default {DEFAULT_SLOTS}; 0: none)")
    p.add_argument("--prefix-cache-ram", default="8G", metavar="SIZE",
                   help="most bytes the RAM slots may hold together, least recently used out first (default 8G)")
    p.add_argument("--prefix-cache-min-tokens", type=int, default=DEFAULT_MIN_TOKENS, metavar="N",
                   help=f"shortest prefix worth a snapshot (default {DEFAULT_MIN_TOKENS})")
    p.add_argument("--kv-cache-dir", metavar="DIR",
                   help="also keep the snapshots on disk, one file each under DIR/<model fingerprint>/, found "
                        "again after a restart (default: RAM only)")
    p.add_argument("--kv-cache-budget", default="4G", metavar="SIZE",
                   help="most bytes the snapshot files of --kv-cache-dir may take, least recently used out first "
                        "(default 4G; K, M, G, T are binary units)")


def add_speculative_arguments(p: argparse.ArgumentParser, *, force: bool) -> None:
    """The speculative-decoding flags: -md, --spec-type, --tree-budget, --draft-block-size (and, for
    generate and bench, --force-accept)."""
    p.add_argument("-md", "--model-draft", "--draft", dest="model_draft",
                   help="draft GGUF (e.g. a DFlash drafter): enables speculative decoding; the file's "
                        "architecture chooses the drafter")
    p.add_argument("--spec-type", default="ddtree", metavar="NAME",
                   help="the verifier: chain (one drafted block), ddtree (a best-first draft tree, the "
                        "default), or any an installed plugin provides")
    p.add_argument("--tree-budget", type=tree_budget,
                   help="drafted nodes per ddtree verify, or 'auto' (the default): the tree from the measured "
                        "verify-cost curve and the drafter's confidence, and plain decoding while drafting measures "
                        "slower than plain steps")
    p.add_argument("--draft-block-size", type=int, help="positions per draft block (default: the draft's, 16)")
    p.add_argument("--no-draft", action="store_true",
                   help="with no -m: the default model without the drafter it ships with (plain decoding)")
    if force:
        p.add_argument("--force-accept", type=float, metavar="K",
                       help="benchmark aid: replace the first K drafts per step by the target's own greedy "
                            "continuation (computed first) so exactly K are accepted; fractional K mixes "
                            "floor and ceil. Output equals plain greedy. Never a real acceptance rate.")


def check_force_accept(force: float | None, speculative: Any) -> None:
    """`--force-accept` needs a drafter, and at most a block's drafts."""
    from .errors import LuceboxError

    if force is None:
        return
    if speculative is None:
        raise LuceboxError("--force-accept needs a drafter (-md/--model-draft FILE)")
    if not 0 <= force:
        raise LuceboxError(f"--force-accept must be >= 0, got {force}")
    if force > speculative.block_size - 1:
        raise LuceboxError(f"--force-accept {force} exceeds the {speculative.block_size - 1} drafts of a block")


def add_prefill_compression_arguments(p: argparse.ArgumentParser) -> None:
    """PFlash's flags (`serve` and `generate`)."""
    p.add_argument("--prefill-compression", choices=("off", "auto", "always"), default="off",
                   help="PFlash: a small scorer model keeps the parts of the prompt that matter to the question: "
                        "of a chat, only aged messages (never the system prompt, tools, tool calls and results, "
                        "or the last user message, unless under always the protected parts alone reach the "
                        "threshold; auto then leaves the chat whole); of a raw prompt, all but its last chunks; "
                        "auto: prompts of at least --prefill-threshold tokens (default off)")
    p.add_argument("--prefill-threshold", type=int, default=32768, metavar="N",
                   help="prompt tokens from which --prefill-compression auto compresses (default 32768)")
    p.add_argument("--prefill-keep-ratio", type=float, default=0.05, metavar="F",
                   help="fraction of 32-token chunks kept (default 0.05)")
    p.add_argument("--prefill-curve", nargs="+", default=[], metavar="T:R",
                   help="keep ratio against prompt tokens, linear between points, e.g. 32768:0.1 131072:0.02")
    p.add_argument("--prefill-compressor", default="pflash", metavar="NAME",
                   help="the prefill compressor (default pflash; `lucebox plugins` lists those installed)")
    p.add_argument("--prefill-alpha", type=float, default=0.85, metavar="F",
                   help="the scorer's block-sparse attention over prompts longer than 256 tokens keeps a 128-token "
                        "key block when its score is at least F x its row's best (FlashPrefill; default 0.85)")
    p.add_argument("--prefill-drafter", metavar="FILE",
                   help="the scorer GGUF (a qwen3 model such as Qwen3-0.6B; default: the one beside -m)")
    p.add_argument("--prefill-skip-park", action="store_true",
                   help="keep the scorer loaded even where it does not fit beside the target (default: on a GPU "
                        "whose free memory cannot hold the scorer's weights and keys over the longest prompt, it "
                        "is loaded for each compression and released before the target's prefill)")
    p.add_argument("--prefill-force-park", action="store_true",
                   help="testing: park the scorer even where it fits (on the CPU too)")


def check_prefill_arguments(config: Any) -> None:
    """PFlash's numbers, files and compressor name, checked before anything is loaded (`config`: argparse
    namespace or ServeConfig: the same names)."""
    import os

    from .errors import LuceboxError
    from .prefill_compression import CompressionConfig, parse_curve

    CompressionConfig(keep_ratio=config.prefill_keep_ratio, curve=parse_curve(config.prefill_curve))
    if config.prefill_compression != "off":
        from .plugins import registry

        registry().prefill_compressor(config.prefill_compressor)  # a typo fails before the weights load
    if not 0 <= config.prefill_alpha <= 1:
        raise LuceboxError(f"--prefill-alpha must be between 0 and 1, got {config.prefill_alpha}")
    if config.prefill_threshold < 1:
        raise LuceboxError(f"--prefill-threshold must be at least 1, got {config.prefill_threshold}")
    if config.prefill_drafter is not None and not os.path.isfile(config.prefill_drafter):
        raise LuceboxError(f"{config.prefill_drafter}: no such file (--prefill-drafter)")

