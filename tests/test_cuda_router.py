"""The one-launch MoE router (lucebox_cuda.triton_router: the router's product and the top-k choice together)
against the families' torch references (Laguna's `sigmoid_route`, Qwen3.5-MoE's `softmax_topk_route`), run on
the CPU by Triton's interpreter on random inputs; its counters, its per-token independence, and the op
kernels choosing it."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules are first imported

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'triton>=3.6,<3.7')")

import attrs
import torch
from gguf import GGMLQuantizationType
from lucebox_cuda import norm_kernels, triton_router
from triton.runtime.interpreter import InterpretedFunction

from lucebox_core.quants import QuantTensor
from lucebox_core.torch_backend import TorchBackend
from lucebox_laguna.ops import LAGUNA_OPS
from lucebox_qwen35.ops import QWEN35_OPS

if not isinstance(triton_router._route_kernel, InterpretedFunction):
    pytest.skip("lucebox_cuda.triton_router was imported earlier without TRITON_INTERPRET=1", allow_module_level=True)

# f16, not bf16: the interpreter truncates to bf16 where torch rounds to nearest, which moves near-tie logits.
DTYPES = [torch.float32, torch.float16]


def inputs(tokens: int, experts: int, hidden: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    proj = torch.randn(experts, hidden, generator=gen) * hidden**-0.5  # an fp32 router, as GGUF files keep it
    bias = torch.randn(experts, generator=gen) * 0.05
    return x, proj, bias


def reference(family, dtype: torch.dtype):
    return family.bind(TorchBackend("cpu", dtype, kernel_table_for={}))


def assert_same_choice(ids: torch.Tensor, want_ids: torch.Tensor, logits: torch.Tensor) -> None:
    """The same experts in the same order, but for equal logits (f16 rounds some pairs together: the kernel
    takes the lower index first, torch.topk either)."""
    assert torch.equal(logits.gather(-1, ids), logits.gather(-1, want_ids))
    assert (ids == want_ids).float().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("experts", "top_k", "tokens", "hidden"), [(256, 8, 3, 512), (50, 4, 2, 96), (16, 1, 1, 64)])
def test_sigmoid_router(dtype, experts, top_k, tokens, hidden):
    """Laguna's router: the reference's experts in order (chosen by score + bias), weights within fp32 roundoff."""
    x, proj, bias = inputs(tokens, experts, hidden, dtype, experts + hidden)
    want_weights, want_ids = reference(LAGUNA_OPS, dtype).sigmoid_route(x, proj.to(dtype), bias, top_k, 2.5)
    weights, ids = triton_router.route(x, proj.to(dtype), top_k, selection_bias=bias, scale=2.5)
    assert_same_choice(ids, want_ids, torch.sigmoid((x @ proj.to(dtype).T).float()) + bias)
    torch.testing.assert_close(weights, want_weights, atol=1e-5, rtol=1e-5)
    plain = torch.topk(torch.sigmoid((x.float() @ proj.T)), top_k).indices
    assert top_k == 1 or not torch.equal(ids, plain)  # the bias moved some choice: the kernel adds it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("experts", "top_k", "tokens", "hidden"), [(256, 8, 3, 512), (60, 4, 5, 80)])
def test_softmax_router(dtype, experts, top_k, tokens, hidden):
    """Qwen3.5-MoE's router: softmax over every expert, the top k renormalised."""
    x, proj, _ = inputs(tokens, experts, hidden, dtype, experts * top_k)
    want_weights, want_ids = reference(QWEN35_OPS, dtype).softmax_topk_route(x, proj.to(dtype), top_k)
    weights, ids = triton_router.route(x, proj.to(dtype), top_k)
    assert_same_choice(ids, want_ids, (x @ proj.to(dtype).T).float())
    torch.testing.assert_close(weights, want_weights, atol=1e-5, rtol=1e-5)


def test_a_token_routes_the_same_alone_or_in_a_verify_pass():
    """Each logit is its own fixed-order sum: a token's weights are the same bits whatever shares the launch
    (the decode step and a verify pass agree), and the counters are back at zero after every launch."""
    x, proj, bias = inputs(5, 256, 256, torch.float32, 3)
    together = triton_router.route(x, proj, 8, selection_bias=bias, scale=2.5)
    for token in range(5):
        alone = triton_router.route(x[token : token + 1], proj, 8, selection_bias=bias, scale=2.5)
        assert torch.equal(alone[0][0], together[0][token]) and torch.equal(alone[1][0], together[1][token])
    assert not triton_router._COUNTERS[torch.device("cpu")].any()


