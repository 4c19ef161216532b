"""The real clients the harness drives: how each is installed, configured and run non-interactively, and how
its printed events are read.

Each client's configuration is written into its own folder under the work folder (`clients/<name>/`), in
the client's own format, so a user can copy it: Codex's `config.toml`, Claude Code's `settings.json`,
opencode's `opencode.json`. Everything that would reach the internet (telemetry, update checks, model
catalogues) is switched off there; the only endpoint a client reaches is the Lucebox server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

# The versions the harness installs by default (known to work); `lucebox harness install --latest` takes
# the registry's newest instead.
NPM_VERSIONS = {"codex": "0.171.0", "claude": "2.1.197", "opencode": "1.18.33"}
MAX_OUTPUT_TOKENS = 4096  # what the clients are told they may ask for (the server caps it with -n anyway)
CONTEXT = 32768  # the context the clients are told about (the default model's, on the CPU)


@attrs.frozen
class Outcome:
    """What a client printed, read from its JSON events."""

    answer: str = ""  # the final text answer
    tool_outputs: tuple[str, ...] = ()  # what each tool the client ran returned
    errors: tuple[str, ...] = ()  # errors the client reported


@attrs.frozen
class Client:
    name: str  # the harness's name: codex, claude, opencode
    title: str
    npm_package: str
    binary: str  # in node_modules/.bin
    api: str  # the API the client speaks (for the report)
    forced_tool: str  # the client's file-reading tool, as --force-tool-call NAME=ARGS (ARGS a template)

    def folder(self, work: Path) -> Path:
        return work / "clients" / self.name

    def executable(self, work: Path) -> Path:
        return work / "npm" / "node_modules" / ".bin" / self.binary

    def forced_tool_flag(self, repo: Path, file_name: str) -> str:
        return self.forced_tool.replace("{path}", str(repo / file_name)).replace("{name}", file_name)

    def configure(self, work: Path, base_url: str, model: str) -> dict[str, str]:
        """Write the client's configuration for a server at `base_url` (no /v1) serving `model`; the
        environment to run it with."""
        return _CONFIGURE[self.name](self, self.folder(work), base_url, model)

    def command(self, work: Path, prompt: str) -> list[str]:
        return [str(self.executable(work)), *_ARGUMENTS[self.name](self, self.folder(work)), prompt]

    def read_output(self, stdout: str) -> Outcome:
        return _READ[self.name](_json_lines(stdout))


def _json_lines(text: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    return events


def _quiet_env(home: Path) -> dict[str, str]:
    """A fresh HOME and XDG folders for a client (nothing of the user's own configuration leaks in)."""
    for sub in ("", ".config", ".local/share", ".cache", ".local/state"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    return {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
            "NO_UPDATE_NOTIFIER": "1", "DO_NOT_TRACK": "1"}


# -- Codex CLI: the Responses API, a custom model provider in $CODEX_HOME/config.toml -----------------------

def _codex_configure(client: Client, folder: Path, base_url: str, model: str) -> dict[str, str]:
    home = folder / "codex-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f'''# Codex CLI against Lucebox (written by `lucebox harness`; copy it to ~/.codex/config.toml)
model = "{model}"
model_provider = "lucebox"
model_context_window = {CONTEXT}
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.lucebox]
name = "Lucebox"
base_url = "{base_url}/v1"
wire_api = "responses"   # Codex speaks only the Responses API now
env_key = "LUCEBOX_API_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false
''')
    return {**_quiet_env(folder / "home"), "CODEX_HOME": str(home), "LUCEBOX_API_KEY": "unused"}


def _codex_read(events: list[dict]) -> Outcome:
    answer, outputs, errors = "", [], []
    for event in events:
        item = event.get("item") or {}
        if event.get("type") == "item.completed" and item.get("type") == "agent_message":
            answer = item.get("text", "")
        elif event.get("type") == "item.completed" and item.get("type") == "command_execution":
            outputs.append(item.get("aggregated_output", ""))
        elif event.get("type") in ("error", "turn.failed"):
            errors.append(json.dumps(event)[:500])
    return Outcome(answer, tuple(outputs), tuple(errors))


# -- Claude Code: the Anthropic Messages API, ANTHROPIC_BASE_URL in a settings file -------------------------

def _claude_settings(base_url: str, model: str) -> dict[str, Any]:
    return {"env": {
        "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
        # Claude Code asks for 32000 output tokens by default, more than a 32K context leaves.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS), "MAX_THINKING_TOKENS": "0",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }}


def _claude_configure(client: Client, folder: Path, base_url: str, model: str) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    settings = _claude_settings(base_url, model)
    (folder / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    return {**_quiet_env(folder / "home"), **settings["env"]}


def _claude_arguments(client: Client, folder: Path) -> list[str]:
    # Only the Read tool and a one-line system prompt: Claude Code's full prompt is ~20K tokens, minutes of
    # prefill for a CPU run; the protocol is the same.
    return ["-p", "--output-format", "stream-json", "--verbose", "--settings", str(folder / "settings.json"),
            "--tools", "Read", "--allowedTools", "Read", "--max-turns", "3",
            "--system-prompt", "You are a helpful assistant. Answer briefly."]


def _claude_read(events: list[dict]) -> Outcome:
    answer, outputs, errors = "", [], []
    for event in events:
        if event.get("type") == "user":
            for block in (event.get("message") or {}).get("content") or []:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    content = block.get("content")
                    outputs.append(content if isinstance(content, str) else json.dumps(content))
        elif event.get("type") == "result":
            answer = str(event.get("result") or "")
            if event.get("is_error"):
                errors.append(answer[:500])
    return Outcome(answer, tuple(outputs), tuple(errors))


# -- opencode: OpenAI chat completions through the AI SDK's openai-compatible provider ----------------------

def _opencode_configure(client: Client, folder: Path, base_url: str, model: str) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"lucebox": {
            "npm": "@ai-sdk/openai-compatible", "name": "Lucebox",
            "options": {"baseURL": f"{base_url}/v1", "apiKey": "unused"},
            "models": {model: {"name": f"Lucebox ({model})", "limit": {"context": CONTEXT, "output": MAX_OUTPUT_TOKENS}}},
        }},
        "model": f"lucebox/{model}", "small_model": f"lucebox/{model}",
        "autoupdate": False, "share": "disabled",
        # `opencode run` turns every permission question into a refusal: allow reading, forbid changes.
        "permission": {"read": "allow", "external_directory": "allow", "edit": "deny", "bash": "deny"},
    }
    (folder / "opencode.json").write_text(json.dumps(config, indent=2) + "\n")
    # Its provider package is fetched from npm on first use into XDG_CACHE_HOME, kept across runs.
    return {**_quiet_env(folder / "home"), "OPENCODE_CONFIG": str(folder / "opencode.json"),
            "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}


def _opencode_read(events: list[dict]) -> Outcome:
    answer, outputs, errors = "", [], []
    for event in events:
        part = event.get("part") or {}
        if event.get("type") == "text":
            answer = part.get("text", "")
        elif event.get("type") == "tool_use":
            state = part.get("state") or {}
            outputs.append(str(state.get("output", "")))
        elif event.get("type") == "error":
            errors.append(json.dumps(event)[:500])
    return Outcome(answer, tuple(outputs), tuple(errors))


CLIENTS = {
    "codex": Client("codex", "Codex CLI", "@openai/codex", "codex", "Responses",
                    'exec_command={"cmd": "cat {name}"}'),
    "claude": Client("claude", "Claude Code", "@anthropic-ai/claude-code", "claude", "Anthropic Messages",
                     'Read={"file_path": "{path}"}'),
    "opencode": Client("opencode", "opencode", "opencode-ai", "opencode", "OpenAI chat",
                       'read={"filePath": "{path}"}'),
}
_CONFIGURE = {"codex": _codex_configure, "claude": _claude_configure, "opencode": _opencode_configure}
_ARGUMENTS = {
    "codex": lambda client, folder: ["exec", "--skip-git-repo-check", "--json"],
    "claude": _claude_arguments,
    "opencode": lambda client, folder: ["run", "--format", "json"],
}
_READ = {"codex": _codex_read, "claude": _claude_read, "opencode": _opencode_read}
