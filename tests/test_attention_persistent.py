"""A decode step's gated attention as one op (`gated_attention_decode_`, the qwen35 family's) and its persistent CUDA
kernel's choice, on the CPU.

The op's reference is held to the attention written here from its definition (transformers' `Qwen3_5Attention` for
one token over a cache, on gguf's numpy dequantisation of the weights, in float64); the kernel itself runs only on a
GPU (tests/test_attention_persistent_gpu.py): here its source compiles (tests/test_cuda_compile.py), its limits are
the catalogue's, its partition covers the window, and its choice refuses what it cannot take, by name."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from lucebox_core.kquants import random_blocks
from lucebox_core.kv import FullKVCache, KVLayerShape
from lucebox_core.quants import QuantTensor
from lucebox_core.static_step import running_static_step
from lucebox_core.torch_backend import TorchBackend, concat_rows

pytestmark = pytest.mark.usefixtures("row_major_weights")  # these kernels read GGUF's rows

LAYER = 3  # an attention layer's index (a hybrid model's are sparse)


def _quant(name, ggml_type, rows, cols, seed):
    raw = random_blocks(ggml_type, rows * cols, 0.05, np.random.default_rng(seed))
    return QuantTensor(name, ggml_type, (rows, cols), torch.from_numpy(raw.copy()))


def _dequant(weight):
    return torch.from_numpy(gguf_quants.dequantize(weight.data.numpy().reshape(weight.shape[0], -1),
                                                   weight.ggml_type)).double()


def _attention(ops, hidden=256, heads=4, kv_heads=2, dim=256, rope_dim=64, v_type=T.Q6_K, dtype=torch.float32,
               past=5, seed=0):
    """A random gated attention, a cache holding `past` random positions, the input and the position after them."""
    from lucebox_qwen35.model import GatedAttention

    g = torch.Generator().manual_seed(seed)
    attention = GatedAttention(
        ops, LAYER,
        q_proj=_quant("q", T.Q4_K, heads * 2 * dim, hidden, seed),
        k_proj=_quant("k", T.Q4_K, kv_heads * dim, hidden, seed + 1),
        v_proj=_quant("v", v_type, kv_heads * dim, hidden, seed + 2),
        o_proj=_quant("o", T.Q4_K, hidden, heads * dim, seed + 3),
        q_norm=(torch.rand(dim, generator=g) + 0.5).to(dtype), k_norm=(torch.rand(dim, generator=g) + 0.5).to(dtype),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, rope_dim=rope_dim, rope_theta=10_000_000.0, eps=1e-6,
    )
    kv = FullKVCache({LAYER: KVLayerShape(kv_heads, dim, dim)}, 64, dtype=dtype)
    kv.write(LAYER, torch.arange(past), torch.randn(past, kv_heads, dim, generator=g).to(dtype),
             torch.randn(past, kv_heads, dim, generator=g).to(dtype))
    return attention, kv, torch.randn(1, 1, hidden, generator=g).to(dtype), torch.tensor([past])


def _by_definition(attention, kv, x, position):
    """One token of gated attention in float64 from the definition: returns (out, its key row, its value row)."""
    d, heads, kv_heads, rot = attention.head_dim, attention.num_heads, attention.num_kv_heads, attention.rope_dim
    m = x.double().reshape(-1)
    query_gate = (_dequant(attention.q_proj) @ m).reshape(heads, 2 * d)
    q, gate = query_gate[:, :d], query_gate[:, d:]
    k = (_dequant(attention.k_proj) @ m).reshape(kv_heads, d)
    v = (_dequant(attention.v_proj) @ m).reshape(kv_heads, d)

    def norm_rope(rows, weight):
        rows = rows / torch.sqrt((rows * rows).mean(-1, keepdim=True) + attention.eps) * weight.double()
        inv_freq = 1.0 / attention.rope_theta ** (torch.arange(0, rot // 2, dtype=torch.float64) * 2 / rot)
        angle = int(position) * inv_freq
        first, second = rows[:, : rot // 2], rows[:, rot // 2 : rot]
        cos, sin = angle.cos(), angle.sin()
        rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], -1)
        return torch.cat([rotated, rows[:, rot:]], -1)

    q, k = norm_rope(q, attention.q_norm), norm_rope(k, attention.k_norm)
    past_keys, past_values = (t[: int(position)].double() for t in kv.gather(LAYER, int(position)))
    keys, values = torch.cat([past_keys, k[None]]), torch.cat([past_values, v[None]])  # [P + 1, kv_heads, d]
    out = torch.empty(heads, d, dtype=torch.float64)
    group = heads // kv_heads
    for h in range(heads):
        scores = keys[:, h // group] @ q[h] / d ** 0.5
        out[h] = torch.softmax(scores, 0) @ values[:, h // group]
    return _dequant(attention.o_proj) @ (out * torch.sigmoid(gate)).reshape(-1), k, v


@pytest.mark.parametrize("fuse", [False, True])
def test_the_reference_is_gated_attention_by_its_definition(fuse):
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.float32, kernel_table_for={}))
    attention, kv, x, position = _attention(ops, v_type=T.Q4_K if fuse else T.Q6_K)  # rows of one type fuse
    if fuse:
        attention.in_proj, attention.in_proj_parts = concat_rows([attention.q_proj, attention.k_proj,
                                                                  attention.v_proj]), 3
    want_out, want_key, want_value = _by_definition(attention, kv, x, position)
    out = ops.gated_attention_decode_(x, attention, kv, position, 16)  # the window: 16 rows, masked past 5
    torch.testing.assert_close(out.reshape(-1).double(), want_out, rtol=1e-4, atol=1e-4)
    keys, values = kv.gather(LAYER, 16)
    torch.testing.assert_close(keys[int(position)].double(), want_key, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values[int(position)].double(), want_value, rtol=1e-5, atol=1e-5)


def test_a_decode_step_runs_each_attention_layer_after_the_first_through_the_add_and_norm_op(tmp_path, monkeypatch):
    """The tiny model's decode step (on the CPU, not recorded): every attention layer (none is the first layer,
    which has no MLP output to add yet) goes through `add_rms_norm_gated_attention_`, whose reference is the ops
    that ran before, so the logits are still the forward pass's."""
    from lucebox_core.ggufio import GGUFFile
    from lucebox_qwen35 import loader, ops as qwen_ops, synth

    path = synth.write(tmp_path / "tiny.gguf", size="tiny", type="q4_k_m", seed=3)
    seen = []
    reference = qwen_ops.QWEN35_OPS.references["add_rms_norm_gated_attention_"]
    monkeypatch.setitem(qwen_ops.QWEN35_OPS.references, "add_rms_norm_gated_attention_",
                        lambda ops, *a: seen.append(a[4]) or reference(ops, *a))
    model = loader.load(GGUFFile(path), TorchBackend("cpu", torch.float32))  # bound with the recording reference
    prompt = torch.tensor([7, 2, 13, 4, 8])
    state = model.new_state(32)
    model.forward(state, prompt[:-1])
    stepped = model.decode_step(state, int(prompt[-1]), graphs=False)
    whole = model.forward(model.new_state(32), prompt)[-1:]
    attentions = [layer.self_attn for layer in model.layers if not layer.is_linear]
    assert attentions and not model.layers[0].self_attn and seen == attentions
    logits = stepped[0] if isinstance(stepped, tuple) else stepped
    torch.testing.assert_close(logits.reshape(whole.shape), whole, rtol=1e-4, atol=1e-4)


