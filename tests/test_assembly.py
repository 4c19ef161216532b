"""One place assembles an engine: generate, bench and serve all go through `assembly.build_engine`, and a
wrong option fails before any weight is read, with a message naming the flag."""

from __future__ import annotations

import pytest

from lucebox_core import assembly, cli
from lucebox_core.assembly import EngineOptions, build_engine, check_options
from lucebox_core.errors import LuceboxError


@pytest.fixture
def built(monkeypatch):
    """Every EngineOptions that build_engine is called with."""
    seen: list[EngineOptions] = []
    original = assembly.build_engine

    def recording(options, **kwargs):
        seen.append(options)
        return original(options, **kwargs)

    monkeypatch.setattr(assembly, "build_engine", recording)
    return seen


def test_generate_bench_and_serve_assemble_through_one_function(tiny_target_and_draft, built, capsys):
    target, draft = tiny_target_and_draft
    assert cli.main(["generate", "-m", str(target), "--prompt-ids", "1,2,3", "-n", "3", "--temp", "0", "--json",
                     "-md", str(draft), "--spec-type", "chain", "-ub", "2"]) == 0
    assert cli.main(["bench", "-m", str(target), "-p", "4", "-n", "2", "-r", "1", "--json", "-ctk", "f16"]) == 0
    from lucebox_core.server.service import ModelService, ServeConfig

    service = ModelService(ServeConfig(model=str(target), ctx_size=64, parallel=2, kv_policy="full"))
    service.load()
    assert service.status == "ok", service.error
    service.close()
    generate, bench, serve = built
    assert (generate.model_draft, generate.spec_type, generate.prefill_chunk) == (str(draft), "chain", 2)
    assert bench.cache_type_k == "f16" and bench.ctx_size >= 4 + 2
    assert isinstance(serve, ServeConfig) and serve.parallel == 2
    assert service.engine.idle_sequences == 2 and service.engine.ctx_size == 64


def test_options_are_checked_before_loading(tiny_target_and_draft, monkeypatch, tmp_path):
    target, draft = tiny_target_and_draft

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("lucebox_core.loading.load_model", no_loading)
    cases = [
        (EngineOptions(model=str(tmp_path / "nope.gguf")), "no such file (-m/--model)"),
        (EngineOptions(model=str(target), model_draft=str(tmp_path / "d.gguf")), "-md/--model-draft"),
        (EngineOptions(model=str(target), kv_policy="paged-later"), "--kv-policy"),
        (EngineOptions(model=str(target), cache_type_k="q2_k"), "-ctk/--cache-type-k"),
        (EngineOptions(model=str(target), model_draft=str(draft), spec_type="beam"), "--spec-type"),
        (EngineOptions(model=str(target), model_draft=str(draft), tree_budget=0), "--tree-budget"),
        (EngineOptions(model=str(target), ctx_size=0), "-c/--ctx-size"),
        (EngineOptions(model=str(target), prefill_chunk=0), "-ub/--ubatch-size"),
    ]
    for options, needle in cases:
        with pytest.raises(LuceboxError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            build_engine(options)
    choices = check_options(EngineOptions(model=str(target), cache_type_k="q8_0", model_draft=str(draft)))
    assert (choices.kv_policy.name, choices.cache_type_k, choices.verifier.name) == ("full", "q8_0", "ddtree")


def test_the_drafter_is_chosen_by_the_draft_files_architecture(tiny_target_and_draft, tmp_path):
    import gguf
    import numpy as np

    target, draft = tiny_target_and_draft
    assembled = build_engine(EngineOptions(model=str(target), model_draft=str(draft), ctx_size=64))
    assert type(assembled.speculative.drafter).__name__ == "DFlashDrafter"
    foreign = tmp_path / "foreign.gguf"
    writer = gguf.GGUFWriter(str(foreign), "medusa-heads")
    writer.add_tensor("x.weight", np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(LuceboxError, match=r"foreign\.gguf: no installed drafter loads architecture 'medusa-heads'"):
        build_engine(EngineOptions(model=str(target), model_draft=str(foreign), ctx_size=64))
