"""Cache entry codecs: exact for bf16/fp32, bounded error for fp8 / MXFP4, byte layout pinned."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.kv_codec import decode_rows, encode_rows


def test_fp8_ue8m0_layout_for_flash_head() -> None:
    torch.manual_seed(0)
    rows = torch.randn(5, 512)
    records = encode_rows(rows, "fp8_ue8m0", 584, rope_dim=64)
    assert records.shape == (5, 584) and records.dtype == torch.uint8
    # 448 nope e4m3 bytes, then 64 bf16 rope dims stored exactly, then 7 scale bytes + 1 pad.
    rope = records[:, 448:576].contiguous().view(torch.bfloat16).float()
    assert torch.equal(rope, rows[:, 448:].to(torch.bfloat16).float())
    assert (records[:, 583] == 0).all()
    decoded = decode_rows(records, "fp8_ue8m0", 512, rope_dim=64)
    # e4m3 keeps 3 mantissa bits: per 64-dim block the error is below 2^-4 of the block max.
    err = (decoded[:, :448] - rows[:, :448]).abs().view(5, 7, 64).amax(-1)
    block_max = rows[:, :448].abs().view(5, 7, 64).amax(-1)
    assert (err <= block_max * 2.0**-4).all()


def test_fp8_scale_bytes_are_power_of_two_exponents() -> None:
    rows = torch.zeros(1, 128)
    rows[0, :64] = 3.0  # amax 3 -> 2^ceil(log2(3/448)) = 2^-7 -> byte 120
    records = encode_rows(rows, "fp8_ue8m0", 2 * 64 + 64 + 8, rope_dim=64)
    assert records[0, 64 + 128].item() == 120
    assert torch.equal(decode_rows(records, "fp8_ue8m0", 128, 64)[0, :64], rows[0, :64])


@pytest.mark.parametrize("name,width", [("bf16", 2), ("fp32", 4)])
def test_plain_formats_round_trip_exactly(name: str, width: int) -> None:
    rows = torch.randn(3, 64).to(torch.bfloat16).float()
    records = encode_rows(rows, name, 64 * width, rope_dim=0)
    assert torch.equal(decode_rows(records, name, 64, 0), rows)


def test_mxfp4_index_rows_are_68_bytes_and_bounded() -> None:
    torch.manual_seed(1)
    rows = torch.randn(4, 128)
    records = encode_rows(rows, "mxfp4", 68, rope_dim=0)
    decoded = decode_rows(records, "mxfp4", 128, 0)
    # e2m1 grid spacing is at most 2 at the top of [-6, 6]: error <= scale = amax/6 rounded up.
    block_max = rows.view(4, 4, 32).abs().amax(-1, keepdim=True)
    assert ((decoded - rows).view(4, 4, 32).abs() <= block_max / 3).all()


def test_fp8_fp32scale_index_rows() -> None:
    rows = torch.randn(2, 128)
    records = encode_rows(rows, "fp8_fp32scale", 132, rope_dim=0)
    decoded = decode_rows(records, "fp8_fp32scale", 128, 0)
    assert ((decoded - rows).abs() <= rows.abs().amax(-1, keepdim=True) * 2.0**-4).all()


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown cache entry format"):
        encode_rows(torch.zeros(1, 4), "int3", 4, 0)
