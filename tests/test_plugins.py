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
    assert [k.name for k in registry.kv_policies()] == ["full", "kvflash"]


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
    assert registry.family_for("gemma4").name == "gemma4"
    assert registry.family_for("laguna").name == "laguna"
    assert registry.family_for("qwen3").name == "qwen3"  # dense Qwen3, also in lucebox-qwen
    with pytest.raises(PluginError, match=r"'laguna'.*lucebox-laguna is installed but not loaded"):
        discover(allowed="qwen35").family_for("laguna", "model.gguf")
    with pytest.raises(PluginError, match="'gemma4'.*lucebox-gemma4 is installed but not loaded"):
        discover(allowed="qwen35").family_for("gemma4")
    with pytest.raises(PluginError, match="'qwen35'.*lucebox-qwen is installed but not loaded"):
        discover(allowed="").family_for("qwen35")
    # A plugin that is loaded but does not handle an architecture is not suggested again for it.
    with pytest.raises(PluginError, match="'qwen3next'") as raised:
        registry.family_for("qwen3next")
    assert "install lucebox-qwen" not in str(raised.value) and "lucebox plugins" in str(raised.value)


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
\"\"\"A third party's plugin: a kernel backend with a kernel of its own, a model family, and a drafter, a
verifier and a KV policy that generation runs through, none of them known to the core.\"\"\"
import os

import torch

from lucebox_core import Drafter, KernelBackend, KVPolicy, ModelFamily, OpKernel, PrefillCompressor, Verifier, hookimpl
from lucebox_core.kv import K_FLAG, KV_CACHE_TYPES, V_FLAG, kv_bytes_per_token, kv_cache_type
from lucebox_core.speculative import Verdict
from lucebox_core.torch_backend import TorchBackend


def log(line):
    \"\"\"Components say they ran into $TOY_LOG, for the test to read.\"\"\"
    if os.environ.get("TOY_LOG"):
        with open(os.environ["TOY_LOG"], "a") as f:
            f.write(line + "\\n")


class ToyBackend(TorchBackend):
    \"\"\"The reference ops, counting rms_norm calls so the test can see the toy backend was used.\"\"\"
    name = "toy"
    calls = 0

    def rms_norm(self, x, weight, eps, *, out=None):
        ToyBackend.calls += 1
        return super().rms_norm(x, weight, eps, out=out)


# A kernel for a family's op (the qwen35 family's one-token convolution), offered by this backend alone.
conv_kernel_calls = []


def conv_step_kernel(ops, x, weight, state):
    conv_kernel_calls.append(tuple(x.shape))
    window = torch.cat([state.to(x.dtype), x[:, None]], dim=1)
    return (window * weight.to(x.dtype).t()).sum(dim=1), window[:, 1:]


def conv_step_accepts(ops, x, weight, state):
    return x.dtype == torch.float32


class ToyModel:
    def __init__(self, gguf_file, backend):
        self.architecture = gguf_file.architecture
        self.width = gguf_file.get("toyarch.width", type=int)
        self.backend = backend


def load(gguf_file, backend, **options):
    return ToyModel(gguf_file, backend)


class LookupDrafter:
    \"\"\"Prompt-lookup drafting: find the last `ngram` tokens earlier in the sequence and propose what
    followed them there (one-hot rows; nothing found: the last token repeated).\"\"\"
    name = "toy-lookup"

    def __init__(self, gguf_file, target, backend=None, **options):
        arch = gguf_file.architecture
        self.block_size = gguf_file.get(arch + ".block_size", type=int)
        self.ngram = gguf_file.get(arch + ".ngram", type=int)
        self.target = target

    def describe(self):
        return {"kind": self.name, "block_size": self.block_size, "ngram": self.ngram}

    def prepare_target(self, target, target_state, ctx_size):
        pass

    def new_state(self):
        return LookupState()

    def draft(self, target, target_state, draft_state, tokens, block_size):
        tokens = list(tokens)
        proposal = []
        key = tokens[-self.ngram:]
        for start in range(len(tokens) - self.ngram - 1, -1, -1):
            if tokens[start:start + self.ngram] == key:
                proposal = tokens[start + self.ngram:start + self.ngram + block_size - 1]
                break
        proposal = (proposal + [tokens[-1]] * block_size)[: block_size - 1]
        logits = torch.full((block_size - 1, target.vocab_size), -30.0)
        logits[torch.arange(block_size - 1), torch.tensor(proposal)] = 30.0
        draft_state.drafts += 1
        log(f"drafter drafted {len(proposal)}")
        return logits


