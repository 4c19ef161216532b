"""GGUFFile: metadata, zero-copy tensors, `describe`, and a GGUFError for every kind of broken file."""

import math
import os
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.constants import GGUFValueType

from lucebox_core.errors import GGUFError
from lucebox_core.ggufio import GGUFFile, describe, format_description
from test_quants import random_block_bytes, random_float_bytes

VOCAB_DIR = Path("/work/shared/fixtures/vocab")
TOKENS = ["<s>", "hello", "héllo", "日本", " world"]


def build_tensors(rng: np.random.Generator) -> dict[str, tuple[T, np.ndarray]]:
    """name -> (type, raw bytes shaped (rows, row bytes)); insertion order is file order."""
    def quantized(qtype, shape):
        return qtype, gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)

    return {
        "token_embd.weight": quantized(T.Q8_0, (8, 64)),
        "blk.0.attn_q.weight": quantized(T.Q4_0, (4, 64)),
        "blk.0.ffn_up.weight": (T.Q4_K, random_block_bytes(T.Q4_K, (2, 256), rng)),
        "blk.0.ffn_gate.weight": (T.Q5_K, random_block_bytes(T.Q5_K, (3, 256), rng)),
        "blk.0.ffn_down.weight": (T.Q6_K, random_block_bytes(T.Q6_K, (2, 512), rng)),
        "blk.0.attn_norm.weight": (T.F32, random_float_bytes(T.F32, (64,), rng)),
        "output_norm.weight": (T.F16, random_float_bytes(T.F16, (2, 32), rng)),
        "blk.0.attn_k.weight": (T.BF16, random_float_bytes(T.BF16, (3, 16), rng)),
        "blk.0.exotic.weight": (T.Q2_K, rng.integers(0, 256, (1, 84), dtype=np.uint8)),
    }


