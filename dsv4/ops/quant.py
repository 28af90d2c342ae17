"""Weight storage formats of the DeepSeek-V4 checkpoints (docs/model.md#checkpoint-formats).

- FP8 linears: e4m3 weights with one UE8M0 (power-of-two, stored as float8_e8m0fnu) scale
  per 128x128 block; `w = w_fp8 * scale[block]`.
- MXFP4 routed experts: two e2m1 values per int8 byte (low nibble = even column), one UE8M0
  scale per 32 consecutive values of a row; `w = e2m1 * scale`.

Quantisers round to nearest and choose the smallest power-of-two scale that keeps the block's
absolute maximum representable (scale = 2^ceil(log2(amax / max_code))), as the official
`convert.py` and vLLM do. Dequantisers are exact (every code and scale is a dyadic number).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
MXFP4_BLOCK = 32
# The eight e2m1 magnitudes, indexed by the low three bits of a nibble; bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding thresholds between consecutive magnitudes (midpoints).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Smallest amax a scale is computed from, so all-zero blocks get a finite scale.
_MIN_AMAX = 1e-12


def ue8m0_scale(amax: torch.Tensor, max_code: float) -> torch.Tensor:
    """Power-of-two scale 2^ceil(log2(amax / max_code)) in fp32 (UE8M0 representable)."""
    ratio = amax.float().clamp_min(_MIN_AMAX) / max_code
    return torch.exp2(torch.ceil(torch.log2(ratio))).clamp(2.0**-127, 2.0**127)


def fp8_block_quantize(
    weight: torch.Tensor, block_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (e4m3 [out, in], float8_e8m0fnu [ceil(out/b), ceil(in/b)])."""
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // block_size), -(-in_dim // block_size)
    padded = weight.float().new_zeros(rows * block_size, cols * block_size)
    padded[:out_dim, :in_dim] = weight.float()
    blocks = padded.view(rows, block_size, cols, block_size)  # [R, b, C, b]
    amax = blocks.abs().amax(dim=(1, 3))  # [R, C]
    scale = ue8m0_scale(amax, FP8_E4M3_MAX)
    scaled = blocks / scale[:, None, :, None]
    codes = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    codes = codes.view(rows * block_size, cols * block_size)[:out_dim, :in_dim].contiguous()
    return codes, scale.to(torch.float8_e8m0fnu)


def fp8_block_dequantize(
    weight_fp8: torch.Tensor, scale_e8m0: torch.Tensor, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `fp8_block_quantize`: [out, in] e4m3 x block scales -> [out, in] `dtype`."""
    out_dim, in_dim = weight_fp8.shape
    expected = (-(-out_dim // block_size), -(-in_dim // block_size))
    if tuple(scale_e8m0.shape) != expected:
        raise ValueError(
            f"fp8 scale shape {tuple(scale_e8m0.shape)} != {expected} for {block_size}"
        )
    scale = scale_e8m0.float()
    full = scale.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    return (weight_fp8.float() * full[:out_dim, :in_dim]).to(dtype)


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to e2m1 nibbles (uint8 in 0..15)."""
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=values.device)
    mag = values.float().abs().clamp_max(E2M1_MAX)
    index = torch.bucketize(mag, mids, right=False).to(torch.uint8)  # ties round down
    sign = (values < 0).to(torch.uint8) << 3
    return sign | index


