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
