"""The tensor-core matvec's lane mapping, emulated on the CPU: A and B fragments must agree on every k slot.

One warp's `mma_block` (matvec_mma_body.cuh) at batch 1 is replayed in Python for one GGUF block of 16 rows: each
lane's bytes (`W::load`), its quants per step (`W::step_quants`), the (magic + q) pairs made by `low_pair` and
`high_pair`, the activation registers (`ActivationFragment<bf16>::load` / `load8` at `W::step_column`), the
`mma.sync.m16n8k16` fragment layouts of the PTX ISA, the sums of x (an all-ones A), and the scale-and-min epilogue
with `byte_to_float`. The prmt selectors and magic constants are read from mma_formats.cuh, so the test checks the
kernel's constants, not a copy of them. The result must equal the rows dequantized by `gguf`'s numpy code times x
(float64 throughout, where every product of the kernel is exact): a selector pairing columns differently on the A
side than the B side, or a wrong step column, gives the wrong products. The GPU tests then hold the real kernel to
its references; this one says, without a GPU, that the mapping is right.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from test_tiled_weights import row_major_lane

KERNELS = Path(__file__).resolve().parents[1] / "backends" / "cuda" / "lucebox_cuda" / "kernels"
SOURCE = (KERNELS / "mma_formats.cuh").read_text()
FORMAT_TYPES = {"q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}


def constant(pattern: str) -> int:
    match = re.search(pattern, SOURCE, re.DOTALL)
    assert match, f"mma_formats.cuh no longer matches {pattern!r}"
    return int(match.group(1), 16)


LOW_PAIR = constant(r"low_pair\(u32 q4\) \{ return byte_perm\(q4, E::MAGIC_PAIR, (0x[0-9a-fA-F]+)u\)")
HIGH_PAIR = constant(r"high_pair\(u32 q4\) \{ return byte_perm\(q4, E::MAGIC_PAIR, (0x[0-9a-fA-F]+)u\)")
# Per 16-bit element type of the mma: its (magic + q) pair, its pair of ones, its magic (MmaBf16, MmaF16).
ELEMENTS = {
    "bf16": (constant(r"struct MmaBf16 \{.*?MAGIC_PAIR = (0x[0-9a-fA-F]+)u"),
             constant(r"struct MmaBf16 \{.*?ONE_PAIR = (0x[0-9a-fA-F]+)u"), 128.0),
    "f16": (constant(r"struct MmaF16 \{.*?MAGIC_PAIR = (0x[0-9a-fA-F]+)u"),
            constant(r"struct MmaF16 \{.*?ONE_PAIR = (0x[0-9a-fA-F]+)u"), 1024.0),
}
BF16_MAGIC_PAIR = ELEMENTS["bf16"][0]
MAGIC_BYTE = re.search(r"byte_perm\((0x[0-9a-fA-F]+)u, word, (0x[0-9a-fA-F]+)u \+ k\)", SOURCE)
assert MAGIC_BYTE, "mma_formats.cuh's magic_byte changed form"


def prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte selector[i] of {b, a}, sign-replicated if bit 3."""
    pool = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = pool[nibble & 7]
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def f16_value(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


VALUE = {"bf16": bf16_value, "f16": f16_value}


def f32_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def byte_to_float(word: int, k: int) -> float:
    return f32_value(prmt(int(MAGIC_BYTE.group(1), 16), word, int(MAGIC_BYTE.group(2), 16) + k)) - 8388608.0


def u32(data: bytes, offset: int) -> int:
    return int.from_bytes(data[offset: offset + 4], "little")


def half(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


# -- each format: step quants, step column, scales (mma_formats.cuh, in Python) ---------------------------------

def q4_words(raw: dict) -> list[tuple[int, int]]:
    return [(u32(chunk, 0), u32(chunk, 4)) for chunk in raw["qs"]]


def step_quants(fmt: str, raw: dict, s: int) -> int:
    if fmt in ("q4_k", "q5_k"):
        j = s >> 1
        x, y = q4_words(raw)[j >> 1]
        word = y if s & 1 else x
        quants = ((word >> 4) if j & 1 else word) & 0x0F0F0F0F
        if fmt == "q5_k":
            high = u32(raw["qh"], 4 if s & 1 else 0)
            quants |= ((high >> j) & 0x01010101) << 4
        return quants
    hi, r = ((s >> 3) << 1) | (s & 1), (s >> 1) & 3
    low = raw["ql_b"][hi] if r & 1 else raw["ql_a"][hi]
    nibbles = ((low >> 4) if r & 2 else low) & 0x0F0F0F0F
    qh = raw["qh"][hi]
    top = ((qh << 4) if r == 0 else (qh << 2) if r == 1 else qh if r == 2 else (qh >> 2)) & 0x30303030
    return nibbles | top


def step_column(fmt: str, s: int, t: int) -> int:
    if fmt in ("q4_k", "q5_k"):
        return 32 * (s >> 1) + 8 * t + 4 * (s & 1)
    return 128 * (s >> 3) + 32 * ((s >> 1) & 3) + 16 * (s & 1) + 4 * t


def group_scales(fmt: str, raw: dict, grp: int) -> tuple[float, float]:
    """(d * scale, dmin * min) of sub-block `grp` of this row, as MmaQ4K/MmaQ6K::scales and ::group make them."""
    if fmt in ("q4_k", "q5_k"):
        head = raw["head"]
        d, dmin = half(u32(head, 0) & 0xFFFF), half(u32(head, 0) >> 16)
        w0, w1, w2 = u32(head, 4), u32(head, 8), u32(head, 12)
        sc = [w0 & 0x3F3F3F3F, (w2 & 0x0F0F0F0F) | ((w0 >> 2) & 0x30303030)]
        mins = [w1 & 0x3F3F3F3F, ((w2 >> 4) & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)]
        return (d * byte_to_float(sc[grp >= 4], grp & 3), dmin * byte_to_float(mins[grp >= 4], grp & 3))
    d = half(int.from_bytes(raw["d"], "little"))
    word = raw["sc"][grp >> 2] ^ 0x80808080
    return d * (byte_to_float(word, grp & 3) - 128.0), 0.0


STEPS_PER_GROUP = {"q4_k": 2, "q5_k": 2, "q6_k": 1}
BIAS = {"q4_k": 0.0, "q5_k": 0.0, "q6_k": 32.0}  # W::BIAS: OFFSET = E::MAGIC + W::BIAS


# -- the warp -----------------------------------------------------------------------------------------------------

def a_matrix(registers: list[list[int]], value=bf16_value) -> np.ndarray:
    """A (16 x 16) from each lane's 4 registers: PTX m16n8k16 .bf16 A layout (reg 0: row g, k 2t, 2t+1; reg 1: row
    g+8; reg 2: row g, k 2t+8, 2t+9; reg 3: row g+8, k 2t+8, 2t+9; the low half is the lower k)."""
    a = np.zeros((16, 16))
    for lane, regs in enumerate(registers):
        g, t = lane >> 2, lane & 3
        for reg, (row, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            a[row, k], a[row, k + 1] = value(regs[reg]), value(regs[reg] >> 16)
    return a


def b_matrix(registers: list[tuple[int, int]], value=bf16_value) -> np.ndarray:
    """B (16 x 8) from each lane's 2 registers: reg 0 holds k 2t, 2t+1 and reg 1 k 2t+8, 2t+9 of column g."""
    b = np.zeros((16, 8))
    for lane, (b0, b1) in enumerate(registers):
        g, t = lane >> 2, lane & 3
        b[2 * t, g], b[2 * t + 1, g] = value(b0), value(b0 >> 16)
        b[2 * t + 8, g], b[2 * t + 9, g] = value(b1), value(b1 >> 16)
    return b


def warp_block(fmt: str, rows: list[bytes], x_bits: np.ndarray, element: str = "bf16") -> np.ndarray:
    """The 16 rows' products with x (one GGUF block, batch 1, x as 16-bit `element` bits) as one warp of the kernel
    forms them."""
    magic_pair, one_pair, magic = ELEMENTS[element]
    value = VALUE[element]
    lanes = [(row_major_lane(fmt, rows[lane >> 2], lane & 3), row_major_lane(fmt, rows[(lane >> 2) + 8], lane & 3))
             for lane in range(32)]
    acc = np.zeros(16)
    steps_per_group = STEPS_PER_GROUP[fmt]
    ones = a_matrix([[one_pair] * 4] * 32, value)
    for grp in range(16 // steps_per_group):
        p = np.zeros((16, 8))
        s = np.zeros((16, 8))
        for within in range(steps_per_group):
            step = grp * steps_per_group + within
            a_regs, b_regs = [], []
            for lane, (raw_a, raw_b) in enumerate(lanes):
                q_a, q_b = step_quants(fmt, raw_a, step), step_quants(fmt, raw_b, step)
                a_regs.append([prmt(q_a, magic_pair, LOW_PAIR), prmt(q_b, magic_pair, LOW_PAIR),
                               prmt(q_a, magic_pair, HIGH_PAIR), prmt(q_b, magic_pair, HIGH_PAIR)])
                g, t = lane >> 2, lane & 3
                c = step_column(fmt, step, t)
                # Column g of B: activation row g of the batch; only row 0 exists (the kernel loads zeros for others).
                b_regs.append((int(x_bits[c]) | int(x_bits[c + 1]) << 16, int(x_bits[c + 2]) | int(x_bits[c + 3]) << 16)
                              if g == 0 else (0, 0))
            b = b_matrix(b_regs, value)
            p += a_matrix(a_regs, value) @ b
            s += ones @ b
        for r in range(16):
            raw = lanes[4 * (r % 8)][0 if r < 8 else 1]
            d_scale, dmin_min = group_scales(fmt, raw, grp)
            acc[r] += d_scale * (p[r, 0] - (magic + BIAS[fmt]) * s[r, 0]) - dmin_min * s[r, 0]
    return acc


def test_the_selectors_pair_consecutive_columns():
    """The magic pairs hold quant bytes (0, 1) and (2, 3) in the low and high halves: the B side's load order."""
    q = 0x0D0C0B0A
    assert prmt(q, BF16_MAGIC_PAIR, LOW_PAIR) == 0x430B430A
    assert prmt(q, BF16_MAGIC_PAIR, HIGH_PAIR) == 0x430D430C
    assert [byte_to_float(0xF0C3A507, k) for k in range(4)] == [0x07, 0xA5, 0xC3, 0xF0]


@pytest.mark.parametrize("element", list(ELEMENTS))
@pytest.mark.parametrize("fmt", list(FORMAT_TYPES))
def test_a_warp_multiplies_a_block_as_gguf_dequantizes_it(fmt, element):
    rng = np.random.default_rng(17)
    blocks = rng.integers(0, 256, (16, BLOCK_BYTES[fmt]), dtype=np.uint8)
    # Scales that are finite and not tiny: fp16 d (and dmin) drawn in [2^-8, 2^-2], either sign.
    d = (rng.uniform(2**-8, 2**-2, (16, 2)) * rng.choice([-1, 1], (16, 2))).astype(np.float16).view(np.uint8)
    if fmt == "q6_k":
        blocks[:, 208:210] = d[:, :2]
    else:
        blocks[:, 0:4] = d.reshape(16, 4)
    x = rng.standard_normal(256).astype(np.float32)
    if element == "bf16":
        x_bits = (x.view(np.uint32) >> 16).astype(np.uint32)  # bf16 by truncation: the values the kernel sees
        x_16 = (x_bits << 16).view(np.float32).astype(np.float64)
    else:
        x_bits = x.astype(np.float16).view(np.uint16).astype(np.uint32)
        x_16 = x.astype(np.float16).astype(np.float64)
    weights = gguf_quants.dequantize(blocks.reshape(-1), FORMAT_TYPES[fmt]).reshape(16, 256).astype(np.float64)
    expected = weights @ x_16
    got = warp_block(fmt, [bytes(row) for row in blocks], x_bits, element)
    # gguf's numpy dequantizes in fp32 (each weight rounded once); the emulation is exact. So within 2^-22 of the
    # sum of |w x| a row, where a column paired with the wrong activation is off by the size of the terms.
    bound = 2.0**-22 * (np.abs(weights) @ np.abs(x_16))
    assert np.all(np.abs(got - expected) <= bound), np.abs(got - expected) / bound
