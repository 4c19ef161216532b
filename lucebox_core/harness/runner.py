"""`lucebox harness install` and `run`: real clients against a real `lucebox serve` on loopback.

A run makes a scratch repository holding one file with a code word, starts two servers (each its own
`lucebox serve` process, logging every request's shape with `--log-requests`):

- the *answer* server (`--short-answers`): a random-weight model's answers end with `stop`, so each client
  accepts a whole one-shot answer;
- the *tool* server (`--short-answers` and `--force-tool-call` for each client's file-reading tool, its
  arguments pinned to the code-word file): the first turn must call the tool; the client runs it (reads the
  file) and sends the result back; the second turn answers in text.

Each client runs once against each, and the checks are about the protocol (the words are noise with random
weights): the client exited 0 and reported no error, printed an answer, streamed, got 200 for every
request, and for the tool run its tool printed the code word and its next request carried the tool result.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from ..errors import LuceboxError
from ..server.request_log import read_request_log
from ..server.testing import free_port
from .clients import CLIENTS, NPM_VERSIONS, Client

MODEL_NAME = "lucebox-test"
NOTES = "NOTES.md"
ANSWER_PROMPT = "Say hello in one short sentence."
TOOL_PROMPT = f"Read the file {NOTES} and tell me the code word in it."
# A follow-up request carries a tool's result as its last message, in the shape of the client's API.
TOOL_RESULT_SHAPES = ("tool", "user:tool_result", "function_call_output")


def default_work() -> Path:
    return Path(os.environ.get("LUCEBOX_HARNESS_WORK", ".harness-work")).resolve()


# ------------------------------------------------------------------------------------------- install

def npm_install(work: Path, names: list[str], latest: bool = False) -> dict[str, str]:
    """Install the named npm clients into `work/npm` (one `npm install`); their installed versions."""
    npm = shutil.which("npm")
    if npm is None:
        raise LuceboxError("npm is not installed (the clients are npm packages: install Node.js 20+ with npm)")
    folder = work / "npm"
    folder.mkdir(parents=True, exist_ok=True)
    specs = [f"{CLIENTS[n].npm_package}@{'latest' if latest else NPM_VERSIONS[n]}" for n in names]
    done = subprocess.run([npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund", "--loglevel=error",
                           *specs], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise LuceboxError(f"npm install {' '.join(specs)} failed: {(done.stderr or done.stdout).strip()[-800:]}")
    return installed_versions(work, names)


def installed_versions(work: Path, names: list[str]) -> dict[str, str]:
    """The version of each named client installed in `work` (clients not installed are left out)."""
    versions = {}
    for name in names:
        package = work / "npm" / "node_modules" / CLIENTS[name].npm_package / "package.json"
        if package.exists() and CLIENTS[name].executable(work).exists():
            versions[name] = json.loads(package.read_text())["version"]
    return versions


# -------------------------------------------------------------------------------------------- server

@attrs.define
class ServerProcess:
    """`lucebox serve` in a child process, on a free loopback port, logging requests to `log`."""

    extra: list[str]
    log: Path
    model: str | None = None
    port: int = attrs.field(factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300) -> "ServerProcess":
        import httpx

        command = [sys.executable, "-m", "lucebox_core.cli", "serve", "--port", str(self.port), "--model-name",
                   MODEL_NAME, "-n", "64", "--log-requests", str(self.log), *self.extra]
        if self.model:
            command += ["-m", self.model]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        stderr = (self.log.parent / f"{self.log.stem}.server.txt").open("w")
        self.process = subprocess.Popen(command, stdout=stderr, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LuceboxError(f"lucebox serve exited ({self.process.returncode}): "
                                   f"{(self.log.parent / f'{self.log.stem}.server.txt').read_text()[-800:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise LuceboxError(f"lucebox serve on {self.url} was not ready within {timeout:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def entries_since(self, start: int) -> list[dict]:
        return read_request_log(self.log)[start:]

    def entry_count(self) -> int:
        return len(read_request_log(self.log))


# ----------------------------------------------------------------------------------------------- run

def make_repo(folder: Path) -> tuple[Path, str]:
    """A scratch git repository with one file holding a fresh code word."""
    word = f"LUCEBOX-{secrets.token_hex(4).upper()}"
    repo = folder / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    (repo / NOTES).write_text(f"The code word is {word}.\n")
    (repo / "README.md").write_text("A scratch repository for `lucebox harness`.\n")
    git = shutil.which("git")
    if git:  # the agents like a repository; not needed otherwise
        env = {**os.environ, "GIT_AUTHOR_NAME": "lucebox", "GIT_AUTHOR_EMAIL": "harness@lucebox.invalid",
               "GIT_COMMITTER_NAME": "lucebox", "GIT_COMMITTER_EMAIL": "harness@lucebox.invalid"}
        for step in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "scratch"]):
            subprocess.run([git, *step], cwd=repo, env=env, capture_output=True)
    return repo, word


@attrs.define
class PhaseResult:
    client: str
    phase: str  # "answer" or "tool"
    returncode: int
    seconds: float
    answer: str
    tool_outputs: list[str]
    client_errors: list[str]
    requests: list[dict]  # the server's log entries for this phase
    problems: list[str] = attrs.Factory(list)
    output_file: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def check_phase(result: PhaseResult, word: str) -> None:
    """The protocol checks (module docstring); problems are appended to `result.problems`."""
    problems = result.problems
    if result.returncode != 0:
        problems.append(f"the client exited with status {result.returncode}")
    problems += [f"the client reported an error: {e}" for e in result.client_errors]
    if not result.answer.strip():
        problems.append("the client printed no answer")
    generating = [e for e in result.requests if e["method"] == "POST"]
    if not generating:
        problems.append("the client sent no request to the server")
    problems += [f"{e['method']} {e['path']} answered {e['status']}" for e in result.requests
                 if e["status"] is None or e["status"] >= 400]
    if generating and not all((e.get("request") or {}).get("stream") for e in generating):
        problems.append("a generation request did not stream")
    if result.phase == "tool":
        if not any(word in output for output in result.tool_outputs):
            problems.append(f"no tool the client ran printed the code word {word}")
        follow_ups = [e for e in generating if ((e.get("request") or {}).get("messages") or ["?"])[-1]
                      in TOOL_RESULT_SHAPES]
        if not follow_ups:
            problems.append("no request carried a tool result back to the server")


def run_phase(client: Client, work: Path, server: ServerProcess, repo: Path, phase: str, word: str,
              out: Path, timeout: float = 600) -> PhaseResult:
    env = {**os.environ, **client.configure(work, server.url, MODEL_NAME)}
    prompt = TOOL_PROMPT if phase == "tool" else ANSWER_PROMPT
    start, began = server.entry_count(), time.monotonic()
    try:
        done = subprocess.run(client.command(work, prompt), cwd=repo, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout)
        returncode, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, stdout = -1, (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = f"timed out after {timeout:.0f} s"
    seconds = time.monotonic() - began
    out.mkdir(parents=True, exist_ok=True)
    output_file = out / f"{client.name}-{phase}.stdout.jsonl"
    output_file.write_text(stdout)
    (out / f"{client.name}-{phase}.stderr.txt").write_text(stderr)
    outcome = client.read_output(stdout)
    result = PhaseResult(client.name, phase, returncode, round(seconds, 1), outcome.answer,
                         list(outcome.tool_outputs), list(outcome.errors), server.entries_since(start),
                         output_file=str(output_file))
    if returncode != 0 and not stdout.strip():
        result.problems.append(f"stderr: {stderr.strip()[-500:]}")
    check_phase(result, word)
    return result


@attrs.define
class HarnessRun:
    """Both servers and the scratch repository of one run (a context manager)."""

    work: Path
    clients: list[Client]
    model: str | None = None
    out: Path = attrs.field(default=None)
    repo: Path = attrs.field(default=None)
    word: str = ""
    answer_server: ServerProcess | None = None
    tool_server: ServerProcess | None = None

    def __enter__(self) -> "HarnessRun":
        self.out = self.out or self.work / "runs" / time.strftime("%Y%m%d-%H%M%S")
        self.repo, self.word = make_repo(self.out)
        forced = [a for client in self.clients for a in ("--force-tool-call", client.forced_tool_flag(self.repo, NOTES))]
        self.answer_server = ServerProcess(["--short-answers", "60"], self.out / "answer-requests.jsonl", self.model)
        self.tool_server = ServerProcess(["--short-answers", "60", *forced], self.out / "tool-requests.jsonl", self.model)
        try:
            self.answer_server.start()
            self.tool_server.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for server in (self.answer_server, self.tool_server):
            if server is not None:
                server.stop()

    def run(self, client: Client, phase: str) -> PhaseResult:
        server = self.tool_server if phase == "tool" else self.answer_server
        return run_phase(client, self.work, server, self.repo, phase, self.word, self.out)


def report_rows(results: list[PhaseResult]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        rows.append({
            "client": r.client, "phase": r.phase, "ok": r.ok, "seconds": r.seconds, "problems": r.problems,
            "answer": r.answer[:200], "tool_outputs": [o[:200] for o in r.tool_outputs],
            "requests": [{"path": e["path"], "status": e["status"], **(e.get("request") or {}),
                          "user_agent": e["client"].get("user-agent")} for e in r.requests],
        })
    return rows