@pytest.mark.parametrize("rows", ["1", "8"])
def test_router_rows_a_program_change_the_grid_not_the_choice(monkeypatch, rows):
    """`LUCEBOX_ROUTER_EXPERTS_PER_PROGRAM` (a benchmark's A/B): 1 or 8 rows a program where the default is 2 (other
    grids, other masks, the shared gate's row in another program) route as the default, counters back at
    zero. Run by the interpreter, which ignores warps: that the GPU's warps may move a logit's last bits is why
    one process keeps one setting."""
    monkeypatch.delenv(triton_router.WARPS_ENV, raising=False)
    monkeypatch.delenv(triton_router.EXPERTS_ENV, raising=False)
    x, proj, bias = inputs(2, 60, 128, torch.float32, 9)
    gate = torch.randn(1, 128, generator=torch.Generator().manual_seed(4)) * 128**-0.5
    default = (triton_router.route(x, proj, 4, selection_bias=bias, scale=2.5)
               + triton_router.route(x, proj, 4, shared_gate=gate))
    monkeypatch.setenv(triton_router.EXPERTS_ENV, rows)
    spread = (triton_router.route(x, proj, 4, selection_bias=bias, scale=2.5)
              + triton_router.route(x, proj, 4, shared_gate=gate))
    assert all(torch.equal(a, b) for a, b in zip(spread, default))
    assert not triton_router._COUNTERS[torch.device("cpu")].any()


@pytest.mark.parametrize("name", ["WARPS_ENV", "EXPERTS_ENV"])
def test_a_bad_router_launch_setting_is_refused_by_name(monkeypatch, name):
    env = getattr(triton_router, name)
    x, proj, bias = inputs(1, 16, 64, torch.float32, 2)
    for bad in ("3", "16", "four"):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            triton_router.route(x, proj, 2, selection_bias=bias)


def test_gguf_float_routers_are_read_in_place_and_quantized_ones_left_to_the_product():
    proj = torch.randn(32, 64)
    as_gguf = QuantTensor("blk.0.ffn_gate_inp.weight", GGMLQuantizationType.F32, (32, 64),
                          proj.contiguous().view(torch.uint8).reshape(-1))
    assert torch.equal(triton_router.plain_weight(as_gguf), proj)
    half = QuantTensor("r", GGMLQuantizationType.F16, (32, 64), proj.half().view(torch.uint8).reshape(-1))
    assert triton_router.plain_weight(half).dtype == torch.float16
    q8 = QuantTensor("r", GGMLQuantizationType.Q8_0, (32, 64), torch.zeros(32 * 2 * 34, dtype=torch.uint8))
    assert triton_router.plain_weight(q8) is None
    x = torch.randn(1, 64)
    assert triton_router.takes(x, as_gguf) and not triton_router.takes(x, q8)
    assert not triton_router.takes(torch.randn(triton_router.MAX_TOKENS + 1, 64), as_gguf)  # a prefill chunk
    assert not triton_router.takes(torch.randn(1, 48), as_gguf)


def test_the_op_kernels_take_the_one_launch_router(monkeypatch):
    """The backend's `sigmoid_route` and `softmax_topk_route` run it for a decode step's token (one launch, no
    `linear`), the two-launch path when switched off, and both give the reference's routing."""
    backend = TorchBackend("cpu", torch.float32, kernel_table_for={})
    product = backend.linear
    products = []
    monkeypatch.setattr(backend, "linear", lambda *a, **k: products.append(1) or product(*a, **k))
    ops = LAGUNA_OPS.bind(backend)
    x, proj, bias = inputs(1, 64, 128, torch.float32, 9)
    fused = norm_kernels.sigmoid_route(ops, x, proj, bias, 4, 2.5)
    assert products == []
    monkeypatch.setenv(triton_router.ENV_SWITCH, "0")
    apart = norm_kernels.sigmoid_route(ops, x, proj, bias, 4, 2.5)
    assert products == [1]
    assert torch.equal(fused[1], apart[1])
    torch.testing.assert_close(fused[0], apart[0], atol=1e-6, rtol=1e-6)
    monkeypatch.delenv(triton_router.ENV_SWITCH)
    qwen = QWEN35_OPS.bind(TorchBackend("cpu", torch.float32, kernel_table_for={}))
    want = qwen.softmax_topk_route(x, proj, 4)
    got = norm_kernels.softmax_topk_route(qwen, x, proj, 4)
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("tokens", [1, 4])
def test_the_shared_expert_gate_rides_as_one_more_row(tokens):
    """Qwen3.5-MoE's router with its shared expert's gate (`softmax_topk_route_gated`): the reference's routing
    and gate logit (`linear`'s, in the activations' dtype), and the routing the same bits as without the gate."""
    x, proj, _ = inputs(tokens, 256, 256, torch.float32, 21)
    shared_gate = torch.randn(1, 256) * 0.1
    ops = reference(QWEN35_OPS, torch.float32)
    want_weights, want_ids, want_gate = ops.softmax_topk_route_gated(x, proj, shared_gate, 8)
    weights, ids, gate = triton_router.route(x, proj, 8, shared_gate=shared_gate)
    assert torch.equal(ids, want_ids) and gate.shape == want_gate.shape == (tokens, 1)
    torch.testing.assert_close(weights, want_weights, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gate, want_gate, atol=1e-5, rtol=1e-5)
    plain = triton_router.route(x, proj, 8)
    assert torch.equal(plain[0], weights) and torch.equal(plain[1], ids)
    backend = TorchBackend("cpu", torch.float32, kernel_table_for={})
    assert norm_kernels.accepts_softmax_topk_route_gated(backend, x, proj, shared_gate, 8)
    assert not norm_kernels.accepts_softmax_topk_route_gated(backend, x, proj, shared_gate.half(), 8)
    assert not triton_router.takes(x, proj, torch.randn(2, 256))  # one row only