def test_the_persistent_kernel_is_off_unless_asked_and_never_on_the_cpu(monkeypatch):
    from lucebox_cuda import attention_persistent
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.bfloat16, kernel_table_for={}))
    attention, kv, x, position = _attention(ops, dtype=torch.bfloat16)
    assert attention_persistent.refusal(x, attention, kv, position, 16) is None  # the shapes it takes
    monkeypatch.delenv(attention_persistent.ENV_SWITCH, raising=False)
    with running_static_step(decode_only=True):
        assert not attention_persistent.takes(ops, x, attention, kv, position, 16)
        monkeypatch.setenv(attention_persistent.ENV_SWITCH, "1")
        assert not attention_persistent.takes(ops, x, attention, kv, position, 16)  # a CPU tensor
    assert not attention_persistent.takes(ops, x, attention, kv, position, 16)  # outside a static step


class _QueryWatcher(FullKVCache):
    def observe_query(self, layer, query):
        pass


CASES = {
    "two tokens": "2 tokens",
    "f32": "activations torch.float32",
    "128 dims": "head dim 128",
    "uneven groups": "5 query heads over 2 KV heads",
    "16 heads a group": "32 query heads over 2 KV heads",
    "odd rope": "rope dims 63",
    "q_norm f64": "q_norm weight",
    "k_norm f32": "q_norm torch.bfloat16 beside k_norm torch.float32",
    "position int32": "position torch.int32",
    "q8_0 v": "tensor-core K-quant",
    "q6_k k": "tensor-core K-quant",
    "short o": "o rows 240",
    "f16 cache": "cache keys torch.float16",
    "q8_0 cache": "without plain rows",
    "sliding layer": "ring of 16 slots",
    "window past the cache": "window 65",
    "watched queries": "KV policy _QueryWatcher",
}


