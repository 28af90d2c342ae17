"""Byte formats of the cache entries (docs/model.md#entry-formats): float rows <-> uint8 records.

The paged cache stores every entry as raw bytes in one `[num_blocks, block_stride]` tensor; these
codecs are the reference for what a Triton pack/unpack kernel writes and reads.

- "fp8_ue8m0" (KV, 584 B for head_dim 512): [nope e4m3 | rope bf16 | one UE8M0 byte per 64 nope
  dims, zero padded to a multiple of 8]. Scale per 64-dim block = 2^ceil(log2(amax / 448)),
  amax clamped >= 1e-4 (vLLM fp8_ds_mla); the rope dims stay bf16 as trained (QAT).
- "bf16" / "fp32" (KV and indexer keys, `--kv-dtype` / `--indexer-key-dtype`): the row in that
  dtype; exact for a model of that precision (served = transformers checks).
- "mxfp4" (indexer keys, 68 B for d = 128): [d/2 packed e2m1, low nibble = even dim | d/32 UE8M0].
- "fp8_fp32scale" (indexer keys, 132 B): [d e4m3 | fp32 scale], one scale per row.
- "fp32" (compressor state): the row in fp32.

`round_trip` is what a step attends to for its own fresh rows: the same values a later step
decodes from the cache, so chunk boundaries do not change outputs.
"""

from __future__ import annotations

import torch

from dsv4.ops.quant import FP8_E4M3_MAX, e2m1_decode, e2m1_encode, ue8m0_scale

_KV_BLOCK = 64
_MIN_KV_AMAX = 1e-4


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> biased exponent bytes (uint8)."""
    return (torch.log2(scale).round() + 127).to(torch.uint8)


def _e8m0_values(raw: torch.Tensor) -> torch.Tensor:
    return torch.exp2(raw.float() - 127)


def encode_rows(
    rows: torch.Tensor, dtype_name: str, entry_bytes: int, rope_dim: int
) -> torch.Tensor:
    """rows [N, dim] float -> records [N, entry_bytes] uint8."""
    n, dim = rows.shape
    out = torch.zeros(n, entry_bytes, dtype=torch.uint8, device=rows.device)
    if dtype_name in ("bf16", "fp32"):
        raw = rows.to(torch.bfloat16 if dtype_name == "bf16" else torch.float32)
        packed = raw.contiguous().view(torch.uint8).view(n, -1)
        out[:, : packed.shape[1]] = packed
        return out
    if dtype_name == "fp8_ue8m0":
        nope = dim - rope_dim
        blocks = -(-nope // _KV_BLOCK)
        padded = rows.float().new_zeros(n, blocks * _KV_BLOCK)
        padded[:, :nope] = rows[:, :nope].float()
        grouped = padded.view(n, blocks, _KV_BLOCK)
        scale = ue8m0_scale(grouped.abs().amax(-1).clamp_min(_MIN_KV_AMAX), FP8_E4M3_MAX)
        codes = (grouped / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        codes = codes.to(torch.float8_e4m3fn).view(n, -1)[:, :nope]
        out[:, :nope] = codes.view(torch.uint8)
        rope = rows[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8).view(n, -1)
        out[:, nope : nope + 2 * rope_dim] = rope
        out[:, nope + 2 * rope_dim : nope + 2 * rope_dim + blocks] = _e8m0_bytes(scale)
        return out
    if dtype_name == "mxfp4":
        grouped = rows.float().view(n, dim // 32, 32)
        scale = ue8m0_scale(grouped.abs().amax(-1), 6.0)  # [N, dim/32]
        nibbles = e2m1_encode(grouped / scale[..., None]).view(n, dim)
        out[:, : dim // 2] = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        out[:, dim // 2 : dim // 2 + dim // 32] = _e8m0_bytes(scale)
        return out
    if dtype_name == "fp8_fp32scale":
        scale = (rows.float().abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp_min(1e-12)
        codes = (rows.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        out[:, :dim] = codes.view(torch.uint8)
        out[:, dim : dim + 4] = scale.contiguous().view(torch.uint8).view(n, 4)
        return out
    raise ValueError(f"unknown cache entry format {dtype_name!r}")


def decode_rows(records: torch.Tensor, dtype_name: str, dim: int, rope_dim: int) -> torch.Tensor:
    """records [N, entry_bytes] uint8 -> rows [N, dim] fp32."""
    n = records.shape[0]
    if dtype_name in ("bf16", "fp32"):
        width = dim * (2 if dtype_name == "bf16" else 4)
        raw = records[:, :width].contiguous()
        return (
            raw.view(torch.bfloat16 if dtype_name == "bf16" else torch.float32).float().view(n, dim)
        )
    if dtype_name == "fp8_ue8m0":
        nope = dim - rope_dim
        blocks = -(-nope // _KV_BLOCK)
        codes = records[:, :nope].contiguous().view(torch.float8_e4m3fn).float()
        scale = _e8m0_values(records[:, nope + 2 * rope_dim : nope + 2 * rope_dim + blocks])
        nope_vals = codes * scale.repeat_interleave(_KV_BLOCK, dim=1)[:, :nope]
        rope = records[:, nope : nope + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
        return torch.cat((nope_vals, rope.view(n, rope_dim)), dim=1)
    if dtype_name == "mxfp4":
        raw = records[:, : dim // 2]
        nibbles = torch.stack((raw & 0xF, raw >> 4), dim=-1).view(n, dim)
        scale = _e8m0_values(records[:, dim // 2 : dim // 2 + dim // 32])
        return (e2m1_decode(nibbles).view(n, dim // 32, 32) * scale[..., None]).view(n, dim)
    if dtype_name == "fp8_fp32scale":
        codes = records[:, :dim].contiguous().view(torch.float8_e4m3fn).float()
        scale = records[:, dim : dim + 4].contiguous().view(torch.float32)
        return codes * scale
    raise ValueError(f"unknown cache entry format {dtype_name!r}")


def round_trip(
    rows: torch.Tensor, dtype_name: str, entry_bytes: int, rope_dim: int
) -> torch.Tensor:
    """rows [N, dim] -> what reading them back from the cache gives, in rows' dtype.

    A step attends to its own fresh rows through this, exactly as a later step reads them, so
    outputs do not depend on where chunk boundaries fall (`dsv4.model.state`)."""
    records = encode_rows(rows, dtype_name, entry_bytes, rope_dim)
    return decode_rows(records, dtype_name, rows.shape[1], rope_dim).to(rows.dtype)
