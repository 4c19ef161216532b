"""Block-quantized KV storage in torch: GGUF's Q4_0 and Lucebox's TQ3_0 ("TurboQuant"), and which K/V pairs go.

Both are reference implementations: what the KV cache stores and what the attention ops' references decode;
backends' kernels read the same bytes in registers. All operations are device tensor ops without a host
sync, so a recorded decode step can quantize the rows it writes.

Q4_0 (GGUF's block): per 32 values an fp16 scale `d` and 16 bytes of nibbles (18 bytes, 4.5 bits a value);
byte j holds value j in its low nibble and value j + 16 in its high one, value = (nibble - 8) * d. Quantized
as ggml's `quantize_row_q4_0_ref`: `d` = the value of largest magnitude (the first, on ties) / -8, in fp32;
nibble = min(15, trunc(x * (1 / d) + 8.5)) (0 for an all-zero block); `d` stored as fp16.

TQ3_0 (Lucebox's vendored ggml, `ggml-common.h` and `ggml-cuda/tq3-quant.cuh`; 3.5 bits a value). Blocks of
32 values, 14 bytes each: an fp16 `norm`, `qs` (8 bytes: the low two bits of each value's 3-bit index,
value j at bits 2*(j % 4) of byte j // 4) and `signs` (4 bytes: the index's high bit, value j at bit j % 8 of
byte j // 8). Four consecutive blocks make a 128-value rotation group and carry the same norm, so a head dim
must be a multiple of 128. A group x is quantized as:

    g = |x|_2;  u = x * (1/g) (0 if g <= 1e-10);  y = D2 . H . D1 . u
    index_i = how many of the 7 thresholds y_i is not below (ties go up)
    norm = g / |c|_2 (g if |c|_2 <= 1e-10), c_i = CENTROIDS[index_i]; stored as fp32 -> fp16

where D1, D2 are Lucebox's fixed +-1 diagonals (`TQ3_SIGNS_1/2`, copied as facts from `tq3-quant.cuh`), H the
128-point Walsh-Hadamard matrix in natural (Sylvester) order scaled by 1/sqrt(128) (what its butterflies
compute), and CENTROIDS the Lloyd-Max levels for N(0, 1/128). Decoding in the *rotated* domain is
`CENTROIDS[index] * norm`; the original domain needs the inverse rotation D1 . H . D2 (R is orthogonal).

So attention over a TQ3_0 K needs the query rotated forward (q . k = Rq . Rk), and over a TQ3_0 V gives the
output in the rotated domain, rotated back afterwards (sum p_i R v_i = R sum p_i v_i). That is how kernels
read TQ3_0 without an inverse rotation per row (`rotate_tq3`); the eager path decodes to un-rotated floats.

The decisions (norm, rotation, thresholds, the reconstruction norm) are computed in float64 here, so the
codes depend on no summation order (the tests check them byte for byte against an independent numpy
quantizer). Lucebox computes in fp32, and its two quantizers (one thread, or a warp) already sum in
different orders: a rotated value within ~1e-7 of a threshold, or a norm on an fp16 rounding boundary,
may take the neighbouring code there. Any block written here decodes the same with Lucebox's kernels.
"""

from __future__ import annotations

import functools

import torch

from .errors import LuceboxError

QUANT_BLOCK = 32  # values per block, for every block type here

Q4_0_BLOCK_BYTES = 2 + QUANT_BLOCK // 2  # fp16 d, then 16 bytes of nibbles

TQ3_0_BLOCK_BYTES = 2 + QUANT_BLOCK // 4 + QUANT_BLOCK // 8  # fp16 norm, qs[8], signs[4]
TQ3_0_GROUP = 128  # values that share a rotation and a norm (4 blocks)
# Lloyd-Max levels for N(0, 1/128), index order (index 4 + k is +level k, 3 - k is -level k), as fp32.
TQ3_0_LEVELS = (0.021460, 0.065717, 0.117832, 0.190685)
TQ3_0_CENTROIDS = tuple(-level for level in reversed(TQ3_0_LEVELS)) + TQ3_0_LEVELS
# Decision thresholds: the midpoints; a value equal to one takes the upper index.
TQ3_0_THRESHOLDS = (-0.154259, -0.091775, -0.043589, 0.0, 0.043589, 0.091775, 0.154259)
# The fixed sign diagonals D1 and D2 of the rotation (entry i: '+' is +1, '-' is -1), Lucebox's values.
TQ3_SIGNS_1 = ("-++--+-+--+++++++-+-+--+++-++----++-++-+-++--+-++++-----+-++++-+"
               "--+---+---+---+++--+++--++-++-+--++-+-+-++++-+-++-++-----++-++-+")
