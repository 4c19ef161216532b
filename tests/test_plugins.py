"""The plugin system: built-ins, entry-point discovery, LUCEBOX_PLUGINS, broken plugins, every hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import lucebox_core
from lucebox_core import hookspecs
from lucebox_core.errors import PluginError
from lucebox_core.plugins import discover

TESTS = Path(__file__).parent


def test_every_hook_has_a_test():
    """Datasette's rule: a hook no test names is a hook nobody checks."""
    hooks = [name for name in dir(hookspecs) if name.startswith("lucebox_")]
    assert len(hooks) >= 8
    test_sources = "\n".join(p.read_text() for p in TESTS.glob("test_*.py") if p.name != "test_plugins.py")
    here = Path(__file__).read_text().split("def test_every_hook_has_a_test", 1)[1].split("\n", 3)[3]
    untested = [hook for hook in hooks if hook not in test_sources and hook not in here]
    assert not untested, f"hooks without a test: {untested}"


def test_builtins_always_load_even_when_plugins_are_restricted():
    registry = discover(allowed="nothing-by-this-name")
    assert [p.name for p in registry.plugins] == ["builtin"]
    assert [b.name for b in registry.kernel_backends()] == ["torch"]
    assert [k.name for k in registry.kv_policies()] == ["full"]


def test_lucebox_kernel_backends_builtin_torch_is_the_fallback():
    registry = discover()
    backend = registry.kernel_backend()
    assert backend.name == "torch" or backend.priority > 0
    torch_backend = registry.kernel_backend("torch")
    ops = torch_backend.create(device="cpu")
    import torch

    x = torch.randn(3, 8)
    w = torch.rand(8) + 0.5
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), expected)
    with pytest.raises(PluginError, match="no installed plugin provides the kernel backend 'nope'"):
        registry.kernel_backend("nope")


def test_lucebox_kv_policies_full_is_builtin():
    registry = discover()
    policy = registry.named("lucebox_kv_policies", "full", "KV policy")
    assert policy.is_available() == (True, "")
    assert policy.create is not None


def test_lucebox_model_families_qwen35_and_install_hints():
    registry = discover()
    family = registry.family_for("qwen35")
    assert family.name == "qwen35"
    with pytest.raises(PluginError, match=r"'gemma4'.*install lucebox-gemma4"):
        registry.family_for("gemma4", "model.gguf")
    with pytest.raises(PluginError, match="'qwen35'.*install lucebox-qwen"):
        discover(allowed="").family_for("qwen35")


