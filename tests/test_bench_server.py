"""`lucebox bench-server` against the real server (a tiny model on loopback): the numbers are consistent with
each other and with what the server reported, the JSON and the table carry them, and a server that is not
there is a one-line error."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import loaded_service
from lucebox_core.bench_server import suite_requests
from lucebox_core.cli import main
from test_cli import assert_one_line_error, lucebox


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield from loaded_service(tmp_path_factory, ctx_size=4096, parallel=1)
    finally:
        torch.set_num_threads(threads)


def test_short_suite_timings_are_consistent(url, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench-server", "--url", url, "--suite", "short", "-n", "3", "--max-tokens", "8",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["requests"]
    assert len(rows) == 3 and report["suite"] == "short" and report["url"] == f"{url}/v1"
    for row in rows:
        assert row["usage_reported"] and row["prompt_tokens"] > 0
        assert 0 < row["ttft_s"] <= row["end_to_end_s"]
        # Random weights may end early on an end token, never later than asked.
        assert 1 <= row["completion_tokens"] <= 8
        assert row["finish_reason"] in ("stop", "length")
        if row["completion_tokens"] == 8:
            assert row["finish_reason"] == "length"
        if row["completion_tokens"] >= 2:
            expected = (row["completion_tokens"] - 1) / (row["end_to_end_s"] - row["ttft_s"])
            assert row["decode_tps"] == pytest.approx(expected)
    total = report["total"]
    assert total["total_completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert total["total_s"] == pytest.approx(sum(r["end_to_end_s"] for r in rows))
    assert total["mean_ttft_s"] <= total["mean_end_to_end_s"]
    table = capsys.readouterr().out
    assert "bench-server short" in table and "TTFT s" in table and "decode tok/s" in table


def test_agent_suite_prompts_are_long_and_carry_tools(url, tmp_path):
    out = tmp_path / "agent.json"
    assert main(["bench-server", "--url", f"{url}/v1", "--suite", "agent", "-n", "1", "--max-tokens", "2",
                 "--json", str(out)]) == 0
    row = json.loads(out.read_text())["requests"][0]
    assert row["prompt_tokens"] > 1500 and row["ttft_s"] <= row["end_to_end_s"]
    assert all(r.get("tools") for r in suite_requests("agent", None, 4))
    assert len(suite_requests("short", 10, 4)) == 10


def test_unreachable_server_is_a_one_line_error():
    assert_one_line_error(lucebox("bench-server", "--url", "http://127.0.0.1:9/v1", "--timeout", "5"),
                          "cannot reach http://127.0.0.1:9/v1")


def test_bad_request_count_is_a_one_line_error():
    assert_one_line_error(lucebox("bench-server", "--url", "http://127.0.0.1:9", "-n", "0"), "-n must be at least 1")
