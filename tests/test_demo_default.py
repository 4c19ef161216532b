"""The shipped demo pair (issue #22): the default model and its drafter, trained by `scripts/train_demo.py` on the
H200 and committed as parts in lucebox-qwen's package data. Their checksums hold, they reassemble into files
Lucebox loads, and the held-out prompts recorded at training time give the same greedy tokens here, plain and
through the drafter with both verifiers: a regression check on the whole stack (tokenizer, loader, Q8_0
products, Gated DeltaNet, attention, sampler, drafter, verifiers) against what the trained files did then."""

from __future__ import annotations

import gzip
import hashlib
import json

import pytest

from lucebox_qwen35 import default

PARTS = default.demo_parts_folder()
MANIFEST = json.loads((PARTS / "manifest.json").read_text())
RECORDS = json.loads((PARTS / "expected_greedy.json").read_text())


def test_every_shipped_part_matches_its_manifest_checksum():
    names = {entry["name"] for entry in MANIFEST["files"]}
    assert names == {default.DEMO_TARGET, default.DEMO_DRAFT}
    assert MANIFEST["encoding"] == "gzip"
    for entry in MANIFEST["files"]:
        stored = b""
        for part in entry["parts"]:
            data = (PARTS / part["name"]).read_bytes()
            assert len(data) == part["bytes"] and len(data) <= 16 * 1024 * 1024
            assert hashlib.sha256(data).hexdigest() == part["sha256"], part["name"]
            stored += data
        assert len(stored) == entry["stored_bytes"]
        whole = gzip.decompress(stored)
        assert len(whole) == entry["bytes"] and hashlib.sha256(whole).hexdigest() == entry["sha256"]
    target = next(e for e in MANIFEST["files"] if e["name"] == default.DEMO_TARGET)
    assert RECORDS["target_sha256"] == target["sha256"]  # the records are of this very file


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from lucebox_core.assembly import load_drafter
    from lucebox_core.loading import load_model

    home = tmp_path_factory.mktemp("home")
    target, draft = default.provide_trained(home), default.provide_trained_draft(home)
    loaded = load_model(target, backend="torch", device="cpu")
    return loaded, load_drafter(str(draft), loaded.model, loaded.backend)


def test_the_pair_loads_and_says_what_it_is(pair):
    loaded, drafter = pair
    assert loaded.gguf.architecture == "qwen35"
    assert loaded.gguf.get("lucebox.train.role", str) == "target"
    assert "standard library" in loaded.gguf.get("general.description", str)
    assert loaded.gguf.metadata["tokenizer.ggml.tokens"].__len__() == 248320
    assert drafter.config.target_layer_ids and drafter.config.block_size == 16
    assert loaded.path.stat().st_size <= 40_000_000  # the size limit


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, "chain", "ddtree"])
def test_recorded_prompts_give_the_recorded_greedy_tokens(pair, spec):
    from lucebox_core.engine import Engine, GenerationRequest
    from lucebox_core.sampling import SamplingParams
    from lucebox_core.speculative import SpeculativeDecoder

    loaded, drafter = pair
    speculative = None if spec is None else SpeculativeDecoder(loaded.model, drafter, spec, budget=22)
    engine = Engine(loaded.model, loaded.tokenizer, ctx_size=1024, speculative=speculative)
    records = RECORDS["records"]
    assert len(records) >= 3
    for record in records:
        assert loaded.tokenizer.encode(record["prompt"], add_bos=False) == record["prompt_ids"]
        request = GenerationRequest(prompt_ids=record["prompt_ids"], max_tokens=len(record["token_ids"]),
                                    sampling=SamplingParams(temperature=0))
        result = engine.generate(request)
        assert list(result.token_ids) == record["token_ids"], (record["file"], record["function"], spec)
        assert result.text == record["text"]