class LookupState:
    drafts = 0

    def crop(self, length):
        pass


class GreedyChain:
    \"\"\"Greedy chain verification written from the protocol alone: candidates are the drafted argmaxes, one
    target pass, accept while the target's argmax agrees.\"\"\"
    name = "toy-chain"

    def __init__(self, target, **options):
        self.target = target

    def max_nodes(self, block_size):
        return block_size

    def describe(self):
        return {"verifier": self.name}

    def verify(self, target, state, root, draft_logits, sampler, history):
        drafted = draft_logits.argmax(dim=-1).tolist()
        tokens = [root] + drafted
        verification = target.verify(state, tokens, list(range(-1, len(tokens) - 1)))
        best = verification.logits.argmax(dim=-1).tolist()
        path = [0]
        while path[-1] + 1 < len(tokens) and tokens[path[-1] + 1] == best[path[-1]]:
            path.append(path[-1] + 1)
        log(f"verifier accepted {len(path) - 1}")
        return Verdict([tokens[i] for i in path[1:]] + [best[path[-1]]], path, verification)


class ReversedPagesKV:
    \"\"\"A paged KV cache whose pages are handed out last first: position p's row sits in slot
    table[p // 4] * 4 + p % 4, never at p, so only the interface (logical positions) can make it work.\"\"\"
    PAGE = 4

    def __init__(self, layers, max_context, *, dtype, device, k_type=None, v_type=None):
        self.shapes, self.max_context, self.dtype, self.device = dict(layers), max_context, dtype, torch.device(device)
        self.k_type = kv_cache_type(dtype if k_type is None else k_type, K_FLAG)
        self.v_type = kv_cache_type(dtype if v_type is None else v_type, V_FLAG)
        pages = -(-max_context // self.PAGE)
        self.table = torch.arange(pages - 1, -1, -1, device=self.device)
        k_dtype, v_dtype = KV_CACHE_TYPES[self.k_type], KV_CACHE_TYPES[self.v_type]
        slots = pages * self.PAGE
        self._k = {i: torch.zeros(slots, s.kv_heads, s.k_head_dim, dtype=k_dtype, device=self.device)
                   for i, s in self.shapes.items()}
        self._v = {i: torch.zeros(slots, s.kv_heads, s.v_head_dim, dtype=v_dtype, device=self.device)
                   for i, s in self.shapes.items()}
        self._lengths = {i: 0 for i in self.shapes}
        log(f"kv policy made: position 0 in slot {int(self._slots(torch.tensor([0]))[0])}")

    def _slots(self, positions):
        positions = positions.to(self.device)
        return self.table[positions // self.PAGE] * self.PAGE + positions % self.PAGE

    @property
    def length(self):
        return max(self._lengths.values(), default=0)

    @property
    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (*self._k.values(), *self._v.values()))

    @property
    def bytes_per_token(self):
        return sum(kv_bytes_per_token(s, self.k_type, self.v_type) for s in self.shapes.values())

    def ensure_room(self, new_tokens):
        if self.length + new_tokens > self.max_context:
            raise ValueError("context overflow")

    def as_stored(self, k, v):
        return k.to(KV_CACHE_TYPES[self.k_type]), v.to(KV_CACHE_TYPES[self.v_type])

    def write(self, layer, positions, k, v):
        slots = self._slots(positions)
        self._k[layer].index_copy_(0, slots, k.to(self._k[layer].dtype))
        self._v[layer].index_copy_(0, slots, v.to(self._v[layer].dtype))

    def gather(self, layer, size):
        slots = self._slots(torch.arange(size, device=self.device))
        return self._k[layer].index_select(0, slots), self._v[layer].index_select(0, slots)

    def append(self, layer, k, v):
        start = self._lengths[layer]
        self.write(layer, torch.arange(start, start + k.shape[0]), k, v)
        self._lengths[layer] = start + k.shape[0]
        return self.read(layer)

    def read(self, layer):
        return self.gather(layer, self._lengths[layer]) if self._lengths[layer] else (
            self._k[layer][:0], self._v[layer][:0])

    def move(self, source, destination):
        for buffers in (self._k, self._v):
            for buffer in buffers.values():
                buffer.index_copy_(0, self._slots(destination), buffer.index_select(0, self._slots(source)))

    def commit(self, length):
        for layer in self._lengths:
            self._lengths[layer] = max(self._lengths[layer], length)

    def rollback(self, length):
        for layer in self._lengths:
            self._lengths[layer] = min(self._lengths[layer], length)


@hookimpl
def lucebox_kernel_backends():
    return [KernelBackend(name="toy", factory=ToyBackend, priority=100, description="test backend")]


@hookimpl
def lucebox_op_kernels():
    return [OpKernel(op="causal_conv1d_step", backend="toy", kernel=conv_step_kernel, accepts=conv_step_accepts)]


@hookimpl
def lucebox_model_families():
    return [ModelFamily(name="toy", architectures=["toyarch"], loader=load)]


@hookimpl
def lucebox_drafters():
    return [Drafter(name="toy-lookup", factory=LookupDrafter, architectures=["toy-lookup-draft"])]


@hookimpl
def lucebox_verifiers():
    return [Verifier(name="toy-chain", factory=GreedyChain)]


@hookimpl
def lucebox_kv_policies():
    return [KVPolicy(name="toy-paged", factory=ReversedPagesKV, cache_types=["f32", "f16", "bf16"])]


class FirstWords:
    \"\"\"A prefill compression policy without a scorer: each compressible text keeps its first three words.\"\"\"

    name = "toy-first-words"

    def __init__(self, config, loaded):
        self.target = loaded

    def compress(self, pieces):
        return [p.text if p.protected else " ".join(p.text.split()[:3]) for p in pieces]


@hookimpl
def lucebox_prefill_compressors():
    return [PrefillCompressor(name="toy-first-words", factory=FirstWords)]
'''

USE_TOY = '''
import json, sys
import torch
from lucebox_core.chat_compression import ChatCompressor
from lucebox_core.ggufio import GGUFFile
from lucebox_core.plugins import registry
import lucebox_toy
r = registry()


def _compressed(r):
    # The server's path: the compressor named by --prefill-compressor, under a ChatCompressor.
    chats = ChatCompressor(r.prefill_compressor("toy-first-words").create(None, None), mode="always", hot_window=0)
    chat = [{"role": "system", "content": "be brief and exact"}, {"role": "user", "content": "one two three four"},
            {"role": "assistant", "content": "five six seven eight"}, {"role": "user", "content": "nine ten eleven"}]
    return [m["content"] for m in chats.apply(chat)]


backend_spec = r.kernel_backend()
ops = backend_spec.create(device="cpu")
ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
model = r.family_for("toyarch").load(GGUFFile(sys.argv[1]), ops)
# A real family on the toy backend: the family's convolution op runs the toy backend's kernel for it.
qwen = r.family_for("qwen35").load(GGUFFile(sys.argv[2]), ops)
state = qwen.new_state(16)
qwen.forward(state, torch.tensor([3]))
print(json.dumps({
    "backend": backend_spec.name,
    "calls": type(ops).calls > 0,
    "model": type(model).__name__,
    "width": model.width,
    "conv_kernel_calls": len(lucebox_toy.conv_kernel_calls),
    "conv_choice": qwen.ops.causal_conv1d_step.choice(torch.zeros(1, 4), torch.zeros(4, 2), torch.zeros(1, 1, 4)),
    "conv_choice_f16": qwen.ops.causal_conv1d_step.choice(torch.zeros(1, 4, dtype=torch.float16),
                                                          torch.zeros(4, 2), torch.zeros(1, 1, 4)),
    "drafter": r.drafter_for("toy-lookup-draft").name,
    "verifier": r.verifier("toy-chain").name,
    "kv_policy": r.kv_policy("toy-paged").name,
    "compressed": _compressed(r),
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


def _run_together(site: Path, *runs: tuple[list[str], dict[str, str]]) -> list[subprocess.CompletedProcess]:
    """`_run(site, args, **env)` for each (args, env) of `runs`, the processes started together: each is
    mostly its own start-up (torch's import, the model's load), single-threaded, so a second core halves
    them. Each process's torch takes its share of the cores (threads past them spin against each other's)."""
    threads = str(max(1, len(os.sched_getaffinity(0)) // len(runs)))
    processes = []
    for args, env in runs:
        environment = dict(os.environ, PYTHONPATH=str(site), **env)
        environment.pop("LUCEBOX_PLUGINS", None) if "LUCEBOX_PLUGINS" not in env else None
        environment.setdefault("OMP_NUM_THREADS", threads)
        processes.append(subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=environment))
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


def test_third_party_plugin_is_discovered_and_broken_one_reported(toy_site):
    result = _run(toy_site, ["-m", "lucebox_core.cli", "plugins", "--json"])
    assert result.returncode == 0, result.stderr
    by_name = {p["name"]: p for p in json.loads(result.stdout)}
    assert by_name["toy"]["distribution"] == "lucebox-toy"
    assert by_name["toy"]["version"] == "4.5.6"
    provided = {(i["kind"], i["name"]) for i in by_name["toy"]["provides"]}
    assert provided == {("backend", "toy"), ("model", "toy"), ("drafter", "toy-lookup"), ("verifier", "toy-chain"),
                        ("kv_policy", "toy-paged"), ("kernel", "toy.causal_conv1d_step"),
                        ("prefill_compressor", "toy-first-words")}
    assert ("prefill_compressor", "pflash") in {(i["kind"], i["name"]) for i in by_name["builtin"]["provides"]}
    assert "toy plugin is broken on purpose" in by_name["broken"]["error"]
    assert "qwen35" in by_name, "a broken plugin must not hide the others"


def test_lucebox_plugins_env_restricts_entry_points(toy_site):
    result = _run(toy_site, ["-m", "lucebox_core.cli", "plugins", "--json"], LUCEBOX_PLUGINS="toy")
    names = [p["name"] for p in json.loads(result.stdout)]
    assert names == ["builtin", "toy"]


def _write_gguf(path: Path, architecture: str, keys: dict[str, int]) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in keys.items():
        writer.add_uint32(key, value)
    writer.add_tensor("toy.weight", np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def qwen_target(tmp_path_factory) -> Path:
    from lucebox_qwen35 import synth

    return synth.write(tmp_path_factory.mktemp("target") / "target.gguf", size="tiny", type="f32", seed=12)


def test_third_party_backend_kernel_family_and_plugins_are_found(toy_site, tmp_path, qwen_target):
    """lucebox_op_kernels: a third party's backend offers a kernel for a family's op, and that family's
    model runs it; its drafter, verifier and KV policy are found by the registry."""
    path = _write_gguf(tmp_path / "toy.gguf", "toyarch", {"toyarch.width": 7})
    script = tmp_path / "use_toy.py"
    script.write_text(USE_TOY)
    result = _run(toy_site, [str(script), str(path), str(qwen_target)])
    assert result.returncode == 0, result.stderr
    used = json.loads(result.stdout.strip().splitlines()[-1])
    assert used == {
        "backend": "toy",  # priority 100 beats the torch reference
        "calls": True,
        "model": "ToyModel",
        "width": 7,
        "conv_kernel_calls": 6,  # one per Gated DeltaNet layer of the tiny model's one-token step
        "conv_choice": "toy.causal_conv1d_step",
        "conv_choice_f16": "reference",  # the kernel's own check declines: the reference runs
        "drafter": "toy-lookup",
        "verifier": "toy-chain",
        "kv_policy": "toy-paged",
        # lucebox_prefill_compressors: the system prompt and the last message untouched, the rest cut short.
        "compressed": ["be brief and exact", "one two three", "five six seven", "nine ten eleven"],
    }
    info = _run(toy_site, ["-m", "lucebox_core.cli", "info", str(path), "--json"])
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["handled_by"] == "toy"


USE_TOY_KV = '''
import json, sys
import torch
from lucebox_core.plugins import registry
from lucebox_qwen35.loader import load
r = registry()
models = {name: load(sys.argv[1], kv_policy=r.kv_policy(name)) for name in ("full", "toy-paged")}
logits = {}
for name, model in models.items():
    state = model.new_state(40)
    out = [model.forward(state, torch.arange(5) + 7)[-1:]]
    for token in (3, 4, 5):  # the static decode step: `write` at a device position, `gather` a window
        out.append(model.decode_step(state, token, graphs=False))
    verification = model.verify(state, [6, 7, 8, 9, 10], [-1, 0, 0, 1, 3], static=True, graphs=False)
    out.append(verification.logits)
    model.commit(state, verification, [0, 1, 3])  # `move` the accepted rows from their scratch positions
    out.append(model.decode_step(state, 11, graphs=False))
    logits[name] = (torch.cat(out), type(state.kv).__name__, state.length)
(full, full_kind, full_length), (paged, paged_kind, paged_length) = logits["full"], logits["toy-paged"]
print(json.dumps({"kinds": [full_kind, paged_kind], "lengths": [full_length, paged_length],
                  "max_diff": float((full - paged).abs().max())}))
'''


def test_the_static_paths_run_through_a_third_party_kv_policy(toy_site, tmp_path, qwen_target):
    """The static decode step, a static verify pass and its commit on the paged policy (slots out of
    position order) give the logits they give on the built-in one, bit for bit."""
    script = tmp_path / "use_toy_kv.py"
    script.write_text(USE_TOY_KV)
    result = _run(toy_site, [str(script), str(qwen_target)])
    assert result.returncode == 0, result.stderr
    used = json.loads(result.stdout.strip().splitlines()[-1])
    assert used == {"kinds": ["FullKVCache", "ReversedPagesKV"], "lengths": [12, 12], "max_diff": 0.0}


def test_generate_runs_through_a_third_party_drafter_verifier_and_kv_policy(toy_site, tmp_path, qwen_target):
    """`lucebox generate` with the toy package's drafter (chosen by the draft file's architecture), verifier
    (--spec-type) and KV policy (--kv-policy, pages out of position order): no core edit, and the greedy
    output equals plain decoding on the built-in policy."""
    draft = _write_gguf(tmp_path / "lookup.gguf", "toy-lookup-draft",
                        {"toy-lookup-draft.block_size": 5, "toy-lookup-draft.ngram": 2})
    prompt = ",".join(str(t) for t in [11, 12, 13, 14, 11, 12, 13, 14, 11, 12])
    common = ["-m", "lucebox_core.cli", "generate", "-m", str(qwen_target), "--backend", "torch", "--temp", "0",
              "--prompt-ids", prompt, "-n", "24", "--ignore-eos", "--json"]
    # The runs are independent (each toy run logs to its own file), so they start together.
    plain_log, toy_log, forced_log = (tmp_path / f"{run}.log" for run in ("plain", "toy", "forced"))
    toy_flags = ["-md", str(draft), "--spec-type", "toy-chain", "--kv-policy", "toy-paged"]
    plain, toy, forced, bad_policy, bad_verifier, bad_cache = _run_together(
        toy_site,
        (common, {"TOY_LOG": str(plain_log)}),
        ([*common, *toy_flags], {"TOY_LOG": str(toy_log)}),
        # With forced acceptance the verifier accepts 3 of every block's 4 drafts: the paged cache keeps (and
        # rolls back) several positions a step, and the output is still plain greedy.
        ([*common, *toy_flags, "--force-accept", "3"], {"TOY_LOG": str(forced_log)}),
        # Its unknown names are clear errors naming the flag and the choices.
        ([*common, "--kv-policy", "nope"], {}),
        ([*common, "-md", str(draft), "--spec-type", "nope"], {}),
        ([*common, "--kv-policy", "toy-paged", "-ctk", "q8_0"], {}),
    )
    assert plain.returncode == 0, plain.stderr
    assert not plain_log.exists(), "no toy component runs without being asked for"
    assert toy.returncode == 0, toy.stderr
    plain_out, toy_out = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (plain, toy))
    assert toy_out["token_ids"] == plain_out["token_ids"]
    assert toy_out["speculative"]["kind"] == "toy-lookup" and toy_out["speculative"]["spec_type"] == "toy-chain"
    assert toy_out["accepted_lengths"] and sum(toy_out["accepted_lengths"]) == 23  # the first is the prefill's
    assert forced.returncode == 0, forced.stderr
    forced_out = json.loads(forced.stdout.strip().splitlines()[-1])
    assert forced_out["token_ids"] == plain_out["token_ids"]
    assert forced_out["accepted_lengths"][:-1] == [4] * (len(forced_out["accepted_lengths"]) - 1)
    lines = toy_log.read_text().splitlines() + forced_log.read_text().splitlines()
    made = [line for line in lines if line.startswith("kv policy made")]
    assert made and all(not line.endswith("slot 0") for line in made)  # physical slot != logical position
    assert any(line.startswith("drafter drafted") for line in lines)
    assert any(line.startswith("verifier accepted") for line in lines)
    assert bad_policy.returncode == 2 and "--kv-policy" in bad_policy.stderr and "toy-paged" in bad_policy.stderr
    assert bad_verifier.returncode == 2 and "--spec-type" in bad_verifier.stderr and "toy-chain" in bad_verifier.stderr
    assert bad_cache.returncode == 2 and "toy-paged" in bad_cache.stderr and "q8_0" in bad_cache.stderr
