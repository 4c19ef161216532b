"""`lucebox harness` as a user first meets it: what it says when the clients are not installed yet, or a
client name is wrong (the runs themselves: tests/test_harness_clients.py)."""

from __future__ import annotations

from test_cli import assert_one_line_error, lucebox


def test_run_before_install_says_what_to_run(tmp_path):
    result = lucebox("harness", "run", "--work", str(tmp_path), "--clients", "codex,claude")
    assert_one_line_error(result, f"not installed in {tmp_path}: codex, claude",
                          "lucebox harness install --clients codex,claude")


def test_unknown_client_is_a_usage_error(tmp_path):
    result = lucebox("harness", "install", "--work", str(tmp_path), "--clients", "codex,aider")
    assert result.returncode == 2 and "unknown client 'aider'" in result.stderr and "Traceback" not in result.stderr


def test_harness_without_an_action_prints_its_usage():
    result = lucebox("harness")
    assert result.returncode == 2 and "{install,run}" in result.stdout