def test_family_tools_come_from_hooks():
    """lucebox_synthesizers, lucebox_converters, lucebox_default_models: provided by lucebox-qwen."""
    registry = discover()
    assert "qwen35" in [s.name for s in registry.synthesizers()]
    assert any("qwen3_5" in c.model_types for c in registry.converters())
    assert registry.default_models(), "lucebox-qwen provides a default model"
    bare = discover(allowed="")
    assert bare.synthesizers() == [] and bare.default_models() == []
    # The core converts only what it owns itself (DFlash drafter checkpoints), never a model family.
    assert [c.name for c in bare.converters()] == ["dflash"]
    assert not bare.converters()[0].accepts({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    assert bare.converters()[0].accepts({"model_type": "qwen3", "architectures": ["DFlashDraftModel"]})


def test_lucebox_plugins_json_lists_every_plugin():
    out = subprocess.run(
        [sys.executable, "-m", "lucebox_core.cli", "plugins", "--json"], capture_output=True, text=True, check=True
    ).stdout
    report = json.loads(out)
    by_name = {p["name"]: p for p in report}
    assert by_name["builtin"]["distribution"] == "lucebox-core"
    assert by_name["builtin"]["version"] == lucebox_core.__version__
    assert by_name["qwen35"]["distribution"] == "lucebox-qwen"
    kinds = {(item["kind"], item["name"]) for item in by_name["qwen35"]["provides"]}
    assert ("model", "qwen35") in kinds and ("synth", "qwen35") in kinds
    for plugin in report:
        for item in plugin["provides"]:
            assert set(item) == {"kind", "name", "available", "reason"}


# --------------------------------------------------------------------------- a third-party package

TOY_PLUGIN = '''
"""A third party's plugin: a kernel backend, a model family, a drafter and a verifier."""
from lucebox_core import Drafter, KernelBackend, ModelFamily, Verifier, hookimpl
from lucebox_core.torch_backend import TorchBackend


class ToyBackend(TorchBackend):
    """The reference ops, counting rms_norm calls so the test can see the toy backend was used."""
    calls = 0

    def rms_norm(self, x, weight, eps):
        ToyBackend.calls += 1
        return super().rms_norm(x, weight, eps)


class ToyModel:
    def __init__(self, gguf_file, backend):
        self.architecture = gguf_file.architecture
        self.width = gguf_file.get("toyarch.width", type=int)
        self.backend = backend


def load(gguf_file, backend, **options):
    return ToyModel(gguf_file, backend)


@hookimpl
def lucebox_kernel_backends():
    return [KernelBackend(name="toy", factory=ToyBackend, priority=100, description="test backend")]


@hookimpl
def lucebox_model_families():
    return [ModelFamily(name="toy", architectures=["toyarch"], loader=load)]


@hookimpl
def lucebox_drafters():
    return [Drafter(name="toy-draft", factory=lambda: "toy drafter", architectures=["toy-draft"])]


@hookimpl
def lucebox_verifiers():
    return [Verifier(name="toy-verify", factory=lambda: "toy verifier")]
'''

USE_TOY = '''
import json, sys
import torch
from lucebox_core.ggufio import GGUFFile
from lucebox_core.plugins import registry
r = registry()
backend_spec = r.kernel_backend()
ops = backend_spec.create(device="cpu")
ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
model = r.family_for("toyarch").load(GGUFFile(sys.argv[1]), ops)
print(json.dumps({
    "backend": backend_spec.name,
    "calls": type(ops).calls,
    "model": type(model).__name__,
    "width": model.width,
    "drafter": r.named("lucebox_drafters", "toy-draft", "drafter").create(),
    "verifier": r.named("lucebox_verifiers", "toy-verify", "verifier").create(),
}))
'''


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory) -> Path:
    """Build and install (into a private folder) a package with a working and a broken plugin."""
    root = tmp_path_factory.mktemp("toy")
    source = root / "src"
    (source / "lucebox_toy").mkdir(parents=True)
    (source / "lucebox_toy" / "__init__.py").write_text(TOY_PLUGIN)
    (source / "lucebox_broken").mkdir()
    (source / "lucebox_broken" / "__init__.py").write_text("raise RuntimeError('toy plugin is broken on purpose')\n")
    (source / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "lucebox-toy"
            version = "4.5.6"

            [project.entry-points.lucebox]
            toy = "lucebox_toy"
            broken = "lucebox_broken"

            [tool.setuptools]
            packages = ["lucebox_toy", "lucebox_broken"]
            """
        )
    )
    site = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(site), str(source)],
        check=True,
        capture_output=True,
    )
    return site


def _run(site: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=str(site), **env)
    environment.pop("LUCEBOX_PLUGINS", None) if "LUCEBOX_PLUGINS" not in env else None
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environment, timeout=120)


def test_third_party_plugin_is_discovered_and_broken_one_reported(toy_site):
    result = _run(toy_site, ["-m", "lucebox_core.cli", "plugins", "--json"])
    assert result.returncode == 0, result.stderr
    by_name = {p["name"]: p for p in json.loads(result.stdout)}
    assert by_name["toy"]["distribution"] == "lucebox-toy"
    assert by_name["toy"]["version"] == "4.5.6"
    provided = {(i["kind"], i["name"]) for i in by_name["toy"]["provides"]}
    assert provided == {("backend", "toy"), ("model", "toy"), ("drafter", "toy-draft"), ("verifier", "toy-verify")}
    assert "toy plugin is broken on purpose" in by_name["broken"]["error"]
    assert "qwen35" in by_name, "a broken plugin must not hide the others"


def test_lucebox_plugins_env_restricts_entry_points(toy_site):
    result = _run(toy_site, ["-m", "lucebox_core.cli", "plugins", "--json"], LUCEBOX_PLUGINS="toy")
    names = [p["name"] for p in json.loads(result.stdout)]
    assert names == ["builtin", "toy"]


def test_third_party_backend_family_drafter_verifier_are_used(toy_site, tmp_path):
    """lucebox_drafters and lucebox_verifiers have no built-in yet: the toy package provides them."""
    import gguf

    path = tmp_path / "toy.gguf"
    writer = gguf.GGUFWriter(str(path), "toyarch")
    writer.add_uint32("toyarch.width", 7)
    writer.add_tensor("toy.weight", np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    script = tmp_path / "use_toy.py"
    script.write_text(USE_TOY)
    result = _run(toy_site, [str(script), str(path)])
    assert result.returncode == 0, result.stderr
    used = json.loads(result.stdout.strip().splitlines()[-1])
    assert used == {
        "backend": "toy",  # priority 100 beats the torch reference
        "calls": 1,
        "model": "ToyModel",
        "width": 7,
        "drafter": "toy drafter",
        "verifier": "toy verifier",
    }
    info = _run(toy_site, ["-m", "lucebox_core.cli", "info", str(path), "--json"])
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["handled_by"] == "toy"
