"""FP8 block and MXFP4 dequantisation against a plain bit-level reference."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.quant import (
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
)


def decode_e4m3_byte(byte: int) -> float:
    """OCP e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * (mantissa / 8.0) * 2.0**-6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


def decode_e8m0_byte(byte: int) -> float:
    return float("nan") if byte == 255 else 2.0 ** (byte - 127)


E2M1 = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


def decode_e2m1_nibble(nibble: int) -> float:
    value = E2M1[nibble & 7]
    return -value if nibble & 8 else value


def plain_fp8_dequant(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    code_bytes = codes.view(torch.uint8).tolist()
    scale_bytes = scales.view(torch.uint8).tolist()
    out = torch.empty(codes.shape, dtype=torch.float64)
    for r, row in enumerate(code_bytes):
        for c, byte in enumerate(row):
            out[r, c] = decode_e4m3_byte(byte) * decode_e8m0_byte(
                scale_bytes[r // block][c // block]
            )
    return out


def plain_mxfp4_dequant(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows = packed.view(torch.uint8).tolist()
    scale_bytes = scales.view(torch.uint8).tolist()
    out = torch.empty(len(rows), 2 * len(rows[0]), dtype=torch.float64)
    for r, row in enumerate(rows):
        for j, byte in enumerate(row):
            for half, nibble in enumerate((byte & 0xF, byte >> 4)):
                col = 2 * j + half
                out[r, col] = decode_e2m1_nibble(nibble) * decode_e8m0_byte(
                    scale_bytes[r][col // 32]
                )
    return out


@pytest.mark.parametrize("shape", [(5, 7), (130, 260), (128, 128)])
def test_fp8_dequant_matches_bit_reference(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    weight = torch.randn(shape) * torch.logspace(-3, 1, shape[1])
    codes, scales = fp8_block_quantize(weight, block_size=128 if shape[0] > 8 else 4)
    block = 128 if shape[0] > 8 else 4
    ours = fp8_block_dequantize(codes, scales, block, torch.float64)
    assert torch.equal(ours, plain_fp8_dequant(codes, scales, block))
    # e4m3 has 3 mantissa bits: relative error per element <= 2^-4 of the block maximum.
    blockwise_max = weight.abs().max()
    assert (ours.float() - weight).abs().max() <= blockwise_max * 2.0**-4


def test_fp8_scale_is_smallest_power_of_two_that_fits() -> None:
    weight = torch.full((4, 4), 3.0)
    codes, scales = fp8_block_quantize(weight, block_size=4)
    assert scales.float().item() == 2.0**-7  # 3 / 448 -> ceil(log2) = -7
    assert fp8_block_dequantize(codes, scales, 4, torch.float32).eq(3.0).all()


@pytest.mark.parametrize("shape", [(3, 32), (17, 96), (64, 128)])
def test_mxfp4_dequant_matches_bit_reference(shape: tuple[int, int]) -> None:
    torch.manual_seed(1)
    weight = torch.randn(shape)
    packed, scales = mxfp4_quantize(weight)
    assert packed.dtype == torch.int8 and packed.shape == (shape[0], shape[1] // 2)
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (shape[0], shape[1] // 32)
    ours = mxfp4_dequantize(packed, scales, torch.float64)
    assert torch.equal(ours, plain_mxfp4_dequant(packed, scales))


def test_mxfp4_represents_grid_values_exactly() -> None:
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4).view(1, 32)
    weight = torch.cat([grid, -grid], dim=0)
    packed, scales = mxfp4_quantize(weight)
    assert torch.equal(mxfp4_dequantize(packed, scales, torch.float32), weight)
    # Low nibble holds the even column: 0.0 -> 0x0, 0.5 -> 0x1 gives byte 0x10.
    assert packed.view(torch.uint8)[0, 0].item() == 0x10


def test_dequant_rejects_mismatched_scales() -> None:
    packed, scales = mxfp4_quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match="MXFP4 scale shape"):
        mxfp4_dequantize(packed, scales[:, :1], torch.float32)
    codes, fscales = fp8_block_quantize(torch.randn(4, 4), block_size=2)
    with pytest.raises(ValueError, match="fp8 scale shape"):
        fp8_block_dequantize(codes, fscales[:1], 2, torch.float32)


@pytest.mark.parametrize("block_k", [64, 128])
def test_halves_layouts_dequantise_to_the_stored_values(block_k: int) -> None:
    """The re-packed "halves" layouts (dsv4.ops.quant.repack_halves) hold the same codes:
    dequantised they equal the stored layout's values, and unpacking restores the bytes."""
    from dsv4.ops.quant import dequantize, repack_halves, unpack_halves

    gen = torch.Generator().manual_seed(3)
    q, s = mxfp4_quantize(torch.randn(6, 256, generator=gen))
    halves = repack_halves(q, block_k)
    assert not torch.equal(halves, q) and torch.equal(unpack_halves(halves, block_k), q)
    want = dequantize(q, s, "mxfp4", torch.float32)
    assert torch.equal(dequantize(halves, s, f"mxfp4_halves{block_k}", torch.float32), want)
    rows = dequantize(halves[2:4], s[2:4], f"mxfp4_halves{block_k}", torch.float32)
    assert torch.equal(rows, want[2:4])  # row slices: the parts a loader views
