"""GGUFFile: metadata, zero-copy tensors, `describe`, and a GGUFError for every kind of broken file."""

import math
import os
import sys
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.constants import GGUFValueType
from test_quants import random_block_bytes, random_float_bytes

from lucebox_core.errors import GGUFError
from lucebox_core.ggufio import GGUFFile, describe, format_description

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
    file_map = gf._map
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


# --- parity with gguf's own reader -----------------------------------------------------------------------


def reader_type(field: gguf.ReaderField) -> str:
    """gguf's type list for a field, in the words `GGUFFile` uses in its type errors."""
    if field.types[0] == GGUFValueType.ARRAY:
        return "ARRAY of " + (field.types[-1].name if len(field.types) > 1 else "nothing (empty)")
    return field.types[0].name


def assert_same_metadata(gf: GGUFFile, reader: gguf.GGUFReader, refused: tuple[str, ...] = ()) -> None:
    """Same keys in the same order, equal values of the same Python types, same type names; keys in
    `refused` hold values Lucebox refuses to decode (checked separately)."""
    fields = {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert gf.keys() == list(fields)
    assert gf.version == reader.fields["GGUF.version"].contents()
    for key, field in fields.items():
        if key in refused:
            continue
        ours, theirs = gf.get(key), field.contents()
        assert ours == theirs, key
        if isinstance(theirs, list):
            assert [type(item) for item in ours] == [type(item) for item in theirs], key
        else:
            assert type(ours) is type(theirs), key
        assert gf._gguf_type(key) == reader_type(field), key


@pytest.mark.skipif(not VOCAB_DIR.is_dir(), reason=f"needs the shared vocabulary fixtures in {VOCAB_DIR}")
def test_vocab_fixture_metadata_matches_gguf_reader():
    path = VOCAB_DIR / "ggml-vocab-qwen35.gguf"
    gf = GGUFFile(path)
    assert_same_metadata(gf, gguf.GGUFReader(path))
    assert len(gf.get("tokenizer.ggml.tokens")) == 151936 and gf.tensors == {}


def write_every_value_type(path: Path, rng: np.random.Generator) -> Path:
    """A file with random values of every scalar type and arrays of each, plus an array of arrays."""
    integer_types = {
        GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8,
        GGUFValueType.UINT16: np.uint16, GGUFValueType.INT16: np.int16,
        GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
        GGUFValueType.UINT64: np.uint64, GGUFValueType.INT64: np.int64,
    }

    def random_values(value_type: GGUFValueType, n: int) -> list:
        if value_type in integer_types:
            limits = np.iinfo(integer_types[value_type])
            return rng.integers(limits.min, limits.max, n, dtype=integer_types[value_type], endpoint=True).tolist()
        if value_type == GGUFValueType.FLOAT32:
            return [float(x) for x in rng.standard_normal(n).astype(np.float32)]
        if value_type == GGUFValueType.FLOAT64:
            return [float(x) for x in rng.standard_normal(n)]
        if value_type == GGUFValueType.BOOL:
            return [bool(x) for x in rng.integers(0, 2, n)]
        alphabet = ["a", "é", "日", "🙂", " ", "\n", "\x00"]
        return ["".join(rng.choice(alphabet, rng.integers(0, 6))) for _ in range(n)]

    writer = gguf.GGUFWriter(path, "testarch")
    for value_type in [*integer_types, GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.BOOL,
                       GGUFValueType.STRING]:
        name = value_type.name.lower()
        writer.add_key_value(f"test.{name}", random_values(value_type, 1)[0], value_type)
        writer.add_key_value(f"test.{name}_array", random_values(value_type, 17), GGUFValueType.ARRAY,
                             value_type)
    writer.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY, GGUFValueType.ARRAY)
    writer.add_uint32("test.after_nested", 12345)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_every_value_type_matches_gguf_reader(tmp_path):
    path = write_every_value_type(tmp_path / "values.gguf", np.random.default_rng(7))
    gf = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    assert gf.get("test.uint64_array", list[int]) != [0] * 17  # random, not zeros
    assert gf.get("test.after_nested", int) == 12345  # the array of arrays was stepped over correctly
    with pytest.raises(GGUFError, match=r"values\.gguf: metadata key 'test.nested': arrays of arrays"):
        gf.get("test.nested")
    assert_same_metadata(gf, reader, refused=("test.nested",))  # gguf flattens it; Lucebox refuses it


