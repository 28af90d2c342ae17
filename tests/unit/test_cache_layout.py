"""KV cache layout (docs/model.md#paged-cache): sizes, dense packing, addressing, compat
hash, hand-off."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from dsv4.cache import (
    COMPRESSED,
    COMPRESSOR_STATE,
    INDEXER,
    INDEXER_STATE,
    WINDOW,
    CacheOptions,
    KVLayout,
)
from dsv4.config.model import ModelConfig, flash_config, tiny_config
from dsv4.errors import ConfigError


def full_flash() -> ModelConfig:
    """V4-Flash: layers 0-1 SWA, 2..42 alternate C4/C128 (21 + 20), MTP layer SWA."""
    ratios = (0, 0, *(4 if i % 2 == 0 else 128 for i in range(41)))
    return ModelConfig(num_hidden_layers=43, compress_ratios=ratios)


LAYOUTS = {
    "flash43": lambda: KVLayout.build(full_flash()),
    "flash43-fp8idx-mtp2": lambda: KVLayout.build(
        full_flash(), CacheOptions(index_dtype="fp8", num_speculative_tokens=2)
    ),
    "flash4": lambda: KVLayout.build(flash_config()),
    "tiny-bf16": lambda: KVLayout.build(tiny_config(), CacheOptions(kv_dtype="bf16")),
    "tiny-fp8-512": lambda: KVLayout.build(tiny_config(), CacheOptions(block_size=512)),
}


def test_flash_entry_formats_match_dsv4_arch() -> None:
    layout = KVLayout.build(full_flash())
    assert layout.kv_entry_bytes == 584  # 448 e4m3 + 64 bf16 rope + 8 UE8M0 scale bytes
    assert layout.index_entry_bytes == 68  # MXFP4: 64 packed + 4 scales
    fp8_index = KVLayout.build(full_flash(), CacheOptions(index_dtype="fp8"))
    assert fp8_index.index_entry_bytes == 132
    assert KVLayout.build(full_flash(), CacheOptions(kv_dtype="bf16")).kv_entry_bytes == 1024
    c4, c128, swa = 2, 3, 0
    assert layout.region(c4, COMPRESSOR_STATE).entry_bytes == 8 * 1024
    assert layout.region(c4, INDEXER_STATE).entry_bytes == 2 * 1024
    assert layout.region(c128, COMPRESSOR_STATE).entry_bytes == 4 * 1024
    assert layout.region(c4, COMPRESSOR_STATE).ring_slots == 8  # c * r
    assert layout.region(c128, COMPRESSOR_STATE).ring_slots == 128
    assert layout.region(swa, WINDOW).ring_slots == 128
    # 256-token block: 64 C4 entries, 2 C128 entries, 64 indexer rows (docs/model.md#block-packing).
    assert layout.region(c4, COMPRESSED).page_bytes == 64 * 584
    assert layout.region(c128, COMPRESSED).page_bytes == 2 * 584
    assert layout.region(c4, INDEXER).page_bytes == 64 * 68


def test_generalised_formats_for_the_tiny_config() -> None:
    layout = KVLayout.build(tiny_config())  # head_dim 128 = 64 nope + 64 rope, index dim 64
    assert layout.kv_entry_bytes == 64 + 2 * 64 + 8  # one scale byte, padded to 8
    assert layout.index_entry_bytes == 32 + 2
    assert KVLayout.build(tiny_config(), CacheOptions(index_dtype="fp8")).index_entry_bytes == 68


def test_caches_per_layer_follow_the_vllm_table() -> None:
    layout = KVLayout.build(full_flash())
    kinds = {i: {r.kind for r in layout.regions_of_layer(i)} for i in layout.layer_ids}
    assert len(layout.layer_ids) == 44  # 43 + the MTP layer
    assert kinds[0] == kinds[43] == {WINDOW}
    assert kinds[2] == {WINDOW, COMPRESSED, COMPRESSOR_STATE, INDEXER, INDEXER_STATE}
    assert kinds[3] == {WINDOW, COMPRESSED, COMPRESSOR_STATE}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_regions_fit_and_never_overlap_inside_a_slab(name: str) -> None:
    layout = LAYOUTS[name]()
    stride = layout.block_stride_bytes
    slabs: dict[object, list[tuple[int, int]]] = {}
    for region in layout.regions:
        num_blocks = max(1, region.num_ring_blocks)
        for block in range(num_blocks):
            key = "token" if not region.is_ring else region.ring_block_index + block
            rows = region.entries_per_block
            if region.is_ring and block == num_blocks - 1:  # a split page's tail block
                rows = region.ring_slots - rows * (num_blocks - 1)
            end = region.offset_bytes + rows * region.entry_bytes
            slabs.setdefault(key, []).append((region.offset_bytes, end))
    for spans in slabs.values():
        spans.sort()
        assert spans[0][0] >= 0 and spans[-1][1] <= stride
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert set(slabs) - {"token"} == set(range(layout.num_ring_blocks))
    assert stride % layout.kv_entry_bytes == 0
    for region in layout.regions:
        if region.kind in (WINDOW, COMPRESSED):
            assert region.offset_bytes % layout.kv_entry_bytes == 0  # global KV slot ids
        else:
            assert region.offset_bytes % 16 == 0


def test_token_slab_is_dense_for_flash() -> None:
    layout = KVLayout.build(full_flash())
    token_pages = [r for r in layout.regions if not r.is_ring]
    packed = sum(r.page_bytes for r in token_pages)
    assert packed == 21 * (64 * 584 + 64 * 68) + 20 * 2 * 584 == 899_648
    end = max(r.offset_bytes + r.page_bytes for r in token_pages)
    assert end == packed  # no holes between regions
    # Stride = packed slab rounded to a multiple of lcm(584, 16) only.
    assert layout.block_stride_bytes == 900_528
    ring_bytes = sum(r.ring_slots * r.entry_bytes for r in layout.regions if r.is_ring)
    assert ring_bytes == 44 * 128 * 584 + 21 * 8 * (8192 + 2048) + 20 * 128 * 4096
    assert layout.num_ring_blocks == 20  # ring payload needs >= 18 slabs; packing uses 20


def test_every_address_of_a_request_is_distinct() -> None:
    """Walk the documented addressing rules over a request's blocks: no two entries share a
    byte and all stay inside the request's blocks."""
    layout = KVLayout.build(tiny_config(), CacheOptions(num_speculative_tokens=1))
    num_tokens = 700
    ring_ids = list(range(100, 100 + layout.num_ring_blocks))
    token_ids = [7, 3, 50][: layout.num_token_blocks(num_tokens)]
    stride = layout.block_stride_bytes
    owned = {b * stride for b in ring_ids + token_ids}
    spans = []
    for region in layout.regions:
        ratio = layout.model.layer_ratio(region.layer_id)
        if region.is_ring:
            rows = range(region.ring_slots)
        else:
            rows = range(num_tokens // (ratio if region.kind == COMPRESSED else 4))
        for row in rows:
            if region.is_ring:
                block = ring_ids[region.ring_block_index + row // region.entries_per_block]
            else:
                block = token_ids[row // region.entries_per_block]
            start = block * stride + region.offset_bytes
            start += (row % region.entries_per_block) * region.entry_bytes
            assert (start // stride) * stride in owned
            assert (start + region.entry_bytes - 1) // stride == start // stride
            spans.append((start, start + region.entry_bytes))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def test_flash_at_32k_compacted_handoff_vs_raw_bf16() -> None:
    """docs/architecture.md (Blocks, not groups): 0.133 GB against 1.48 GB of raw bf16 KV."""
    layout = KVLayout.build(full_flash())
    n = 32 * 1024
    live = layout.live_state_bytes(n)
    moved = layout.compacted_bytes(n)
    raw = layout.raw_bf16_bytes(n)
    # window 44*128*584 + C4 21*8192*(584+68) + C128 20*256*584 + C4 rows needing state
    expected_live = 44 * 128 * 584 + 21 * 8192 * (584 + 68) + 20 * 256 * 584
    expected_live += 21 * 4 * (8192 + 2048)  # C4: the last full window's rows; C128: none
    assert live == expected_live == 119_304_192  # 0.119 GB = 0.111 GiB
    assert moved == (20 + 128) * 900_528 == 133_278_144  # 0.133 GB = 0.124 GiB
    assert raw == 44 * n * 512 * 2 == 1_476_395_008  # 1.48 GB = 1.375 GiB
    assert 0.11e9 < live < moved < 0.14e9 and raw / moved > 11


def one_layer(ratio: int) -> KVLayout:
    model = ModelConfig(num_hidden_layers=1, compress_ratios=(ratio,), num_nextn_predict_layers=0)
    return KVLayout.build(model)


@pytest.mark.parametrize(
    ("seq_len", "window_rows", "c4_entries", "c128_entries", "c128_pending"),
    [
        # decode step: S = p + 1 for p = 999, 128, 4095, 4.
        (1000, 128, 250, 7, 1000 % 128),
        (129, 128, 32, 1, 1),
        (4096, 128, 1024, 32, 0),
        (5, 5, 1, 0, 5),
        # prefill chunk: A after its chunk (1512 tokens), B (300 tokens).
        (1512, 128, 378, 11, 104),
        (300, 128, 75, 2, 44),
    ],
)
def test_worked_examples_as_live_state(
    seq_len: int, window_rows: int, c4_entries: int, c128_entries: int, c128_pending: int
) -> None:
    """docs/model.md#bookkeeping-example rules, read back from the live hand-off payload of one
    layer."""
    kv = 584
    assert one_layer(0).live_state_bytes(seq_len) == window_rows * kv
    c128 = one_layer(128).live_state_bytes(seq_len)
    assert c128 == (window_rows + c128_entries) * kv + c128_pending * 4096
    # C4: the previous full window's 4 rows plus the pending ones feed the next entry.
    c4_state_rows = min(seq_len, 4 + seq_len % 4)
    c4 = one_layer(4).live_state_bytes(seq_len)
    assert c4 == (window_rows + c4_entries) * kv + c4_entries * 68 + c4_state_rows * (8192 + 2048)


def test_bytes_per_token_report() -> None:
    report = KVLayout.build(full_flash()).bytes_per_token()
    assert report["c4"].num_layers == 21 and report["c4"].paged_bytes_per_token == 146 + 17
    assert report["c128"].num_layers == 20 and report["c128"].paged_bytes_per_token == 584 / 128
    assert report["swa"].num_layers == 3 and report["swa"].paged_bytes_per_token == 0
    assert report["swa"].ring_bytes_per_request == 128 * 584
    assert report["c4"].ring_bytes_per_request == 128 * 584 + 8 * 8192 + 8 * 2048
    assert report["c128"].ring_bytes_per_request == 128 * 584 + 128 * 4096
    assert report["c4"].raw_bf16_bytes_per_token == 1024
    fp8_index = KVLayout.build(full_flash(), CacheOptions(index_dtype="fp8")).bytes_per_token()
    assert fp8_index["c4"].paged_bytes_per_token == 146 + 33


def test_num_blocks_for_budget_and_request_sizes() -> None:
    layout = KVLayout.build(full_flash())
    stride = layout.block_stride_bytes
    assert layout.num_blocks_for_budget(10 * stride + stride - 1) == 10
    assert layout.num_blocks_for_budget(0) == 0
    assert layout.num_token_blocks(256) == 1 and layout.num_token_blocks(257) == 2
    assert layout.num_blocks_for_request(0) == layout.num_ring_blocks


def test_spec_tokens_add_ring_slots() -> None:
    layout = KVLayout.build(full_flash(), CacheOptions(num_speculative_tokens=2))
    assert layout.region(0, WINDOW).ring_slots == 130
    assert layout.region(2, COMPRESSOR_STATE).ring_slots == 10


def test_compat_hash_is_stable_and_sensitive() -> None:
    base = KVLayout.build(full_flash())
    assert base.compat_hash == KVLayout.build(full_flash()).compat_hash
    assert len(base.compat_hash) == 16 and int(base.compat_hash, 16) >= 0
    variants = [
        CacheOptions(block_size=512),
        CacheOptions(kv_dtype="bf16"),
        CacheOptions(index_dtype="fp8"),
        CacheOptions(num_speculative_tokens=1),
    ]
    hashes = {KVLayout.build(full_flash(), options).compat_hash for options in variants}
    hashes.add(KVLayout.build(full_flash().with_overrides(sliding_window=64)).compat_hash)
    assert base.compat_hash not in hashes and len(hashes) == 5
    # Independent of the interpreter's hash seed (P and D are different processes).
    code = (
        "from dsv4.cache import KVLayout; from dsv4.config.model import flash_config;"
        "print(KVLayout.build(flash_config()).compat_hash)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == KVLayout.build(flash_config()).compat_hash


@pytest.mark.parametrize(
    "options",
    [
        CacheOptions(block_size=192),
        CacheOptions(block_size=0),
        CacheOptions(kv_dtype="fp16"),
        CacheOptions(index_dtype="int4"),
        CacheOptions(num_speculative_tokens=-1),
    ],
)
def test_bad_options_raise_config_error(options: CacheOptions) -> None:
    with pytest.raises(ConfigError):
        KVLayout.build(tiny_config(), options)


def test_cache_and_scheduler_import_without_torch_or_numpy() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "import dsv4.cache, dsv4.cache.manager, dsv4.scheduler, dsv4.scheduler.policy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
