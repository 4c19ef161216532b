"""Several devices in one box (issue #19): the target's layers split into parts (`--target-devices` with
`--target-layer-split`), the drafter on its own device (`--draft-device`). On the CPU the parts are `cpu`
twice: the hand-over between parts goes by part index and copies even between equal devices, so these tests
run the very code path two GPUs run, and hold its greedy output to the one-device run's, bit for bit."""

from __future__ import annotations

import httpx
import pytest
import torch

from lucebox_core.assembly import EngineOptions, build_engine
from lucebox_core.device_map import DeviceMap, SplitKVCache, build_device_map, parse_split
from lucebox_core.engine import GenerationRequest
from lucebox_core.errors import LuceboxError
from lucebox_core.sampling import SamplingParams

PROMPT = list(range(5, 45))


def greedy(assembled, max_tokens: int = 10) -> list[int]:
    request = GenerationRequest(prompt_ids=PROMPT, max_tokens=max_tokens, ignore_eos=True,
                                sampling=SamplingParams(temperature=0))
    return assembled.engine.generate(request).token_ids


@pytest.fixture
def hand_overs(monkeypatch):
    """How many times the qwen35 model handed its hidden state over between parts (the real function,
    counted)."""
    import lucebox_qwen35.model as qwen35_model

    calls = []
    real = qwen35_model.hand_over

    def counted(tensor, device):
        calls.append(str(device))
        return real(tensor, device)

    monkeypatch.setattr(qwen35_model, "hand_over", counted)
    return calls


@pytest.mark.slow
def test_split_plain_decoding_is_bit_identical_to_one_device(tiny_target_and_draft, hand_overs):
    target = str(tiny_target_and_draft[0])
    one = build_engine(EngineOptions(model=target, ctx_size=128))
    reference = greedy(one)
    assert not hand_overs
    split = build_engine(EngineOptions(model=target, ctx_size=128, target_devices="cpu,cpu",
                                       target_layer_split="0.5,0.5"))
    model = split.loaded.model
    assert model.device_map.layer_parts == (0, 0, 0, 0, 1, 1, 1, 1)
    assert greedy(split) == reference
    # The prefill chunk and every decoded token crossed the boundary once (hidden state and MLP output).
    assert len(hand_overs) == 2 * (1 + 9)
    state = model.new_state(64)
    assert isinstance(state.kv, SplitKVCache)


@pytest.mark.slow
def test_split_by_layer_counts_with_the_drafter_on_its_device(tiny_target_and_draft, hand_overs):
    target, draft = (str(p) for p in tiny_target_and_draft)
    spec = build_engine(EngineOptions(model=target, model_draft=draft, ctx_size=128, spec_type="chain"))
    reference = greedy(spec)
    split = build_engine(EngineOptions(model=target, model_draft=draft, ctx_size=128, target_devices="cpu,cpu,cpu",
                                       target_layer_split="2,3,3", draft_device="cpu", spec_type="chain"))
    assert split.loaded.model.device_map.layer_parts == (0, 0, 1, 1, 1, 2, 2, 2)
    tokens = greedy(split)
    assert tokens == reference
    assert split.engine.speculative is not None and hand_overs


def test_split_static_decode_step_and_verify_pass_match_one_device(tiny_target_and_draft):
    """The static decode step and verify pass (what a GPU records as graphs) on a split model, run eagerly."""
    from lucebox_core.loading import load_model

    path = tiny_target_and_draft[0]
    one = load_model(path).model
    split = load_model(path, device_map=DeviceMap.from_split(["cpu", "cpu"], [3, 5])).model
    states = [m.new_state(64) for m in (one, split)]
    for model, state in zip((one, split), states):
        model.enable_capture(state, [1, 4, 6], 64)
        model.forward(state, torch.arange(7, 20), last_only=True)
    steps = [[model.decode_step(state, token, graphs=False) for token in (3, 1234)]
             for model, state in zip((one, split), states)]
    for a, b in zip(*steps):
        assert torch.equal(a, b)
    assert torch.equal(states[0].features, states[1].features)
    tree = ([5, 6, 7, 8], [-1, 0, 0, 1])
    verified = [model.verify(state, *tree, static=True, graphs=False) for model, state in zip((one, split), states)]
    assert torch.equal(verified[0].logits, verified[1].logits)
    assert torch.equal(verified[0].features, verified[1].features)
    for model, state, verification in zip((one, split), states, verified):
        model.commit(state, verification, [0, 1, 3])
    assert torch.equal(one.forward(states[0], torch.tensor([11])), split.forward(states[1], torch.tensor([11])))
    assert isinstance(states[1].kv, SplitKVCache) and states[1].kv.length == states[0].kv.length