# The CUDA backend's Triton kernels a tiny MoE model's decode step reaches (the NVRTC products need the GPU).
TRITON_OPS = ("sigmoid_route", "softmax_topk_route", "softmax_topk_route_gated", "gated_tree_attention",
              "tree_attention", "softplus_head_gate", "qk_norm_rope_scaled", "add_rms_norm")


def _backend_on_cpu(ran: list[str]):
    """A CPU backend with the CUDA backend's kernels for `TRITON_OPS` (run here in the interpreter), each call
    that reaches one noted in `ran`."""
    from lucebox_core.ops import kernel_table
    from lucebox_core.plugins import registry

    specs = [spec for spec in registry().op_kernels() if spec.backend == "cuda" and spec.op in TRITON_OPS]
    table = kernel_table("cuda", specs)
    for op, kernels in table.items():
        table[op] = [attrs.evolve(k, kernel=lambda *a, _k=k.kernel, _op=op, **kw: ran.append(_op) or _k(*a, **kw))
                     for k in kernels]
    return TorchBackend("cpu", torch.float32, kernel_table_for=table)


@pytest.mark.parametrize("arch", ["laguna", "qwen35moe"])
def test_a_tiny_model_decodes_on_the_kernels_as_on_the_reference(arch, tmp_path):
    """The static decode step of a tiny file on the CUDA backend's kernel table (the one-launch router, the gated
    attention merge: every layer's call goes to the kernels, counted) gives the reference backend's logits."""
    from lucebox_core.ggufio import GGUFFile

    if arch == "laguna":
        from lucebox_laguna import loader, synth

        path, load = synth.write(tmp_path / "tiny.gguf", size="tiny", seed=4), loader.load
        fused_ops = ("sigmoid_route", "gated_tree_attention")
    else:
        from lucebox_qwen35 import loader, synth

        path, load = synth.write_moe(tmp_path / "tiny.gguf", size="tiny", seed=4), loader.load_moe
        fused_ops = ("softmax_topk_route_gated",)
    ran: list[str] = []
    kernels = load(GGUFFile(path), _backend_on_cpu(ran))
    reference = load(GGUFFile(path), TorchBackend("cpu", torch.float32, kernel_table_for={}))
    ids = torch.randint(0, 200, (6,), generator=torch.Generator().manual_seed(2))
    states = kernels.new_state(32), reference.new_state(32)
    kernels.forward(states[0], ids[:3]), reference.forward(states[1], ids[:3])
    ran.clear()
    for token in ids[3:]:
        got = kernels.decode_step(states[0], token.reshape(1), graphs=False)
        want = reference.decode_step(states[1], token.reshape(1), graphs=False)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    moe_layers = sum(1 for layer in kernels.layers if hasattr(layer.mlp, "top_k"))
    assert moe_layers > 0
    for name in fused_ops:  # every MoE layer (and every attention layer) of every step took the kernel
        assert ran.count(name) >= 3 * (moe_layers if "route" in name else 1), (name, ran.count(name))


def test_a_verify_pass_routes_in_one_launch_as_the_decode_step():
    """Every verify pass the backend runs on its matrix-vector kernels fits one launch: a verified node must
    route with the decode step's arithmetic (the two-launch path sums the logits in another order)."""
    from lucebox_cuda import op_kernels

    assert triton_router.MAX_TOKENS >= op_kernels.VERIFY_ROWS
    assert len(triton_router._counters(torch.device("cpu"))) >= triton_router.MAX_TOKENS


def test_a_gguf_router_is_read_from_the_backends_device_copy():
    """A loaded model's router is the file's memory map on the host; the kernel reads the backend's upload."""
    from lucebox_cuda.norm_kernels import _on_device

    class Backend:
        device = torch.device("cuda", 0)  # never touched: only compared

        def __init__(self):
            self.uploads = []

        def device_weight(self, weight):
            self.uploads.append(weight.name)
            return weight

    backend = Backend()
    router = QuantTensor("blk.0.ffn_gate_inp.weight", GGMLQuantizationType.F32, (4, 8),
                         torch.zeros(4 * 8 * 4, dtype=torch.uint8))
    plain = torch.zeros(4, 8)
    assert _on_device(backend, router, plain) == (router, plain)
    assert backend.uploads == ["blk.0.ffn_gate_inp.weight"]
