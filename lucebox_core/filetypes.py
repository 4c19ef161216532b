"""Which ggml type each tensor gets for a given output file type, the way llama.cpp decides it.

Two sources of truth are mirrored:

- `convert_hf_to_gguf.py` (f32 / f16 / bf16 / q8_0): 1-D tensors, `*_norm.weight`, the kinds a family
  registers with `keep_f32` (recurrent layers' convolution kernels), MoE routers (`ffn_gate_inp`) and
  names not ending in `.weight` (per-head scalars, biases) stay F32; every other matrix gets the
  requested type (q8_0 falls back to F16 when a row is not a multiple of 32).
- `llama-quant.cpp` `llama_tensor_get_type` for Q4_K_M: matrices are Q4_K except
  `output.weight` (and `token_embd.weight` when the output is tied to it) -> Q6_K, and the
  "attn_v-like" tensors (`attn_v`, or `attn_qkv` where a layer has no `attn_v`: one per layer) and
  `ffn_down` on the `use_more_bits` layers -> Q6_K. Rows that are not a multiple of 256 fall back:
  Q4_K -> Q5_0, Q6_K -> Q8_0 (output/tied embedding directly to Q8_0), then F16 below 32.
  Those kinds, routers and norms are never quantized.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType


T = GGMLQuantizationType
# Tensor kinds (a part of the name) that llama.cpp keeps F32 whatever the file type besides 1-D tensors,
# norms and routers: a family registers its own (`keep_f32`), e.g. a recurrent family's convolution kernels.
_KEPT_F32: set[str] = set()


def keep_f32(*kinds: str) -> None:
    """Name parts of tensors that stay F32 in every file type (llama.cpp's converter keeps them so)."""
    _KEPT_F32.update(kinds)

FILE_TYPES: dict[str, LlamaFileType] = {
    "f32": LlamaFileType.ALL_F32,
    "f16": LlamaFileType.MOSTLY_F16,
    "bf16": LlamaFileType.MOSTLY_BF16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
}

_PLAIN_TYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}


def layer_of(name: str) -> int | None:
    """The block index of a `blk.N.*` tensor name, else None."""
    if not name.startswith("blk."):
        return None
    return int(name.split(".", 2)[1])


def file_type(name: str, allowed: tuple[str, ...] | None = None) -> LlamaFileType:
    allowed = allowed or tuple(FILE_TYPES)
    if name not in allowed:
        raise ValueError(f"unknown type {name!r}; choose one of {', '.join(allowed)}")
    return FILE_TYPES[name]


def stays_f32(name: str, shape: tuple[int, ...]) -> bool:
    """Tensors llama.cpp's converter always writes as F32 and its quantizer never touches."""
    return (
        len(shape) <= 1
        or name.endswith("_norm.weight")
        or any(kind in name for kind in _KEPT_F32)
        or name.endswith("ffn_gate_inp.weight")  # MoE routers: the converter and quantizer keep them F32
        or not name.endswith(".weight")
    )


def use_more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the *_M K-quant mixes."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def _fits(ggml_type: GGMLQuantizationType, row_length: int) -> bool:
    return row_length % GGML_QUANT_SIZES[ggml_type][0] == 0


def _q4_k_m_type(name: str, shape: tuple[int, ...], n_layer: int, tied_output: bool) -> GGMLQuantizationType:
    row_length = shape[-1]
    if name == "output.weight" or (tied_output and name == "token_embd.weight"):
        return T.Q6_K if _fits(T.Q6_K, row_length) else T.Q8_0
    wanted = T.Q4_K
    layer = layer_of(name)
    # One attn_v-like tensor per layer (attn_v or attn_qkv), so llama.cpp's counter is the layer index.
    more_bits_kind = name.endswith((".attn_v.weight", ".attn_qkv.weight", ".ffn_down.weight"))
    if layer is not None and more_bits_kind and use_more_bits(layer, n_layer):
        wanted = T.Q6_K
    if not _fits(wanted, row_length):
        wanted = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}[wanted]
        if not _fits(wanted, row_length):
            wanted = T.F16
    return wanted


def tensor_type(
    name: str, shape: tuple[int, ...], type_name: str, *, n_layer: int, tied_output: bool
) -> GGMLQuantizationType:
    """The ggml type of tensor `name` (numpy-order `shape`) in a file of type `type_name`."""
    if stays_f32(name, shape):
        return T.F32
    if type_name == "q4_k_m":
        return _q4_k_m_type(name, shape, n_layer, tied_output)
    wanted = _PLAIN_TYPES[type_name]
    if wanted == T.Q8_0 and not _fits(T.Q8_0, shape[-1]):
        return T.F16  # the converter's fallback for rows that do not split into 32-blocks
    return wanted


def nbytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size
