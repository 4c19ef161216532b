"""Spark's foundations: the routing profile (live counts, the CSV beside the model, bad files refused),
placement under a byte budget, and the expert slot pool, whose routed-expert products equal the
all-resident stack's bit for bit (the core's op on real Q8_0 blocks)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from lucebox_core.errors import LuceboxError
from lucebox_core.quants import QuantTensor
from lucebox_core.spark import ExpertSlots, RoutingProfile, place_experts
from lucebox_core.torch_backend import TorchBackend


def test_profile_counts_traffic_and_round_trips(tmp_path):
    profile = RoutingProfile(layers=2, experts=8)
    profile.observe(0, torch.tensor([[1, 3], [3, 7]]))
    profile.observe(1, torch.tensor([[0, 1]]))
    profile.observe(0, torch.tensor([[3, 2]]))
    assert profile.counts[0].tolist() == [0, 1, 1, 3, 0, 0, 0, 1] and profile.counts[1, :2].tolist() == [1, 1]
    path = RoutingProfile.path_for(tmp_path / "model.gguf")
    assert path.name == "model.gguf.spark.csv"
    profile.save(path)
    assert torch.equal(RoutingProfile.load(path, 2, 8).counts, profile.counts)


@pytest.mark.parametrize(("text", "message"), [
    ("expert,count\n", "not a Spark profile"),
    ("layer,expert,count\n0,1,x\n", "line 2: expected three integers"),
    ("layer,expert,count\n0,1,2\n5,1,2\n", "line 3: layer 5 expert 1"),
    ("layer,expert,count\n0,9,2\n", "line 2: layer 0 expert 9"),
])
def test_a_malformed_profile_names_the_line(tmp_path, text, message):
    path = tmp_path / "m.gguf.spark.csv"
    path.write_text(text)
    with pytest.raises(LuceboxError, match=message):
        RoutingProfile.load(path, 2, 8)


def test_placement_takes_the_most_used_per_byte_within_the_budget():
    counts = torch.tensor([[9, 1, 5, 0], [2, 8, 0, 4]])
    # Layer 1's experts are twice the bytes of layer 0's: its 8 is worth 4 a byte, less than layer 0's 5.
    # The minimum a layer first (layer 0's 9, layer 1's 8: 30 bytes), then by count per byte: layer 0's 5
    # (0.5 a byte), layer 1's 4 (0.2), then layer 0's 1 and layer 1's 2 tie at 0.1 (the lower layer first).
    assert place_experts(counts, expert_bytes=[10, 20], budget=40) == [[0, 2], [1]]
    assert place_experts(counts, expert_bytes=[10, 20], budget=60) == [[0, 2], [1, 3]]
    assert place_experts(counts, expert_bytes=[10, 20], budget=70) == [[0, 1, 2], [1, 3]]
    with pytest.raises(LuceboxError, match="does not hold 2 expert"):
        place_experts(counts, [10, 20], budget=50, min_per_layer=2)


def _q8_0_stack(experts: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    values = np.random.default_rng(seed).standard_normal((experts, rows, cols)).astype(np.float32)
    blocks = quants.quantize(values, GGMLQuantizationType.Q8_0)  # [E, rows, cols / 32 * 34]
    return torch.from_numpy(blocks.reshape(experts, -1).copy()), (experts, rows, cols)


def test_the_slot_pool_gives_the_all_resident_products_bit_for_bit():
    experts, hidden, inter, top_k = 8, 64, 32, 2
    stacks = {name: _q8_0_stack(experts, *shape, seed) for name, shape, seed in
              (("gate", (inter, hidden), 1), ("up", (inter, hidden), 2), ("down", (hidden, inter), 3))}
    full = {name: QuantTensor(name, GGMLQuantizationType.Q8_0, shape, host.reshape(-1))
            for name, (host, shape) in stacks.items()}
    pools = {name: ExpertSlots(host, slots=6, device="cpu", initial=[0, 1]) for name, (host, _) in stacks.items()}
    ops = TorchBackend("cpu", torch.float32, weight_cache_bytes=0)  # the pool's rows change between calls
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        x = torch.randn(3, hidden, generator=generator)
        ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(2)] +
                          [torch.tensor([0, 1])])  # at most 6 distinct experts: the pool's size
        weights = torch.softmax(torch.randn(3, top_k, generator=generator), dim=-1)
        slot_ids = {name: pool.resident_ids(ids) for name, pool in pools.items()}
        assert all(torch.equal(slot_ids["gate"], s) for s in slot_ids.values())
        in_slots = {name: QuantTensor(name, GGMLQuantizationType.Q8_0, (6, *stacks[name][1][1:]),
                                      pools[name].stack.reshape(-1)) for name in stacks}
        reference = ops.moe_experts_swiglu(x, full["gate"], full["up"], full["down"], weights, ids)
        offloaded = ops.moe_experts_swiglu(x, in_slots["gate"], in_slots["up"], in_slots["down"], weights,
                                           slot_ids["gate"])
        assert torch.equal(offloaded, reference), step
    stats = pools["gate"].stats
    assert stats.misses > 0 and stats.hits > 0
    assert stats.bytes_moved == (stats.misses + 2) * stacks["gate"][0].shape[1]  # the two placed at the start too


def test_least_recently_used_experts_leave_first():
    pool = ExpertSlots(torch.arange(6 * 4, dtype=torch.uint8).reshape(6, 4), slots=3, device="cpu", initial=[0, 1, 2])
    pool.resident_ids(torch.tensor([0]))  # 1 is now the least recently used
    mapped = pool.resident_ids(torch.tensor([5]))
    assert pool.resident == [0, 2, 5] and int(pool.slot_of[1]) == -1
    assert torch.equal(pool.stack[int(mapped[0])], torch.arange(20, 24, dtype=torch.uint8))
    with pytest.raises(LuceboxError, match="routes to 4 experts but the pool has 3 slots"):
        pool.resident_ids(torch.tensor([1, 2, 3, 4]))


def test_the_least_routed_resident_leaves_first_and_a_miss_must_outrank_it():
    """With routing counts (the profile's row, read live): the victim is the resident of the lowest count (ties:
    least recently used); a miss is worth promoting only past `RANK_MARGIN` times the victim's count; an eager
    batch never evicts an expert it needs, however rarely routed."""
    from lucebox_core.spark import RANK_MARGIN

    counts = np.array([10, 3, 7, 3, 3, 20], dtype=np.int64)
    pool = ExpertSlots(torch.arange(6 * 4, dtype=torch.uint8).reshape(6, 4), slots=3, device="cpu",
                       initial=[0, 1, 2], counts=counts)
    assert pool.victim() == 1 and pool.outranks(5) and not pool.outranks(4)
    assert counts[4] <= RANK_MARGIN * counts[1] < counts[5]
    counts[1] = 8  # the live counts move: now 2 (7) is the least routed resident
    assert pool.victim() == 2 and pool.outranks(4) is False
    pool.resident_ids(torch.tensor([2, 3]))  # 2 is needed: 3 evicts the next least routed, 1 (8), not 2 (7)
    assert pool.resident == [0, 2, 3] and int(pool.slot_of[1]) == -1
    assert torch.equal(pool.stack[int(pool.slot_of[3])], torch.arange(12, 16, dtype=torch.uint8))


# -- wired into the families ------------------------------------------------------------------------------


# The MoE families, each with its synthetic size that has experts: separate SwiGLU stacks (laguna, qwen35moe),
# and GeGLU over a fused [gate | up] stack with a per-expert scale in the router (gemma4).
MOE_SIZES = {"laguna": "tiny", "qwen35moe": "tiny", "gemma4": "tiny-moe"}


def write_moe(arch: str, folder, seed: int):
    from lucebox_core.plugins import registry

    synth = registry().named("lucebox_synthesizers", arch, "synth")
    return synth.write(folder / f"{arch}.gguf", size=MOE_SIZES[arch], type="q8_0", seed=seed)


@pytest.fixture(scope="module", params=list(MOE_SIZES))
def moe_file(request, tmp_path_factory):
    return write_moe(request.param, tmp_path_factory.mktemp(f"spark-{request.param}"), seed=7)


def _greedy(options, prompt, n=12):
    from lucebox_core.assembly import build_engine
    from lucebox_core.engine import GenerationRequest
    from lucebox_core.sampling import SamplingParams

    assembled = build_engine(options)
    request = GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True)
    return assembled.engine.generate(request).token_ids, assembled


def test_offloaded_experts_decode_as_the_all_resident_model(moe_file):
    from lucebox_core.assembly import EngineOptions

    prompt = torch.randint(10, 5000, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    plain, _ = _greedy(EngineOptions(model=str(moe_file), ctx_size=128), prompt)
    offloaded, assembled = _greedy(EngineOptions(model=str(moe_file), ctx_size=128, spark=True), prompt)
    assert offloaded == plain  # the 40-token prefill ran in expert groups, the decode steps through the pool
    described = assembled.spark.describe()
    assert 0 < described["residency"] < 1 and described["misses"] > 0 and described["hits"] > 0
    assert described["bytes_moved"] > 0
    # The profile counted every routed token: 51 positions (40 prompt + 11 fed) x top_k, in every MoE layer.
    from lucebox_core.spark import moe_blocks

    counts = assembled.spark.profile.counts
    top_k = moe_blocks(assembled.loaded.model)[0][1].top_k
    assert (counts.sum(dim=1) == (40 + 11) * top_k).all()
    assembled.spark.save_profile()
    assert RoutingProfile.path_for(moe_file).is_file()
    # The next start places the most routed experts first (before any request moves them).
    from lucebox_core.assembly import build_engine

    again = build_engine(EngineOptions(model=str(moe_file), ctx_size=128, spark=True))
    hottest = int(counts[0].argmax())
    assert hottest in again.spark.layers[0].pools[0].resident
    RoutingProfile.path_for(moe_file).unlink()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
def test_on_the_gpu_the_slots_live_on_the_device_and_decode_as_all_resident(moe_file):
    """On a GPU backend: the pools are device memory filled from pinned host copies, the whole stacks are never
    uploaded, the decode steps replay as graphs over the paged experts (misses read from pinned host memory),
    and greedy tokens equal the all-resident model's."""
    from lucebox_core.assembly import EngineOptions

    prompt = torch.randint(10, 5000, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    plain, _ = _greedy(EngineOptions(model=str(moe_file), ctx_size=128, device="cuda"), prompt)
    offloaded, assembled = _greedy(EngineOptions(model=str(moe_file), ctx_size=128, device="cuda", spark=True), prompt)
    assert offloaded == plain
    model = assembled.loaded.model
    assert model.decode_graphs is True and assembled.spark.graphed is not None
    for layer in assembled.spark.layers:
        for pool in layer.pools:
            assert pool.stack.device.type == "cuda" and pool.host.device.type == "cpu" and pool.host.is_pinned()
    # What the backend uploaded: the slot views (named `....slots`), never a full expert stack.
    uploaded = [weight.name for weight, _ in assembled.loaded.backend._device_weights.values()]
    assert any(name.endswith(".slots") for name in uploaded)
    assert not [name for name in uploaded if name.endswith("_exps.weight")]
    described = assembled.spark.describe()
    assert described["misses"] > 0 and described["bytes_moved"] > 0
    assert described["graphed"] and described["zero_copy_reads"] > 0


@pytest.mark.slow  # two CLI runs over the real Gemma-4 vocabulary: ~20 s on two cores
def test_generate_with_spark_on_a_gemma4_moe_file(tmp_path, capsys, monkeypatch):
    """`lucebox generate --spark` on a Gemma-4 MoE file (fused [gate | up] experts): the CLI assembles Spark
    around the model's experts, and the greedy tokens are the all-resident run's."""
    import json

    from lucebox_core import assembly, cli

    built, original = [], assembly.build_engine

    def recording(options, **kwargs):
        built.append(original(options, **kwargs))
        return built[-1]

    monkeypatch.setattr(assembly, "build_engine", recording)
    path = write_moe("gemma4", tmp_path, seed=11)
    runs = []
    for extra in ([], ["--spark"]):  # half the experts resident (the default budget)
        args = ["generate", "-m", str(path), "--prompt-ids", ",".join(str(i) for i in range(100, 112)), "-n", "4",
                "--temp", "0", "--json", "--ignore-eos", "-c", "128", *extra]
        assert cli.main(args) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert len(runs[0]) == 4 and runs[1] == runs[0]
    assert built[0].spark is None
    described = built[1].spark.describe()  # the CLI's engine ran Gemma-4's experts through the slot pools
    assert 0 < described["residency"] < 1 and described["misses"] > 0 and described["bytes_moved"] > 0


def test_spark_needs_moe_layers_and_a_budget_that_holds_top_k(tiny_target_and_draft, moe_file):
    from lucebox_core.assembly import EngineOptions, build_engine

    with pytest.raises(LuceboxError, match="no MoE layers"):
        build_engine(EngineOptions(model=str(tiny_target_and_draft[0]), ctx_size=64, spark=True))
    with pytest.raises(LuceboxError, match="expert budget"):
        build_engine(EngineOptions(model=str(moe_file), ctx_size=64, spark=True, spark_vram="1K"))
    for bad in ("150%", "0%", "lots%"):  # refused before the model is read, naming the flag
        with pytest.raises(LuceboxError, match="--spark-vram"):
            build_engine(EngineOptions(model=str(moe_file), ctx_size=64, spark=True, spark_vram=bad))


def test_spark_promote_takes_bytes_or_zero(moe_file):
    """`--spark-promote`: a size, 0 for none, the default when not given; anything else refused by name."""
    from lucebox_core.assembly import EngineOptions, build_engine
    from lucebox_core.spark import PROMOTION_BYTES, spark_promotion_bytes

    assert spark_promotion_bytes(None) == PROMOTION_BYTES and spark_promotion_bytes("8M") == 8 << 20
    assert spark_promotion_bytes("0") == 0 and spark_promotion_bytes(0) == 0
    for bad in ("lots", "-4M"):
        with pytest.raises(LuceboxError, match="--spark-promote"):
            build_engine(EngineOptions(model=str(moe_file), ctx_size=64, spark=True, spark_promote=bad))
    spark = build_engine(EngineOptions(model=str(moe_file), ctx_size=64, spark=True, spark_promote="0")).spark
    assert spark.describe()["promotion_bytes"] == 0


def test_spark_vram_takes_bytes_or_a_share_of_the_experts(moe_file):
    """`--spark-vram 25%` holds a quarter of the experts' bytes, `75%` three quarters; a size is bytes."""
    from lucebox_core.assembly import EngineOptions, build_engine
    from lucebox_core.spark import spark_budget

    assert spark_budget(None) == (None, 0.5)
    assert spark_budget("512M") == (512 << 20, 0.5) and spark_budget(" 60% ") == (None, 0.6)
    budgets = {}
    for share in ("25%", "75%"):
        spark = build_engine(EngineOptions(model=str(moe_file), ctx_size=64, spark=True, spark_vram=share)).spark
        budgets[share] = spark.budget
        assert spark.budget == int(spark.expert_bytes * float(share[:-1]) / 100)
    assert budgets["25%"] < budgets["75%"]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from conftest import loaded_service
    from lucebox_laguna import synth

    model = synth.write(tmp_path_factory.mktemp("spark-served") / "laguna.gguf", size="tiny", type="q8_0", seed=9)
    yield from loaded_service(tmp_path_factory, model=str(model), ctx_size=256, spark=True)


def test_the_server_reports_residency_and_saves_the_profile(service, oai, url):
    import httpx

    oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello there"}], max_tokens=4,
                                temperature=0)
    spark = httpx.get(f"{url}/props").json()["spark"]
    assert spark["enabled"] and 0 < spark["residency"] < 1 and spark["hits"] + spark["misses"] > 0
    assert spark["profile"].endswith(".gguf.spark.csv")
    metrics = httpx.get(f"{url}/metrics").text
    assert "lucebox_spark_residency " in metrics and "lucebox_spark_bytes_moved " in metrics
    service.spark.save_profile()  # what closing the server does
    assert RoutingProfile.load(spark["profile"], len(service.spark.layers), service.spark.profile.experts).counts.sum() > 0


