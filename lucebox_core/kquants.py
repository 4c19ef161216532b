"""Random quantized blocks with a chosen weight scale, for synthetic GGUF files.

A synthetic model needs weights that dequantize to something like a real initialisation (zero mean,
std ~0.02), not a faithful encoding of given floats, so blocks are built directly from random
quants plus scales picked to hit the target std. That is thousands of times faster than encoding
floats, and it needs no K-quant encoder (the `gguf` package only has K-quant *decoders*).

Block layouts (ggml `block_*` structs, little endian):

| type | bytes | layout | dequantized value |
| --- | --- | --- | --- |
| Q8_0 | 34 | d f16, qs i8[32] | d*q |
| Q5_0 | 22 | d f16, qh u8[4], qs u8[16] | d*(q5 - 16) |
| Q4_K | 144 | d f16, dmin f16, scales u8[12] (8 x 6-bit scale + 8 x 6-bit min), qs u8[128] | d*sc*q4 - dmin*m |
| Q6_K | 210 | ql u8[128], qh u8[64], scales i8[16], d f16 | d*sc*(q6 - 32) |
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

T = GGMLQuantizationType

_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
_Q5_0 = np.dtype([("d", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)])
_Q4_K = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])
_Q6_K = np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])

# Standard deviations of uniformly random quants, to turn a target std into a block scale.
_STD_INT8 = np.sqrt((255**2 - 1) / 12)  # q uniform in [-127, 127]
_STD_Q5 = np.sqrt((32**2 - 1) / 12)  # q5 - 16 uniform in [-16, 15]
_STD_Q4 = np.sqrt((16**2 - 1) / 12)  # q4 uniform in [0, 15]
_STD_Q6 = np.sqrt((64**2 - 1) / 12)  # q6 - 32 uniform in [-32, 31]

# Q4_K sub-block scales are drawn from [16, 33]; each min is set to cancel the sub-block mean
# (min*dmin ~= 7.5*sc*d with dmin = 4d, i.e. min = 1.875*sc, which stays within 6 bits).
_Q4K_SCALES = np.arange(16, 34)
_Q4K_DMIN_OVER_D = 4
_Q6K_SCALES = np.arange(16, 49)  # |scale| of each 16-weight group, random sign


def _random_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    return np.frombuffer(rng.bytes(n), dtype=np.uint8).reshape(shape)


def pack_q4_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins per block into ggml's 12-byte Q4_K/Q5_K layout.

    Sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7 put their
    low 4 bits in bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits in the spare
    top bits of bytes 0-3 (scale) and 4-7 (min).
    """
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    out = np.empty(sc.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    return out


def random_blocks(ggml_type: GGMLQuantizationType, n_elements: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Bytes (uint8) of `n_elements` weights of `ggml_type`, zero-mean with standard deviation ~`std`."""
    block, _ = GGML_QUANT_SIZES[ggml_type]
    if n_elements % block:
        raise ValueError(f"{n_elements} weights do not fill whole {ggml_type.name} blocks of {block}")
    nb = n_elements // block
    if ggml_type in (T.F32, T.F16, T.BF16):
        x = rng.standard_normal(n_elements, dtype=np.float32) * np.float32(std)
        if ggml_type == T.F32:
            return x.view(np.uint8)
        if ggml_type == T.F16:
            return x.astype(np.float16).view(np.uint8)
        return quants.quantize(x, T.BF16).reshape(-1)
    if ggml_type == T.Q8_0:
        b = np.empty(nb, dtype=_Q8_0)
        b["d"] = std / _STD_INT8
        b["qs"] = rng.integers(-127, 128, size=(nb, 32), dtype=np.int8)
    elif ggml_type == T.Q5_0:
        b = np.empty(nb, dtype=_Q5_0)
        # q5 - 16 has mean -1/2; a random sign per block cancels that bias over a row.
        b["d"] = (std / _STD_Q5) * (rng.integers(0, 2, size=nb) * 2 - 1)
        b["qh"] = _random_bytes(rng, (nb, 4))
        b["qs"] = _random_bytes(rng, (nb, 16))
    elif ggml_type == T.Q4_K:
        b = np.empty(nb, dtype=_Q4_K)
        sc = rng.choice(_Q4K_SCALES, size=(nb, 8)).astype(np.uint8)
        mn = np.rint(sc * (7.5 / _Q4K_DMIN_OVER_D)).astype(np.uint8)
        d = std / (_STD_Q4 * np.sqrt(np.mean(_Q4K_SCALES.astype(np.float64) ** 2)))
        b["d"] = d
        b["dmin"] = d * _Q4K_DMIN_OVER_D
        b["scales"] = pack_q4_k_scales(sc, mn)
        b["qs"] = _random_bytes(rng, (nb, 128))
    elif ggml_type == T.Q6_K:
        b = np.empty(nb, dtype=_Q6_K)
        b["ql"] = _random_bytes(rng, (nb, 128))
        b["qh"] = _random_bytes(rng, (nb, 64))
        sign = rng.integers(0, 2, size=(nb, 16), dtype=np.int8) * 2 - 1
        b["scales"] = rng.choice(_Q6K_SCALES, size=(nb, 16)).astype(np.int8) * sign
        b["d"] = std / (_STD_Q6 * np.sqrt(np.mean(_Q6K_SCALES.astype(np.float64) ** 2)))
    else:
        raise ValueError(f"no random block maker for {ggml_type.name}")
    return b.view(np.uint8)
