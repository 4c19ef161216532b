"""The `lucebox` command.

Every subcommand turns a `LuceboxError` (and an unreadable file) into one `error: ...` line on stderr
and exit status 2, without a traceback. Heavy modules are imported inside the subcommands so that
`lucebox plugins` and `lucebox --help` stay fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from . import __version__
from .errors import LuceboxError

EXIT_USAGE = 2


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=None, ensure_ascii=False))


# ----------------------------------------------------------------------------------------------- plugins


def plugins_report() -> list[dict[str, Any]]:
    """Every plugin with what it provides, as printed by `lucebox plugins --json`."""
    from .plugins import registry

    report = []
    for info in registry().plugins:
        provides = []
        for spec in info.specs:
            available, reason = spec.is_available()
            provides.append({"kind": spec.kind, "name": spec.name, "available": available, "reason": reason})
        entry = {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "module": info.module,
            "builtin": info.builtin,
            "provides": provides,
        }
        if info.error:
            entry["error"] = info.error
        report.append(entry)
    return report


def cmd_plugins(args: argparse.Namespace) -> int:
    report = plugins_report()
    if args.json:
        _print_json(report)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Lucebox plugins", show_lines=False)
    for column in ("plugin", "distribution", "version", "kind", "name", "available"):
        table.add_column(column, overflow="fold")
    for entry in report:
        if "error" in entry:
            table.add_row(entry["name"], entry["distribution"], entry["version"], "-", "-", f"[red]{entry['error']}[/red]")
        for index, item in enumerate(entry["provides"]):
            first = index == 0
            status = "yes" if item["available"] else f"no: {item['reason']}"
            table.add_row(
                entry["name"] if first else "",
                entry["distribution"] if first else "",
                entry["version"] if first else "",
                item["kind"],
                item["name"],
                status,
            )
    console = Console()
    if not console.is_terminal:  # piped: don't fold names at rich's default 80 columns
        console = Console(width=160)
    console.print(table)
    return 0


# -------------------------------------------------------------------------------------------------- info


def cmd_info(args: argparse.Namespace) -> int:
    from .errors import PluginError
    from .ggufio import describe, format_description
    from .plugins import registry

    description = describe(args.file)
    try:
        family = registry().family_for(description.get("architecture"), args.file)
        description["handled_by"] = family.name
    except PluginError as exc:
        description["handled_by"] = None
        description["note"] = str(exc).removeprefix(f"{args.file}: ")
    if args.json:
        _print_json(description)
        return 0
    print(format_description(description))
    if description["handled_by"]:
        print(f"model family: {description['handled_by']}")
    else:
        print(f"note: {description['note']}")
    return 0


# ------------------------------------------------------------------------------------------------- synth


def cmd_synth(args: argparse.Namespace) -> int:
    from .plugins import registry

    synthesizer = registry().named("lucebox_synthesizers", args.arch, "synthetic-model writer for architecture")
    if args.size not in synthesizer.sizes:
        raise LuceboxError(f"--size {args.size!r} is not one of {', '.join(synthesizer.sizes)} for {args.arch}")
    if args.type not in synthesizer.types:
        raise LuceboxError(f"--type {args.type!r} is not one of {', '.join(synthesizer.types)} for {args.arch}")
    extra = {"target": args.target} if args.target else {}
    if args.router_skew is not None:
        if "router_skew" not in synthesizer.options:
            offering = [s.name for s in registry().synthesizers() if "router_skew" in s.options]
            raise LuceboxError(f"--router-skew: the {args.arch} writer has no MoE routers to skew (these do: "
                               f"{', '.join(offering) or 'none'})")
        extra["router_skew"] = args.router_skew
    path = synthesizer.write(Path(args.output), size=args.size, type=args.type, seed=args.seed, vocab=args.vocab,
                             **extra)
    skew = f", router skew {args.router_skew:g}" if args.router_skew is not None else ""
    print(f"wrote {path} ({args.arch} {args.size} {args.type}, seed {args.seed}{skew}, RANDOM WEIGHTS)")
    return 0


# ----------------------------------------------------------------------------------------------- convert


def _hf_config(hf_dir: Path) -> dict:
    config_path = hf_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise LuceboxError(f"{config_path}: not found; is {hf_dir} a Hugging Face model folder?") from None
    except (OSError, ValueError) as exc:
        raise LuceboxError(f"{config_path}: cannot read: {exc}") from None
    if not isinstance(config, dict):
        raise LuceboxError(f"{config_path}: not a JSON object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if not isinstance(config.get("model_type") or text.get("model_type"), str):
        raise LuceboxError(f"{config_path}: no 'model_type'")
    return config


def cmd_convert(args: argparse.Namespace) -> int:
    from .errors import PluginError
    from .plugins import install_hint, registry

    hf_dir = Path(args.hf_dir)
    config = _hf_config(hf_dir)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    model_type = config.get("model_type") or text.get("model_type")
    # Converters that also name HF architectures are the more specific: they go first.
    candidates = sorted(registry().converters(), key=lambda c: not c.hf_architectures)
    converters = [c for c in candidates if c.accepts(config)]
    if not converters:
        hint = install_hint(model_type, registry().loaded_distributions)
        raise PluginError(f"{hf_dir}: no installed plugin converts model_type {model_type!r}{hint}")
    converter = converters[0]
    if args.type not in converter.types:
        raise LuceboxError(f"--type {args.type!r} is not one of {', '.join(converter.types)} for {converter.name}")
    options = {"type": args.type}
    if args.vocab is not None:
        options["vocab"] = args.vocab
    path = converter.convert(hf_dir, Path(args.output), **options)
    print(f"wrote {path} ({converter.name}: {model_type} -> GGUF {args.type})")
    return 0


# ---------------------------------------------------------------------------------------------- tokenize


def cmd_tokenize(args: argparse.Namespace) -> int:
    from .tokenizer import Tokenizer

    if args.file is not None:
        try:
            raw = Path(args.file).read_bytes()  # byte-exact: no newline stripping
        except OSError as exc:
            raise LuceboxError(f"{args.file}: cannot read: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise LuceboxError(f"{args.file}: not valid UTF-8 at byte {exc.start}") from None
    else:
        text = args.prompt
    tokenizer = Tokenizer.from_gguf(args.model)
    ids = tokenizer.encode(text, add_bos=False if args.no_bos else None, parse_special=args.parse_special)
    if args.show_pieces:
        for token_id in ids:
            print(f"{token_id:>8} -> {tokenizer.id_to_token(token_id)!r}")
    print(json.dumps(ids))
    return 0


# ---------------------------------------------------------------------------------------------- generate


def _assemble(args: argparse.Namespace, **overrides: Any) -> Any:
    """The engine the flags describe (`assembly.build_engine`: the one place engines are made)."""
    from .assembly import EngineOptions, build_engine

    options = EngineOptions.from_args(args, **overrides)
    force = getattr(args, "force_accept", None)
    if force is not None and options.model_draft is None and (options.model is not None or options.no_draft):
        raise LuceboxError("--force-accept needs a drafter (-md/--model-draft FILE)")
    if force is not None and force < 0:
        raise LuceboxError(f"--force-accept must be >= 0, got {force}")
    return build_engine(options)


def _compressed_prompt(args: argparse.Namespace, loaded: Any) -> str:
    """-p shortened by the prefill compressor when --prefill-compression asks: a raw prompt is one piece, its
    question kept by the selection's forced last chunks."""
    from .chat_compression import Piece
    from .plugins import registry

    if args.prefill_compression == "auto" and len(loaded.tokenizer.encode(args.prompt)) < args.prefill_threshold:
        return args.prompt
    compressor = registry().prefill_compressor(args.prefill_compressor).create(args, loaded)
    start = time.perf_counter()
    [text] = compressor.compress([Piece(args.prompt, protected=False)])
    print(f"prefill compression: {len(args.prompt)} -> {len(text)} characters in {time.perf_counter() - start:.2f} s",
          file=sys.stderr)
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import GenerationRequest
    from .flags import check_force_accept
    from .sampling import SamplingParams

    from .flags import check_prefill_arguments

    check_prefill_arguments(args)
    assembled = _assemble(args)
    loaded, engine, speculative = assembled.loaded, assembled.engine, assembled.speculative
    check_force_accept(args.force_accept, speculative)
    tokenizer = loaded.tokenizer
    if args.prompt is not None and args.prefill_compression != "off":
        args.prompt = _compressed_prompt(args, loaded)
    if args.prompt_ids is not None:
        prompt_ids = args.prompt_ids
        if any(not 0 <= i < tokenizer.vocab_size for i in prompt_ids):
            raise LuceboxError(f"--prompt-ids: every id must be in [0, {tokenizer.vocab_size})")
    elif args.chat:
        if loaded.chat_template is None:
            raise LuceboxError(f"{loaded.path}: has no chat template; pass --chat-template-file")
        from .chat_prompt import render_chat

        # The user's text stays text unless --parse-special: only the template's markup is control tokens.
        rendered = render_chat(loaded.chat_template, tokenizer, [{"role": "user", "content": args.prompt}],
                               add_generation_prompt=True, user_control_tokens=args.parse_special)
        prompt_ids = rendered.encode(tokenizer)
    else:
        prompt_ids = tokenizer.encode(args.prompt, parse_special=args.parse_special)
    if not prompt_ids:
        raise LuceboxError("the prompt is empty")
    sampling = SamplingParams.from_gguf_defaults(
        loaded.gguf.metadata,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )
    request = GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=args.n_predict, sampling=sampling, stop=args.stop or (),
        ignore_eos=args.ignore_eos,
    )
    if args.force_accept is not None:
        if not sampling.greedy:
            raise LuceboxError("--force-accept needs greedy decoding (--temp 0)")
        import attrs

        # The plain greedy continuation, one block past the end so the last step is forced like the others.
        reference = engine.generate(
            attrs.evolve(request, speculative=False, max_tokens=args.n_predict + speculative.block_size)
        )
        request = attrs.evolve(request, force_accept=args.force_accept, force_reference=reference.token_ids)
    if args.json:
        result = engine.generate(request)
        spec_info = {}
        if speculative is not None:
            spec_info = {
                "accepted_lengths": result.timings.accepted_lengths,
                "mean_accepted_length": round(result.timings.mean_accepted_length, 3),
                "speculative": speculative.describe(),
                "forced_accept": args.force_accept,
                # Tokens this request decoded plainly on the governor's word (drafting measured slower).
                "governed_plain_tokens": result.timings.governed_plain_tokens,
            }
        _print_json(
            {
                "token_ids": result.token_ids,
                "text": result.text,
                "finish_reason": result.finish_reason,
                "prompt_ids": list(prompt_ids),
                "prompt_tokens": result.timings.prompt_tokens,
                "generated_tokens": len(result.token_ids),
                "prompt_tokens_per_s": round(result.timings.prompt_tokens_per_s, 3),
                "decode_tokens_per_s": round(result.timings.decode_tokens_per_s, 3),
                "backend": loaded.backend_name,
                **spec_info,
            }
        )
        return 0
    from .engine import Timings

    timings = Timings()
    finish = "length"
    for step in engine.stream(engine.new_sequence(), request, timings):
        sys.stdout.write(step.text)
        sys.stdout.flush()
        finish = step.finish_reason or finish
    sys.stdout.write("\n")
    accepted = ""
    if timings.accepted_lengths:
        forced = " FORCED" if args.force_accept is not None else ""
        accepted = f", {timings.mean_accepted_length:.2f} tokens per verify{forced}"
        if timings.governed_plain_tokens:
            accepted += f", {timings.governed_plain_tokens} tokens plain (drafting measured slower)"
    print(
        f"[{finish}] prompt {timings.prompt_tokens} tokens at {timings.prompt_tokens_per_s:.1f} tok/s, "
        f"generated {timings.decode_tokens} tokens at {timings.decode_tokens_per_s:.1f} tok/s ({loaded.backend_name})"
        f"{accepted}",
        file=sys.stderr,
    )
    return 0


