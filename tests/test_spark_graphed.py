"""Spark's graphed mode (issue #14): the decode step and the static verify pass stay one recorded step while
experts move. Each stack is paged (device slots, every expert in host memory, a device table expert -> slot);
the paged op reads an expert where the table says, so its products equal the all-resident stack's bit for bit;
between steps Spark counts what the steps routed and promotes the hot misses into slots.

On the CPU the graph contract is emulated (`test_static_step.GraphStandIn`: recording runs nothing, a replay
re-runs the recorded function into the recording's buffers), on real tiny GGUFs of both MoE families; the
GPU test (skipped without CUDA) replays real CUDA graphs over the paged kernel."""

from __future__ import annotations

import attrs
import pytest
import torch
from gguf import GGMLQuantizationType
from test_spark import MOE_SIZES, _q8_0_stack, write_moe
from test_static_step import GraphStandIn

from lucebox_core.quants import QuantTensor
from lucebox_core.spark import ExpertPages, ExpertSlots, attach_spark, moe_blocks
from lucebox_core.torch_backend import TorchBackend


def test_the_paged_op_equals_the_stacked_op_bit_for_bit():
    """The torch reference of `moe_experts_swiglu_paged` against `moe_experts_swiglu` over the whole stacks,
    on real Q8_0 blocks, with the routed experts resident, on the host, or some of each."""
    experts, hidden, inter, top_k, slots = 8, 64, 32, 2, 3
    stacks = {name: _q8_0_stack(experts, *shape, seed) for name, shape, seed in
              (("gate", (inter, hidden), 11), ("up", (inter, hidden), 12), ("down", (hidden, inter), 13))}
    full = {name: QuantTensor(name, GGMLQuantizationType.Q8_0, shape, host.reshape(-1))
            for name, (host, shape) in stacks.items()}
    ops = TorchBackend("cpu", torch.float32, weight_cache_bytes=0)
    generator = torch.Generator().manual_seed(1)
    for resident in ([0, 1, 2], [5], [3, 7, 6], []):
        pools = {name: ExpertSlots(host.clone(), slots, "cpu", initial=resident) for name, (host, _) in stacks.items()}
        for pool in pools.values():  # what must never be read: resident experts' host rows, empty slots
            pool.host[resident] = 0x7F
            if len(resident) < slots:
                pool.stack[len(resident):] = 0x7F
        pages = [ExpertPages(QuantTensor(f"{name}.slots", GGMLQuantizationType.Q8_0, (slots, *stacks[name][1][1:]),
                                         pools[name].stack.reshape(-1)), pools[name].host, pools[name].slot_of)
                 for name in stacks]
        counts = torch.zeros(experts, dtype=torch.long)  # the routing counts ride on the first stack only
        pages[0] = attrs.evolve(pages[0], counts=counts)
        routed = torch.zeros(experts, dtype=torch.long)
        for tokens in (1, 5):
            x = torch.randn(tokens, hidden, generator=generator)
            ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
            reference = ops.moe_experts_swiglu(x, full["gate"], full["up"], full["down"], weights, ids)
            paged = ops.moe_experts_swiglu_paged(x, *pages, weights, ids)
            assert torch.equal(paged, reference), (resident, tokens)
            routed += torch.bincount(ids.reshape(-1), minlength=experts)
        assert torch.equal(counts, routed)  # each routed pair counted once, wherever its expert was read
        assert pages[0].shape == (experts, inter, hidden)


