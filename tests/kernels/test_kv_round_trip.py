"""The paged forward's round trip of a prefill chunk's own K=V rows (`kv_rows.round_trip`)
through `kv_store` / `kv_gather` on a scratch equals the codec's write-then-read, for the
Triton kernels (the interpreter on CPU) and the torch references alike."""

from __future__ import annotations

import pytest
import torch

from dsv4.cache.layout import KVLayout
from dsv4.cache.packing import CacheOptions
from dsv4.config.model import tiny_config
from dsv4.ops.kv_codec import round_trip
from dsv4.runner.kv_cache import PagedKVCache
from dsv4.runner.paged import kv_rows
from dsv4.runner.paged.geometry import CacheGeometry
from kernels.backend import KernelBackendConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", ["triton", "ref"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_equals_codec(backend: str, kv_dtype: str, dtype: torch.dtype) -> None:
    cfg = tiny_config()
    layout = KVLayout.build(cfg, CacheOptions(block_size=128, kv_dtype=kv_dtype))
    geo = CacheGeometry(layout, PagedKVCache(layout, num_blocks=2, device=DEVICE).backing)
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(9, cfg.head_dim, generator=gen) * torch.logspace(-6, 4, 9)[:, None]
    rows = rows.to(DEVICE, dtype)
    got = kv_rows.round_trip(geo, rows, KernelBackendConfig(default=backend))
    want = round_trip(rows, geo.kv_format, geo.kve, cfg.qk_rope_head_dim)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(kv_rows.round_trip(geo, rows[:0], KernelBackendConfig()), rows[:0])
