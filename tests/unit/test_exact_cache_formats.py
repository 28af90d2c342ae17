"""The exact cache formats: `--kv-dtype fp32|bf16` and `--indexer-key-dtype bf16|fp32` (beside
the lossy fp8 / mxfp4), from flags, env and YAML, validated, in the layout's compat hash, and
the round trip a step's own rows take (identity where the format is exact)."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pytest
import torch

from dsv4.cache.layout import KVLayout
from dsv4.cache.packing import INDEX_DTYPES, KV_DTYPES, CacheOptions
from dsv4.config import add_config_args, config_from_args, load_config, resolve_auto
from dsv4.config.model import tiny_config
from dsv4.errors import ConfigError
from dsv4.ops.kv_codec import round_trip
from dsv4.runner.kv_cache import PagedKVCache


def test_flags_env_and_yaml_set_the_exact_formats(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(["--kv-dtype", "fp32", "--indexer-key-dtype", "bf16"])
    flags = config_from_args(args, {})
    assert (flags.cache.kv_dtype, flags.cache.indexer_key_dtype) == ("fp32", "bf16")
    env = load_config(None, None, {"DSV4_KV_DTYPE": "bf16", "DSV4_INDEXER_KEY_DTYPE": "fp32"})
    assert (env.cache.kv_dtype, env.cache.indexer_key_dtype) == ("bf16", "fp32")
    path = tmp_path / "serve.yaml"
    path.write_text("cache:\n  kv_dtype: fp32\n  indexer_key_dtype: fp32\n")
    yaml = load_config(None, str(path), {})
    assert (yaml.cache.kv_dtype, yaml.cache.indexer_key_dtype) == ("fp32", "fp32")
    resolved = resolve_auto(yaml, has_cuda=True, hostname="h", pid=1)  # explicit: kept
    assert (resolved.cache.kv_dtype, resolved.cache.indexer_key_dtype) == ("fp32", "fp32")


@pytest.mark.parametrize(
    "key,value", [("cache.kv_dtype", "fp16"), ("cache.indexer_key_dtype", "int8")]
)
def test_unknown_formats_are_refused_with_the_choices(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match="fp32") as info:
        load_config({key: value})
    assert info.value.field_name == key


def test_every_format_pair_has_its_own_compat_hash() -> None:
    """P and D pair only on equal hashes, so a format mismatch is refused before any pull."""
    hashes = {
        KVLayout.build(tiny_config(), CacheOptions(block_size=128, kv_dtype=kv, index_dtype=ix))
        .compat_hash
        for kv, ix in itertools.product(KV_DTYPES, INDEX_DTYPES)
    }  # fmt: skip
    assert len(hashes) == len(KV_DTYPES) * len(INDEX_DTYPES)


def test_exact_formats_hold_rows_exactly_and_need_no_round_trip() -> None:
    cfg = tiny_config()
    layout = KVLayout.build(cfg, CacheOptions(block_size=128, kv_dtype="fp32", index_dtype="fp32"))
    assert layout.kv_entry_bytes == cfg.head_dim * 4
    assert layout.index_entry_bytes == cfg.index_head_dim * 4
    cache = PagedKVCache(layout, num_blocks=4)
    c4 = cfg.compress_ratios.index(4)
    assert cache.stored_rows(c4, "window") is None
    assert cache.stored_rows(c4, "compressed") is None
    assert cache.stored_rows(c4, "indexer") is None
    rows = torch.randn(5, cfg.head_dim, dtype=torch.bfloat16)
    assert torch.equal(round_trip(rows, "bf16", cfg.head_dim * 2, 64), rows)  # bf16 in bf16


def test_lossy_round_trip_equals_a_write_then_a_read_of_the_cache() -> None:
    """What a step attends to for its own rows is what the next step reads back."""
    cfg = tiny_config()
    options = CacheOptions(block_size=128, kv_dtype="fp8", index_dtype="mxfp4")
    cache = PagedKVCache(KVLayout.build(cfg, options), num_blocks=4)
    c4 = cfg.compress_ratios.index(4)
    table = (0,)
    for kind, dim in (("compressed", cfg.head_dim), ("indexer", cfg.index_head_dim)):
        rows = torch.randn(7, dim) * torch.logspace(-3, 3, 7)[:, None]
        cache.write_entries(c4, kind, table, 0, rows)
        stored = cache.stored_rows(c4, kind)
        assert stored is not None
        read_back = cache.read_entries(c4, kind, table, 0, 7)
        assert torch.equal(stored(rows), read_back)
        assert not torch.equal(read_back, rows)  # lossy indeed
