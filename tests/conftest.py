"""Test-session setup shared by every test module."""

import os

import pytest

# Triton decides when `triton.language` is first imported whether its kernels (and its standard library's
# helpers) are compiled or interpreted. Something may import it early (transformers does), so choose for the
# whole session here: without a GPU, the interpreter. (A GPU run can export TRITON_INTERPRET=0.)
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_target_and_draft(tmp_path_factory):
    """A tiny synthetic qwen35 target (f32, random weights) and a tiny DFlash drafter fitted to it, written
    once for every module that only needs some such pair."""
    from lucebox_qwen35 import draft_synth, synth

    folder = tmp_path_factory.mktemp("tiny-pair")
    target = synth.write(folder / "target.gguf", size="tiny", type="f32", seed=41)
    draft = draft_synth.write(folder / "draft.gguf", size="tiny", type="f32", seed=42, target=target)
    return target, draft