def test_a_split_sequence_snapshots_and_restores_across_splits(tiny_target_and_draft):
    """The prefix cache's snapshots of a split sequence (KV rows from every part, the recurrent state from each
    layer's device) restore into another split and into one device, and decoding goes on alike."""
    from lucebox_core.loading import load_model

    path = tiny_target_and_draft[0]
    one = load_model(path).model
    split = load_model(path, device_map=DeviceMap.from_split(["cpu", "cpu"], [5, 3])).model
    other = load_model(path, device_map=DeviceMap.from_split(["cpu", "cpu", "cpu"], [2, 2, 4])).model
    source = split.new_state(64)
    split.forward(source, torch.arange(30, 42), last_only=True)
    saved = split.snapshot_state(source)
    assert {name for name in saved if name.startswith("kv.")} == {
        f"kv.{layer}.{role}" for layer in one.kv_layer_shapes() for role in "kv"}
    logits = []
    for model in (split, other, one):
        state = model.new_state(64)
        model.restore_state(state, saved, 12)
        logits.append(model.forward(state, torch.tensor([77])))
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    with pytest.raises(LuceboxError, match="layers this cache does not hold"):
        split.new_state(64).kv.import_rows({"99.k": torch.zeros(1)}, 1)


def test_device_flag_errors_name_the_flag():
    map_of = lambda **flags: build_device_map(**{"device": None, "target_device": None, "target_devices": None,  # noqa: E731
                                                 "layer_split": None, "draft_device": None, "layers": 8, **flags})
    with pytest.raises(LuceboxError, match=r"--target-devices: no device cuda:7 on this machine; it has cpu"):
        map_of(target_devices="cpu,cuda:7")
    with pytest.raises(LuceboxError, match=r"--target-device: 'gpu0' is not a torch device"):
        map_of(target_device="gpu0")
    with pytest.raises(LuceboxError, match=r"--draft-device: no device cuda:1"):
        map_of(draft_device="cuda:1")
    with pytest.raises(LuceboxError, match=r"--target-layer-split: '0.5,0.6' sums to 1.1"):
        map_of(target_devices="cpu,cpu", layer_split="0.5,0.6")
    with pytest.raises(LuceboxError, match=r"--target-layer-split: '3,3' sums to 6"):
        map_of(target_devices="cpu,cpu", layer_split="3,3")
    with pytest.raises(LuceboxError, match=r"--target-layer-split: 3 parts for the 2 devices"):
        map_of(target_devices="cpu,cpu", layer_split="3,3,2")
    with pytest.raises(LuceboxError, match=r"--target-devices: 9 parts for a model of 8 layers"):
        map_of(target_devices=",".join(["cpu"] * 9))
    with pytest.raises(LuceboxError, match=r"--target-layer-split needs --target-devices"):
        map_of(layer_split="0.5,0.5")
    with pytest.raises(LuceboxError, match=r"--target-layer-split: '0.95,0.05' leaves a part without layers"):
        map_of(target_devices="cpu,cpu", layer_split="0.95,0.05")
    assert map_of() is None
    # The default model's layer count is not known before it is chosen: counts pass, their shape is checked.
    assert map_of(target_devices="cpu,cpu", layer_split="14,10", layers=None) is None
    with pytest.raises(LuceboxError, match=r"--target-layer-split: every part must be positive"):
        map_of(target_devices="cpu,cpu", layer_split="14,0", layers=None)
    assert map_of(target_devices="cpu,cpu,cpu").layer_parts == (0, 0, 0, 1, 1, 2, 2, 2)
    assert parse_split("0.25,0.75", 2, 8) == [2, 6]


def test_engine_options_check_the_split_against_the_model(tiny_target_and_draft):
    target = str(tiny_target_and_draft[0])
    with pytest.raises(LuceboxError, match=r"--target-layer-split: '4,5' sums to 9: .* the model's 8 layers"):
        build_engine(EngineOptions(model=target, ctx_size=64, target_devices="cpu,cpu", target_layer_split="4,5"))
    with pytest.raises(LuceboxError, match=r"--draft-device needs a drafter"):
        build_engine(EngineOptions(model=target, ctx_size=64, draft_device="cpu"))
    with pytest.raises(LuceboxError, match=r"--kvflash cannot go with --target-devices"):
        build_engine(EngineOptions(model=target, ctx_size=64, target_devices="cpu,cpu", kvflash="4096"))


