"""kv_store / kv_gather (kernels/kv_store.py) against their kv_codec references, byte for byte.

Rows include the codec's corner cases: blocks with amax < 1e-4 (clamped scale), huge values
(large scales, bf16 rope near its max), exact zeros, negative zeros, fp32 values halfway
between two bf16 values (ties to even) and blocks whose small elements become e4m3 subnormals.
The cache is poisoned with random bytes first, so untouched rows and bytes are checked too.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.kv_codec import decode_rows, encode_rows
from kernels.kv_store import (
    FORMATS,
    kv_gather,
    kv_gather_ref,
    kv_store,
    kv_store_ref,
    min_entry_bytes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TAIL_BYTES = 8  # record bytes past the format's content: written as zeros
OUTSIDE_BYTES = 5  # bytes of each cache row past `cache.shape[1]`: never written


def _rows(num_rows, dim, dtype, seed):
    """[num_rows, dim] rows: row i is ordinary random data for i % 7 == 0, else a corner case."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, (num_rows, 1), generator=g).float())
    x = torch.randn(num_rows, dim, generator=g) * scale  # [T, D]
    for i in range(num_rows):
        kind = i % 7
        if kind == 1:  # amax < 1e-4
            x[i] = torch.randn(dim, generator=g) * 1e-6
        elif kind == 2:  # huge: exponents near the top of fp32 / bf16
            x[i] = torch.randn(dim, generator=g) * 1e36
            x[i, ::37] = 3.0e38
        elif kind == 3:
            x[i] = 0.0
        elif kind == 4:
            x[i] = -0.0
        elif kind == 5:  # halfway between bf16 neighbours (ties to even)
            hi = torch.randint(0x3000, 0x4800, (dim,), generator=g, dtype=torch.int32)
            sign = torch.randint(0, 2, (dim,), generator=g, dtype=torch.int32) << 31
            x[i] = ((hi << 16) | 0x8000 | sign).view(torch.float32)
        elif kind == 6:  # wide range inside a block: e4m3 subnormals and flushes to zero
            x[i] = torch.randn(dim, generator=g) * torch.exp2(
                torch.randint(-30, 8, (dim,), generator=g).float()
            )
    return x.to(dtype).to(DEVICE)


def _poisoned_cache(num_slots, entry, seed):
    """A [num_slots, entry + OUTSIDE_BYTES] random byte buffer and its [num_slots, entry] view."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, 256, (num_slots, entry + OUTSIDE_BYTES), generator=g)
    full = full.to(torch.uint8).to(DEVICE)
    return full, full[:, :entry]


def _slots(num_rows, num_slots, seed, dtype=torch.int32):
    """Distinct rows in random order, every 4th token (from the 3rd) skipped with -1."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:num_rows]
    slots[2::4] = -1
    return slots.to(dtype).to(DEVICE)


def _bits(x):
    """Bit patterns, so -0.0 != 0.0 and the comparison is exact."""
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_rows", "dim", "rope"),
                         [(0, 128, 64), (1, 128, 64), (3, 128, 64), (17, 128, 64),
                          (17, 512, 64), (17, 256, 32)])  # fmt: skip
def test_kv_store_matches_ref(fmt, dtype, num_rows, dim, rope):
    rows = _rows(num_rows, dim, dtype, seed=num_rows + dim)
    entry = min_entry_bytes(fmt, dim, rope) + TAIL_BYTES
    num_slots = 2 * num_rows + 3
    slots = _slots(num_rows, num_slots, seed=dim)
    poison, _ = _poisoned_cache(num_slots, entry, seed=num_rows)
    got, ref = poison.clone(), poison.clone()
    kv_store(rows, got[:, :entry], slots, fmt=fmt, rope_dim=rope)
    kv_store_ref(rows, ref[:, :entry], slots, fmt=fmt, rope_dim=rope)
    assert torch.equal(got, ref)
    written = torch.zeros(num_slots, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0].long()] = True
    assert torch.equal(got[~written], poison[~written])  # rows not addressed
    assert torch.equal(got[:, entry:], poison[:, entry:])  # bytes past cache.shape[1]
    if written.any():  # and the kernel's records are the codec's
        records = encode_rows(rows[slots >= 0], fmt, entry, rope)
        assert torch.equal(got[slots[slots >= 0].long(), :entry], records)


