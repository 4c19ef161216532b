"""scripts/train_demo.py and its parts on the CPU (issue #22): a few-step run with tiny sizes writes both GGUFs,
which Lucebox loads and decodes with (speculative output = plain greedy); the export computes what the training
model computes (logits, captured layers, draft logits) on randomised weights; the corpus helpers; the parts that
carry the files and the default model's reassembly of them; the acceptance script's logic."""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _import(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


train_demo = _import("train_demo")
demo_models = _import("demo_models")
demo_export = _import("demo_export")
demo_corpus = _import("demo_corpus")

TINY = ["--device", "cpu", "--budget-s", "600", "--finish-reserve-s", "10",
        "--hidden", "32", "--layers", "4", "--ffn", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
        "--gdn-key-heads", "1", "--gdn-value-heads", "2", "--gdn-head-dim", "32",
        "--seq-len", "64", "--batch", "2", "--target-steps", "3", "--warmup", "1", "--eval-tokens", "512",
        "--draft-layers", "1", "--draft-ffn", "64", "--draft-heads", "2", "--draft-kv-heads", "1",
        "--draft-head-dim", "32", "--draft-taps", "2", "--draft-steps", "3", "--draft-batch", "2", "--anchors", "4",
        "--gen-seqs", "4", "--gen-batch", "2", "--gen-tokens", "24", "--prompt-lens", "8,16", "--heldout-gen-seqs", "2",
        "--max-files", "12", "--record-prompts", "2", "--record-tokens", "8", "--seed", "7"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert train_demo.main(["--out", str(out), *TINY]) == 0
    results = json.loads((out / "results.json").read_text())
    return out, results


def _files(out: Path, results: dict) -> tuple[Path, Path]:
    return out / results["target"]["file"], out / results["drafter"]["file"]


# -- the run ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_writes_the_pair_with_its_training_record(demo_run):
    from lucebox_core.ggufio import GGUFFile

    out, results = demo_run
    target_path, draft_path = _files(out, results)
    target, draft = GGUFFile(target_path), GGUFFile(draft_path)
    assert target.architecture == "qwen35" and draft.architecture == "qwen35-dflash-draft"
    assert target.get("lucebox.train.seed", int) == 7 and target.get("lucebox.train.role", str) == "target"
    hyper = json.loads(target.get("lucebox.train.hyperparameters", str))
    assert hyper["hidden"] == 32 and hyper["target_steps"] == 3
    assert target.get("lucebox.train.heldout_files", list) == results["corpus"]["heldout_files"]
    assert target.get("lucebox.train.corpus_files", int) == results["corpus"]["files"] == 12
    assert draft.get("lucebox.train.target", str) == target_path.name
    assert draft.get("qwen35-dflash-draft.dflash.mask_token_id", int) == 248070
    # Q8_0 matrices, F32 norms and conv taps, as llama.cpp's converter writes them.
    assert target.tensors["blk.0.ffn_up.weight"].ggml_type.name == "Q8_0"
    assert target.tensors["blk.0.ssm_conv1d.weight"].ggml_type.name == "F32"
    assert draft.tensors["blk.0.attn_q.weight"].ggml_type.name == "Q8_0"

    quantized = results["target"]["heldout_quantized"]
    assert math.isfinite(quantized["loss"]) and quantized["perplexity"] == pytest.approx(math.exp(quantized["loss"]))
    assert results["target"]["steps"] == 3 and results["drafter"]["steps"] == 3
    assert results["drafter"]["untrained"]["blocks"] > 0
    assert len(results["drafter"]["heldout_quantized"]["accuracy_by_position"]) == 15


@pytest.mark.slow
def test_parts_carry_the_files_with_checksums(demo_run):
    out, results = demo_run
    manifest = json.loads((out / "parts" / "manifest.json").read_text())
    assert [f["name"] for f in manifest["files"]] == [p.name for p in _files(out, results)]
    for entry in manifest["files"]:
        data = (out / entry["name"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["bytes"] == len(data)
        joined = b"".join((out / "parts" / p["name"]).read_bytes() for p in entry["parts"])
        assert len(joined) == entry["stored_bytes"] and gzip.decompress(joined) == data
        assert all(p["bytes"] <= demo_export.PART_BYTES for p in entry["parts"])


@pytest.mark.slow
def test_lucebox_generate_with_the_trained_drafter_repeats_the_recorded_greedy_text(demo_run):
    out, results = demo_run
    target_path, draft_path = _files(out, results)
    expected = json.loads((out / "expected_greedy.json").read_text())
    assert expected["target_sha256"] == hashlib.sha256(target_path.read_bytes()).hexdigest()
    records = expected["records"]
    assert len(records) == 2
    assert all(r["chain_equals_plain"] and r["ddtree_equals_plain"] for r in records)
    record = records[0]
    env = {**os.environ, "LUCEBOX_PLUGINS": "qwen35"}
    done = subprocess.run(
        [sys.executable, "-m", "lucebox_core.cli", "generate", "-m", str(target_path), "-md", str(draft_path),
         "--spec-type", "ddtree", "--prompt-ids", ",".join(map(str, record["prompt_ids"])), "-n", "8", "--temp", "0",
         "--backend", "torch", "--device", "cpu", "-c", "1024", "--json"],
        capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["token_ids"] == record["token_ids"]


@pytest.mark.slow
def test_trained_checkpoint_computes_what_the_file_computes(demo_run):
    """The file stores the trained weights after their Q8_0 round trip: same logits, to float rounding."""
    from lucebox_core.loading import load_model

    out, results = demo_run
    saved = torch.load(out / "target_state.pt", weights_only=False)
    model = demo_models.Qwen35Trainable(saved["config"], seed=0)
    model.load_state_dict(saved["state"])
    ids = torch.randint(0, saved["config"].vocab, (1, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.logits(model.hidden_states(ids)[0])[0]
    loaded = load_model(_files(out, results)[0], backend="torch", device="cpu")
    got = loaded.model.forward(loaded.model.new_state(128), ids[0])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_acceptance_script_measures_each_mode(demo_run, tmp_path):
    demo_acceptance = _import("demo_acceptance")
    out, results = demo_run
    target_path, draft_path = _files(out, results)
    report = tmp_path / "acceptance.json"
    files = ",".join(r["file"] for r in json.loads((out / "expected_greedy.json").read_text())["records"])
    assert demo_acceptance.main(["--target", str(target_path), "--draft", str(draft_path), "--files", files,
                                 "--prompts", "2", "-n", "10", "--modes", "plain,chain,ddtree",
                                 "--backend", "torch", "--device", "cpu", "--out", str(report)]) == 0
    data = json.loads(report.read_text())
    assert set(data["modes"]) == {"plain", "chain (trained drafter)", "ddtree (trained drafter)",
                                  "chain (random drafter)", "ddtree (random drafter)"}
    for name, mode in data["modes"].items():
        if name != "plain":
            assert mode["all_equal_plain"] and mode["mean_accepted_length"] >= 1.0 and mode["verify_steps"] > 0
    assert "| mode |" in report.with_suffix(".md").read_text()


# -- export parity on randomised weights --------------------------------------------------------------


def _tiny_config():
    from lucebox_qwen35.layout import Qwen35Config

    # GDN with more value heads than key heads (the tiled order), attention at layer 3, Q8_0-able rows.
    return Qwen35Config(n_layer=4, hidden=64, ffn=96, n_head=2, n_head_kv=1, head_dim=32, ssm_d_state=32,
                        ssm_n_group=1, ssm_dt_rank=2, ssm_d_inner=64, rope_dim=8, rope_sections=(2, 1, 1, 0),
                        tied_output=True, context_length=4096)


@torch.no_grad()
def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Weights far from their initial values (norms not 1, decays and gates spread), so that a tensor exported
    under the wrong name or transform changes the output."""
    generator = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if p.dim() == 1 or "conv1d" in name:
            p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
            if name.endswith("dt_bias"):
                p.sub_(2.0)
        else:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.08)


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """A randomised trainable target and drafter, written as F32 GGUFs."""
    from lucebox_core.speculative.dflash import DraftConfig

    folder = tmp_path_factory.mktemp("parity")
    target = demo_models.Qwen35Trainable(_tiny_config(), seed=1).eval()
    _randomise(target, 1)
    draft_cfg = DraftConfig(architecture="qwen35-dflash-draft", n_layer=2, hidden=64, ffn=128, n_head=4, n_head_kv=2,
                            head_dim=32, block_size=16, target_layer_ids=[0, 2], mask_token_id=248070, vocab=248320)
    drafter = demo_models.DFlashTrainable(draft_cfg, seed=2).eval()
    _randomise(drafter, 2)
    target_path = demo_export.write_target(folder / "target.gguf", target, "f32", name="t", description="d",
                                           training={"seed": 1})
    draft_path = demo_export.write_drafter(folder / "draft.gguf", drafter, "f32", name="d", training={"seed": 2})
    return target, drafter, target_path, draft_path


@pytest.mark.slow
def test_exported_target_gives_the_training_models_logits_and_features(random_pair):
    from lucebox_core.loading import load_model

    target, _, target_path, _ = random_pair
    ids = torch.randint(0, 248320, (1, 90), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden, taps = target.hidden_states(ids, capture=(1, 3))
        expected = target.logits(hidden)[0]
    model = load_model(target_path, backend="torch", device="cpu").model
    state = model.new_state(256)
    got = model.forward(state, ids[0], capture=(1, 3))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for layer, tap in zip((1, 3), taps):
        torch.testing.assert_close(state.captured[layer], tap[0], rtol=1e-4, atol=1e-4)
    # One token at a time (the recurrent GDN form and the KV cache) gives the same.
    stepwise = model.new_state(256)
    got_steps = torch.cat([model.forward(stepwise, ids[0, i:i + 1]) for i in range(ids.shape[1])])
    torch.testing.assert_close(got_steps, expected, rtol=1e-4, atol=1e-4)
    # And so does the training model's own cached generation.
    with torch.no_grad():
        continuation = target.generate_greedy(ids[:, :60], 12)
    plain = model.new_state(256)
    logits = model.forward(plain, ids[0, :60])[-1]
    greedy = []
    for _ in range(12):
        greedy.append(int(logits.argmax()))
        logits = model.forward(plain, torch.tensor([greedy[-1]]))[-1]
    assert continuation[0].tolist() == greedy


@pytest.mark.slow
def test_exported_drafter_gives_the_training_models_draft(random_pair):
    from lucebox_core.assembly import load_drafter
    from lucebox_core.loading import load_model

    target, drafter, target_path, draft_path = random_pair
    context = 37
    ids = torch.randint(0, 151000, (1, context + 1), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, taps = target.hidden_states(ids[:, :context], capture=tuple(drafter.config.target_layer_ids))
        block = torch.full((1, 1, 16), 248070)
        block[0, 0, 0] = ids[0, context]
        hidden = drafter.block_hidden(torch.cat(taps, -1), target.embed_tokens.weight[block], torch.tensor([[context]]))
        expected = target.logits(hidden[0, 0, 1:])
    loaded = load_model(target_path, backend="torch", device="cpu")
    lucebox_drafter = load_drafter(str(draft_path), loaded.model, loaded.backend)
    state = loaded.model.new_state(256)
    lucebox_drafter.prepare_target(loaded.model, state, 256)
    loaded.model.forward(state, ids[0, :context])
    got = lucebox_drafter.draft(loaded.model, state, lucebox_drafter.new_state(), ids[0].tolist())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_quantize_roundtrip_stores_exactly_the_rounded_weights(tmp_path):
    """After the round trip, encoding the weights again gives them back bit for bit: the Q8_0 file holds the
    model that was measured."""
    from gguf import GGMLQuantizationType
    from lucebox_core.checkpoint import encoded_bytes
    from lucebox_core.quants import dequantize

    model = demo_models.Qwen35Trainable(_tiny_config(), seed=3)
    plans = demo_export.target_plans(model.config, "q8_0")
    assert demo_export.quantize_roundtrip_(model.gguf_tensors(), plans) == sum(
        p.ggml_type == GGMLQuantizationType.Q8_0 for p in plans)
    weight = model.layers[0].mlp.up_proj.weight.detach()
    again = dequantize(torch.from_numpy(encoded_bytes(weight.clone(), GGMLQuantizationType.Q8_0)),
                       GGMLQuantizationType.Q8_0, tuple(weight.shape))
    assert torch.equal(again, weight)


def test_output_vocabulary_loss_equals_the_full_softmax_and_its_zero_rows_stay_zero():
    """Training over the corpus's tokens only is the full vocabulary's loss (the unused rows are zero and enter
    as one column), gradient included, and AdamW leaves the zero rows at zero through a training step."""
    model = demo_models.Qwen35Trainable(_tiny_config(), seed=4)
    vocab = model.config.vocab
    generator = torch.Generator().manual_seed(8)
    used = torch.unique(torch.randint(0, vocab, (700,), generator=generator))
    model.use_vocabulary(demo_models.OutputVocabulary.of(used, vocab))
    unused = torch.ones(vocab, dtype=torch.bool)
    unused[used] = False
    assert int(unused.sum()) == vocab - used.numel()
    assert not model.embed_tokens.weight[unused].any()
    stream = used[torch.randint(0, used.numel(), (3, 41), generator=generator)]
    subset_loss, count = model.loss(stream[:, :-1], stream[:, 1:])
    full_loss, full_count = model.loss(stream[:, :-1], stream[:, 1:], exact=True)
    assert count == full_count == 3 * 40
    torch.testing.assert_close(subset_loss, full_loss, rtol=1e-5, atol=1e-4)
    # The same gradient for every parameter but the unused rows (the full softmax would push them down: the
    # subset keeps them at zero, where the file's logits for them are 0).
    names = [name for name, _ in model.named_parameters()]
    subset_grads = torch.autograd.grad(subset_loss, list(model.parameters()), allow_unused=True)
    full_grads = torch.autograd.grad(model.loss(stream[:, :-1], stream[:, 1:], exact=True)[0],
                                     list(model.parameters()), allow_unused=True)
    for name, a, b in zip(names, subset_grads, full_grads):
        if name == "embed_tokens.weight":
            assert not a[unused].any() and b[unused].abs().sum() > 0
            a, b = a[~unused], b[~unused]
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model.loss(stream[:, :-1], stream[:, 1:])[0].backward()
    optimizer.step()
    assert not model.embed_tokens.weight[unused].any()
    assert model.embed_tokens.weight[used].abs().sum() > 0
    # A label outside the used tokens is an error, or (a drafter's rare unused greedy token) weighs nothing.
    hidden = torch.randn(4, model.config.hidden, generator=generator)
    outside = torch.tensor([int(torch.nonzero(unused)[0])] + used[:3].tolist())
    with pytest.raises(ValueError, match="outside the output vocabulary"):
        demo_models.chunked_cross_entropy(hidden, model.embed_tokens.weight, outside, vocabulary=model.vocabulary)
    total, weight = demo_models.chunked_cross_entropy(hidden, model.embed_tokens.weight, outside,
                                                      vocabulary=model.vocabulary, skip_outside=True)
    assert weight == 3
    kept, _ = demo_models.chunked_cross_entropy(hidden[1:], model.embed_tokens.weight, outside[1:])
    # The subset's log-sum-exp (used rows, the rest as one column) adds in another order than the full one: at ~12
    # nats a token, float32 differs in the fifth digit. A wrongly skipped or counted label moves it by whole nats.
    torch.testing.assert_close(total, kept, rtol=1e-4, atol=1e-4)


# -- corpus -------------------------------------------------------------------------------------------


SOURCE = '''
import os


def documented(a, b=2):
    """Add two numbers.

    Longer text.
    """
    total = a + b
    return total


def undocumented(x):
    return x


class Box:
    async def method(self):
        """Wait."""
        await thing()
        return 1
'''


def test_functions_are_cut_after_their_docstring():
    found = {f.name: f for f in demo_corpus.functions(SOURCE, "m.py")}
    assert set(found) == {"documented", "method"}
    doc = found["documented"]
    assert doc.header == "def documented(a, b=2):"
    assert doc.prompt.endswith('    """\n') and doc.prompt.startswith("def documented(a, b=2):\n")
    assert doc.body == "    total = a + b\n    return total\n"
    method = found["method"]
    assert method.prompt == 'async def method(self):\n    """Wait."""\n'  # dedented out of its class
    assert demo_corpus.functions("def broken(:\n", "x.py") == []


def test_docstring_ends_are_the_positions_after_each_docstring_line():
    """In a stream of two files and their <|endoftext|>, every found position's prefix decodes to text that ends
    with a function's docstring line, and each function with a clean token boundary there is found."""
    tokenizer, _, _ = train_demo.load_tokenizer()
    other = 'x = 1\n\n\ndef f(y):\n    """Twice y."""\n    return 2 * y\n'
    sources = [SOURCE, other]
    eot = tokenizer.token_to_id(demo_corpus.END_OF_TEXT)
    ids, starts = [], []
    for text in sources:
        starts.append(len(ids))
        ids += tokenizer.encode(text, add_bos=False) + [eot]
    stream = np.asarray(ids, dtype=np.uint32)
    ends = demo_corpus.docstring_ends(tokenizer, stream, sources, starts)
    assert len(ends) == 3  # documented, method, f
    texts = []
    for end in ends:
        file = 0 if end < starts[1] else 1
        texts.append(tokenizer.decode(stream[starts[file]:end].tolist()))
    assert texts[0].endswith('\n    Longer text.\n    """\n') and "total" not in texts[0]
    assert texts[1].endswith('        """Wait."""\n')
    assert texts[2] == 'x = 1\n\n\ndef f(y):\n    """Twice y."""\n'


def test_heldout_split_depends_on_the_path_alone():
    files = [f"pkg/mod{i}.py" for i in range(400)]
    train, heldout = demo_corpus.split_heldout(files, 50)
    assert 5 <= len(heldout) <= 40 and not set(train) & set(heldout) and sorted(train + heldout) == sorted(files)
    assert demo_corpus.split_heldout(reversed(files), 50) == (train, heldout)
    # A file keeps its side whatever else is in the corpus.
    assert set(demo_corpus.split_heldout(files[:200], 50)[1]) == {f for f in heldout if f in files[:200]}
    assert demo_corpus.split_heldout(["a.py", "b.py"], 0)[1]  # at least one held out


def test_stdlib_listing_leaves_out_tests_and_data():
    files = demo_corpus.stdlib_files()
    assert "os.py" in files and "json/decoder.py" in files
    assert not [f for f in files if "/test/" in f"/{f}" or f.startswith(("encodings/", "pydoc_data/"))]
    assert len(demo_corpus.stdlib_files(include_tests=True)) > len(files)


@pytest.mark.slow
def test_chat_documents_tokenize_as_the_server_tokenizes_them(tmp_path):
    tokenizer, template, _ = train_demo.load_tokenizer()
    text = template.render([{"role": "user", "content": "Write `f(x)`."}], add_generation_prompt=True,
                           enable_thinking=False) + "```python\ndef f(x):\n    return x\n```<|im_end|>\n"
    assert demo_corpus.encode_chat(tokenizer, text) == tokenizer.encode(text, add_bos=False, parse_special=True)
    assert tokenizer.token_to_id("<think>") in demo_corpus.encode_chat(tokenizer, text)

    def render(user: str) -> str:
        return template.render([{"role": "user", "content": user}], add_generation_prompt=True, enable_thinking=False)

    # A docstring ending in a space (the template trims a message's content), after a plain one (in the
    # documents' order, by hash: the first is rendered in full, the rest fill the rendered frame).
    first_line = {name: line for name, line in (("a", 1), ("b", 5))}
    plain, spaced = sorted(first_line, key=lambda n: demo_corpus.path_hash(f"pkg/mod.py:{n}:{first_line[n]}"))
    docs = {plain: "Plain.", spaced: "Ends with a space. "}
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "".join(f'def {n}(x):\n    """{docs[n]}"""\n    return x\n\n' for n in ("a", "b")))
    documents = demo_corpus.chat_documents(tmp_path, ["pkg/mod.py"], render, 3)
    assert len(documents) == 2 and "Ends with a space." in documents[1]
    documents += demo_corpus.chat_documents(demo_corpus.stdlib_root(), ["json/decoder.py"], render, 3)
    assert len(documents) == 5
    for document in documents:  # the template rendered once, then filled in: as rendering each
        user = document.removeprefix("<|im_start|>user\n").partition("<|im_end|>")[0]
        assert user.startswith("Write the Python function `def ") and ("(json.decoder)" in user or "(pkg.mod)" in user)
        prompt = render(user)
        assert document.startswith(prompt) and document.removeprefix(prompt).startswith("```python\ndef ")
        assert document.endswith("```<|im_end|>\n")


# -- the default model's parts ------------------------------------------------------------------------


def test_default_model_parts_reassemble_with_checksums(tmp_path):
    from lucebox_core.errors import LuceboxError
    from lucebox_qwen35 import default

    original = tmp_path / "model.gguf"
    original.write_bytes(os.urandom(40_000))
    parts = tmp_path / "parts"
    manifest = demo_export.split_into_parts([original], parts, part_bytes=16_384)
    stored = manifest["files"][0]["stored_bytes"]  # random bytes do not shrink: a few more than 40,000
    assert manifest["encoding"] == "gzip" and stored > 2 * 16_384
    assert [p["bytes"] for p in manifest["files"][0]["parts"]] == [16_384, 16_384, stored - 2 * 16_384]
    home = tmp_path / "home"
    joined = default.reassemble("model.gguf", home, parts)
    assert joined.read_bytes() == original.read_bytes()
    assert default.reassemble("model.gguf", home, parts).stat().st_mtime_ns == joined.stat().st_mtime_ns  # reused

    damaged = bytearray((parts / "model.gguf.gz.part01").read_bytes())
    damaged[100] ^= 1
    (parts / "model.gguf.gz.part01").write_bytes(bytes(damaged))
    joined.unlink()
    with pytest.raises(LuceboxError, match=r"model.gguf.gz.part01: part of model.gguf is damaged"):
        default.reassemble("model.gguf", home, parts)
    assert not list(home.iterdir())  # nothing half-written is left
    with pytest.raises(LuceboxError, match="lists no file 'other.gguf'"):
        default.reassemble("other.gguf", home, parts)
    with pytest.raises(LuceboxError, match="cannot read the demo model's manifest"):
        default.reassemble("model.gguf", home, tmp_path / "nowhere")