def test_graphed_accounting_settles_every_layer_at_once():
    """Between graphed steps the routed pairs `[layers, experts]` are settled in array operations: hits where
    resident (marked used), misses with their pairs read from host memory, most routed first; the next
    promotion evicts the least recently used resident, never one the last step used."""
    from lucebox_core.spark import GraphedSteps, OffloadedExperts, Residency, RoutingProfile

    layers_n, experts, slots = 3, 16, 6
    mirror = Residency(layers_n, experts)
    profile = RoutingProfile(layers_n, experts)
    stack = QuantTensor("s", GGMLQuantizationType.F32, (experts, 2, 2), torch.arange(experts * 16, dtype=torch.uint8))
    layers = [OffloadedExperts(i, [stack, stack, stack], slots, list(range(slots)), profile, device="cpu",
                               mirror=mirror) for i in range(layers_n)]
    steps = GraphedSteps(TorchBackend("cpu", torch.float32), layers, profile, 10**9)
    pairs = np.zeros((layers_n, experts), dtype=np.int64)
    pairs[0, [1, 3, 9, 12]] = [2, 1, 5, 1]  # 9 and 12 missed (resident: 0..5)
    pairs[2, [0, 15]] = [1, 3]
    misses = steps._settle(pairs)
    assert misses == [(-5, 0, 9), (-3, 2, 15), (-1, 0, 12)]
    stats = [layer.pools[0].stats for layer in layers]
    assert [(s.hits, s.misses, s.zero_copy_reads) for s in stats] == [(2, 2, 6), (0, 0, 0), (1, 1, 3)]
    # Layer 0 used 1 and 3 last: the next two evictions take 0 and 2 (the oldest uses, lowest id first).
    evicted = [layers[0].promote(expert)[1] for expert in (9, 12)]
    assert evicted == [0, 2] and layers[0].pools[0].resident == [1, 3, 4, 5, 9, 12]
    assert layers[2].promote(15)[1] == 1  # 0 was used, 1..5 not: the lowest of those
    # The promotions' candidates (`ranked`): a miss only where its count outranks its layer's least routed
    # resident by RANK_MARGIN. Layer 0 holds 1, 3, 4, 5, 9, 12; the least routed of them is 1 (count 10).
    profile.counts[0] = torch.arange(experts) * 10
    profile.counts[0, 6] = 12  # not past 1.25 x 10
    pairs = np.zeros((layers_n, experts), dtype=np.int64)
    pairs[0, [6, 7, 9]] = [4, 1, 2]
    assert steps._settle(pairs, ranked=True) == [(-1, 0, 7)]
    assert layers[0].pools[0].outranks(7) and not layers[0].pools[0].outranks(6)
    # Residencies apart (not rows of one, in order) cannot be settled at once: refused when the steps are made.
    apart = [OffloadedExperts(i, [stack] * 3, slots, list(range(slots)), profile, device="cpu") for i in range(2)]
    with pytest.raises(LuceboxError, match="rows of one Residency"):
        GraphedSteps(TorchBackend("cpu", torch.float32), apart, profile, 10**9)