def test_the_paged_geglu_op_equals_the_stacked_op_bit_for_bit():
    """Gemma-4's `moe_experts_paged` (GeGLU over a fused [gate | up] stack) against `moe_experts` over the whole
    stacks, on real Q8_0 blocks, the routed experts resident, on the host, or some of each; the routing weights
    carry a per-expert scale (as Gemma-4's router gives them), which the paged op must pass through alike."""
    from lucebox_gemma4.ops import GEMMA4_OPS

    experts, hidden, inter, top_k, slots = 8, 64, 32, 2, 3
    stacks = {name: _q8_0_stack(experts, *shape, seed) for name, shape, seed in
              (("gate_up", (2 * inter, hidden), 14), ("down", (hidden, inter), 15))}
    full = {name: QuantTensor(name, GGMLQuantizationType.Q8_0, shape, host.reshape(-1))
            for name, (host, shape) in stacks.items()}
    ops = GEMMA4_OPS.bind(TorchBackend("cpu", torch.float32, weight_cache_bytes=0))
    generator = torch.Generator().manual_seed(6)
    per_expert_scale = torch.rand(experts, generator=generator) * 2
    for resident in ([0, 1, 2], [6], [4, 7, 5], []):
        pools = {name: ExpertSlots(host.clone(), slots, "cpu", initial=resident) for name, (host, _) in stacks.items()}
        for pool in pools.values():  # what must never be read: resident experts' host rows, empty slots
            pool.host[resident] = 0x7F
            if len(resident) < slots:
                pool.stack[len(resident):] = 0x7F
        pages = [ExpertPages(QuantTensor(f"{name}.slots", GGMLQuantizationType.Q8_0, (slots, *stacks[name][1][1:]),
                                         pools[name].stack.reshape(-1)), pools[name].host, pools[name].slot_of)
                 for name in stacks]
        for tokens in (1, 6):
            x = torch.randn(tokens, hidden, generator=generator)
            ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1) * per_expert_scale[ids]
            reference = ops.moe_experts(x, full["gate_up"], full["down"], weights, ids)
            paged = ops.moe_experts_paged(x, *pages, weights, ids)
            assert torch.equal(paged, reference), (resident, tokens)
        assert pages[0].shape == (experts, 2 * inter, hidden)


@pytest.fixture(scope="module", params=list(MOE_SIZES))
def moe_file(request, tmp_path_factory):
    return request.param, write_moe(request.param, tmp_path_factory.mktemp(f"spark-graphed-{request.param}"), seed=21)


def _load(arch, path, backend):
    if arch == "laguna":
        from lucebox_laguna.loader import load

        return load(path, backend)
    if arch == "gemma4":
        from lucebox_gemma4.loader import load

        return load(path, backend)
    from lucebox_qwen35.loader import load_moe

    return load_moe(path, backend)