def test_tensor_infos_match_gguf_reader(model):
    path, _ = model
    gf = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    assert list(gf.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = gf.tensors[t.name]
        assert info.ggml_type == t.tensor_type
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert info.n_elements == t.n_elements
        assert info.n_bytes == t.n_bytes
        assert info.offset == t.data_offset
        assert gf._map[info.offset : info.offset + info.n_bytes].tobytes() == t.data.tobytes()
    assert_same_metadata(gf, reader)


def count_numpy_calls(action) -> int:
    """How many calls into numpy (functions or array methods) `action()` makes."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, np.ndarray) or (getattr(arg, "__module__", None) or "").startswith("numpy"):
                calls += 1
        elif event == "call" and frame.f_code.co_filename.startswith(os.path.dirname(np.__file__)):
            calls += 1

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return calls


def test_large_vocabulary_is_read_without_per_token_numpy_work(tmp_path):
    """GGUFReader makes several numpy views per array element, which is what made opening slow."""
    n_tokens = 20_000
    tokens = [f"tok{i}" for i in range(n_tokens)]
    writer = gguf.GGUFWriter(tmp_path / "vocab.gguf", "testarch")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * n_tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()

    def open_and_read():
        gf = GGUFFile(tmp_path / "vocab.gguf")
        assert gf.get("tokenizer.ggml.tokens") == tokens
        assert gf.get("tokenizer.ggml.token_type") == [1] * n_tokens

    assert count_numpy_calls(open_and_read) < 50
    # the measure itself sees gguf's per-element work
    assert count_numpy_calls(lambda: gguf.GGUFReader(tmp_path / "vocab.gguf")) > n_tokens


# --- more broken files ----------------------------------------------------------------------------------


def test_duplicate_metadata_key(model):
    path, _ = model
    type_offset, _ = key_offsets(path, "testarch.logit_scale")
    name = b"testarch.block_count"  # as long as the key it replaces
    patch(path, type_offset - len(name), name)
    message = open_error(path)
    assert "malformed header" in message and "'testarch.block_count' appears twice" in message


def test_metadata_key_that_is_not_utf8(model):
    path, _ = model
    type_offset, _ = key_offsets(path, "testarch.use_bias")
    patch(path, type_offset - len("testarch.use_bias"), b"\xff")
    message = open_error(path)
    assert "malformed header" in message and "not UTF-8" in message
    assert "'testarch.logit_scale'" in message  # the last key that parsed


@pytest.mark.parametrize("token, extra", [(1, 3), (4, 3), (4, 8 + 2)])
def test_truncated_inside_the_token_strings(model, token, extra):
    """Cut `extra` bytes into token `token` (its 8-byte length, then its text): the whole array no
    longer fits, the length is cut short, or the text is."""
    path, _ = model
    _, value_offset = key_offsets(path, "tokenizer.ggml.tokens")
    token_start = value_offset + 4 + 8 + sum(8 + len(t.encode()) for t in TOKENS[:token])
    truncate(path, token_start + extra)
    message = open_error(path)
    assert "truncated header" in message and "'tokenizer.ggml.model'" in message


def test_duplicate_tensor_name(model):
    path, _ = model
    type_offset, _ = tensor_info_offsets(path, "blk.0.attn_q.weight")
    name_offset = type_offset - 4 - 8 * 2 - len("blk.0.attn_q.weight")
    patch(path, name_offset, b"blk.0.attn_k.weight")
    message = open_error(path)
    assert "'blk.0.attn_k.weight'" in message and "twice" in message


def test_alignment_of_the_wrong_type(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "align.gguf", "testarch")
    writer.add_key_value("general.alignment", 32.0, GGUFValueType.FLOAT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    message = open_error(tmp_path / "align.gguf")
    assert "'general.alignment'" in message and "FLOAT32" in message
