"""IndexCache patterns (dsv4.model.index_cache) and the cache layout they shape: Shared
ratio-4 layers have no indexer page and no indexer ring, so their keys are never stored or
moved, and the compatibility hash tells the patterns apart."""

from __future__ import annotations

import pytest

from dsv4.cache import INDEXER, INDEXER_STATE, CacheOptions, KVLayout
from dsv4.config.index_pattern import IndexPattern, c4_layer_ids
from dsv4.config.model import flash_config, tiny_config
from dsv4.errors import ConfigError

# 8 layers, C4 at 1, 3, 5, 7 (the benchmark shape).
FLASH8 = flash_config(8, (0, 4, 128, 4, 128, 4, 128, 4))


def test_c4_layers_and_all_full() -> None:
    assert c4_layer_ids(tiny_config()) == (1, 3)
    pattern = IndexPattern.all_full(FLASH8)
    assert pattern.layer_ids == (1, 3, 5, 7) and pattern.roles == "FFFF"
    assert pattern.is_all_full and pattern.num_full == 4


@pytest.mark.parametrize(
    "freq,roles", [(1, "FFFF"), (2, "FSFS"), (3, "FSSF"), (4, "FSSS"), (9, "FSSS")]
)
def test_every_freq_th_c4_layer_is_full(freq: int, roles: str) -> None:
    assert IndexPattern.from_freq(FLASH8, freq).roles == roles


def test_sources_are_the_nearest_preceding_full_layer() -> None:
    pattern = IndexPattern.from_string(FLASH8, "FSSF")
    assert [pattern.source_of(i) for i in (1, 3, 5, 7)] == [1, 1, 1, 7]
    assert [pattern.is_shared(i) for i in range(8)] == [False] * 3 + [True, False, True] + [
        False
    ] * 2
    assert pattern.full_layer_ids == (1, 7)
    assert pattern.with_role(7, "S").roles == "FSSS"


def test_from_features_follows_the_serve_config_switches() -> None:
    assert IndexPattern.from_features(FLASH8, False, 2, "FSFS").is_all_full
    assert IndexPattern.from_features(FLASH8, True, 2, "").roles == "FSFS"
    assert IndexPattern.from_features(FLASH8, True, 2, "FSSF").roles == "FSSF"  # pattern wins
    assert IndexPattern.from_full_layers(FLASH8, [1, 5]).roles == "FSFS"


@pytest.mark.parametrize("roles", ["SFFF", "FSF", "FSFSF", "FXFF"])
def test_bad_patterns_raise_config_error(roles: str) -> None:
    with pytest.raises(ConfigError):
        IndexPattern.from_string(FLASH8, roles)
    with pytest.raises(ConfigError):
        KVLayout.build(FLASH8, CacheOptions(index_pattern=roles))


def test_freq_below_one_is_rejected() -> None:
    with pytest.raises(ConfigError):
        IndexPattern.from_freq(FLASH8, 0)


def test_shared_layers_have_no_indexer_pages_or_rings() -> None:
    full = KVLayout.build(FLASH8)
    shared = KVLayout.build(FLASH8, CacheOptions(index_pattern="FSFS"))
    for layer_id in (1, 5):
        assert shared.region(layer_id, INDEXER).entries_per_block == 64  # Full: still there
        assert shared.region(layer_id, INDEXER_STATE).ring_slots == 8
    for layer_id in (3, 7):
        kinds = {r.kind for r in shared.regions_of_layer(layer_id)}
        assert kinds == {"window", "compressed", "compressor_state"}
    # Two fewer indexer pages per token block: 2 * 64 MXFP4 rows of 68 B.
    assert full.block_stride_bytes - shared.block_stride_bytes >= 2 * 64 * 68 - 584
    assert shared.live_state_bytes(32768) < full.live_state_bytes(32768)
    assert shared.compacted_bytes(32768) < full.compacted_bytes(32768)


def test_compat_hash_changes_with_the_pattern_only() -> None:
    base = KVLayout.build(FLASH8).compat_hash
    assert KVLayout.build(FLASH8, CacheOptions(index_pattern="FFFF")).compat_hash == base
    hashes = {KVLayout.build(FLASH8, CacheOptions(index_pattern=p)).compat_hash
              for p in ("FSFS", "FSSS", "FSSF")}  # fmt: skip
    assert base not in hashes and len(hashes) == 3
