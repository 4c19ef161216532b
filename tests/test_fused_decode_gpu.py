"""Session 21's decode-step kernels on a CUDA device (skipped without one): the one-launch MoE router against the
two-launch path and inside a replayed graph (its counters), the softplus head gate in the attention's merge
against the two kernels bit for bit, and the path attention's chunked merge keeping decode == verify to the bit
on the GPU's own reduction order. The CPU runs the same kernels in Triton's interpreter (test_cuda_router,
test_cuda_gates, test_triton_attention); only the GPU has the real memory ordering and reduction trees."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # A test module imported before this one may have put Triton in its interpreter (test_cuda_router does).
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton runs interpreted in this process"),
]


def _router_inputs(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, 2048, device="cuda", generator=g).to(torch.bfloat16)
    proj = torch.randn(256, 2048, device="cuda", generator=g) * 2048**-0.5  # Laguna-XS.2's fp32 router
    bias = torch.randn(256, device="cuda", generator=g) * 0.05
    return x, proj, bias


@pytest.mark.parametrize("tokens", [1, 3, 23])
def test_the_one_launch_router_routes_as_the_two_launch_path(tokens):
    from lucebox_cuda import triton_gates, triton_norms, triton_router

    x, proj, bias = _router_inputs(tokens, tokens)
    logits = (x.float() @ proj.T).to(torch.bfloat16)  # the product's output, rounded as `linear` gives it
    want_weights, want_ids = triton_gates.sigmoid_topk(logits, bias, 8, 2.5)
    weights, ids = triton_router.route(x, proj, 8, selection_bias=bias, scale=2.5)
    # Summation orders differ: ids may part only where two biased scores are within bf16's rounding.
    assert (ids == want_ids).float().mean() >= 0.95
    same = (ids == want_ids).all(dim=-1)
    torch.testing.assert_close(weights[same], want_weights[same], atol=1e-5, rtol=1e-5)
    soft_weights, soft_ids = triton_router.route(x, proj, 8)
    want_soft = triton_norms.softmax_topk(logits, None, 8)
    assert (soft_ids == want_soft[1]).float().mean() >= 0.95
    gate_row = torch.randn(1, 2048, device="cuda") * 0.02  # Qwen3.5-MoE's shared expert gate, one more row
    gated = triton_router.route(x, proj, 8, shared_gate=gate_row)
    assert torch.equal(gated[0], soft_weights) and torch.equal(gated[1], soft_ids)
    torch.testing.assert_close(gated[2].float(), (x.float() @ gate_row.T), atol=2e-2, rtol=2e-2)
    assert not triton_router._COUNTERS[x.device].any()


def test_the_one_launch_router_replays_in_a_graph():
    """Recorded once, replayed over new inputs: every replay routes as an eager call (the last program resets
    its token's counter, so the next replay counts from zero)."""
    from lucebox_cuda import triton_router

    x, proj, bias = _router_inputs(2, 7)
    static_x = x.clone()
    triton_router.route(static_x, proj, 8, selection_bias=bias, scale=2.5)  # counters made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = triton_router.route(static_x, proj, 8, selection_bias=bias, scale=2.5)
    for seed in range(10):
        fresh, _, _ = _router_inputs(2, 100 + seed)
        static_x.copy_(fresh)
        graph.replay()
        eager = triton_router.route(fresh, proj, 8, selection_bias=bias, scale=2.5)
        assert torch.equal(ids, eager[1]) and torch.equal(weights, eager[0]), f"replay {seed}"


@pytest.mark.parametrize("ring", [0, 512])
def test_the_gate_in_the_merge_equals_the_gate_kernel_bit_for_bit(ring):
    from lucebox_cuda import triton_attention, triton_gates

    g = torch.Generator(device="cuda").manual_seed(ring)
    position, rows = 700, 512 if ring else 1024
    q = torch.randn(1, 1, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(rows, 8, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    node_k, node_v = (torch.randn(1, 8, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    gate = (torch.randn(1, 1, 64, device="cuda", generator=g) * 3).to(torch.bfloat16)
    one = torch.ones(1, 1, dtype=torch.bool, device="cuda")
    pos = torch.tensor([position], device="cuda")
    extra = {"node_k": node_k, "node_v": node_v, "ring": ring}
    plain = triton_attention.tree_attention(q, k, v, pos, one, scale=128**-0.5, **extra)
    fused = triton_attention.tree_attention(q, k, v, pos, one, scale=128**-0.5, head_gate=gate, **extra)
    assert torch.equal(fused, triton_gates.softplus_head_gate(plain, gate))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("position", "window"), [(40, 300), (5000, 9000)])
def test_decode_equals_a_verified_node_past_one_merge_chunk(dtype, position, window):
    """A 27B-shaped attention (24 query heads on 4 KV heads of 256): every node of a tree equals the one-node
    decode over its committed path, to the bit, in a window with more (empty) splits: one split against two
    (a single-split merge), and 20 against 36 (past one chunk of 16, counts not multiples of 16)."""
    from lucebox_core.speculative.trees import TreeIndex
    from lucebox_cuda import triton_attention

    parents = [-1, 0, 0, 1, 3, 2, 2]
    nodes = len(parents)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, nodes, 24, 256, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(position + nodes, 4, 256, device="cuda", generator=g).to(dtype) for _ in range(2))
    visible = TreeIndex.build(parents).visibility().cuda()
    verified = triton_attention.tree_attention(q, k, v, torch.tensor([position], device="cuda"), visible,
                                               scale=256**-0.5)
    for node in range(nodes):
        path = [i for i in range(nodes) if visible[node, i]]
        k_decode, v_decode = (torch.randn(window, 4, 256, device="cuda", generator=g).to(dtype) for _ in range(2))
        k_decode[:position], v_decode[:position] = k[:position], v[:position]
        for depth, index in enumerate(path):
            k_decode[position + depth], v_decode[position + depth] = k[position + index], v[position + index]
        decoded = triton_attention.decode_attention(q[:, node : node + 1], k_decode, v_decode,
                                                    torch.tensor([position + len(path) - 1], device="cuda"),
                                                    scale=256**-0.5)
        assert torch.equal(decoded[0, 0], verified[0, node]), f"node {node}"


@pytest.mark.parametrize("arch", ["laguna", "qwen35moe", "qwen35", "gemma4"])
def test_programmatic_dependent_launch_changes_no_bit(arch, tmp_path, monkeypatch):
    """PDL moves when kernels start, never what they compute: a tiny file's graphed decode steps give the same
    logits, bit for bit, with PDL (the default) as with LUCEBOX_PDL=0 (a kernel reading before its wait would race and differ,
    at least now and then, over 24 steps of every layer)."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_core.static_step import running_static_step
    from lucebox_cuda import pdl
    from lucebox_cuda.backend import CudaBackend

    if torch.cuda.get_device_capability() < pdl.MIN_CAPABILITY:
        pytest.skip("PDL needs compute capability 9.0")
    if arch in ("laguna", "gemma4"):
        if arch == "laguna":
            from lucebox_laguna import loader, synth
        else:
            from lucebox_gemma4 import loader, synth
        path, load = synth.write(tmp_path / "tiny.gguf", size="tiny", type="q4_k_m", seed=3), loader.load
    else:
        from lucebox_qwen35 import loader, synth

        writer, load = (synth.write_moe, loader.load_moe) if arch == "qwen35moe" else (synth.write, loader.load)
        path = writer(tmp_path / "tiny.gguf", size="tiny", type="q4_k_m", seed=3)
    model = load(GGUFFile(path), CudaBackend(dtype=torch.bfloat16))
    prompt = torch.randint(0, 200, (5,), generator=torch.Generator().manual_seed(1)).cuda()

    def run(switch: str) -> list[torch.Tensor]:
        monkeypatch.setenv(pdl.ENV_SWITCH, switch)
        state = model.new_state(64)
        logits = model.forward(state, prompt)[-1:]
        outs = []
        for _ in range(24):
            token = logits.argmax(-1).reshape(1)
            logits = model.decode_step(state, token)
            outs.append(logits.clone())
        torch.cuda.synchronize()
        # Recorded and replayed, not run eagerly after a failed capture (which would compare eager with eager).
        assert state.decode is not None and state.decode.failure is None and state.decode._recorded
        return outs

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns
        plain, dependent = run("0"), run("1")
    device = torch.device("cuda", torch.cuda.current_device())
    assert not pdl.enabled(device)  # a prefill's launches never take it (its large kernels lose)
    with running_static_step():
        assert pdl.enabled(device)  # a static step's do: the decode steps above ran with it
    for step, (a, b) in enumerate(zip(plain, dependent)):
        assert torch.equal(a, b), f"step {step}"


@pytest.mark.parametrize("arch", ["laguna", "qwen35moe"])
def test_a_loaded_models_decode_step_takes_the_one_launch_router(arch, tmp_path, monkeypatch):
    """The router of a file loaded on the CUDA backend (its bytes first on the host, in the file's map) runs in
    one launch in every MoE layer of the decode step and of a short prefill."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_cuda import triton_router
    from lucebox_cuda.backend import CudaBackend

    if arch == "laguna":
        from lucebox_laguna import loader, synth

        path, load = synth.write(tmp_path / "tiny.gguf", size="tiny", type="q4_k_m", seed=3), loader.load
    else:
        from lucebox_qwen35 import loader, synth

        path, load = synth.write_moe(tmp_path / "tiny.gguf", size="tiny", type="q4_k_m", seed=3), loader.load_moe
    model = load(GGUFFile(path), CudaBackend(dtype=torch.bfloat16))
    calls = []
    route = triton_router.route
    monkeypatch.setattr(triton_router, "route", lambda *a, **k: calls.append(1) or route(*a, **k))
    state = model.new_state(64)
    model.forward(state, torch.arange(5, device="cuda"))
    moe_layers = sum(1 for layer in model.layers if hasattr(layer.mlp, "top_k"))
    assert moe_layers > 0
    assert len(calls) == moe_layers
    model.decode_step(state, torch.tensor([7], device="cuda"), graphs=False)
    assert len(calls) == 2 * moe_layers