@pytest.mark.parametrize("case", CASES)
def test_the_persistent_kernel_refuses_what_it_cannot_take(case):
    from lucebox_cuda import attention_persistent
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.bfloat16, kernel_table_for={}))
    heads = {"uneven groups": 5, "16 heads a group": 32}.get(case, 4)
    attention, kv, x, position = _attention(ops, heads=heads, dim=128 if case == "128 dims" else 256,
                                            v_type=T.Q8_0 if case == "q8_0 v" else T.Q6_K, dtype=torch.bfloat16)
    window = 65 if case == "window past the cache" else 16
    shape = KVLayerShape(2, 256, 256)
    if case == "two tokens":
        x = torch.cat([x, x], dim=1)
    elif case == "f32":
        x = x.float()
    elif case == "odd rope":
        attention.rope_dim = 63
    elif case == "q_norm f64":
        attention.q_norm = attention.q_norm.double()
    elif case == "k_norm f32":
        attention.k_norm = attention.k_norm.float()
    elif case == "position int32":
        position = position.int()
    elif case == "q6_k k":
        attention.k_proj = _quant("k", T.Q6_K, 512, 256, 9)
    elif case == "short o":
        attention.o_proj = _quant("o", T.Q4_K, 240, 4 * 256, 9)
    elif case == "f16 cache":
        kv = FullKVCache({LAYER: shape}, 64, dtype=torch.float16)
    elif case == "q8_0 cache":
        kv = FullKVCache({LAYER: shape}, 64, dtype=torch.bfloat16, k_type="q8_0", v_type="q8_0")
    elif case == "sliding layer":
        kv = FullKVCache({LAYER: KVLayerShape(2, 256, 256, window=16)}, 64, dtype=torch.bfloat16)
    elif case == "watched queries":
        kv = _QueryWatcher({LAYER: shape}, 64, dtype=torch.bfloat16)
    reason = attention_persistent.refusal(x, attention, kv, position, window)
    assert reason is not None and CASES[case] in reason


def test_the_input_add_and_norm_is_refused_by_name_where_the_kernel_cannot_take_it():
    from lucebox_cuda import attention_persistent
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.bfloat16, kernel_table_for={}))
    attention, _, x, _ = _attention(ops, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm = torch.ones(256, dtype=torch.bfloat16)
    assert attention_persistent.residual_refusal(x, residual, norm, attention) is None
    assert "input norm torch.float32" in attention_persistent.residual_refusal(x, residual, norm.float(), attention)
    assert "residual torch.float32" in attention_persistent.residual_refusal(x, residual.float(), norm, attention)


def test_a_fused_weights_rows_are_addressed_where_they_start():
    """The kernel reads k's rows (and v's) inside the fused q | k | v weight: the weight's start plus the rows
    before them, whole GGUF rows."""
    from lucebox_cuda import attention_persistent, ffn_persistent
    from lucebox_qwen35.ops import QWEN35_OPS

    ops = QWEN35_OPS.bind(TorchBackend("cpu", torch.float32, kernel_table_for={}))
    attention, _, _, _ = _attention(ops, v_type=T.Q4_K)
    fused = concat_rows([attention.q_proj, attention.k_proj, attention.v_proj])
    attention.in_proj, attention.in_proj_parts = fused, 3
    rows = attention_persistent._rows(attention)
    q_rows, k_rows = attention.q_proj.shape[0], attention.k_proj.shape[0]
    assert rows["k"] == (fused, q_rows) and rows["v"] == (fused, q_rows + k_rows)
    assert attention_persistent.formats(attention, 256) == ("q4_k", "q4_k", "q4_k")

    class _Device:
        def device_weight(self, weight):
            return weight

    row_bytes = fused.data.numel() // fused.shape[0]
    pointer = ffn_persistent.row_pointer(_Device(), fused, q_rows + k_rows)
    assert torch.equal(fused.data[(q_rows + k_rows) * row_bytes:], attention.v_proj.data)
    assert pointer.value == fused.data.data_ptr() + (q_rows + k_rows) * row_bytes
    attention.in_proj_parts = 2  # q | k fused, v apart (another GGUF type)
    assert attention_persistent._rows(attention)["v"] == (attention.v_proj, 0)


@pytest.mark.parametrize("window", [1, 15, 16, 64, 65, 640, 4097, 8192])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_the_partition_covers_the_window_in_spans_of_whole_warps(window, kv_heads):
    """Every key of the window falls in exactly one warp's span (span index = key // span, the merge's rule), spans
    hold at least MIN_SPAN keys, and a long window spreads over about the grid's units."""
    from lucebox_cuda import attention_persistent as ap

    span, spans = ap.partition(window, kv_heads, units=264)
    assert span >= ap.MIN_SPAN
    assert (spans - 1) * ap.WARPS * span < window <= spans * ap.WARPS * span  # no unit without keys
    assert spans * ap.WARPS <= ap.MAX_PARTIALS  # the merge's shared weights hold every span
    if window >= 264 * ap.WARPS * ap.MIN_SPAN:
        assert kv_heads * spans <= 264 + kv_heads


def test_the_kernels_limits_are_the_catalogues():
    from lucebox_cuda import attention_persistent, catalogue, nvrtc

    source = nvrtc.kernel_sources()["attention_persistent.cu"]

    def constant(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", source).group(1))

    assert constant("ATTN_STAGE_VALUES") == catalogue.ATTENTION_PERSISTENT_STAGE_VALUES
    assert constant("ATTN_WARPS") * 32 == catalogue.ATTENTION_PERSISTENT_THREADS
    assert constant("ATTN_MAX_PARTIALS") == attention_persistent.MAX_PARTIALS
    assert (constant("ATTN_HEAD_DIM"), constant("ATTN_WARPS"), constant("ATTN_TILE")) == (
        attention_persistent.HEAD_DIM, attention_persistent.WARPS, attention_persistent.TILE)