TQ3_SIGNS_2 = ("++++-++-+---+---++--+-+-+--+-+++++---+------+++-+-+++--+------++"
               "+-+----+-+-+--++-+-++-+----+--+-+-+++--+-+-++--+-+-++-+-+-----+-")
_TINY_NORM = 1e-10  # below this a group (or its reconstruction) counts as zero, as in Lucebox

# Allowed K/V pairs, Lucebox's table on our types: any K but TQ3_0 with any V; a TQ3_0 K only with these V
# (the V types Lucebox's TQ3_0-K attention kernels read; it has no f32 cache).
TQ3_K_VALUES = ("f16", "bf16", "q4_0", "q8_0", "tq3_0")


def check_kv_pair(k_type: str, v_type: str, all_types: tuple[str, ...]) -> None:
    """A LuceboxError listing the allowed pairs if K `k_type` cannot go with V `v_type`."""
    if k_type == "tq3_0" and v_type not in TQ3_K_VALUES:
        others = ", ".join(t for t in all_types if t != "tq3_0")
        raise LuceboxError(
            f"-ctk tq3_0 with -ctv {v_type} is not a supported KV pair; allowed pairs: K in {{{others}}} with any "
            f"V ({', '.join(all_types)}), or K tq3_0 with V in {{{', '.join(TQ3_K_VALUES)}}}"
        )


def block_bytes(cache_type: str) -> int:
    """Bytes of one 32-value block of a block type."""
    return {"q8_0": 2 + QUANT_BLOCK, "q4_0": Q4_0_BLOCK_BYTES, "tq3_0": TQ3_0_BLOCK_BYTES}[cache_type]


def head_dim_multiple(cache_type: str) -> int:
    """What a head dim must be a multiple of to be stored in `cache_type` (1: any)."""
    return {"q8_0": QUANT_BLOCK, "q4_0": QUANT_BLOCK, "tq3_0": TQ3_0_GROUP}.get(cache_type, 1)


# -- stored rows as the static path hands them to attention ---------------------------------------------
# A Q8_0 window is uint8 `[N, H, D / 32 * 34]` (its contract since it came first). Q4_0 and TQ3_0 are kept as
# `[N, H, D / 32, block bytes]`: the block dim says the format (18 Q4_0, 14 TQ3_0), so an attention op knows
# what it reads from the tensor alone and no family passes a type along.

_BLOCKED_FORMATS = {Q4_0_BLOCK_BYTES: "q4_0", TQ3_0_BLOCK_BYTES: "tq3_0"}


def stored_format(rows: torch.Tensor) -> str | None:
    """The block type of a window of stored rows (`q8_0`, `q4_0`, `tq3_0`), or None for values."""
    if rows.dtype != torch.uint8:
        return None
    if rows.dim() == 4:
        if rows.shape[-1] not in _BLOCKED_FORMATS:
            raise ValueError(f"a window of {rows.shape[-1]}-byte blocks is no KV block type (18 q4_0, 14 tq3_0)")
        return _BLOCKED_FORMATS[rows.shape[-1]]
    return "q8_0"


def stored_dim(rows: torch.Tensor) -> int:
    """The head dim of a window of stored rows (values or blocks)."""
    kind = stored_format(rows)
    if kind is None:
        return rows.shape[-1]
    if kind == "q8_0":
        return rows.shape[-1] // block_bytes("q8_0") * QUANT_BLOCK
    return rows.shape[-2] * QUANT_BLOCK


