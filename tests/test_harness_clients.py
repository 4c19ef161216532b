"""Real clients against a real `lucebox serve`: Codex CLI, Claude Code and opencode from npm, Open WebUI in
headless Chromium (`lucebox harness`; runner.py says what is checked). Run them alone with `-m clients`.

The npm clients are installed once per session into the harness's work folder (`.harness-work/`, or
LUCEBOX_HARNESS_WORK), which later runs reuse; a client that cannot be installed is a skip with npm's
reason. Open WebUI's install is large (its own virtual environment, ~3 minutes), so it is done by
`lucebox harness install --clients openwebui` (CI's script runs it) and its test is skipped, with the
reason, where that has not been done. Screenshots of the browser are copied to `artifacts/`.
"""

import os
import shutil
from pathlib import Path

import pytest

from lucebox_core.errors import LuceboxError
from lucebox_core.harness import openwebui
from lucebox_core.harness.clients import CLIENTS
from lucebox_core.harness.runner import HarnessRun, default_work, installed_versions, npm_install

pytestmark = [pytest.mark.clients, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"

# What each client's follow-up request (the one carrying the tool's result) looks like, by API.
EXPECTED = {
    "codex": ("/v1/responses", "function_call_output"),
    "claude": ("/v1/messages", "user:tool_result"),
    "opencode": ("/v1/chat/completions", "tool"),
}


@pytest.fixture(scope="session")
def harness_work():
    # The repository's .harness-work (where `.ci/run` installs), wherever pytest is started from.
    work = default_work() if "LUCEBOX_HARNESS_WORK" in os.environ else ROOT / ".harness-work"
    names = list(CLIENTS)
    reason = {}
    if set(installed_versions(work, names)) != set(names):
        try:
            npm_install(work, names)
        except LuceboxError as exc:
            reason = {name: str(exc) for name in names}
    return work, reason


@pytest.fixture(scope="module")
def harness_run(harness_work, tmp_path_factory):
    work, _ = harness_work
    patch = pytest.MonkeyPatch()
    patch.setenv("LUCEBOX_HOME", str(tmp_path_factory.mktemp("lucebox-home")))  # the servers' default model
    installed = [CLIENTS[name] for name in installed_versions(work, list(CLIENTS))]
    try:
        with HarnessRun(work, installed, out=tmp_path_factory.mktemp("harness-run")) as run:
            yield run
    finally:
        patch.undo()


@pytest.mark.parametrize("name", list(CLIENTS))
def test_npm_client_answers_and_runs_a_forced_tool(name, harness_work, harness_run):
    work, reasons = harness_work
    if name not in installed_versions(work, [name]):
        pytest.skip(f"{CLIENTS[name].title} could not be installed: {reasons.get(name, 'not installed')}")
    client = CLIENTS[name]
    path, follow_up_shape = EXPECTED[name]

    answer = harness_run.run(client, "answer")
    assert answer.ok, answer.problems
    generating = [e for e in answer.requests if e["method"] == "POST"]
    assert {e["path"] for e in generating} == {path}
    assert all(e["request"]["stream"] for e in generating)

    tool = harness_run.run(client, "tool")
    assert tool.ok, tool.problems
    assert any(harness_run.word in output for output in tool.tool_outputs)  # the client ran the tool
    shapes = [e["request"]["messages"] for e in tool.requests if e["method"] == "POST" and e["path"] == path]
    first_turn = [m for m in shapes if m[-1] not in (follow_up_shape,)]
    assert first_turn, shapes  # the request that got the forced call...
    assert any(m[-1] == follow_up_shape for m in shapes), shapes  # ...and the one that sent its result back
    assert tool.answer.strip()  # the client printed the follow-up answer


def test_open_webui_chats_in_headless_chromium(harness_run):
    reason = openwebui.missing_reason(harness_run.work)
    if reason:
        pytest.skip(reason)
    row = openwebui.run_open_webui(harness_run.work, harness_run.answer_server, harness_run.out)
    ARTIFACTS.mkdir(exist_ok=True)
    kept = []
    for shot in row["screenshots"]:
        if Path(shot).exists():
            kept.append(shutil.copy(shot, ARTIFACTS / Path(shot).name))
    print(f"Open WebUI screenshots: {', '.join(map(str, kept))}")
    assert row["ok"], row["problems"]
    assert any(Path(s).name == "openwebui-chat.png" for s in kept)
    chats = [r for r in row["requests"] if r["path"] == "/v1/chat/completions" and r.get("stream")]
    assert chats and chats[0]["messages"][-1] == "user"