def e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles (0..15) -> fp32 values."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=nibbles.device)
    nib = nibbles.to(torch.int64)
    mag = table[nib & 7]
    return torch.where((nib & 8) != 0, -mag, mag)


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 packed [out, in/2], float8_e8m0fnu [out, in/32])."""
    out_dim, in_dim = weight.shape
    if in_dim % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of 32, got {in_dim}")
    blocks = weight.float().view(out_dim, in_dim // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = ue8m0_scale(blocks.abs().amax(dim=2), E2M1_MAX)  # [out, in/32]
    nibbles = e2m1_encode(blocks / scale[..., None]).view(out_dim, in_dim)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # low nibble = even column
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def mxfp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """Stored MXFP4 bytes [..., cols/2] (int8 or uint8, low nibble = even column) -> the e2m1
    codes [..., cols] uint8 in column order."""
    raw = packed.view(torch.uint8)
    return torch.stack((raw & 15, raw >> 4), dim=-1).flatten(-2)


def mxfp4_dequantize(
    packed_int8: torch.Tensor, scale_e8m0: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `mxfp4_quantize`: [out, in/2] int8 x [out, in/32] scales -> [out, in]."""
    out_dim, half = packed_int8.shape
    in_dim = half * 2
    if tuple(scale_e8m0.shape) != (out_dim, in_dim // MXFP4_BLOCK):
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale_e8m0.shape)} != {(out_dim, in_dim // MXFP4_BLOCK)}"
        )
    values = e2m1_decode(mxfp4_codes(packed_int8)).view(out_dim, in_dim // MXFP4_BLOCK, MXFP4_BLOCK)
    return (values * scale_e8m0.float()[..., None]).view(out_dim, in_dim).to(dtype)


# K blocks the re-packed MXFP4 "halves" layouts come in (format "mxfp4_halves<block>"): the
# MMA kernel's K step is the block (kernels/moe_mxfp4.py); the decode GEMV reads 128
HALVES_BLOCKS = (64, 128)


# The largest UE8M0 scale byte the "halves" layouts hold (a block scale of 2: weights below
# 16): the GPU kernel multiplies the codes' bf16 bits by 2^(s-1) in bf16, finite to s = 128
# (kernels/moe_mxfp4.py). Real expert weights sit far below it (|w| ~ 0.1: s ~ 120).
HALVES_MAX_SCALE_BYTE = 128


def halves_scales_fit(*scales: torch.Tensor | None) -> bool:
    """Whether every UE8M0 byte of `scales` (float8_e8m0fnu or uint8) is at most
    HALVES_MAX_SCALE_BYTE: experts that may take a "halves" layout (one host read a tensor)."""
    return all(int(s.view(torch.uint8).max()) <= HALVES_MAX_SCALE_BYTE
               for s in scales if s is not None and s.numel())  # fmt: skip


def halves_block(fmt: str) -> int | None:
    """The K block of a "halves" format name ("mxfp4_halves64" / "mxfp4_halves128"); None for
    any other format."""
    names = {f"mxfp4_halves{b}": b for b in HALVES_BLOCKS}
    return names.get(fmt)


def repack_halves(packed: torch.Tensor, block_k: int) -> torch.Tensor:
    """Stored MXFP4 codes [..., cols/2] int8 (low nibble = even column) -> the "halves" layout
    of the same shape: in each block of block_k columns, byte j = column j | column block_k/2 + j
    << 4. Row by row (a row slice of a repacked tensor is the repacked row slice); cols must be
    a multiple of block_k."""
    assert block_k in HALVES_BLOCKS and packed.shape[-1] % (block_k // 2) == 0, packed.shape
    blocks = mxfp4_codes(packed).unflatten(
        -1, (-1, 2, block_k // 2)
    )  # [..., cols / block_k, 2, block_k / 2]
    out = blocks[..., 0, :] | (blocks[..., 1, :] << 4)
    return out.flatten(-2).view(torch.int8)


def unpack_halves(packed: torch.Tensor, block_k: int) -> torch.Tensor:
    """Inverse of `repack_halves`: the "halves" layout -> the stored MXFP4 layout."""
    raw = packed.view(torch.uint8).unflatten(-1, (-1, block_k // 2))
    codes = torch.stack((raw & 15, raw >> 4), dim=-2).flatten(-2)  # [..., cols], column order
    out = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., cols / block_k, block_k / 2]
    return out.flatten(-2).view(torch.int8)


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor | None, fmt: str, dtype: torch.dtype
) -> torch.Tensor:
    """A weight in a `kernels.moe` format -> `dtype`: "bf16" (dense, cast), "fp8" (e4m3 with
    128x128 block scales, UE8M0 or fp32), "mxfp4" (packed e2m1 pairs, UE8M0 per 32) or a
    "halves" re-packing of it ("mxfp4_halves64" / "mxfp4_halves128": unpacked first)."""
    if fmt == "fp8":
        return fp8_block_dequantize(weight, scale, 128, dtype)
    if halves_block(fmt):
        weight, fmt = unpack_halves(weight, halves_block(fmt)), "mxfp4"
    if fmt == "mxfp4":
        return mxfp4_dequantize(weight, scale, dtype)
    return weight.to(dtype)
