"""Fused projections (`ops.fuse_rows`): a backend that stacks the weights sharing an input gives the same
model. Checked on the CPU with the reference ops plus row stacking, on quantized tiny synthetic files
(whose GGUF types differ per tensor, so some groups fuse and some cannot), for prefill, the static decode
step and tree verification; and `concat_rows` on its own against the parts."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from lucebox_core.loading import load_model
from lucebox_core.quants import QuantTensor
from lucebox_core.torch_backend import TorchBackend, concat_rows
from lucebox_qwen35 import loader as qwen_model
from lucebox_qwen35 import synth
from lucebox_qwen35.memory import weights_of


class StackingBackend(TorchBackend):
    """The reference ops, with projections stacked as a fast backend would."""

    def fuse_rows(self, weights):
        return concat_rows(weights)


@pytest.fixture(scope="module", params=["q8_0", "q4_k_m"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("fused") / f"tiny-{request.param}.gguf"
    synth.write(path, size="tiny", type=request.param, seed=5)
    plain = load_model(path).model
    fused = qwen_model.load(path, StackingBackend())
    return plain, fused


def test_some_projections_fuse(pair):
    _, fused = pair
    fused_parts = [layer.mlp.gate_up_proj for layer in fused.layers]
    fused_parts += [layer.linear_attn.in_proj_ba for layer in fused.layers if layer.linear_attn is not None]
    assert all(part is not None for part in fused_parts)
    # Memory accounting counts a stacked weight once, not with its parts.
    plain_bytes = fused.estimate_memory(64).weights
    layer = fused.layers[0]
    names = {id(w) for w in weights_of(layer)}
    assert id(layer.mlp.gate_proj) not in names and id(layer.mlp.gate_up_proj) in names
    assert plain_bytes == pair[0].estimate_memory(64).weights


def test_fused_model_equals_plain(pair):
    plain, fused = pair
    prompt = torch.randint(0, plain.vocab_size, (23,), generator=torch.Generator().manual_seed(2))
    a, b = plain.new_state(), fused.new_state()
    torch.testing.assert_close(fused.forward(b, prompt), plain.forward(a, prompt), atol=1e-4, rtol=1e-4)
    token = int(prompt[-1])
    for _ in range(6):  # the static decode step (fused one-token ops) against the plain model's
        x, y = plain.decode_step(a, token, graphs=False), fused.decode_step(b, token, graphs=False)
        torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)
        token = int(x.argmax())
    parents = [-1, 0, 0, 1, 3]
    tokens = torch.randint(0, plain.vocab_size, (5,), generator=torch.Generator().manual_seed(4))
    va, vb = plain.verify(a, tokens, parents), fused.verify(b, tokens, parents)
    torch.testing.assert_close(vb.logits, va.logits, atol=1e-4, rtol=1e-4)


def test_concat_rows_stacks_rows():
    gen = torch.Generator().manual_seed(0)
    parts = [QuantTensor(f"w{i}", T.Q8_0, (rows, 64), torch.randint(0, 255, (rows * 2 * 34,), dtype=torch.uint8,
                                                                     generator=gen))
             for i, rows in enumerate((3, 5))]
    for part in parts:  # make the fp16 scales finite
        part.data.view(-1, 34)[:, 1] = 0x3C
    stacked = concat_rows(parts)
    assert stacked.shape == (8, 64)
    torch.testing.assert_close(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert concat_rows([parts[0], QuantTensor("f", T.F32, (2, 64), torch.zeros(512, dtype=torch.uint8))]) is None
    dense = [torch.randn(2, 4, generator=gen), torch.randn(3, 4, generator=gen)]
    assert torch.equal(concat_rows(dense), torch.cat(dense))
    assert concat_rows([dense[0], dense[1].double()]) is None