def test_kv_store_strided_rows_int64_slots():
    """Rows as a column slice of a wider tensor, int64 slots, bf16 rows into fp8 records."""
    dim, rope, fmt = 128, 64, "fp8_ue8m0"
    wide = _rows(9, dim + 32, torch.bfloat16, seed=3)
    rows = wide[:, :dim]  # stride(0) = dim + 32
    entry = min_entry_bytes(fmt, dim, rope)
    slots = _slots(9, 12, seed=4, dtype=torch.int64)
    poison, _ = _poisoned_cache(12, entry, seed=5)
    got, ref = poison.clone(), poison.clone()
    kv_store(rows, got[:, :entry], slots, fmt=fmt, rope_dim=rope)
    kv_store_ref(rows.contiguous(), ref[:, :entry], slots, fmt=fmt, rope_dim=rope)
    assert torch.equal(got, ref)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # huge rows -> fp16 inf
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_kv_gather_matches_ref(fmt, out_dtype, slot_dtype):
    dim, rope, num_slots = 128, 64, 24
    entry = min_entry_bytes(fmt, dim, rope) + TAIL_BYTES
    _, cache = _poisoned_cache(num_slots, entry, seed=6)  # bytes past each record: garbage
    cache[:, : min_entry_bytes(fmt, dim, rope)] = encode_rows(
        _rows(num_slots, dim, torch.float32, seed=7), fmt, entry, rope
    )[:, : min_entry_bytes(fmt, dim, rope)]
    slots = _slots(19, num_slots, seed=8, dtype=slot_dtype)
    slots[0] = slots[5] = slots[1]  # repeated reads are fine
    kw = dict(fmt=fmt, dim=dim, rope_dim=rope, out_dtype=out_dtype)
    got, ref = kv_gather(cache, slots, **kw), kv_gather_ref(cache, slots, **kw)
    assert got.dtype == out_dtype and got.shape == (19, dim)
    assert torch.equal(_bits(got), _bits(ref))
    assert not got[slots < 0].any() and not _bits(got[slots < 0]).any()  # +0.0
    empty = kv_gather(cache, slots[:0], **kw)
    assert empty.shape == (0, dim) and empty.dtype == out_dtype


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_then_gather_round_trip(fmt, dtype):
    dim, rope = 128, 64
    x = _rows(17, dim, dtype, seed=9)
    entry = min_entry_bytes(fmt, dim, rope)
    _, cache = _poisoned_cache(40, entry, seed=10)
    slots = torch.randperm(40, generator=torch.Generator().manual_seed(11))[:17]
    slots = slots.to(torch.int32).to(DEVICE)
    kv_store(x, cache, slots, fmt=fmt, rope_dim=rope)
    got = kv_gather(cache, slots, fmt=fmt, dim=dim, rope_dim=rope, out_dtype=torch.float32)
    expect = decode_rows(encode_rows(x, fmt, entry, rope), fmt, dim, rope)
    assert torch.equal(_bits(got), _bits(expect))
    if fmt != "fp32":  # fp8 and bf16 rows are exact in bf16
        got16 = kv_gather(cache, slots, fmt=fmt, dim=dim, rope_dim=rope)
        assert torch.equal(got16.float(), expect)


def test_unknown_format_raises():
    cache = torch.zeros(2, 1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="unknown KV entry format"):
        kv_store(torch.zeros(1, 128), cache, torch.zeros(1, dtype=torch.int32), fmt="mxfp4")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_store_production_shape_gpu(fmt, dtype):
    """T = 512 rows of D = 512 into a 64K-slot cache, then read back."""
    num_rows, dim, rope, num_slots = 512, 512, 64, 65536
    rows = _rows(num_rows, dim, dtype, seed=12)
    entry = min_entry_bytes(fmt, dim, rope)
    slots = _slots(num_rows, num_slots, seed=13)
    poison, _ = _poisoned_cache(num_slots, entry, seed=14)
    got, ref = poison.clone(), poison.clone()
    kv_store(rows, got[:, :entry], slots, fmt=fmt, rope_dim=rope)
    kv_store_ref(rows, ref[:, :entry], slots, fmt=fmt, rope_dim=rope)
    assert torch.equal(got, ref)
    kw = dict(fmt=fmt, dim=dim, rope_dim=rope, out_dtype=torch.bfloat16)
    cache = got[:, :entry]
    assert torch.equal(
        _bits(kv_gather(cache, slots, **kw)), _bits(kv_gather_ref(cache, slots, **kw))
    )