# ------------------------------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import DECODE_WARMUP_STEPS, SPEC_PROMPT_TOKENS, format_bench, run_bench
    from .flags import check_force_accept

    if args.reps < 1:
        raise LuceboxError(f"-r/--reps must be at least 1, got {args.reps}")
    # Room for the longest test, and the decode warm-up past depth + n_gen; with a drafter, the speculative
    # row's prompt, its tokens and one more drafted block and tree (at most 64 + 65 positions).
    spec = SPEC_PROMPT_TOKENS + args.n_gen + 129 if getattr(args, "model_draft", None) else 0
    ctx = max(args.ctx_size or 0, max(args.n_prompt or [0]) + 1, max(args.depth or [0]) + args.n_gen + 1, spec)
    assembled = _assemble(args, ctx_size=ctx + DECODE_WARMUP_STEPS)
    check_force_accept(args.force_accept, assembled.speculative)
    rows = run_bench(assembled, prompts=args.n_prompt, n_gen=args.n_gen, depths=args.depth, reps=args.reps,
                     force_accept=args.force_accept)
    if args.json:
        _print_json(rows)
    else:
        print(format_bench(assembled.loaded, rows))
    return 0


# ---------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from .flags import add_model_arguments, add_speculative_arguments, comma_ints

    parser = argparse.ArgumentParser(prog="lucebox", description="Lucebox: fast local LLM inference.")
    parser.add_argument("--version", action="version", version=f"lucebox {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = commands.add_parser("plugins", help="list installed plugins and what each provides")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(run=cmd_plugins)

    p = commands.add_parser("info", help="describe a GGUF file (architecture, sizes, tensor types, tokenizer)")
    p.add_argument("file", help="GGUF file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=cmd_info)

    p = commands.add_parser("synth", help="write a random-weight GGUF with a family's exact layout")
    p.add_argument("--arch", required=True, help="architecture, e.g. qwen35")
    p.add_argument("--size", default="tiny", help="tiny, 0.8b, 27b (what the family offers)")
    p.add_argument("--type", default="f32", help="f32, f16, q8_0, q4_k_m (what the family offers)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--vocab", help="tokenizer GGUF to take the vocabulary from (default: the family's)")
    p.add_argument("--target", help="for drafter architectures: the target GGUF the drafter must fit")
    p.add_argument("--router-skew", type=float, metavar="F",
                   help="MoE files: routers biased toward a fixed hot set of 35%% of each layer's experts, which "
                        "then take about F of the routed picks (default: random routers, close to uniform)")
    p.add_argument("-o", "--output", required=True, help="GGUF file to write")
    p.set_defaults(run=cmd_synth)

    p = commands.add_parser("convert", help="convert a Hugging Face checkpoint folder to GGUF")
    p.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    p.add_argument("-o", "--output", required=True, help="GGUF file to write")
    p.add_argument("--type", default="f16", help="f32, f16, bf16, q8_0 (default f16)")
    p.add_argument("--vocab", help="tokenizer GGUF to take tokenizer metadata from when the folder has none")
    p.set_defaults(run=cmd_convert)

    p = commands.add_parser("tokenize", help="print the token ids of a text as a JSON list (last line)")
    p.add_argument("-m", "--model", required=True, help="GGUF file (only tokenizer metadata is read)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("-p", "--prompt", help="text to tokenize")
    source.add_argument("-f", "--file", help="file to tokenize, read byte for byte")
    p.add_argument("--no-bos", action="store_true", help="never add BOS (default: as the GGUF says)")
    p.add_argument("--parse-special", action="store_true", help="turn control-token text into its ids")
    p.add_argument("--show-pieces", action="store_true", help="also print each id with its token text")
    p.set_defaults(run=cmd_tokenize)

    p = commands.add_parser("generate", help="generate text from a prompt")
    add_model_arguments(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=comma_ints, help="prompt as token ids, e.g. 1,2,3")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--chat", action="store_true", help="render -p as a user message through the chat template")
    from .flags import add_prefill_compression_arguments

    add_prefill_compression_arguments(p)
    p.add_argument("--chat-template-file", help="jinja chat template to use instead of the GGUF's")
    p.add_argument("--parse-special", action="store_true",
                   help="turn control-token text in -p into its ids (with --chat too; otherwise it stays text)")
    p.add_argument("--temp", type=float, help="temperature; 0 is greedy (default 0.8 or the GGUF's)")
    p.add_argument("--top-k", type=int, help="keep the k most likely tokens; 0 is off (default 40)")
    p.add_argument("--top-p", type=float, help="keep the smallest set with this much mass; 1 is off (default 0.95)")
    p.add_argument("--min-p", type=float, help="drop tokens below this fraction of the best; 0 is off (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, help="penalise recent tokens (1 is off, the default)")
    p.add_argument("--presence-penalty", type=float, help="subtract from tokens seen recently (default 0)")
    p.add_argument("--frequency-penalty", type=float, help="subtract per occurrence (default 0)")
    p.add_argument("--seed", type=int, help="random seed; the same seed gives the same tokens")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object (ids, text, speeds) instead of text")
    add_speculative_arguments(p, force=True)
    p.set_defaults(run=cmd_generate)

    p = commands.add_parser("bench", help="measure prompt and decode speed, like llama-bench")
    add_model_arguments(p, ctx_help="least context to allocate (default and raised to: what the longest test needs)")
    p.add_argument("-p", "--n-prompt", type=comma_ints, default=[512], help="prompt lengths (default 512)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="tokens to decode per test (default 128)")
    p.add_argument("-d", "--depth", type=comma_ints, default=[0], help="context depths for decode (default 0)")
    p.add_argument("-r", "--reps", type=int, default=3, help="repetitions; medians are reported (default 3)")
    p.add_argument("--json", action="store_true", help="print a JSON list of results")
    add_speculative_arguments(p, force=True)
    p.set_defaults(run=cmd_bench)

    from .server.cli import add_serve_parser  # the server's subcommand lives with the server

    add_serve_parser(commands)
    from .bench_server import add_bench_server_parser
    from .harness.cli import add_harness_parser

    add_bench_server_parser(commands)
    add_harness_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.run(args) or 0)
    except LuceboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
