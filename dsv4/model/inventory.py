"""The checkpoint inventory: every tensor a DeepSeek-V4 checkpoint stores
(docs/model.md#checkpoint-names).

Names are the official ones (no `model.` prefix, per-expert `ffn.experts.{e}.w{1,2,3}`, MTP under
`mtp.0.`). Quantised linears appear as `<name>.weight` plus `<name>.scale`; the model holds the
dequantised `<name>.weight` only. The tiny-checkpoint writer and the loader both read this list,
so a name the model and the checkpoint disagree on shows up in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.config.model import ModelConfig

FP8_LINEAR_SUFFIXES = (
    "attn.wq_a",
    "attn.wq_b",
    "attn.wkv",
    "attn.wo_a",
    "attn.wo_b",
    "attn.indexer.wq_b",
    "ffn.shared_experts.w1",
    "ffn.shared_experts.w2",
    "ffn.shared_experts.w3",
    "e_proj",
    "h_proj",
)


@dataclass(frozen=True)
class TensorSpec:
    """One logical weight. `fmt` is how it is stored: bf16 | fp32 | int64 | fp8 | fp4."""

    name: str
    shape: tuple[int, ...]
    fmt: str
    role: str  # what initialises it: linear | norm | embed | hc_fn | hc_base | hc_scale | ...


def quantized_kind(name: str, cfg: ModelConfig) -> str | None:
    """'fp8' for a block-scaled FP8 linear, 'fp4' for an MXFP4 expert, else None.

    `name` is a module weight name such as `layers.3.attn.wq_b.weight`.
    """
    if not name.endswith(".weight"):
        return None
    stem = name[: -len(".weight")]
    if ".ffn.experts." in stem:
        return {"fp4": "fp4", "fp8": "fp8"}.get(cfg.expert_dtype)
    if cfg.linear_dtype == "fp8" and stem.endswith(FP8_LINEAR_SUFFIXES):
        return "fp8"
    return None


def _block_tensors(cfg: ModelConfig, prefix: str, layer_id: int) -> list[TensorSpec]:
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    m, nmix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    ratio = cfg.layer_ratio(layer_id)
    out = [
        TensorSpec(f"{prefix}attn_norm.weight", (d,), "bf16", "norm"),
        TensorSpec(f"{prefix}ffn_norm.weight", (d,), "bf16", "norm"),
    ]
    for part in ("attn", "ffn"):
        out += [
            TensorSpec(f"{prefix}hc_{part}_fn", (nmix, m * d), "fp32", "hc_fn"),
            TensorSpec(f"{prefix}hc_{part}_base", (nmix,), "fp32", "hc_base"),
            TensorSpec(f"{prefix}hc_{part}_scale", (3,), "fp32", "hc_scale"),
        ]
    a = f"{prefix}attn."
    out += [
        TensorSpec(f"{a}wq_a.weight", (cfg.q_lora_rank, d), "bf16", "linear"),
        TensorSpec(f"{a}q_norm.weight", (cfg.q_lora_rank,), "bf16", "norm"),
        TensorSpec(f"{a}wq_b.weight", (h * hd, cfg.q_lora_rank), "bf16", "linear"),
        TensorSpec(f"{a}wkv.weight", (hd, d), "bf16", "linear"),
        TensorSpec(f"{a}kv_norm.weight", (hd,), "bf16", "norm"),
        TensorSpec(
            f"{a}wo_a.weight",
            (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups),
            "bf16",
            "linear",
        ),
        TensorSpec(f"{a}wo_b.weight", (d, cfg.o_groups * cfg.o_lora_rank), "bf16", "linear"),
        TensorSpec(f"{a}attn_sink", (h,), "fp32", "sink"),
    ]
    if ratio:
        out += _compressor(f"{a}compressor.", cfg, ratio, hd)
    if ratio == 4:
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        out += [
            TensorSpec(f"{a}indexer.wq_b.weight", (ih * idim, cfg.q_lora_rank), "bf16", "linear"),
            TensorSpec(f"{a}indexer.weights_proj.weight", (ih, d), "bf16", "linear"),
            *_compressor(f"{a}indexer.compressor.", cfg, ratio, idim),
        ]
    out += _moe(f"{prefix}ffn.", cfg, layer_id)
    return out


def _compressor(p: str, cfg: ModelConfig, ratio: int, dim: int) -> list[TensorSpec]:
    width = cfg.overlap(ratio) * dim
    return [
        TensorSpec(f"{p}ape", (ratio, width), "fp32", "ape"),
        TensorSpec(f"{p}wkv.weight", (width, cfg.hidden_size), "bf16", "linear"),
        TensorSpec(f"{p}wgate.weight", (width, cfg.hidden_size), "bf16", "linear"),
        TensorSpec(f"{p}norm.weight", (dim,), "bf16", "norm"),
    ]


def _moe(p: str, cfg: ModelConfig, layer_id: int) -> list[TensorSpec]:
    d, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    out = [TensorSpec(f"{p}gate.weight", (e, d), "bf16", "linear")]
    if cfg.is_hash_layer(layer_id):
        out.append(
            TensorSpec(
                f"{p}gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "int64", "tid2eid"
            )
        )
    else:
        out.append(TensorSpec(f"{p}gate.bias", (e,), "fp32", "gate_bias"))
    for x in range(e):
        out += [
            TensorSpec(f"{p}experts.{x}.w1.weight", (inter, d), "bf16", "linear"),
            TensorSpec(f"{p}experts.{x}.w2.weight", (d, inter), "bf16", "linear"),
            TensorSpec(f"{p}experts.{x}.w3.weight", (inter, d), "bf16", "linear"),
        ]
    shared = inter * cfg.n_shared_experts
    if shared:
        out += [
            TensorSpec(f"{p}shared_experts.w1.weight", (shared, d), "bf16", "linear"),
            TensorSpec(f"{p}shared_experts.w2.weight", (d, shared), "bf16", "linear"),
            TensorSpec(f"{p}shared_experts.w3.weight", (shared, d), "bf16", "linear"),
        ]
    return out


def model_tensors(cfg: ModelConfig, include_mtp: bool = True) -> list[TensorSpec]:
    """Every logical weight of the model, dequantised view (what `state_dict()` holds)."""
    d, m, v = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    out = [
        TensorSpec("embed.weight", (v, d), "bf16", "embed"),
        TensorSpec("head.weight", (v, d), "bf16", "linear"),
        TensorSpec("norm.weight", (d,), "bf16", "norm"),
        TensorSpec("hc_head_fn", (m, m * d), "fp32", "hc_fn"),
        TensorSpec("hc_head_base", (m,), "fp32", "hc_base"),
        TensorSpec("hc_head_scale", (1,), "fp32", "hc_scale"),
    ]
    for i in range(cfg.num_hidden_layers):
        out += _block_tensors(cfg, f"layers.{i}.", i)
    if include_mtp and cfg.has_mtp:
        p = "mtp.0."
        out += [
            TensorSpec(f"{p}e_proj.weight", (d, d), "bf16", "linear"),
            TensorSpec(f"{p}h_proj.weight", (d, d), "bf16", "linear"),
            TensorSpec(f"{p}enorm.weight", (d,), "bf16", "norm"),
            TensorSpec(f"{p}hnorm.weight", (d,), "bf16", "norm"),
            TensorSpec(f"{p}norm.weight", (d,), "bf16", "norm"),
            TensorSpec(f"{p}hc_head_fn", (m, m * d), "fp32", "hc_fn"),
            TensorSpec(f"{p}hc_head_base", (m,), "fp32", "hc_base"),
            TensorSpec(f"{p}hc_head_scale", (1,), "fp32", "hc_scale"),
            *_block_tensors(cfg, p, cfg.num_hidden_layers),
        ]
    return out


def checkpoint_tensors(cfg: ModelConfig, include_mtp: bool = True) -> list[TensorSpec]:
    """What a checkpoint file stores: quantised weights carry a `.scale` companion."""
    out: list[TensorSpec] = []
    b = cfg.fp8_block_size
    for spec in model_tensors(cfg, include_mtp):
        kind = quantized_kind(spec.name, cfg)
        if kind is None:
            out.append(spec)
            continue
        rows, cols = spec.shape
        stem = spec.name[: -len(".weight")]
        if kind == "fp8":
            out.append(TensorSpec(spec.name, spec.shape, "fp8", spec.role))
            out.append(TensorSpec(f"{stem}.scale", (-(-rows // b), -(-cols // b)), "e8m0", "scale"))
        else:
            out.append(TensorSpec(spec.name, (rows, cols // 2), "fp4", spec.role))
            out.append(TensorSpec(f"{stem}.scale", (rows, cols // 32), "e8m0", "scale"))
    return out
