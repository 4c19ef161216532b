"""The MoE block as data (`lucebox_core.moe_routing`) and the add + norm + MoE op (`add_rms_norm_moe`), on the CPU.

A family's MoE block says what it is (`routing()`) once its shared expert's rows are fused, never with Spark's
paged stacks; the decoder runs every such block through the one op, whose reference is the block's own code, so
the logits are the unfused model's. The persistent CUDA kernel runs only on a GPU
(tests/test_moe_persistent_gpu.py); here it compiles (tests/test_cuda_compile.py) and its check refuses, by name,
each thing it cannot take."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from lucebox_core.kquants import random_blocks
from lucebox_core.moe_routing import SIGMOID, SOFTMAX, MoERouting
from lucebox_core.quants import QuantTensor
from lucebox_core.torch_backend import TorchBackend, concat_rows

pytestmark = pytest.mark.usefixtures("row_major_weights")  # these kernels read GGUF's rows


def _quant(ggml_type, shape, seed):
    raw = random_blocks(ggml_type, int(np.prod(shape)), 0.05, np.random.default_rng(seed))
    return QuantTensor(f"w{seed}", ggml_type, shape, torch.from_numpy(raw.copy()))


class _Recording(TorchBackend):
    def __init__(self):
        super().__init__(dtype=torch.float32)
        self.calls = []

    def add_rms_norm_moe(self, *args):
        self.calls.append(args[-1])
        return super().add_rms_norm_moe(*args)


def _fuse_shared_experts(model):
    blocks = [layer.mlp for layer in model.layers if callable(getattr(layer.mlp, "routing", None))]
    for block in blocks:
        assert block.routing() is None  # the reference backend does not fuse the shared expert's rows
        shared = block.shared_expert
        shared.gate_up_proj = concat_rows([shared.gate_proj, shared.up_proj])
    return blocks


@pytest.mark.parametrize("arch", ["laguna", "qwen35moe"])
def test_every_moe_block_goes_through_the_op_and_the_logits_stay(arch, tmp_path):
    """The tiny file of each MoE family on the reference backend: with the shared experts' rows fused, every MoE
    block's add + norm + block is one `add_rms_norm_moe` call, its routing the block's own tensors, and the logits
    of a prefill and a decode step those of the same model whose blocks say nothing (`routing` None)."""
    from lucebox_core.ggufio import GGUFFile

    if arch == "laguna":
        from lucebox_laguna import loader, synth

        path, load, choice = synth.write(tmp_path / "t.gguf", size="tiny", type="q4_k_m", seed=2), loader.load, SIGMOID
    else:
        from lucebox_qwen35 import loader, synth

        path, load = synth.write_moe(tmp_path / "t.gguf", size="tiny", type="q4_k_m", seed=2), loader.load_moe
        choice = SOFTMAX
    plain = load(GGUFFile(path), TorchBackend(dtype=torch.float32))
    fused = load(GGUFFile(path), _Recording())
    blocks = _fuse_shared_experts(fused)
    assert blocks
    for block in blocks:
        routing = block.routing()
        assert routing.choice == choice and routing.router is block.router and routing.top_k == block.top_k
        assert routing.gate_exps is block.gate_exps and routing.down_exps is block.down_exps
        assert routing.shared_gate_up is block.shared_expert.gate_up_proj
        assert (routing.selection_bias is not None) == (choice == SIGMOID)
        assert (routing.shared_gate is not None) == (choice == SOFTMAX)
    tokens = torch.tensor([5, 17, 33, 2])
    runs = []
    for model in (plain, fused):
        state = model.new_state(16)
        logits = [model.forward(state, tokens)[-1]]
        logits.append(model.forward(state, logits[-1].argmax().reshape(1))[-1])
        runs.append(torch.stack(logits))
    assert len(fused.ops.calls) == 2 * len(blocks) and all(call in blocks for call in fused.ops.calls)
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-5)


def _routing(choice=SIGMOID, *, experts=16, top_k=4, hidden=256, inter=256, **changes):
    """A tiny Laguna-like block's routing (Qwen3.5-MoE-like for SOFTMAX); `changes` replace fields (made only
    where not replaced)."""
    made = {
        "gate_exps": lambda: _quant(T.Q4_K, (experts, inter, hidden), 1),
        "up_exps": lambda: _quant(T.Q4_K, (experts, inter, hidden), 2),
        "down_exps": lambda: _quant(T.Q6_K, (experts, hidden, inter), 3),
        "shared_gate_up": lambda: _quant(T.Q4_K, (2 * inter, hidden), 4),
        "shared_down": lambda: _quant(T.Q6_K, (hidden, inter), 5),
        "router": lambda: torch.randn(experts, hidden),
        "selection_bias": lambda: torch.zeros(experts) if choice == SIGMOID else None,
        "shared_gate": lambda: torch.randn(1, hidden) if choice == SOFTMAX else None,
    }
    fields = {name: changes.pop(name) if name in changes else make() for name, make in made.items()}
    return MoERouting(choice=choice, top_k=top_k, scale=2.5 if choice == SIGMOID else 1.0, **fields, **changes)


@pytest.mark.parametrize("case", ["no routing", "two tokens", "fp16 norm", "bf16 router", "too many experts",
                                  "top-k", "no bias", "no shared gate", "q8_0 stacks", "gate and up apart",
                                  "shared expert", "short rows", "too wide", "gated sigmoid", "biased softmax",
                                  "misaligned router"])
def test_the_persistent_moe_kernel_refuses_what_it_cannot_take(case):
    """Each case breaks one condition of a call the kernel takes (a tiny Laguna-like block, which it does take,
    sigmoid and softmax alike): the refusal names what is wrong."""
    from lucebox_cuda import moe_persistent

    x = torch.randn(1, 1, 256, dtype=torch.bfloat16)
    norm = torch.ones(256)
    assert moe_persistent.refusal(x, x, norm, _routing()) is None
    assert moe_persistent.refusal(x, x, norm, _routing(SOFTMAX)) is None
    routing, expected = _routing(), None
    if case == "no routing":
        routing, expected = None, "no routing"
    elif case == "two tokens":
        x, expected = torch.randn(1, 2, 256, dtype=torch.bfloat16), "2 tokens"
    elif case == "fp16 norm":  # neither fp32 nor the activations' bf16
        norm, expected = norm.half(), "norm weight"
    elif case == "bf16 router":
        routing, expected = _routing(router=torch.randn(16, 256).bfloat16()), "router"
    elif case == "too many experts":
        routing, expected = _routing(experts=520, top_k=8), "at most 512 experts"
    elif case == "top-k":
        routing, expected = _routing(top_k=17), "top-k 17"
    elif case == "no bias":
        routing, expected = _routing(selection_bias=None), "selection bias"
    elif case == "no shared gate":
        routing, expected = _routing(SOFTMAX, shared_gate=None), "shared-expert gate"
    elif case == "q8_0 stacks":
        routing = _routing(gate_exps=_quant(T.Q8_0, (16, 256, 256), 6), up_exps=_quant(T.Q8_0, (16, 256, 256), 7))
        expected = "tensor-core"
    elif case == "gate and up apart":
        routing, expected = _routing(up_exps=_quant(T.Q6_K, (16, 256, 256), 8)), "gate and up"
    elif case == "shared expert":
        routing, expected = _routing(shared_down=_quant(T.Q4_K, (256, 256), 9)), "shared expert"
    elif case == "short rows":
        routing = _routing(inter=160, **{name: _quant(T.Q8_0, shape, seed) for name, shape, seed in (
            ("gate_exps", (16, 160, 256), 10), ("up_exps", (16, 160, 256), 11), ("down_exps", (16, 256, 160), 12),
            ("shared_gate_up", (320, 256), 13), ("shared_down", (256, 160), 14))})
        expected = "whole 256-value blocks"
    elif case == "too wide":
        routing, expected = _routing(top_k=8, inter=1024), "at most 8192 values"
    elif case == "gated sigmoid":
        routing, expected = _routing(shared_gate=torch.randn(1, 256)), "gated shared expert"
    elif case == "biased softmax":
        routing, expected = _routing(SOFTMAX, selection_bias=torch.zeros(16)), "selection bias or a scale"
    else:
        routing, expected = _routing(router=torch.randn(16 * 256 + 1)[1:].view(16, 256)), "router"
    reason = moe_persistent.refusal(x, x, norm, routing)
    assert reason is not None and expected in reason, reason


def test_a_routing_record_names_its_choice():
    with pytest.raises(ValueError):
        _routing(choice="top-2")
