"""`lucebox harness install|run`: the argparse subcommand (runner.py does the work)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import LuceboxError

ALL_CLIENTS = ("codex", "claude", "opencode", "openwebui")


def _client_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(ALL_CLIENTS)
    unknown = [n for n in names if n not in ALL_CLIENTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown client {', '.join(unknown) or text!r}: choose from "
                                         f"{', '.join(ALL_CLIENTS)} or all")
    return names


def add_harness_parser(commands: Any) -> None:
    p = commands.add_parser("harness", help="install real clients (Codex, Claude Code, opencode, Open WebUI) and "
                                            "run them against a lucebox server")
    actions = p.add_subparsers(dest="harness_action", metavar="{install,run}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--work", type=Path, default=None,
                        help="work folder for the clients, their configuration and the runs "
                             "(default ./.harness-work, env LUCEBOX_HARNESS_WORK)")
    common.add_argument("--clients", type=_client_list, default=["codex", "claude", "opencode"],
                        help="comma-separated: codex, claude, opencode, openwebui, or all "
                             "(default codex,claude,opencode)")
    install = actions.add_parser("install", parents=[common], help="install the clients into the work folder")
    install.add_argument("--latest", action="store_true",
                         help="the registry's newest releases instead of the versions known to work")
    install.set_defaults(run=cmd_harness_install)
    run = actions.add_parser("run", parents=[common],
                             help="start lucebox serve on loopback and drive each client through the fixed task")
    run.add_argument("-m", "--model", help="GGUF the servers load (default: the default model)")
    run.add_argument("--json", type=Path, help="write the report (per client and phase) to this file")
    run.set_defaults(run=cmd_harness_run)
    p.set_defaults(run=lambda args: p.print_help() or 2)


def cmd_harness_install(args: argparse.Namespace) -> int:
    from .runner import default_work, npm_install

    work = args.work.resolve() if args.work else default_work()
    npm_clients = [n for n in args.clients if n != "openwebui"]
    if npm_clients:
        versions = npm_install(work, npm_clients, latest=args.latest)
        for name, version in versions.items():
            print(f"{name} {version}")
    if "openwebui" in args.clients:
        from .openwebui import install_open_webui

        print(f"openwebui {install_open_webui(work)}")
    print(f"installed into {work}", file=sys.stderr)
    return 0


def cmd_harness_run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .clients import CLIENTS
    from .runner import HarnessRun, default_work, installed_versions, report_rows

    work = args.work.resolve() if args.work else default_work()
    npm_clients = [n for n in args.clients if n != "openwebui"]
    missing = [n for n in npm_clients if n not in installed_versions(work, [n])]
    if missing:
        raise LuceboxError(f"not installed in {work}: {', '.join(missing)}; run `lucebox harness install "
                           f"--clients {','.join(missing)}` first")
    results = []
    with HarnessRun(work, [CLIENTS[n] for n in npm_clients], model=args.model) as run:
        print(f"run folder {run.out} (servers {run.answer_server.url}, {run.tool_server.url})", file=sys.stderr)
        for name in npm_clients:
            for phase in ("answer", "tool"):
                result = run.run(CLIENTS[name], phase)
                results.append(result)
                print(f"{name} {phase}: {'ok' if result.ok else 'FAILED'} ({result.seconds} s)", file=sys.stderr)
        rows = report_rows(results)
        if "openwebui" in args.clients:
            from .openwebui import run_open_webui

            rows.append(run_open_webui(work, run.answer_server, run.out))
    table = Table(title=f"lucebox harness ({run.out})")
    for column in ("client", "phase", "result", "s", "requests (path: last message shapes)"):
        table.add_column(column)
    for row in rows:
        shapes = "; ".join(f"{r['path']}: {','.join((r.get('messages') or [])[-2:])}" for r in row["requests"]
                           if r.get("messages"))
        table.add_row(row["client"], row["phase"], "ok" if row["ok"] else "; ".join(row["problems"])[:200],
                      str(row["seconds"]), shapes[:200])
    Console(stderr=True).print(table)
    report = {"run_folder": str(run.out), "code_word": run.word, "results": rows}
    (run.out / "report.json").write_text(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(row["ok"] for row in rows) else 1