@pytest.mark.parametrize("promoted", [2, 0])
def test_graphed_steps_over_paged_experts_equal_the_all_resident_model(moe_file, monkeypatch, promoted):
    """Half the experts resident; the decode steps recorded once and replayed (emulated): every step's logits
    equal the all-resident model's bit for bit, no host lookup runs inside a step, experts are promoted
    between steps (the tables change), at most `promotion_bytes` a step, and the traffic is counted. With
    `--spark-promote 0` the same logits, the placement never changes and every miss is read from the host."""
    arch, path = moe_file
    backend = GraphStandIn(kernel_table_for={})
    plain, offloaded = _load(arch, path, backend), _load(arch, path, backend)
    block = moe_blocks(offloaded)[0][1]
    stacks = [getattr(block, name) for name in block.expert_layout.stacks]
    one_expert = sum(stack.nbytes for stack in stacks) // stacks[0].shape[0]
    spark = attach_spark(offloaded, share=0.5, promotion_bytes=promoted * one_expert)  # promotions a step at most
    assert spark.graphed is not None and offloaded.decode_graphs and spark.describe()["graphed"]
    prompt = torch.randint(10, 5000, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    states = [model.new_state(128) for model in (plain, offloaded)]
    # Every token through the decode step (a one-token forward is one; a multi-token prefill over the slots
    # runs in expert groups, exact in greedy tokens only): the first records, every later one replays.
    logits = [model.forward(state, torch.tensor(prompt[:1]), last_only=True)
              for model, state in zip((plain, offloaded), states)]
    assert torch.equal(logits[0], logits[1])
    tables = [layer.pools[0].slot_of.clone() for layer in spark.layers]
    lookups = []
    real_lookup = ExpertSlots.resident_ids
    monkeypatch.setattr(ExpertSlots, "resident_ids", lambda pool, ids: lookups.append(1) or real_lookup(pool, ids))
    promotions, fed = [], prompt[1:]
    for step in range(len(fed) + 10):
        token = fed[step] if step < len(fed) else int(logits[0].argmax())
        before = spark.describe()["promotions"]
        logits = [model.decode_step(state, token) for model, state in zip((plain, offloaded), states)]
        assert torch.equal(logits[0], logits[1]), step
        promotions.append(spark.describe()["promotions"] - before)
        token = int(logits[0].argmax())
    assert not lookups  # the steps decided nothing on the host
    recorded = states[1].decode
    assert len(recorded) == 1 and recorded.recordings()[0].replays == len(fed) + 10 and recorded.failure is None
    assert max(promotions) <= promoted and (sum(promotions) > 0) == (promoted > 0)
    spark.graphed.land()  # the last promotions' table entries (their copies ran beside the last step)
    changed = any(not torch.equal(table, layer.pools[0].slot_of) for table, layer in zip(tables, spark.layers))
    assert changed == (promoted > 0) and spark.describe()["promotion_bytes"] == promoted * one_expert
    for layer in spark.layers:  # the stacks' tables stay one
        assert all(torch.equal(layer.pools[0].slot_of, pool.slot_of) for pool in layer.pools)
        assert sorted(torch.nonzero(layer.pools[0].slot_of >= 0).reshape(-1).tolist()) == layer.pools[0].resident
    described = spark.describe()
    assert described["zero_copy_reads"] > 0 and described["misses"] > 0 and described["hits"] > 0
    # Every routed pair is counted once: 24 prompt tokens and 10 more fed, x top_k, in every MoE layer (the
    # last step's counts are taken in when the profile is saved).
    spark.save_profile()
    top_k = moe_blocks(offloaded)[0][1].top_k
    assert (spark.profile.counts.sum(dim=1) == (24 + 10) * top_k).all()
    if arch in ("qwen35moe", "gemma4"):  # the static verify pass: recorded per (window, nodes), replayed likewise
        for tokens in ([token, 5, 6, 7], [token, 9, 10, 11], [token, 12, 13, 14]):
            results = [model.verify(state, tokens, [-1, 0, 1, 2], static=True)
                       for model, state in zip((plain, offloaded), states)]
            assert torch.equal(results[0].logits, results[1].logits)
        assert states[1].verify.recordings()[0].replays == 2 and not lookups


def test_without_graphs_spark_steps_eagerly(tmp_path):
    """A backend that records no graphs (plain torch on the CPU): the eager lookup, decode steps eager."""
    from lucebox_laguna import synth

    path = synth.write(tmp_path / "laguna.gguf", size="tiny", type="q8_0", seed=3)
    model = _load("laguna", path, TorchBackend(kernel_table_for={}))
    spark = attach_spark(model)
    assert spark.graphed is None and model.decode_graphs is False and not spark.describe()["graphed"]
    assert getattr(model, "static_step_scope", None) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
@pytest.mark.parametrize("arch", ["laguna", "gemma4", "qwen35moe"])
def test_gpu_decode_graph_over_paged_experts_at_60_percent_equals_all_resident(tmp_path, arch):
    """On the GPU: a tiny Laguna (SwiGLU stacks) or Gemma-4 MoE (GeGLU over a fused [gate | up] stack) with 60%
    of its experts resident decodes through one recorded CUDA graph per KV window over the paged kernel,
    misses read from pinned host memory, promotions between replays, and every step's logits equal the
    all-resident model's bit for bit."""
    from lucebox_core.loading import load_model

    path = write_moe(arch, tmp_path, seed=13)
    plain = load_model(str(path), device="cuda").model
    offloaded = load_model(str(path), device="cuda").model
    spark = attach_spark(offloaded, share=0.6)
    assert spark.graphed is not None and offloaded.decode_graphs
    layer = spark.layers[0]
    x = torch.zeros(1, layer.views[0].shape[2], dtype=offloaded.ops.dtype, device=offloaded.ops.device)
    ids = torch.zeros(1, 2, dtype=torch.long, device=offloaded.ops.device)
    paged_op = getattr(offloaded.ops, layer.layout.paged_op)
    assert paged_op.choice(x, *layer.pages, ids.float(), ids) != "reference"
    prompt = torch.randint(10, 5000, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    states = [model.new_state(512) for model in (plain, offloaded)]
    # Every token through the decode step (a multi-token prefill over the slots is greedy-equal, not bit-equal).
    token = prompt[0]
    for step in range(len(prompt) + 24):
        logits = [model.decode_step(state, token) for model, state in zip((plain, offloaded), states)]
        assert torch.equal(logits[0], logits[1]), step
        token = prompt[step + 1] if step + 1 < len(prompt) else int(logits[0].argmax())
    step = states[1].decode
    assert step.graphs and step.failure is None and len(step) >= 1
    described = spark.describe()
    assert described["graphed"] and described["zero_copy_reads"] > 0 and described["promotions"] > 0
    for offload in spark.layers:
        for pool in offload.pools:
            assert pool.stack.device.type == "cuda" and pool.host.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
@pytest.mark.parametrize("one_table", [False, True])  # True: gate and up in one launch (the paged pair kernel)
def test_gpu_paged_kernel_recorded_once_follows_the_table_bit_for_bit(one_table):
    """The CUDA paged op (the paged moe_matvec kernel) against the stacked op over the whole stacks: eagerly,
    then recorded as one CUDA graph and replayed while experts move between slots and host memory (the
    replays read the table as it is then). Resident experts' host rows are garbage: they must come from slots.
    With one table for the three stacks (as `OffloadedExperts` gives them), gate and up pair in one launch."""
    from lucebox_cuda.backend import CudaBackend

    ops = CudaBackend("cuda", torch.bfloat16)
    experts, hidden, inter, top_k, slots = 8, 256, 128, 2, 3
    stacks = {name: _q8_0_stack(experts, *shape, seed) for name, shape, seed in
              (("gate", (inter, hidden), 31), ("up", (inter, hidden), 32), ("down", (hidden, inter), 33))}
    full = {name: QuantTensor(name, GGMLQuantizationType.Q8_0, shape, host.reshape(-1))
            for name, (host, shape) in stacks.items()}
    pools = {name: ExpertSlots(host.clone().pin_memory(), slots, ops.device, initial=[1, 4])
             for name, (host, _) in stacks.items()}
    pages = [ExpertPages(QuantTensor(f"{name}.slots", GGMLQuantizationType.Q8_0, (slots, *stacks[name][1][1:]),
                                     pools[name].stack.reshape(-1), volatile=True),
                         pools[name].host, pools["gate" if one_table else name].slot_of, True) for name in stacks]
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4, hidden, generator=generator).to(ops.device, torch.bfloat16)
    weights = torch.softmax(torch.randn(4, top_k, generator=generator), dim=-1).to(ops.device)
    ids = torch.tensor([[1, 0], [4, 7], [2, 1], [6, 4]], device=ops.device)
    assert ops.moe_experts_swiglu_paged.choice(x, *pages, weights, ids) != "reference"
    paired = ops.expert_matvec_pair(x, pages[0], pages[1], ids.reshape(-1), top_k)
    assert (paired is not None) == one_table

    def stacked():
        return ops.moe_experts_swiglu(x, full["gate"], full["up"], full["down"], weights, ids)

    _recorded_paged_op_follows_the_table(lambda: ops.moe_experts_swiglu_paged(x, *pages, weights, ids), stacked,
                                         pools)


def _recorded_paged_op_follows_the_table(paged, stacked, pools) -> None:
    """`paged()` equals `stacked()` eagerly, then recorded once as a CUDA graph and replayed while experts move
    between slots and host memory, the resident experts' host rows spoiled (they must come from the slots)."""
    assert torch.equal(paged(), stacked())
    graph, out = torch.cuda.CUDAGraph(), None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged()  # warm-up off the capture
        with torch.cuda.graph(graph, stream=stream):
            out = paged()
    torch.cuda.current_stream().wait_stream(stream)
    pristine = {name: pool.host.clone() for name, pool in pools.items()}
    for moved in ([], [6], [0, 2], [7]):
        for name, pool in pools.items():
            pool.host.copy_(pristine[name])
            for expert in moved:  # into a slot (the least recently used one out)
                pool._bring(expert)
        torch.cuda.synchronize()  # the copies out of the host rows are done: now spoil the resident ones
        for pool in pools.values():
            pool.host[pool.resident] = 0x7F
        graph.replay()
        torch.cuda.synchronize()
        for pool in pools.values():  # the stacked reference reads the unspoiled bytes of the whole stacks
            assert torch.equal(torch.nonzero(pool.slot_of >= 0).reshape(-1).cpu(), torch.tensor(pool.resident))
        assert torch.equal(out, stacked()), moved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
def test_gpu_paged_geglu_kernel_recorded_once_follows_the_table_bit_for_bit():
    """Gemma-4's paged op on CUDA (`moe_experts_paged`: the paged moe_matvec kernel over the fused [gate | up]
    stack and the down stack) against `moe_experts` over the whole stacks: eagerly, then recorded as one CUDA
    graph and replayed while experts move (resident experts' host rows spoiled: they must come from slots)."""
    from lucebox_cuda.backend import CudaBackend
    from lucebox_gemma4.ops import GEMMA4_OPS

    ops = GEMMA4_OPS.bind(CudaBackend("cuda", torch.bfloat16))
    experts, hidden, inter, top_k, slots = 8, 256, 128, 2, 3
    stacks = {name: _q8_0_stack(experts, *shape, seed) for name, shape, seed in
              (("gate_up", (2 * inter, hidden), 41), ("down", (hidden, inter), 42))}
    full = {name: QuantTensor(name, GGMLQuantizationType.Q8_0, shape, host.reshape(-1))
            for name, (host, shape) in stacks.items()}
    pools = {name: ExpertSlots(host.clone().pin_memory(), slots, ops.device, initial=[1, 4])
             for name, (host, _) in stacks.items()}
    pages = [ExpertPages(QuantTensor(f"{name}.slots", GGMLQuantizationType.Q8_0, (slots, *stacks[name][1][1:]),
                                     pools[name].stack.reshape(-1), volatile=True),
                         pools[name].host, pools[name].slot_of, True) for name in stacks]
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, hidden, generator=generator).to(ops.device, torch.bfloat16)
    weights = (torch.softmax(torch.randn(4, top_k, generator=generator), dim=-1) * 1.7).to(ops.device)
    ids = torch.tensor([[1, 0], [4, 7], [2, 1], [6, 4]], device=ops.device)
    assert ops.moe_experts_paged.choice(x, *pages, weights, ids) != "reference"

    def stacked():
        return ops.moe_experts(x, full["gate_up"], full["down"], weights, ids)

    _recorded_paged_op_follows_the_table(lambda: ops.moe_experts_paged(x, *pages, weights, ids), stacked, pools)