def test_a_family_that_cannot_split_says_so(tmp_path):
    from lucebox_laguna import synth

    model = synth.write(tmp_path / "laguna.gguf", size="tiny", type="q8_0", seed=3)
    with pytest.raises(LuceboxError, match=r"--target-devices: the laguna family cannot split its layers"):
        build_engine(EngineOptions(model=str(model), ctx_size=64, target_devices="cpu,cpu"))


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_every_command_takes_the_flags_and_names_a_missing_device(command, tiny_target_and_draft):
    from test_cli import assert_one_line_error, lucebox

    extra = ["-p", "hi", "-n", "2"] if command == "generate" else []
    result = lucebox(command, "-m", str(tiny_target_and_draft[0]), "--target-devices", "cpu,cuda:1",
                     "--target-layer-split", "0.5,0.5", *extra, timeout=120)
    assert_one_line_error(result, "--target-devices: no device cuda:1 on this machine; it has cpu")


@pytest.fixture(scope="module")
def service(tmp_path_factory, tiny_target_and_draft):
    from conftest import loaded_service

    target, draft = (str(p) for p in tiny_target_and_draft)
    yield from loaded_service(tmp_path_factory, model=target, model_draft=draft, ctx_size=256,
                              target_devices="cpu,cpu", target_layer_split="3,5", draft_device="cpu")


def test_props_reports_the_device_map_and_the_split_server_answers(url):
    props = httpx.get(f"{url}/props").json()
    device_map = props["runtime"]["device_map"]
    assert device_map["parts"] == [{"device": "cpu", "layers": "0-2"}, {"device": "cpu", "layers": "3-7"}]
    assert device_map["draft_device"] == "cpu" and device_map["head_device"] == "cpu"
    assert device_map["step"] == "eager per part"  # the CPU records no graphs: each part's layers run eagerly
    assert device_map["prefill"] == "eager"  # nor prefill pieces (a split model never does)
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] is not None


def test_what_fits_a_split_model_is_decided_per_device(tiny_target_and_draft):
    """Context fitting with a split: each device holds its own parts' KV, so the device that runs out first
    decides. On `cpu,cpu` every layer's KV is on the one device, as unsplit; with two devices of unequal free
    memory (the parts' backends as the fitting sees them) the smaller budget over its own layers wins."""
    import attrs

    from lucebox_core.context import GRANULE, fit_context, kv_budget, kv_bytes_per_position, split_memory
    from lucebox_core.kv import kv_bytes_per_token
    from lucebox_core.loading import load_model

    path, _ = tiny_target_and_draft
    loaded = load_model(path, device_map=DeviceMap.from_split(["cpu", "cpu"], [4, 4]))
    model = loaded.model
    fits, per_position, _, device = split_memory(model, 1)
    assert device == "cpu" and per_position == kv_bytes_per_position(model)
    assert fit_context(loaded).kv_bytes_per_position == per_position

    @attrs.define
    class Part:  # what fitting reads of a part's backend: its device and its free memory
        device: str
        free: int

        def free_memory(self) -> int:
            return self.free

    shapes = model.kv_layer_shapes()
    share = [sum(kv_bytes_per_token(s, model.cache_type_k, model.cache_type_v) for i, s in shapes.items()
                 if model.device_map.layer_part(i) == part and not s.window) for part in (0, 1)]
    assert all(share), share  # both parts hold attention layers in this split
    model.device_map = DeviceMap.from_split(["cuda:0", "cuda:1"], [4, 4])
    model.part_ops = [Part("cuda:0", 40 << 30), Part("cuda:1", 3 << 30)]
    fits, per_position, budget, device = split_memory(model, 1)
    expected = {d: kv_budget(p.free, False, 1) // s // GRANULE * GRANULE
                for d, p, s in zip(("cuda:0", "cuda:1"), model.part_ops, share)}
    assert device == min(expected, key=expected.get) and fits == min(expected.values())
    assert per_position == share[("cuda:0", "cuda:1").index(device)] < kv_bytes_per_position(model)
