"""IndexCache patterns (arXiv 2603.12201; vLLM #49085 / #51209): which ratio-4 layers reuse a
top-k (the forward's hand-off is `dsv4.model.index_cache.TopkRelay`).

The lightning indexer (docs/model.md#lightning-indexer) runs in every ratio-4 ("C4") layer, yet
consecutive C4 layers pick 70-100% the same entries. IndexCache splits the C4 layers into
- Full layers, which run their indexer (compressor keys, query projection, logits, top-k), and
- Shared layers, which skip all of it and attend to the top-k of the nearest preceding Full
  layer of the same forward. Their indexer keys are then never read, so the cache layout has
  no indexer pages for them (`CacheOptions.index_pattern`).

`IndexPattern` is the static choice (one role per C4 layer in layer order, the first always
Full). The MTP layer is outside the pattern (always Full). Torch-free: the cache layout reads
patterns too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsv4.config.model import ModelConfig
from dsv4.errors import ConfigError

FULL, SHARED = "F", "S"


def c4_layer_ids(cfg: ModelConfig) -> tuple[int, ...]:
    """Main layers with compress ratio 4, in order (the MTP layer is not included)."""
    return tuple(i for i in range(cfg.num_hidden_layers) if cfg.layer_ratio(i) == 4)


@dataclass(frozen=True)
class IndexPattern:
    """Full ("F") / Shared ("S") role of every C4 layer: `roles[j]` is layer `layer_ids[j]`'s."""

    layer_ids: tuple[int, ...]
    roles: str

    def __post_init__(self) -> None:
        if len(self.roles) != len(self.layer_ids):
            raise ConfigError(
                "index_topk_pattern",
                self.roles,
                f"give one F/S per ratio-4 layer ({len(self.layer_ids)} of them)",
            )
        if set(self.roles) - {FULL, SHARED} or (self.roles and self.roles[0] != FULL):
            raise ConfigError("index_topk_pattern", self.roles, "use F and S, starting with F")

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def all_full(cls, cfg: ModelConfig) -> IndexPattern:
        """No IndexCache: every C4 layer runs its indexer."""
        ids = c4_layer_ids(cfg)
        return cls(ids, FULL * len(ids))

    @classmethod
    def from_freq(cls, cfg: ModelConfig, freq: int) -> IndexPattern:
        """Every `freq`-th C4 layer is Full, starting with the first (freq 1 = all Full)."""
        if freq < 1:
            raise ConfigError("index_topk_freq", freq, "use 1 or more")
        ids = c4_layer_ids(cfg)
        return cls(ids, "".join(FULL if j % freq == 0 else SHARED for j in range(len(ids))))

    @classmethod
    def from_string(cls, cfg: ModelConfig, roles: str) -> IndexPattern:
        """An explicit pattern like "FSSF" ("" = all Full)."""
        return cls(c4_layer_ids(cfg), roles) if roles else cls.all_full(cfg)

    @classmethod
    def from_full_layers(cls, cfg: ModelConfig, full: Sequence[int]) -> IndexPattern:
        ids = c4_layer_ids(cfg)
        return cls(ids, "".join(FULL if i in set(full) else SHARED for i in ids))

    @classmethod
    def from_features(
        cls, cfg: ModelConfig, index_cache: bool, freq: int, pattern: str
    ) -> IndexPattern:
        """From `ServeConfig.features`: off -> all Full; an explicit pattern wins over freq."""
        if not index_cache:
            return cls.all_full(cfg)
        return cls.from_string(cfg, pattern) if pattern else cls.from_freq(cfg, freq)

    # ---- lookups ---------------------------------------------------------------------------
    @property
    def is_all_full(self) -> bool:
        return SHARED not in self.roles

    @property
    def num_full(self) -> int:
        return self.roles.count(FULL)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, role in zip(self.layer_ids, self.roles) if role == FULL)

    def is_shared(self, layer_id: int) -> bool:
        """Layers outside the pattern (other ratios, the MTP layer) are never Shared."""
        if layer_id not in self.layer_ids:
            return False
        return self.roles[self.layer_ids.index(layer_id)] == SHARED

    def source_of(self, layer_id: int) -> int:
        """The Full layer whose top-k `layer_id` uses (itself when Full)."""
        j = self.layer_ids.index(layer_id)
        while self.roles[j] != FULL:
            j -= 1
        return self.layer_ids[j]

    def with_role(self, layer_id: int, role: str) -> IndexPattern:
        j = self.layer_ids.index(layer_id)
        return IndexPattern(self.layer_ids, self.roles[:j] + role + self.roles[j + 1 :])

    def __str__(self) -> str:
        return self.roles