def test_the_paged_kernels_launch_arguments_for_counts_and_staging():
    """The CUDA backend's paged launches: a counts row must be a contiguous int64 row on the table's device
    (anything else is refused, naming what it got); the tensor-core kernels stage 16 rows of a missed expert in
    shared memory up to `STAGED_LIMIT` and read longer rows in place (0); the CUDA-core kernel takes no
    staging argument (None)."""
    from lucebox_cuda import catalogue
    from lucebox_cuda.backend import STAGED_LIMIT, _counts, _staged_bytes

    table = torch.full((8,), -1, dtype=torch.long)
    pages = ExpertPages(None, torch.zeros(8, 16, dtype=torch.uint8), table)
    assert _counts(pages).value is None  # no counts: a null pointer
    good = torch.zeros(8, dtype=torch.long)
    assert _counts(attrs.evolve(pages, counts=good)).value == good.data_ptr()
    for bad in (torch.zeros(8, dtype=torch.int32), torch.zeros(8, 2, dtype=torch.long)[:, 0]):
        with pytest.raises(ValueError, match="contiguous int64"):
            _counts(attrs.evolve(pages, counts=bad))
    mma = catalogue.moe_matvec_kernel("q4_k", "bf16", 2048, "pair_paged")
    row_bytes = 2048 // 256 * 144
    assert _staged_bytes(mma, row_bytes) == 16 * row_bytes <= STAGED_LIMIT
    assert _staged_bytes(mma, STAGED_LIMIT // 16 + 1) == 0
    # The SwiGLU down kind keeps its activation row (8 KiB) in static shared memory too: less room for rows.
    swiglu = catalogue.moe_matvec_kernel("q4_k", "bf16", 512, "paged_swiglu")
    assert _staged_bytes(swiglu, 16 * 1024 // 16) == 16 * 1024
    assert _staged_bytes(swiglu, STAGED_LIMIT // 16) == 0
    assert _staged_bytes(catalogue.moe_matvec_kernel("q8_0", "bf16", 2048, "paged"), 2048 // 32 * 34) is None
