"""Frozen view of a DeepSeek-V4 `config.json` (docs/model.md#configurations).

Reads both spellings that exist in the wild:
- the official checkpoint config (`compress_ratios` with L+1 entries, the last one for the MTP
  layer; `num_hash_layers`; `qk_rope_head_dim`; `rope_scaling`);
- the config that `transformers`' `DeepseekV4Config.save_pretrained` writes (`layer_types`,
  `mlp_layer_types`, `compress_rates`, `partial_rotary_factor`, nested `rope_parameters`).

Everything downstream (model, cache layout, planner, kernels) reads only this object.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dsv4.errors import ConfigError

LAYER_TYPE_TO_RATIO = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}
RATIO_TO_LAYER_TYPE = {v: k for k, v in LAYER_TYPE_TO_RATIO.items()}


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation used by compressed layers only (docs/model.md#rope-and-yarn)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # One entry per main layer (0, 4 or 128); the MTP layer's entry is kept apart.
    compress_ratios: tuple[int, ...] = ()
    mtp_compress_ratio: int = 0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    # The official reference leaves the shared expert unclamped; transformers and vLLM clamp it
    # (docs/model.md#choices-where-implementations-differ). We follow transformers (our oracle) by
    # default.
    clamp_shared_expert: bool = True
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    # Checkpoint storage formats: "bf16" | "fp8" for linears, "bf16" | "fp8" | "fp4" for experts.
    linear_dtype: str = "bf16"
    expert_dtype: str = "bf16"
    fp8_block_size: int = 128

    def __post_init__(self) -> None:
        # A zero, negative or absurd size used to pass here and fail later as a bug's line (a
        # tensor of negative dimension, a 0-layer model that served): refused where it is read.
        for name, least in _SIZE_FIELDS:
            value = getattr(self, name)
            if not least <= value < _SIZE_LIMIT:
                raise ConfigError(name, value, f"{name} must be in [{least}, 2**31)")
        if len(self.compress_ratios) != self.num_hidden_layers:
            raise ConfigError(
                "compress_ratios",
                self.compress_ratios,
                f"give one ratio per main layer ({self.num_hidden_layers})",
            )
        for r in (*self.compress_ratios, self.mtp_compress_ratio):
            if r not in RATIO_TO_LAYER_TYPE:
                raise ConfigError("compress_ratios", r, "each ratio must be 0, 4 or 128")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError("o_groups", self.o_groups, "must divide num_attention_heads")
        if self.qk_rope_head_dim > self.head_dim or self.qk_rope_head_dim % 2:
            raise ConfigError("qk_rope_head_dim", self.qk_rope_head_dim, "even and <= head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                "num_experts_per_tok", self.num_experts_per_tok, "<= n_routed_experts"
            )
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError("scoring_func", self.scoring_func, "only sqrtsoftplus is supported")

    # ---- derived facts -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    def layer_ratio(self, layer_id: int) -> int:
        """Compress ratio of layer `layer_id`; `num_hidden_layers` names the MTP layer."""
        if layer_id == self.num_hidden_layers:
            return self.mtp_compress_ratio
        return self.compress_ratios[layer_id]

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    def overlap(self, ratio: int) -> int:
        """c = 1 + [ratio == 4]: the overlapping compressor doubles its projection width."""
        return 2 if ratio == 4 else 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    # ---- I/O -----------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from either the official or the transformers spelling of config.json."""
        n = int(raw["num_hidden_layers"])
        ratios, mtp_ratio = _read_ratios(raw, n)
        num_hash = _read_num_hash_layers(raw, n)
        head_dim = int(raw.get("head_dim", 512))
        rope_dim = raw.get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = round(head_dim * float(raw.get("partial_rotary_factor") or 0.125))
        theta, ctheta, yarn = _read_rope(raw)
        quant = raw.get("quantization_config") or {}
        linear_dtype = "fp8" if quant.get("quant_method") == "fp8" else "bf16"
        expert_dtype = str(raw.get("expert_dtype") or quant.get("expert_dtype") or linear_dtype)
        expert_dtype = {"fp4": "fp4", "mxfp4": "fp4", "fp8": "fp8"}.get(expert_dtype, "bf16")
        eos = raw.get("eos_token_id", 1)
        if isinstance(eos, list):
            eos = eos[0]
        kwargs: dict[str, Any] = {
            "compress_ratios": ratios,
            "mtp_compress_ratio": mtp_ratio,
            "num_hash_layers": num_hash,
            "qk_rope_head_dim": int(rope_dim),
            "rope_theta": theta,
            "compress_rope_theta": ctheta,
            "rope_scaling": yarn,
            "linear_dtype": linear_dtype,
            "expert_dtype": expert_dtype,
            "eos_token_id": int(eos if eos is not None else 1),
            "bos_token_id": int(raw.get("bos_token_id") or 0),
        }
        block = quant.get("weight_block_size")
        if block:
            kwargs["fp8_block_size"] = int(block[0])
        if "clamp_shared_expert" in raw:
            kwargs["clamp_shared_expert"] = bool(raw["clamp_shared_expert"])
        for name in _PLAIN_FIELDS:
            if name in raw and raw[name] is not None:
                kwargs[name] = type(getattr(_DEFAULTS, name))(raw[name])
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read config.json (or the dir holding it). Whatever is wrong with the file is a
        ConfigError naming it: a user's checkpoint, not a bug of ours."""
        if not str(path).strip():  # Path("") is the current directory
            raise ConfigError("model", str(path), "give --model a checkpoint dir")
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_bytes())
        except FileNotFoundError as exc:
            raise ConfigError("model", str(path), "point --model at a checkpoint dir") from exc
        except ValueError as exc:  # not JSON, or not UTF-8 text
            raise ConfigError("model", str(path), f"config.json is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            kind = type(raw).__name__
            raise ConfigError("model", str(path), f"config.json must hold an object, not a {kind}")
        missing = [key for key in _REQUIRED if raw.get(key) is None]
        if raw.get("compress_ratios") is None and raw.get("layer_types") is None:
            missing.append("compress_ratios (or layer_types)")
        if missing:
            raise ConfigError("model", str(path), f"config.json lacks {', '.join(missing)}: "
                              "give a DeepSeek-V4 checkpoint's config.json")  # fmt: skip
        try:
            return cls.from_hf_dict(raw)
        except ConfigError as exc:  # a value out of range: say in which file
            raise ConfigError(exc.field_name, exc.value, f"{exc.fix} (in {path})") from exc
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            # a value of the wrong kind (a string for a count, a number for a mapping, a 0 divisor)
            raise ConfigError(
                "model", str(path), f"config.json has a malformed value ({type(exc).__name__}: "
                f"{exc}): compare it with a DeepSeek-V4 checkpoint's config.json",
            ) from exc  # fmt: skip

    def to_hf_dict(self) -> dict[str, Any]:
        """The official spelling (what `dsv4 make-tiny` writes); transformers reads it too."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
        }
        for name in _PLAIN_FIELDS:
            out[name] = getattr(self, name)
        out["compress_ratios"] = [*self.compress_ratios, self.mtp_compress_ratio]
        out["num_hash_layers"] = self.num_hash_layers
        out["qk_rope_head_dim"] = self.qk_rope_head_dim
        out["num_key_value_heads"] = 1
        out["topk_method"] = "noaux_tc"
        out["hidden_act"] = "silu"
        out["rope_theta"] = self.rope_theta
        out["compress_rope_theta"] = self.compress_rope_theta
        out["bos_token_id"] = self.bos_token_id
        out["eos_token_id"] = self.eos_token_id
        out["tie_word_embeddings"] = self.tie_word_embeddings
        out["clamp_shared_expert"] = self.clamp_shared_expert
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"type": "yarn", **asdict(self.rope_scaling)}
        if self.linear_dtype == "fp8":
            out["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "scale_fmt": "ue8m0",
                "weight_block_size": [self.fp8_block_size, self.fp8_block_size],
            }
        out["expert_dtype"] = self.expert_dtype
        return out


# The integer sizes and counts of a config.json with the least each may be (the rest are >= 1);
# every one stays below 2**31, the largest a tensor dimension or an int32 index can hold.
_SIZE_LIMIT = 2**31
_SIZE_FIELDS = tuple(
    (name, 0 if name in ("n_shared_experts", "num_hash_layers", "num_nextn_predict_layers",
                         "qk_rope_head_dim", "hc_sinkhorn_iters") else 1)
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                 "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                 "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "num_hash_layers", "hc_mult", "hc_sinkhorn_iters",
                 "num_nextn_predict_layers", "max_position_embeddings", "fp8_block_size")
)  # fmt: skip

_PLAIN_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "scoring_func",
    "norm_topk_prob",
    "routed_scaling_factor",
    "swiglu_limit",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "rms_norm_eps",
    "num_nextn_predict_layers",
    "max_position_embeddings",
)


# What `from_hf_dict` cannot default (compress_ratios or layer_types is checked beside them).
_REQUIRED = ("num_hidden_layers",)


def _read_ratios(raw: dict[str, Any], n: int) -> tuple[tuple[int, ...], int]:
    if raw.get("compress_ratios") is not None:
        ratios = [int(r) for r in raw["compress_ratios"]]
    elif raw.get("layer_types") is not None:
        rates = {**_DEFAULT_RATES, **(raw.get("compress_rates") or {})}
        try:
            ratios = [0 if t == "sliding_attention" else int(rates[t]) for t in raw["layer_types"]]
        except KeyError as exc:
            raise ConfigError("layer_types", raw["layer_types"], f"unknown type {exc}") from exc
    else:
        raise ConfigError(
            "compress_ratios", None, "config.json needs compress_ratios or layer_types"
        )
    if len(ratios) not in (n, n + 1):
        raise ConfigError("compress_ratios", ratios, f"need {n} or {n + 1} entries (+1 for MTP)")
    mtp_ratio = ratios[n] if len(ratios) == n + 1 else 0
    return tuple(ratios[:n]), mtp_ratio


_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _read_num_hash_layers(raw: dict[str, Any], n: int) -> int:
    if raw.get("num_hash_layers") is not None:
        return int(raw["num_hash_layers"])
    types = raw.get("mlp_layer_types")
    if types is None:
        return min(3, n)
    return sum(1 for t in types if t == "hash_moe")


def _read_rope(raw: dict[str, Any]) -> tuple[float, float, YarnScaling | None]:
    theta = float(raw.get("rope_theta", 10000.0))
    ctheta = float(raw.get("compress_rope_theta", 160000.0))
    scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        comp = params["compress"]
        ctheta = float(comp.get("rope_theta", ctheta))
        theta = float(params.get("main", {}).get("rope_theta", theta))
        scaling = comp if comp.get("rope_type", comp.get("type")) == "yarn" else None
    if not scaling or scaling.get("rope_type", scaling.get("type")) not in ("yarn",):
        return theta, ctheta, None
    yarn = YarnScaling(
        factor=float(scaling.get("factor", 16.0)),
        original_max_position_embeddings=int(
            scaling.get("original_max_position_embeddings", 65536)
        ),
        beta_fast=float(scaling.get("beta_fast", 32.0)),
        beta_slow=float(scaling.get("beta_slow", 1.0)),
    )
    return theta, ctheta, yarn


def flash_config(num_layers: int = 4, ratios: tuple[int, ...] = (0, 4, 128, 4)) -> ModelConfig:
    """V4-Flash dimensions with few layers (docs/model.md#configurations), for GPU benchmarks."""
    return ModelConfig(
        num_hidden_layers=num_layers,
        compress_ratios=tuple(ratios[:num_layers]),
        num_hash_layers=1,
    )


def tiny_config() -> ModelConfig:
    """The CPU test shape (docs/model.md#configurations): every layer kind, hash and scored
    routing, MTP.

    Window 32 and top-k 16 make 300-700 token prompts cross every boundary: the C4 layer has
    more candidates than top-k, the C128 layer several windows.
    """
    return ModelConfig(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=4,
        compress_ratios=(0, 4, 128, 4),
        mtp_compress_ratio=0,
        num_attention_heads=8,
        head_dim=128,
        qk_rope_head_dim=64,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        sliding_window=32,
        index_n_heads=4,
        index_head_dim=64,
        index_topk=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        num_hash_layers=1,
        max_position_embeddings=4096,
    )


_DEFAULTS = ModelConfig(compress_ratios=(0,), num_hidden_layers=1)
