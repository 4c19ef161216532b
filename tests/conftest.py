"""Test-session setup shared by every test module."""

import ctypes
import gc
import os
import shutil

import pytest

# Triton decides when `triton.language` is first imported whether its kernels (and its standard library's
# helpers) are compiled or interpreted. Something may import it early (transformers does), so choose for the
# whole session here: without a GPU, the interpreter. (A GPU run can export TRITON_INTERPRET=0.)
os.environ.setdefault("TRITON_INTERPRET", "1")

# -- disk: a module's temporary folders go when the module ends -------------------------------------------
# The tiny qwen35 model is ~300 MB in f32 (its real 248k-token vocabulary), and some fifty modules and tests
# write one: kept to the session's end they fill a CI disk (a run stopped at 9.5 GB with ENOSPC). A passing
# test's own `tmp_path` goes at once (`tmp_path_retention_policy = "failed"` in pyproject); this removes the
# folders a module's fixtures made with `tmp_path_factory.mktemp` once its last test is torn down. Session
# fixtures name theirs "session-..." and keep them; a module with a failure keeps everything, to look at.
SESSION_PREFIX = "session-"
_module_failed: set[str] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        _module_failed.add(item.module.__name__)
    return report


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    module = item.module.__name__
    last_of_module = nextitem is None or nextitem.module is not item.module
    if last_of_module and module not in _module_failed:
        base = item.config._tmp_path_factory.getbasetemp()
        for folder in base.iterdir():
            if folder.is_dir() and not folder.is_symlink() and not folder.name.startswith(SESSION_PREFIX):
                shutil.rmtree(folder, ignore_errors=True)
    if last_of_module:
        _return_freed_memory()
    return result


# -- memory: a module's freed memory goes back to the system when the module ends ------------------------------
# Each of CI's two pytest-xdist workers runs half the modules in one process, and glibc keeps what a module freed
# in its arenas: a worker's resident size climbed to 18 GB over a session (test_multi_device, test_static_step:
# tiny models with the real 248k-token vocabulary in f32), and two such workers on a 24 GB machine had one
# killed by the kernel's OOM killer (session 24), which then hung xdist. Collecting cycles and trimming the heap
# after each module keeps a worker near what its current module needs.
_LIBC = None


def _return_freed_memory() -> None:
    global _LIBC
    gc.collect()
    if _LIBC is False:
        return
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        _LIBC = False


@pytest.fixture(scope="session")
def tiny_target_and_draft(tmp_path_factory):
    """A tiny synthetic qwen35 target (f32, random weights) and a tiny DFlash drafter fitted to it, written
    once for every module that only needs some such pair."""
    from lucebox_qwen35 import draft_synth, synth

    folder = tmp_path_factory.mktemp(SESSION_PREFIX + "tiny-pair")
    target = synth.write(folder / "target.gguf", size="tiny", type="f32", seed=41)
    draft = draft_synth.write(folder / "draft.gguf", size="tiny", type="f32", seed=42, target=target)
    return target, draft


@pytest.fixture(scope="session")
def tiny_quantized_files(tmp_path_factory) -> dict:
    """The tiny qwen35 model written as Q8_0 and Q4_K_M (seed 0), once for the modules that read such files
    back (the synth's own checks, the parity with transformers)."""
    from lucebox_qwen35 import synth

    folder = tmp_path_factory.mktemp(SESSION_PREFIX + "tiny-quantized")
    return {t: synth.write(folder / f"tiny-{t}.gguf", size="tiny", type=t, seed=0) for t in ("q8_0", "q4_k_m")}


@pytest.fixture(scope="session")
def tiny_quantized_readers(tiny_quantized_files) -> dict:
    """`gguf.GGUFReader`s of `tiny_quantized_files`: llama.cpp's own reader, independent of Lucebox's. Each
    parses the 248k-token vocabulary into Python objects (seconds on a 2-core CPU), so once a session."""
    from gguf import GGUFReader

    return {t: GGUFReader(path) for t, path in tiny_quantized_files.items()}


# -- a served model, for the modules that drive the HTTP server -------------------------------------------
# A module defines its own `service` fixture (through `loaded_service`); `url`, `oai` and `claude` serve it.

SERVED_FAMILIES = ["qwen35", "gemma4", "laguna"]


def tiny_family_model(family: str, tmp_path_factory) -> str | None:
    """The model a served-family test runs: qwen35's is the default model (None), gemma4's and laguna's a tiny
    Q8_0 file."""
    if family == "qwen35":
        return None
    if family == "laguna":
        from lucebox_laguna import synth as laguna_synth

        return str(laguna_synth.write(tmp_path_factory.mktemp("laguna") / "tiny-q8_0.gguf", size="tiny",
                                      type="q8_0", seed=3))
    from lucebox_gemma4 import synth

    return str(synth.write(tmp_path_factory.mktemp("gemma4") / "tiny-q8_0.gguf", size="tiny", type="q8_0", seed=3))


def loaded_service(tmp_path_factory, **config):
    """A loaded `ModelService` of `ServeConfig(**config)` in a fresh LUCEBOX_HOME; closed after (a generator for
    a fixture to `yield from`)."""
    from lucebox_core.server import ModelService, ServeConfig

    patch = pytest.MonkeyPatch()
    patch.setenv("LUCEBOX_HOME", str(tmp_path_factory.mktemp("lucebox-home")))
    service = ModelService(ServeConfig(**config))
    service.load()
    assert service.status == "ok", service.error
    try:
        yield service
    finally:
        service.close()
        patch.undo()


@pytest.fixture(scope="module")
def url(service):
    from lucebox_core.server import create_app
    from lucebox_core.server.testing import ServerThread

    with ServerThread(create_app(service.config, service)) as base:
        yield base


@pytest.fixture(scope="module")
def oai(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(url):
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


class CountingDict(dict):
    """A dict that counts the entries every iteration over it visits (a planner's or a policy's scans)."""

    visited = 0

    def __iter__(self):
        self.visited += len(self)
        return super().__iter__()

    def keys(self):
        self.visited += len(self)
        return super().keys()

    def values(self):
        self.visited += len(self)
        return super().values()

    def items(self):
        self.visited += len(self)
        return super().items()


@pytest.fixture(scope="module")
def row_major_weights():
    """GGUF's row-major weights for a whole module (LUCEBOX_TILED_WEIGHTS=0; test_tiled_weights.py covers the tiled
    ones): the persistent kernels read GGUF's rows, and a weight's layout is decided at its first use."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LUCEBOX_TILED_WEIGHTS", "0")
        yield