def decode_stored(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A window of stored rows as values `[N, H, D]` in `dtype` (TQ3_0 rotated back): what the reference
    attention ops read."""
    kind = stored_format(rows)
    if kind is None:
        return rows
    if kind == "q8_0":
        return dequantize_q8_0(rows, dtype)
    flat = rows.flatten(-2)
    return dequantize_q4_0(flat, dtype) if kind == "q4_0" else dequantize_tq3_0(flat, dtype)


# -- Q4_0 ---------------------------------------------------------------------------------------------------


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., D]` (D a multiple of 32) -> uint8 `[..., D / 32 * 18]`: GGUF Q4_0 blocks along the last dim."""
    *lead, dim = x.shape
    blocks = x.float().reshape(*lead, dim // QUANT_BLOCK, QUANT_BLOCK)
    # The signed value of largest magnitude (argmax takes the first of equals, as ggml's strict `<` scan).
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    scale = extreme / -8
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    # In [0.5, 16.5]: truncation toward zero is a floor here; 16 (the extreme itself) clamps to 15.
    nibbles = torch.trunc(blocks * inverse + 8.5).clamp(0, 15).to(torch.uint8)
    packed = nibbles[..., : QUANT_BLOCK // 2] | (nibbles[..., QUANT_BLOCK // 2 :] << 4)
    out = torch.cat([scale.to(torch.float16).view(torch.uint8), packed], dim=-1)
    return out.reshape(*lead, dim // QUANT_BLOCK * Q4_0_BLOCK_BYTES)


def dequantize_q4_0(data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 Q4_0 blocks `[..., B * 18]` -> `[..., B * 32]` in `dtype` (`(nibble - 8) * d` in fp32)."""
    *lead, nbytes = data.shape
    blocks = data.reshape(*lead, nbytes // Q4_0_BLOCK_BYTES, Q4_0_BLOCK_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    packed = blocks[..., 2:]
    nibbles = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float() - 8
    return (nibbles * scale).reshape(*lead, nbytes // Q4_0_BLOCK_BYTES * QUANT_BLOCK).to(dtype)


# -- TQ3_0 --------------------------------------------------------------------------------------------------


@functools.cache
def _rotation64() -> torch.Tensor:
    """R = D2 . H . D1 (H normalized, Sylvester order: H[i, j] = (-1)^popcount(i & j)) in float64, on the CPU."""
    index = torch.arange(TQ3_0_GROUP)
    parity = torch.zeros(TQ3_0_GROUP, TQ3_0_GROUP, dtype=torch.long)
    bits = index[:, None] & index[None, :]
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    hadamard = (1 - 2 * parity).double() / TQ3_0_GROUP**0.5
    d1, d2 = (torch.tensor([1.0 if s == "+" else -1.0 for s in signs], dtype=torch.float64)
              for signs in (TQ3_SIGNS_1, TQ3_SIGNS_2))
    return d2[:, None] * hadamard * d1[None, :]


@functools.cache
def _rotation(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return _rotation64().to(device=device, dtype=dtype)


def rotate_tq3(x: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Each 128-value group of `x`'s last dim rotated by R (forward: what TQ3_0 quantizes; a query goes through
    it before scoring against a TQ3_0 K) or by R^T (`inverse`: a TQ3_0 V's attention output, or decoded rows,
    back in the original domain). Computed in fp32 at least; returns `x`'s dtype."""
    *lead, dim = x.shape
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    rotation = _rotation(x.device, compute)
    groups = x.to(compute).reshape(*lead, dim // TQ3_0_GROUP, TQ3_0_GROUP)
    # forward: y = R u, i.e. u @ R^T; inverse: u = R^T y, i.e. y @ R.
    out = groups @ (rotation if inverse else rotation.T)
    return out.reshape(*lead, dim).to(x.dtype)


@functools.cache
def _constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """fp32 constants (as Lucebox's kernels hold them) on `device` in `dtype`, made once: a recorded step
    that quantizes may not copy from the host."""
    return torch.tensor(values, dtype=torch.float32).to(device=device, dtype=dtype)


def quantize_tq3_0(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., D]` (D a multiple of 128) -> uint8 `[..., D / 32 * 14]`: TQ3_0 blocks along the last dim."""
    *lead, dim = x.shape
    device = x.device
    # fp32 inputs (as Lucebox's cache write takes them), the decisions in float64 (see the module docstring).
    groups = x.float().double().reshape(*lead, dim // TQ3_0_GROUP, TQ3_0_GROUP)
    norm = groups.square().sum(-1, keepdim=True).sqrt()
    inverse = torch.where(norm > _TINY_NORM, 1 / norm, torch.zeros_like(norm))
    rotated = (groups * inverse) @ _rotation(device, torch.float64).T
    # How many thresholds (the fp32 constants) each value is not below: 0..7, a tie going up.
    index = torch.bucketize(rotated, _constant(TQ3_0_THRESHOLDS, device, torch.float64), right=True)
    centroids = _constant(TQ3_0_CENTROIDS, device, torch.float64)[index]
    reconstructed = centroids.square().sum(-1, keepdim=True).sqrt()
    corrected = torch.where(reconstructed > _TINY_NORM, norm / reconstructed, norm)
    half_norm = corrected.float().half()  # fp32 first, then fp16: the roundings Lucebox's kernels make

    index = index.reshape(*lead, dim // QUANT_BLOCK, QUANT_BLOCK).to(torch.uint8)
    low = (index & 3).reshape(*index.shape[:-1], QUANT_BLOCK // 4, 4)
    qs = low[..., 0] | (low[..., 1] << 2) | (low[..., 2] << 4) | (low[..., 3] << 6)
    high = (index >> 2).reshape(*index.shape[:-1], QUANT_BLOCK // 8, 8)
    signs = torch.zeros_like(high[..., 0])
    for bit in range(8):
        signs |= high[..., bit] << bit
    blocks_per_group = TQ3_0_GROUP // QUANT_BLOCK
    norms = half_norm.expand(*lead, dim // TQ3_0_GROUP, blocks_per_group).reshape(*lead, dim // QUANT_BLOCK, 1)
    out = torch.cat([norms.contiguous().view(torch.uint8), qs, signs], dim=-1)
    return out.reshape(*lead, dim // QUANT_BLOCK * TQ3_0_BLOCK_BYTES)


def tq3_0_indices(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 TQ3_0 blocks `[..., B * 14]` -> (3-bit indices `[..., B * 32]` long, fp32 norms `[..., B]`)."""
    *lead, nbytes = data.shape
    count = nbytes // TQ3_0_BLOCK_BYTES
    blocks = data.reshape(*lead, count, TQ3_0_BLOCK_BYTES)
    norm = blocks[..., :2].contiguous().view(torch.float16).float()[..., 0]
    qs, signs = blocks[..., 2:10].long(), blocks[..., 10:14].long()
    low = torch.stack([(qs >> (2 * k)) & 3 for k in range(4)], dim=-1).reshape(*lead, count, QUANT_BLOCK)
    high = torch.stack([(signs >> k) & 1 for k in range(8)], dim=-1).reshape(*lead, count, QUANT_BLOCK)
    return (low | (high << 2)).reshape(*lead, count * QUANT_BLOCK), norm


def dequantize_tq3_0(data: torch.Tensor, dtype: torch.dtype = torch.float32, *, rotated: bool = False) -> torch.Tensor:
    """uint8 TQ3_0 blocks `[..., B * 14]` -> `[..., B * 32]` in `dtype`: `centroid * norm` in fp32 (the rotated
    domain, as Lucebox's kernels read it, with `rotated`), by default rotated back to the original domain."""
    index, norm = tq3_0_indices(data)
    *lead, dim = index.shape
    centroids = _constant(TQ3_0_CENTROIDS, data.device, torch.float32)[index]
    values = (centroids.reshape(*lead, dim // QUANT_BLOCK, QUANT_BLOCK) * norm[..., None]).reshape(*lead, dim)
    return (values if rotated else rotate_tq3(values, inverse=True)).to(dtype)


Q8_0_BLOCK = 32  # values per block
Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK  # fp16 scale, then 32 int8


# -- Q8_0 in torch -------------------------------------------------------------------------------------------


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's `roundf` (halves away from zero), exactly: `floor(|x| + 0.5)` can round up in float32 for values
    just under a half, so the half is detected on the exact fractional part instead."""
    magnitude = x.abs()
    whole = torch.floor(magnitude)
    return torch.sign(x) * (whole + torch.floor(2 * (magnitude - whole)))


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., D]` (D a multiple of 32) -> uint8 `[..., D / 32 * 34]`: GGUF Q8_0 blocks along the last dim.

    As ggml's reference: per block `d = max|x| / 127` (fp32), `q = roundf(x / d)` through `1 / d` (0 for an
    all-zero block), `d` stored as fp16. No host sync: safe inside a recorded CUDA graph.
    """
    *lead, dim = x.shape
    blocks = x.float().reshape(*lead, dim // Q8_0_BLOCK, Q8_0_BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    quants = _round_half_away(blocks * inverse).to(torch.int8)
    packed = torch.cat([scale.to(torch.float16).view(torch.uint8), quants.view(torch.uint8)], dim=-1)
    return packed.reshape(*lead, dim // Q8_0_BLOCK * Q8_0_BLOCK_BYTES)


def dequantize_q8_0(data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 Q8_0 blocks `[..., B * 34]` -> `[..., B * 32]` in `dtype` (`q * d` in fp32, then cast)."""
    *lead, nbytes = data.shape
    blocks = data.reshape(*lead, nbytes // Q8_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES)
    # Slices of a row are not contiguous, and a dtype view needs them to be.
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    quants = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (quants * scale).reshape(*lead, nbytes // Q8_0_BLOCK_BYTES * Q8_0_BLOCK).to(dtype)
