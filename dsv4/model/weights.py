"""Load HF-format DeepSeek-V4 checkpoints (config.json + safetensors) into `DeepseekV4`.

Accepted layouts: one `model.safetensors`, shards listed by `model.safetensors.index.json`, or
(no index) every `*.safetensors` in the directory. Accepted names:
- official (docs/model.md#checkpoint-names): `embed.weight`, `layers.{i}.attn.kv_norm.weight`,
  per-expert `ffn.experts.{e}.w1.weight`, `mtp.0.*`, quantised weights with a `.scale` companion;
- the hybrid names transformers' `save_pretrained` writes: a `model.` prefix,
  `model.embed_tokens.weight`, `model.hc_head.hc_fn`, and `attn.norm.weight` for the
  attention's kv_norm. Such checkpoints hold no MTP weights (`load_model` then builds the model
  without the MTP layer).

FP8 linears (e4m3 + 128x128 e8m0 `.scale`) and MXFP4 experts (int8 packed e2m1 + e8m0 `.scale`
per 32) are dequantised to the parameter dtype, one tensor at a time; with `expert_weights=
"checkpoint"` the routed experts are instead copied as stored into their stacked storage
(`dsv4.model.moe.quantized_experts_`, what the paged forward's grouped GEMM reads), and with
`linear_weights="checkpoint"` the FP8 linears into `FP8Linear` modules (`dsv4.model.fp8`).

All-or-nothing: every file header is read and every name, shape and dtype validated before the
first byte is copied, so a missing, unexpected, mis-shaped tensor or an unreadable file raises
`CheckpointError` with the model untouched.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dsv4.config.model import ModelConfig
from dsv4.errors import CheckpointError
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.fp8 import FP8Linear, quantized_linears_, served_linear_format
from dsv4.model.inventory import quantized_kind
from dsv4.model.moe import MoE, quantized_experts_, served_expert_format
from dsv4.model.offload_load import ExpertOffload, offload_experts_empty_
from dsv4.ops.quant import fp8_block_dequantize, mxfp4_dequantize

__all__ = ["checkpoint_files", "load_into", "load_model", "official_name", "quantized_kind"]

log = logging.getLogger(__name__)

_HYBRID_RENAMES = (
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^((?:layers|mtp)\.\d+)\.attn\.norm\.weight$"), r"\1.attn.kv_norm.weight"),
)
_FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}
_INT_DTYPES = {"I64", "I32"}
_SCALE_DTYPES = {"F8_E8M0", "F32"}


def official_name(stored: str) -> str:
    """Map a stored tensor name (official or transformers' hybrid) to the official name."""
    name = stored[len("model.") :] if stored.startswith("model.") else stored
    for pattern, repl in _HYBRID_RENAMES:
        name = pattern.sub(repl, name)
    return name


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (or a single file)."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f}: listed in the index but missing")
    return files


@dataclass(frozen=True)
class _Stored:
    file: Path
    key: str  # name inside the file
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]


def _read_headers(files: list[Path]) -> dict[str, _Stored]:
    """official name -> where it is stored; raises on unreadable files and duplicates."""
    stored: dict[str, _Stored] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    sl = handle.get_slice(key)
                    name = official_name(key)
                    if name in stored:
                        raise CheckpointError(f"tensor {name!r} is stored twice ({f.name})")
                    stored[name] = _Stored(f, key, sl.get_dtype(), tuple(sl.get_shape()))
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for bad files
            raise CheckpointError(
                f"{f}: unreadable safetensors file (truncated or corrupted?): {exc}"
            ) from exc
    return stored


