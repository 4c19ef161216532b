"""The `lucebox` command as a user runs it: exit codes, one-line errors, JSON outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
QWEN_VOCAB = FIXTURES / "vocab" / "ggml-vocab-qwen35.gguf"


def lucebox(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    environment = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "lucebox_core.cli", *args], capture_output=True, text=True, env=environment,
        timeout=timeout,
    )


def lucebox_together(*runs: tuple[str, ...], env: dict | None = None,
                     timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """`lucebox(*args)` for each of `runs`, the processes started together: a run of the tiny models is mostly
    its process's start-up (torch's import, the model's load), single-threaded, so a second core halves them.
    Each process's torch takes its share of the cores (threads past them spin against each other's)."""
    environment = dict(os.environ, **(env or {}))
    environment.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // len(runs))))
    processes = [subprocess.Popen([sys.executable, "-m", "lucebox_core.cli", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=environment) for args in runs]
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_missing_file_is_a_one_line_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    assert_one_line_error(lucebox("info", str(missing)), str(missing))


def test_not_a_gguf_is_a_one_line_error(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"NOPE" + os.urandom(64))
    assert_one_line_error(lucebox("info", str(bogus)), str(bogus))


def test_directory_instead_of_file(tmp_path):
    assert_one_line_error(lucebox("info", str(tmp_path)), str(tmp_path))


def test_info_on_vocab_only_fixture_says_no_plugin_handles_it():
    result = lucebox("info", str(QWEN_VOCAB), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["architecture"] == "qwen2"
    assert info["handled_by"] is None
    assert "no installed plugin handles architecture 'qwen2'" in info["note"]
    text = lucebox("info", str(QWEN_VOCAB))
    assert text.returncode == 0 and "qwen2" in text.stdout and "no installed plugin" in text.stdout


def test_tokenize_prints_ids_on_last_line_and_reads_files_byte_exact(tmp_path):
    from lucebox_core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(QWEN_VOCAB)
    text = "Hello world!\n  indented\tand 数字 123\n"
    result = lucebox("tokenize", "-m", str(QWEN_VOCAB), "-p", text)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == tokenizer.encode(text)
    path = tmp_path / "prompt.txt"
    path.write_bytes(text.encode())
    from_file = lucebox("tokenize", "-m", str(QWEN_VOCAB), "-f", str(path))
    assert json.loads(from_file.stdout.strip().splitlines()[-1]) == tokenizer.encode(text)
    assert tokenizer.encode(text)[-1] != tokenizer.encode(text.rstrip("\n"))[-1], "the trailing newline counts"


def test_tokenize_parse_special():
    plain = lucebox("tokenize", "-m", str(QWEN_VOCAB), "-p", "<|im_start|>user")
    special = lucebox("tokenize", "-m", str(QWEN_VOCAB), "-p", "<|im_start|>user", "--parse-special")
    plain_ids = json.loads(plain.stdout.strip().splitlines()[-1])
    special_ids = json.loads(special.stdout.strip().splitlines()[-1])
    assert len(special_ids) < len(plain_ids)
    assert special_ids[0] == 151644  # <|im_start|> in the Qwen vocabulary


def test_tokenize_bad_utf8_file(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"ok \xff\xfe")
    assert_one_line_error(lucebox("tokenize", "-m", str(QWEN_VOCAB), "-f", str(path)), str(path), "UTF-8")


def test_synth_unknown_arch_names_what_to_install(tmp_path):
    # Every family is installed here: LUCEBOX_PLUGINS leaves laguna's out, as a machine without it would be.
    result = lucebox("synth", "--arch", "laguna", "-o", str(tmp_path / "x.gguf"), env={"LUCEBOX_PLUGINS": "qwen35"})
    assert_one_line_error(result, "laguna", "lucebox-laguna")


def test_synth_bad_size_and_type(tmp_path):
    assert_one_line_error(lucebox("synth", "--arch", "qwen35", "--size", "huge", "-o", str(tmp_path / "x.gguf")), "huge")
    assert_one_line_error(lucebox("synth", "--arch", "qwen35", "--type", "q2_k", "-o", str(tmp_path / "x.gguf")), "q2_k")


def test_convert_needs_a_model_folder(tmp_path):
    assert_one_line_error(lucebox("convert", str(tmp_path), "-o", str(tmp_path / "x.gguf")), "config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    assert_one_line_error(lucebox("convert", str(tmp_path), "-o", str(tmp_path / "x.gguf")), "mystery")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny-q8_0.gguf"
    result = lucebox("synth", "--arch", "qwen35", "--size", "tiny", "--type", "q8_0", "--seed", "3", "-o", str(path))
    assert result.returncode == 0, result.stderr
    return path


def test_info_on_a_synthetic_model(tiny_model):
    info = json.loads(lucebox("info", str(tiny_model), "--json").stdout)
    assert info["architecture"] == "qwen35"
    assert info["handled_by"] == "qwen35"
    assert "RANDOM" in info["name"].upper()


def test_generate_json_greedy_and_seeded(tiny_model):
    """Greedy and seeded runs repeat in a fresh process (the four processes run side by side)."""
    args = ["generate", "-m", str(tiny_model), "--prompt-ids", "1,2,3,4", "-n", "8", "--json", "--ignore-eos"]
    greedy, again, *seeded = lucebox_together((*args, "--temp", "0"), (*args, "--temp", "0"),
                                              (*args, "--temp", "1.0", "--seed", "7"),
                                              (*args, "--temp", "1.0", "--seed", "7"))
    assert greedy.returncode == 0, greedy.stderr
    out = json.loads(greedy.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 8
    assert isinstance(out["text"], str)
    assert out["prompt_tokens_per_s"] > 0 and out["decode_tokens_per_s"] > 0
    again = json.loads(again.stdout.strip().splitlines()[-1])
    assert again["token_ids"] == out["token_ids"]
    seeded = [json.loads(run.stdout.strip().splitlines()[-1])["token_ids"] for run in seeded]
    assert seeded[0] == seeded[1]


def test_generate_rejects_prompt_over_context(tiny_model):
    ids = ",".join(["5"] * 40)
    assert_one_line_error(lucebox("generate", "-m", str(tiny_model), "--prompt-ids", ids, "-c", "32", "-n", "4"), "context")


def test_generate_ubatch_size_chunks_the_prefill(tiny_model):
    """-ub sets the prefill chunk (a 30-token prompt in chunks of 7); greedy output is that of one chunk
    (an f32 model: chunking changes rounding only). A chunk under 1 is a one-line error naming the flag."""
    ids = ",".join(str(100 + i) for i in range(30))
    args = ["generate", "-m", str(tiny_model), "--prompt-ids", ids, "-n", "6", "--json", "--ignore-eos", "--temp", "0"]
    whole, chunked, refused = lucebox_together(args, (*args, "-ub", "7"), (*args, "-ub", "0"))
    assert whole.returncode == 0 and chunked.returncode == 0, (whole.stderr, chunked.stderr)
    tokens = [json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] for r in (whole, chunked)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
    assert_one_line_error(refused, "--ubatch-size")


def test_default_model_is_reassembled_once_and_announced_with_its_drafter(tmp_path):
    env = {"LUCEBOX_HOME": str(tmp_path)}
    result = lucebox("generate", "-p", "def add(a, b):", "-n", "3", "--temp", "0", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert "trained on the Python standard library" in result.stderr
    assert "speculative decoding; --no-draft turns it off" in result.stderr
    models = sorted((tmp_path / "models").glob("*.gguf"))
    assert [m.name for m in models] == ["lucebox-demo-qwen35-stdlib-dflash-draft-q8_0.gguf",
                                        "lucebox-demo-qwen35-stdlib-q8_0.gguf"]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(answer["token_ids"]) <= 3 and answer["speculative"]
    assert answer["speculative"]["tree_budget"] == "auto"  # the demo model's own budget, unless one is asked
    # Two more runs, side by side, find the assembled files and reuse them.
    stamps = [m.stat().st_mtime_ns for m in models]
    chosen, plain = lucebox_together(("generate", "-p", "def add(a, b):", "-n", "3", "--temp", "0", "--json",
                                      "--tree-budget", "5"),
                                     ("generate", "-p", "def add(a, b):", "-n", "3", "--temp", "0", "--json",
                                      "--no-draft"), env=env)
    assert chosen.returncode == 0, chosen.stderr
    chosen_answer = json.loads(chosen.stdout.strip().splitlines()[-1])
    assert chosen_answer["speculative"]["tree_budget"] == 5 and chosen_answer["token_ids"] == answer["token_ids"]
    assert plain.returncode == 0, plain.stderr
    assert "--no-draft turns it off" not in plain.stderr
    assert [m.stat().st_mtime_ns for m in models] == stamps  # reused, not joined again
    plain_answer = json.loads(plain.stdout.strip().splitlines()[-1])
    assert not plain_answer.get("speculative") and plain_answer["token_ids"] == answer["token_ids"]


def test_bench_json(tiny_model):
    result = lucebox("bench", "-m", str(tiny_model), "-p", "16", "-n", "4", "-r", "1", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["achieved_GB_per_s"] > 0