def write_model(path: Path, tensors: dict[str, tuple[T, np.ndarray]]) -> Path:
    writer = gguf.GGUFWriter(path, "testarch")
    writer.add_name("tiny test model")
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_float32("testarch.rope.freq_base", 10000.0)
    writer.add_float32("testarch.logit_scale", 0.5)
    writer.add_bool("testarch.use_bias", True)
    writer.add_array("testarch.head_count_kv", [2, 1])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_chat_template("{{ messages }}")
    for name, (ggml_type, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def model(tmp_path):
    tensors = build_tensors(np.random.default_rng(42))
    return write_model(tmp_path / "tiny.gguf", tensors), tensors


def torch_shape(ggml_type: T, raw: np.ndarray) -> tuple[int, ...]:
    return tuple(gguf.quants.quant_shape_from_byte_shape(raw.shape, ggml_type))


# --- reading a good file -------------------------------------------------------------------------------


def test_tensors_round_trip_bit_exact(model):
    path, tensors = model
    gf = GGUFFile(path)
    assert list(gf.tensors) == list(tensors)
    for name, (ggml_type, raw) in tensors.items():
        info = gf.tensors[name]
        assert info.ggml_type == ggml_type
        assert info.shape == torch_shape(ggml_type, raw)
        assert info.n_bytes == raw.nbytes
        if ggml_type == T.Q2_K:
            continue
        qt = gf.tensor(name, shape=info.shape)
        reference = gguf.quants.dequantize(raw, ggml_type).astype(np.float32).reshape(info.shape)
        assert np.abs(reference).max() > 0
        assert torch.equal(qt.dequantize(), torch.from_numpy(reference)), name


def test_tensor_bytes_are_a_view_on_the_file_map_without_warnings(model):
    path, _ = model
    gf = GGUFFile(path)
    info = gf.tensors["blk.0.ffn_up.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qt = gf.tensor("blk.0.ffn_up.weight")
    file_map = gf._reader.data
    assert qt.data.data_ptr() == file_map.ctypes.data + info.offset
    with open(path, "rb") as f:
        f.seek(info.offset)
        assert qt.data.numpy().tobytes() == f.read(info.n_bytes)


def test_shape_wildcards(model):
    path, _ = model
    gf = GGUFFile(path)
    assert gf.tensor("token_embd.weight", shape=(None, 64)).shape == (8, 64)
    assert gf.has_tensor("token_embd.weight") and not gf.has_tensor("token_embd")


def test_metadata_values(model):
    path, _ = model
    gf = GGUFFile(path)
    assert gf.path == path and gf.version == 3
    assert gf.architecture == "testarch"
    meta = gf.metadata
    assert meta["general.name"] == "tiny test model"
    assert meta["testarch.block_count"] == 2
    assert meta["testarch.rope.freq_base"] == 10000.0
    assert meta["testarch.use_bias"] is True
    assert meta["testarch.head_count_kv"] == [2, 1]
    assert meta["tokenizer.ggml.tokens"] == TOKENS
    assert not any(key.startswith("GGUF.") for key in meta)


def test_get_checks_types(model):
    path, _ = model
    gf = GGUFFile(path)
    assert gf.get("testarch.block_count", int) == 2
    freq = gf.arch_get("block_count", float)  # an int is fine where a float is wanted
    assert freq == 2.0 and isinstance(freq, float)
    assert gf.arch_get("logit_scale", float) == 0.5
    assert gf.get("testarch.use_bias", bool) is True
    assert gf.get("tokenizer.ggml.tokens", list[str]) == TOKENS
    assert gf.get("testarch.head_count_kv", list[int]) == [2, 1]
    assert gf.get("no.such.key", int, default=7) == 7
    assert gf.arch_get("no_such_key", default=None) is None

    with pytest.raises(GGUFError) as excinfo:
        gf.get("testarch.logit_scale", int)
    assert str(path) in str(excinfo.value)
    assert "'testarch.logit_scale'" in str(excinfo.value)
    assert "FLOAT32" in str(excinfo.value) and "int" in str(excinfo.value)
    with pytest.raises(GGUFError, match=r"'testarch.use_bias' has type BOOL, expected int"):
        gf.get("testarch.use_bias", int)
    with pytest.raises(GGUFError, match=r"'tokenizer.ggml.tokens' has type ARRAY of STRING, expected list\[int\]"):
        gf.get("tokenizer.ggml.tokens", list[int])
    with pytest.raises(GGUFError, match=r"tiny\.gguf: missing metadata key 'testarch.expert_count'"):
        gf.arch_get("expert_count", int)


# --- broken files ---------------------------------------------------------------------------------------


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def key_offsets(path: Path, key: str) -> tuple[int, int]:
    """(offset of the value type, offset of the value) of metadata `key`, found by gguf's own reader."""
    field = gguf.GGUFReader(path).fields[key]
    type_offset = field.offset + 8 + len(key.encode())
    return type_offset, type_offset + 4


def tensor_info_offsets(path: Path, name: str) -> tuple[int, int]:
    """(offset of the ggml type, offset of the data offset) in tensor `name`'s description."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    type_offset = tensor.field.offset + 8 + len(name.encode()) + 4 + 8 * len(tensor.shape)
    return type_offset, type_offset + 4


def open_error(path: Path) -> str:
    with pytest.raises(GGUFError) as excinfo:
        GGUFFile(path)
    message = str(excinfo.value)
    assert str(path) in message
    return message


def test_missing_file_and_directory(tmp_path):
    assert "cannot read" in open_error(tmp_path / "absent.gguf")
    assert "cannot read" in open_error(tmp_path)


def test_empty_file(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "empty" in open_error(empty)


def test_bad_magic(model):
    path, _ = model
    patch(path, 0, b"GGML")
    assert "not a GGUF file" in open_error(path)


@pytest.mark.parametrize("version", [1, 4, 99])
def test_unsupported_version(model, version):
    path, _ = model
    patch(path, 4, version.to_bytes(4, "little"))
    assert f"unsupported GGUF version {version}" in open_error(path)


def test_truncated_inside_fixed_header(model):
    path, _ = model
    truncate(path, 12)
    assert "truncated header" in open_error(path)


def test_truncated_inside_metadata(model):
    path, _ = model
    type_offset, _ = key_offsets(path, "tokenizer.ggml.tokens")
    truncate(path, type_offset + 30)  # in the middle of the token strings
    message = open_error(path)
    assert "truncated header" in message
    assert "'tokenizer.ggml.model'" in message  # the last key that parsed, as a landmark


def test_truncated_inside_tensor_data(model):
    path, _ = model
    last = GGUFFile(path).tensors["blk.0.exotic.weight"]
    truncate(path, last.offset + last.n_bytes - 1)
    message = open_error(path)
    assert "'blk.0.exotic.weight'" in message and "past the end of the file" in message


def test_absurd_counts_fail_fast(model):
    path, _ = model
    patch(path, 16, (2**60).to_bytes(8, "little"))  # the metadata key count
    assert "corrupt header" in open_error(path)


def test_absurd_array_length_fails_fast(model):
    path, _ = model
    _, value_offset = key_offsets(path, "testarch.head_count_kv")
    patch(path, value_offset + 4, (2**62).to_bytes(8, "little"))  # after the item type: the length
    assert "truncated header" in open_error(path)


def test_unknown_value_type(model):
    path, _ = model
    type_offset, _ = key_offsets(path, "testarch.use_bias")
    patch(path, type_offset, (99).to_bytes(4, "little"))
    message = open_error(path)
    assert "malformed header" in message and "99" in message


def test_changed_metadata_value_type_is_caught_by_get(model):
    path, _ = model
    type_offset, _ = key_offsets(path, "testarch.block_count")
    patch(path, type_offset, GGUFValueType.FLOAT32.to_bytes(4, "little"))
    gf = GGUFFile(path)
    with pytest.raises(GGUFError) as excinfo:
        gf.arch_get("block_count", int)
    message = str(excinfo.value)
    assert str(path) in message and "'testarch.block_count'" in message
    assert "FLOAT32" in message and "expected int" in message


def test_string_that_is_not_utf8(model):
    path, _ = model
    _, value_offset = key_offsets(path, "general.name")
    patch(path, value_offset + 8, b"\xff")
    gf = GGUFFile(path)
    with pytest.raises(GGUFError, match=r"tiny\.gguf: metadata key 'general.name' .*not UTF-8"):
        gf.get("general.name")


def test_unknown_tensor_type(model):
    path, _ = model
    type_offset, _ = tensor_info_offsets(path, "blk.0.attn_q.weight")
    patch(path, type_offset, (200).to_bytes(4, "little"))
    message = open_error(path)
    assert "'blk.0.attn_q.weight'" in message and "unknown ggml type 200" in message


def test_misaligned_tensor_data(model):
    path, _ = model
    _, offset_offset = tensor_info_offsets(path, "blk.0.attn_q.weight")
    patch(path, offset_offset, (1).to_bytes(8, "little"))
    message = open_error(path)
    assert "'blk.0.attn_q.weight'" in message and "alignment" in message


def test_overlapping_tensor_data(model):
    path, _ = model
    _, offset_offset = tensor_info_offsets(path, "blk.0.attn_q.weight")
    patch(path, offset_offset, (0).to_bytes(8, "little"))  # on top of token_embd.weight
    message = open_error(path)
    assert "overlaps" in message
    assert "'blk.0.attn_q.weight'" in message and "'token_embd.weight'" in message


def test_missing_tensor(model):
    path, _ = model
    gf = GGUFFile(path)
    with pytest.raises(GGUFError) as excinfo:
        gf.tensor("blk.0.attn_v.weight")
    message = str(excinfo.value)
    assert str(path) in message and "missing tensor 'blk.0.attn_v.weight'" in message
    assert "blk.0.attn_q.weight" in message  # a close match is suggested


def test_wrong_shape(model):
    path, _ = model
    gf = GGUFFile(path)
    with pytest.raises(GGUFError) as excinfo:
        gf.tensor("token_embd.weight", shape=(64, 8))
    message = str(excinfo.value)
    assert str(path) in message and "'token_embd.weight'" in message
    assert "(8, 64)" in message and "(64, 8)" in message


def test_unsupported_tensor_type(model):
    path, _ = model
    gf = GGUFFile(path)
    with pytest.raises(GGUFError) as excinfo:
        gf.tensor("blk.0.exotic.weight")
    message = str(excinfo.value)
    assert str(path) in message and "'blk.0.exotic.weight'" in message and "Q2_K" in message


# --- describe ----------------------------------------------------------------------------------------


def test_describe_model(model):
    path, tensors = model
    d = describe(path)
    assert d["architecture"] == "testarch" and d["name"] == "tiny test model"
    assert d["file_size"] == os.path.getsize(path)
    assert d["tensor_count"] == len(tensors)
    assert d["parameter_count"] == sum(math.prod(torch_shape(t, raw)) for t, raw in tensors.values())
    assert d["tensor_types"]["Q6_K"] == {"tensors": 1, "bytes": tensors["blk.0.ffn_down.weight"][1].nbytes}
    assert sum(entry["tensors"] for entry in d["tensor_types"].values()) == len(tensors)
    assert d["tokenizer"] == "gpt2" and d["vocab_size"] == len(TOKENS)
    assert d["has_chat_template"] is True
    assert d["context_length"] == 4096 and d["block_count"] == 2
    text = format_description(d)
    assert "testarch" in text and "Q6_K" in text and "tiny test model" in text


@pytest.mark.skipif(not VOCAB_DIR.is_dir(), reason=f"needs the shared vocabulary fixtures in {VOCAB_DIR}")
@pytest.mark.parametrize(
    "fixture, architecture, tokenizer, vocab_size, context_length, block_count",
    [
        ("ggml-vocab-qwen35.gguf", "qwen2", "gpt2", 151936, 32768, 32),
        ("ggml-vocab-gemma-4.gguf", "gemma4", "gemma4", 262144, 262144, 30),
    ],
)
def test_describe_vocab_only_fixtures(fixture, architecture, tokenizer, vocab_size, context_length, block_count):
    d = describe(VOCAB_DIR / fixture)
    assert d["architecture"] == architecture
    assert d["tokenizer"] == tokenizer and d["vocab_size"] == vocab_size
    assert d["has_chat_template"] is True
    assert d["context_length"] == context_length and d["block_count"] == block_count
    assert d["tensor_count"] == 0 and d["parameter_count"] == 0 and d["tensor_types"] == {}
    lines = format_description(d).splitlines()
    assert any(line.startswith("vocab size") and line.endswith(str(vocab_size)) for line in lines)
    # the table is aligned: every value starts in the same column
    assert len({len(line) - len(line.split("  ", 1)[1].lstrip()) for line in lines}) == 1