Decode = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def _plan_one(
    name: str, target: torch.Tensor, stored: dict[str, _Stored], block: int
) -> tuple[list[str], Decode]:
    """Validate one model tensor against the headers -> (stored names used, decoder)."""
    entry = stored.get(name)
    if entry is None:
        raise CheckpointError(f"missing tensor {name!r} (expected shape {tuple(target.shape)})")
    want = tuple(target.shape)
    scale = stored.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None

    def bad_shape(got: tuple[int, ...], expected: tuple[int, ...], what: str = name) -> None:
        if got != expected:
            raise CheckpointError(f"tensor {what!r} has shape {got}, expected {expected}")

    if entry.dtype in ("F8_E4M3", "I8", "U8") and target.is_floating_point():
        if scale is None or scale.dtype not in _SCALE_DTYPES:
            raise CheckpointError(f"tensor {name!r} is quantised ({entry.dtype}) without a .scale")
        scale_name = name[: -len(".weight")] + ".scale"
        rows, cols = want
        if entry.dtype == "F8_E4M3":
            bad_shape(entry.shape, want)
            bad_shape(scale.shape, (-(-rows // block), -(-cols // block)), scale_name)
            return [name, scale_name], lambda t: fp8_block_dequantize(
                t[name], t[scale_name], block, target.dtype
            )
        bad_shape(entry.shape, (rows, cols // 2))
        bad_shape(scale.shape, (rows, cols // 32), scale_name)
        return [name, scale_name], lambda t: mxfp4_dequantize(
            t[name].view(torch.int8), t[scale_name], target.dtype
        )
    allowed = _FLOAT_DTYPES if target.is_floating_point() else _INT_DTYPES
    if entry.dtype not in allowed:
        raise CheckpointError(f"tensor {name!r} has dtype {entry.dtype}, expected one of {allowed}")
    bad_shape(entry.shape, want)
    return [name], lambda t: t[name]


_QUANTIZED_DTYPES = {"mxfp4": ("I8", "U8"), "fp8": ("F8_E4M3",)}


def _plan_stored(name: str, target: torch.Tensor, dtypes, stored: dict[str, _Stored],
                 switch: str = "features.expert_weights") -> Decode:  # fmt: skip
    """Validate one tensor copied as stored (a quantised expert's or linear's weight or scale;
    `switch` is the setting that asked for it)."""
    entry = stored.get(name)
    if entry is None:
        raise CheckpointError(f"missing tensor {name!r} (expected shape {tuple(target.shape)})")
    if entry.dtype not in dtypes:
        raise CheckpointError(f"tensor {name!r} has dtype {entry.dtype}, expected one of {dtypes} "
                              f"(served as stored: {switch}=checkpoint)")  # fmt: skip
    if entry.shape != tuple(target.shape):
        raise CheckpointError(f"tensor {name!r} has shape {entry.shape}, expected "
                              f"{tuple(target.shape)}")  # fmt: skip
    if target.dtype in (torch.int8, torch.float8_e4m3fn):  # raw bytes, reinterpreted
        return lambda t: t[name].view(target.dtype)
    return lambda t: t[name]  # scales: copy_ converts (exact for UE8M0 values)


def _plan_quantized_experts(model: DeepseekV4, stored: dict[str, _Stored]):
    """(target, [name], decode) for every routed expert tensor of the layers whose experts are
    held as stored (`quantized_experts_`)."""
    for prefix, moe in model.named_modules():
        experts = moe.stacked_experts if isinstance(moe, MoE) else None
        if experts is None or not experts.is_quantized:
            continue
        dtypes = _QUANTIZED_DTYPES[experts.format]
        for e in range(experts.w13.shape[0]):
            for part, (weight, scale) in experts.parts(e).items():
                stem = f"{prefix}.experts.{e}.{part}"
                yield weight, [f"{stem}.weight"], _plan_stored(f"{stem}.weight", weight, dtypes,
                                                               stored)  # fmt: skip
                yield scale, [f"{stem}.scale"], _plan_stored(f"{stem}.scale", scale,
                                                             _SCALE_DTYPES, stored)  # fmt: skip


def _plan_offloaded_experts(model: DeepseekV4, stored: dict[str, _Stored]):
    """(target, names, decode) for every routed expert tensor of the layers whose experts were
    split at load time (`dsv4.model.offload_load`): views of device or host blobs, filled as
    stored (MXFP4 blobs) or dequantised to the blob's dtype (dense blobs)."""
    block = model.cfg.fp8_block_size
    for prefix, moe in model.named_modules():
        store = moe.expert_store if isinstance(moe, MoE) else None
        if store is None:
            continue
        for e in range(moe.cfg.n_routed_experts):
            for part, (weight, scale) in store.parts(e).items():
                stem = f"{prefix}.experts.{e}.{part}"
                if scale is None:
                    names, decode = _plan_one(f"{stem}.weight", weight, stored, block)
                    yield weight, names, decode
                    continue
                yield weight, [f"{stem}.weight"], _plan_stored(f"{stem}.weight", weight,
                                                               _QUANTIZED_DTYPES["mxfp4"], stored)  # fmt: skip
                yield scale, [f"{stem}.scale"], _plan_stored(f"{stem}.scale", scale,
                                                             _SCALE_DTYPES, stored)  # fmt: skip


def _stored_linear_dtypes(model: DeepseekV4) -> dict[str, tuple[str, ...]]:
    """The state_dict names of the `FP8Linear` modules (held as stored) -> accepted dtypes."""
    out: dict[str, tuple[str, ...]] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, FP8Linear):
            out[f"{prefix}.weight"] = _QUANTIZED_DTYPES["fp8"]
            out[f"{prefix}.scale"] = tuple(sorted(_SCALE_DTYPES))
    return out


def _stored_scale_dtype(stored: dict[str, _Stored], name: str) -> torch.dtype | None:
    """torch.float32 when the checkpoint stores the scale `name` as F32 (-Base checkpoints),
    else None (the UE8M0 default of the quantised storage)."""
    first = stored.get(name)
    return torch.float32 if first is not None and first.dtype == "F32" else None


def load_into(model: DeepseekV4, path: str | Path) -> None:
    """Copy the checkpoint at `path` into `model` (validated first; all-or-nothing)."""
    stored = _read_headers(checkpoint_files(path))
    targets = model.state_dict(keep_vars=True)
    as_stored = _stored_linear_dtypes(model)
    plan: list[tuple[torch.Tensor, list[str], Decode]] = []
    used: set[str] = set()
    for name, target in targets.items():
        if name in as_stored:
            decode = _plan_stored(name, target, as_stored[name], stored, "features.linear_weights")
            used.add(name)
            plan.append((target, [name], decode))
            continue
        names, decode = _plan_one(name, target, stored, model.cfg.fp8_block_size)
        used.update(names)
        plan.append((target, names, decode))
    experts = chain(_plan_quantized_experts(model, stored), _plan_offloaded_experts(model, stored))
    for target, names, decode in experts:
        used.update(names)
        plan.append((target, names, decode))
    unexpected = sorted(set(stored) - used)
    if unexpected:
        more = f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(f"unexpected tensor(s) {unexpected[:5]}{more} in {path}")
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, Any] = {}
        for target, names, decode in plan:
            tensors = {}
            for n in names:
                where = stored[n]
                if where.file not in handles:
                    handles[where.file] = stack.enter_context(
                        safe_open(str(where.file), framework="pt", device="cpu")
                    )
                tensors[n] = handles[where.file].get_tensor(where.key)
            target.copy_(decode(tensors))


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    expert_weights: str = "bf16",
    linear_weights: str = "bf16",
    offload: ExpertOffload | None = None,
) -> tuple[DeepseekV4, ModelConfig]:
    """Build a `DeepseekV4` for the checkpoint dir `path` and load its weights.

    `expert_weights` (`features.expert_weights`): "bf16" dequantises the routed experts to
    `dtype` like every weight; "checkpoint" keeps MXFP4 / FP8 experts as stored, stacked for
    the grouped GEMM (`dsv4.model.moe.quantized_experts_`): about a quarter of the bf16 bytes
    for MXFP4, and no dense copy at any point of the load. `linear_weights`
    (`features.linear_weights`) likewise for the FP8 linears: "checkpoint" holds them as
    `FP8Linear` (e4m3 + block scales, about half the bf16 bytes). Either falls back to
    `dtype` for a checkpoint whose config says those tensors are not quantised. `offload`
    splits the routed experts at load time (`dsv4.model.offload_load`): resident ones are
    copied to the device, cold ones into (pinned) host memory, one tensor at a time."""
    cfg = ModelConfig.from_file(path)
    stored = _read_headers(checkpoint_files(path))
    if cfg.has_mtp and not any(n.startswith("mtp.") for n in stored):
        log.warning("%s holds no mtp.* tensors (a transformers save?): building without MTP", path)
        cfg = cfg.with_overrides(num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = DeepseekV4(cfg)
    model.cast_(dtype)
    fmt = served_expert_format(cfg, expert_weights)
    if offload is not None:
        offload_experts_empty_(model, offload, fmt, dtype, device)
    elif fmt != "bf16":
        scale_dtype = _stored_scale_dtype(stored, "layers.0.ffn.experts.0.w1.scale")
        for moe in model.modules():
            if isinstance(moe, MoE):
                quantized_experts_(moe, fmt, device, scale_dtype)
    if served_linear_format(cfg, linear_weights) == "fp8":
        quantized_linears_(model, device, _stored_scale_dtype(stored, "layers.0.attn.wq_a.scale"))
    model.to_empty(device=device)
    load_into(model, path)
    return model.eval(), cfg
