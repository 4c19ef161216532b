"""The README's examples, run as written against a real `lucebox serve` on loopback.

The blocks marked `<!-- readme-test: run -->` are taken from README.md and run in order: a `lucebox serve`
line starts the server (in the background, as a user's terminal would hold it), every other shell line runs
in bash, a python block runs in a fresh interpreter. Two departures, the only ones: a line naming a GGUF
file that does not exist here (a real model such as Qwen3.6-27B) is skipped, and when port 8000 is taken on
this machine, the server line gets `--port P` and every `127.0.0.1:8000` in the examples becomes
`127.0.0.1:P`. LUCEBOX_HOME is a fresh folder (the default model is written there on first use)."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lucebox_core.server.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def marked_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block right after a `readme-test: run` marker."""
    return re.findall(r"<!-- readme-test: run -->\n```(\w+)\n(.*?)\n```", text, flags=re.S)


def shell_lines(code: str) -> list[str]:
    """Commands of a bash block: continuation lines joined, comments kept (bash ignores them)."""
    return [line.strip() for line in code.replace("\\\n", " ").splitlines() if line.strip()]


def names_missing_gguf(line: str) -> bool:
    words = shlex.split(line, comments=True)
    return any(w.endswith(".gguf") and not Path(w).exists() for w in words)


def port_8000_free() -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", 8000))
            return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    bin_dir = str(Path(sys.executable).parent)  # `lucebox` of this environment first on PATH
    return {**os.environ, "LUCEBOX_HOME": str(tmp_path_factory.mktemp("lucebox-home")),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_readme_examples_run_as_written(environment, tmp_path):
    blocks = marked_blocks((ROOT / "README.md").read_text())
    assert [language for language, _ in blocks] == ["bash", "bash", "python", "bash"], blocks
    port = 8000 if port_8000_free() else free_port()

    def as_here(text: str) -> str:
        return text if port == 8000 else text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")

    server = None
    outputs = []
    try:
        for language, code in blocks:
            if language == "python":
                done = subprocess.run([sys.executable, "-c", as_here(code)], env=environment, capture_output=True,
                                      text=True, timeout=300, cwd=tmp_path)
                assert done.returncode == 0, done.stderr
                outputs.append(done.stdout)
                continue
            for line in shell_lines(code):
                if names_missing_gguf(line):
                    continue
                if line.startswith("lucebox serve"):
                    assert server is None, "one server line is expected"
                    command = shlex.split(line, comments=True) + ([] if port == 8000 else ["--port", str(port)])
                    server = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
                    wait_ready(server, port)
                    continue
                done = subprocess.run(["bash", "-c", as_here(line)], env=environment, capture_output=True,
                                      text=True, timeout=300, cwd=tmp_path)
                assert done.returncode == 0, (line, done.stderr)
                outputs.append(done.stdout)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=20)
    assert server is not None
    curl, python, generate = outputs
    assert '"object":"chat.completion"' in curl.replace(" ", "") and '"completion_tokens"' in curl
    assert python.strip()  # the message's text (noise: random weights)
    assert generate.strip()


def wait_ready(server: subprocess.Popen, port: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"lucebox serve exited: {server.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("lucebox serve was not ready in time")
