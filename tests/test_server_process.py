"""`lucebox serve` as a real process: the socket is up before the model, /health says so, a client
that leaves mid-stream frees its slot; a busy port, a file that is no model, and a model that cannot load
each end the process with one `error:` line and exit status 2."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import gguf
import httpx

from lucebox_core.server.testing import free_port


def start(*args: str, home) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "LUCEBOX_HOME": str(home)}
    process = subprocess.Popen([sys.executable, "-m", "lucebox_core.server", "--port", str(port), *args],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, f"http://127.0.0.1:{port}"


def stop(process: subprocess.Popen) -> str:
    if process.poll() is None:
        process.terminate()
    output, _ = process.communicate(timeout=30)
    return output


def wait_for_socket(process: subprocess.Popen, url: str, timeout: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            return httpx.get(f"{url}/health", timeout=5)
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("the server never opened its socket")


def test_health_while_loading_then_disconnect_frees_the_slot(tmp_path):
    process, url = start("-c", "4096", "-np", "1", home=tmp_path)
    try:
        first = wait_for_socket(process, url)
        statuses = [first.status_code]
        if first.status_code == 503:
            assert first.json()["status"] == "loading"
        while statuses[-1] != 200:
            time.sleep(0.1)
            statuses.append(httpx.get(f"{url}/health").status_code)
            assert process.poll() is None and len(statuses) < 1200
        # The model (written on first use into the fresh LUCEBOX_HOME) takes seconds to appear.
        assert statuses[0] == 503 and set(statuses) == {503, 200}

        # A stream that must run for 4000 tokens (`ignore_eos`: no end-of-text ends it); leave after its
        # first token.
        body = {"model": "m", "messages": [{"role": "user", "content": "Write a long story."}], "stream": True,
                "max_tokens": 4000, "temperature": 1.0, "ignore_eos": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                for line in response.iter_lines():
                    if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                        break
        # With one slot, this request could only run once the abandoned one has stopped.
        started = time.monotonic()
        quick = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        elapsed = time.monotonic() - started
        assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 2
        # The worker counts a cancellation only where it stops a generation before its end: the
        # abandoned stream stopped short of its 4000 tokens. (No wall-clock bound: on a loaded 2-core
        # machine even the quick request takes tens of seconds.)
        metrics = httpx.get(f"{url}/metrics").text
        assert re.search(r"^lucebox_cancelled_generations_total 1$", metrics, re.MULTILINE), (elapsed, metrics)
        assert re.search(r"^lucebox_running_generations 0$", metrics, re.MULTILINE)
        generated = re.search(r"^lucebox_generated_tokens_total (\d+)$", metrics, re.MULTILINE)
        assert generated and int(generated.group(1)) == 2, metrics  # the abandoned one never finished
    finally:
        output = stop(process)
    assert "Traceback" not in output, output


def serve_once(*args: str, home, timeout: float = 60) -> subprocess.CompletedProcess:
    """`lucebox serve ARGS` run to its end (a start-up failure), with its output."""
    env = {**os.environ, "LUCEBOX_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "lucebox_core.server", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2, one `error:` line on stderr and nothing else: no "listening", no log lines."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == "" and "listening" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_a_busy_port_is_one_error_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve_once("--port", str(port), home=tmp_path)
    assert_one_error_line(result, f"127.0.0.1:{port}", "address already in use")


def test_a_file_that_is_no_model_is_one_error_line(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not a model")
    assert_one_error_line(serve_once("-m", str(bogus), home=tmp_path), "bogus.gguf")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)  # the magic, then nothing that makes sense
    assert_one_error_line(serve_once("-m", str(broken), home=tmp_path), "broken.gguf")
    foreign = tmp_path / "foreign.gguf"
    write_header_only(foreign, "llama")
    assert_one_error_line(serve_once("-m", str(foreign), home=tmp_path), "foreign.gguf", "'llama'")


def write_header_only(path, architecture: str) -> None:
    """A GGUF with an architecture and nothing else: no hyper-parameters, no tensors."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_model_that_fails_while_loading_ends_the_server_with_one_error_line(tmp_path):
    # The header passes the checks made before listening (a qwen35 file); loading then finds nothing in it.
    hollow = tmp_path / "hollow.gguf"
    write_header_only(hollow, "qwen35")
    process, url = start("-m", str(hollow), home=tmp_path)
    process.wait(timeout=120)
    output = process.communicate()[0]
    assert process.returncode == 2, output
    errors = [line for line in output.splitlines() if line.startswith("error:") or line.startswith("ERROR")]
    assert errors == [line for line in output.splitlines() if line.startswith("error: cannot load the model: ")]
    assert len(errors) == 1 and "hollow.gguf" in errors[0], output
    assert "Traceback" not in output


def test_a_missing_model_file_is_refused_at_once(tmp_path):
    assert_one_error_line(serve_once("-m", str(tmp_path / "none.gguf"), home=tmp_path), "no such file")


def test_a_gemma4_model_serves_as_a_process(tmp_path):
    """The same process on a Gemma-4 file: the socket before the model, then a streamed chat through its
    template and parser, and a clean stop."""
    from lucebox_gemma4 import synth

    model = synth.write(tmp_path / "gemma4-tiny.gguf", size="tiny", type="q8_0", seed=4)
    process, url = start("-m", str(model), "-c", "256", home=tmp_path)
    try:
        wait_for_socket(process, url)
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/health").status_code != 200:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{url}/props").json()["model"]["arch"] == "gemma4"
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 6,
                "temperature": 0}
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    finally:
        output = stop(process)
    assert "Traceback" not in output, output
