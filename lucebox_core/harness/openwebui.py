"""Open WebUI in headless Chromium against the harness's answer server.

Open WebUI is a Python package with heavy dependencies (it pulls torch through sentence-transformers), so
it gets its own virtual environment under the work folder, with torch pinned to the CPU build so pip never
fetches a multi-GB CUDA one. The browser is the system's Chromium (Debian's `chromium`), driven by npm's
`playwright-core` through `openwebui_chat.js`: the page loads, one message is sent, the answer arrives, and
screenshots are kept in the run folder.

Open WebUI runs without login (`WEBUI_AUTH=False`), offline (no model downloads, no update checks, no
telemetry), with Lucebox as its only OpenAI connection.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import LuceboxError
from ..server.testing import free_port

OPEN_WEBUI_VERSION = "0.12.4"
PLAYWRIGHT_VERSION = "1.65.1"
# The CPU torch wheel: an unpinned torch would be a multi-GB CUDA build.
TORCH_CONSTRAINT = "torch==2.13.0"
MESSAGE = "Hello from the Lucebox harness"


def venv(work: Path) -> Path:
    return work / "openwebui" / "venv"


def chromium() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def installed_version(work: Path) -> str | None:
    """Open WebUI's version in the work folder, None when it or playwright-core is not installed."""
    if not (venv(work) / "bin" / "open-webui").exists():
        return None
    if not (work / "npm" / "node_modules" / "playwright-core" / "package.json").exists():
        return None
    found = list((venv(work) / "lib").glob("python*/site-packages/open_webui-*.dist-info"))
    return found[0].name[len("open_webui-"):-len(".dist-info")] if found else "?"


def missing_reason(work: Path) -> str | None:
    """Why the Open WebUI run cannot happen here (None: it can)."""
    if installed_version(work) is None:
        return f"Open WebUI is not installed in {work} (run `lucebox harness install --clients openwebui`)"
    if chromium() is None:
        return "no Chromium (install Debian's `chromium`, or set CHROMIUM to a Chromium binary)"
    if shutil.which("node") is None:
        return "no node (Node.js 20+ runs playwright-core)"
    return None


def install_open_webui(work: Path) -> str:
    folder = work / "openwebui"
    folder.mkdir(parents=True, exist_ok=True)
    constraints = folder / "constraints.txt"
    constraints.write_text(TORCH_CONSTRAINT + "\n")
    if not (venv(work) / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv(work))], check=True)
    done = subprocess.run([str(venv(work) / "bin" / "python"), "-m", "pip", "install", "--quiet", "-c",
                           str(constraints), f"open-webui=={OPEN_WEBUI_VERSION}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise LuceboxError(f"pip install open-webui failed: {(done.stderr or done.stdout).strip()[-800:]}")
    npm = shutil.which("npm")
    if npm is None:
        raise LuceboxError("npm is not installed (the browser is driven by npm's playwright-core)")
    done = subprocess.run([npm, "install", "--prefix", str(work / "npm"), "--no-audit", "--no-fund",
                           "--loglevel=error", f"playwright-core@{PLAYWRIGHT_VERSION}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise LuceboxError(f"npm install playwright-core failed: {(done.stderr or done.stdout).strip()[-800:]}")
    if chromium() is None:
        print("note: no Chromium found; install Debian's `chromium` for the browser run", file=sys.stderr)
    return installed_version(work) or "?"


def open_webui_env(work: Path, base_url: str, data: Path) -> dict[str, str]:
    """Open WebUI's settings: Lucebox as its only connection, no login, nothing fetched from the internet."""
    return {
        "DATA_DIR": str(data), "WEBUI_AUTH": "False", "WEBUI_SECRET_KEY": "lucebox-harness",
        "OPENAI_API_BASE_URL": f"{base_url}/v1", "OPENAI_API_KEY": "unused", "ENABLE_OLLAMA_API": "False",
        "OFFLINE_MODE": "True", "HF_HUB_OFFLINE": "1", "ENABLE_VERSION_UPDATE_CHECK": "False",
        "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False", "ANONYMIZED_TELEMETRY": "False", "SCARF_NO_ANALYTICS": "true",
        "DO_NOT_TRACK": "true", "HOME": str(data / "home"),
    }


def run_open_webui(work: Path, server: Any, out: Path, timeout: float = 300) -> dict[str, Any]:
    """Serve Open WebUI against `server` (a runner.ServerProcess), chat once in Chromium; a report row."""
    import httpx

    reason = missing_reason(work)
    row: dict[str, Any] = {"client": "openwebui", "phase": "answer", "ok": False, "seconds": 0.0, "problems": [],
                           "answer": "", "tool_outputs": [], "requests": [], "screenshots": []}
    if reason:
        row["problems"].append(reason)
        return row
    data = out / "openwebui-data"
    (data / "home").mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = (out / "openwebui.server.txt").open("w")
    process = subprocess.Popen([str(venv(work) / "bin" / "open-webui"), "serve", "--host", "127.0.0.1", "--port",
                                str(port)], env={**os.environ, **open_webui_env(work, server.url, data)},
                               stdout=log, stderr=subprocess.STDOUT, cwd=data)
    began = time.monotonic()
    try:
        deadline = began + timeout
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                row["problems"].append(f"Open WebUI did not start (see {out / 'openwebui.server.txt'})")
                return row
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        start = server.entry_count()
        script = Path(__file__).with_name("openwebui_chat.js")
        done = subprocess.run(["node", str(script), f"http://127.0.0.1:{port}", MESSAGE, str(out / "openwebui")],
                              env={**os.environ, "NODE_PATH": str(work / "npm" / "node_modules"),
                                   "CHROMIUM": chromium() or ""},
                              capture_output=True, text=True, timeout=timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"error": done.stderr[-500:]}
        requests = server.entries_since(start)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
    row["seconds"] = round(time.monotonic() - began, 1)
    row["answer"] = result.get("answer", "")
    row["screenshots"] = result.get("screenshots", [])
    row["requests"] = [{"path": e["path"], "status": e["status"], **(e.get("request") or {}),
                        "user_agent": e["client"].get("user-agent")} for e in requests]
    problems = row["problems"]
    if result.get("error"):
        problems.append(f"browser: {result['error']}")
    if not result.get("loaded"):
        problems.append("the page did not load")
    if not row["answer"]:
        problems.append("no answer appeared in the page")
    chats = [r for r in row["requests"] if r["path"] == "/v1/chat/completions"]
    if not any(r.get("stream") and r["status"] == 200 for r in chats):
        problems.append("Open WebUI sent no streaming chat request that was answered 200")
    problems += [f"{r['path']} answered {r['status']}" for r in row["requests"] if (r["status"] or 500) >= 400]
    row["ok"] = not problems
    return row
