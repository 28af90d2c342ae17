"""`dsv4 make-tiny`: a deterministic random DeepSeek-V4 checkpoint stored as the real ones are.

The checkpoint has every layer kind (ratios 0, 4, 128), a hash layer with a non-trivial
token-to-expert table, the MTP layer, FP8 block-scaled linears and MXFP4 experts (or bf16, on
request), sharded safetensors with an index file, and a byte-level BPE `tokenizer.json`.
`--shape flash` writes V4-Flash dimensions with few layers for GPU benchmarks.

Initialisation keeps activations O(1) through the stack: linears ~ N(0, 1/fan_in), norms near 1,
small hyper-connection logits, sinks and position biases of order 0.1-1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from dsv4.config.model import ModelConfig, flash_config, tiny_config
from dsv4.config.sections import SEED_LIMIT
from dsv4.errors import CheckpointError, UsageError
from dsv4.model.fp8 import quantized_linears_, served_linear_format
from dsv4.model.inventory import TensorSpec, checkpoint_tensors, model_tensors, quantized_kind
from dsv4.model.moe import MoE, quantized_experts_, served_expert_format, stack_experts_
from dsv4.model.offload_load import ExpertOffload, offload_experts_empty_
from dsv4.ops.quant import fp8_block_quantize, mxfp4_quantize
from dsv4.text.tokenizer import build_tokenizer

DEFAULT_SHARD_BYTES = 4 * 1024 * 1024


def random_tensor(spec: TensorSpec, cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """A deterministic random value for one logical weight (fp32, or int64 for tid2eid), drawn
    on the generator's device (a CUDA generator fills a Flash-shaped model in a second)."""
    shape = spec.shape
    dev = gen.device
    if spec.role == "linear":
        # in place: a Flash-shaped head is a [129280, 4096] fp32 draw (1.97 GiB), one copy
        return torch.randn(shape, generator=gen, device=dev).div_(shape[-1] ** 0.5)
    if spec.role == "embed":
        return torch.randn(shape, generator=gen, device=dev)
    if spec.role == "norm":
        return 1.0 + 0.1 * torch.randn(shape, generator=gen, device=dev)
    if spec.role == "hc_fn":
        return torch.randn(shape, generator=gen, device=dev) * 0.5 / shape[-1] ** 0.5
    if spec.role == "hc_base":
        return 0.5 * torch.randn(shape, generator=gen, device=dev)
    if spec.role == "hc_scale":
        return 1.0 + 0.25 * torch.rand(shape, generator=gen, device=dev)
    if spec.role in ("sink", "ape"):
        return 0.5 * torch.randn(shape, generator=gen, device=dev)
    if spec.role == "gate_bias":
        return 0.1 * torch.randn(shape, generator=gen, device=dev)
    if spec.role == "tid2eid":
        # k distinct experts per token, drawn independently per vocabulary id.
        scores = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen, device=dev)
        return scores.argsort(dim=1)[:, : cfg.num_experts_per_tok].to(torch.int64)
    raise ValueError(f"no initialiser for role {spec.role!r} of {spec.name}")


_STORE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64}


def encode_tensor(
    name: str, value: torch.Tensor, fmt: str, cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """One logical weight -> the stored tensors (`weight` [+ `scale`])."""
    kind = quantized_kind(name, cfg)
    stem = name[: -len(".weight")] if name.endswith(".weight") else name
    if kind == "fp8":
        codes, scale = fp8_block_quantize(value, cfg.fp8_block_size)
        return {name: codes, f"{stem}.scale": scale}
    if kind == "fp4":
        packed, scale = mxfp4_quantize(value)
        return {name: packed, f"{stem}.scale": scale}
    return {name: value.to(_STORE_DTYPES[fmt]).contiguous()}


def check_seed(seed: int) -> None:
    """make-tiny / train-tiny --seed: a uint64, as the server's seeds (torch's generators
    overflow past 2**64 - 1 and wrap negative seeds)."""
    if not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"--seed {seed}: give a seed in [0, 2**64)")


def output_dir(out_dir: str | Path) -> Path:
    """`out_dir`, created (with parents) and writable, or a CheckpointError saying which (a
    UsageError for an empty path: Path("") is ".", the files would land in the current dir)."""
    if not str(out_dir).strip():
        shown = repr(str(out_dir))
        raise UsageError(f"OUT_DIR {shown}: give the directory to write into (. for the current)")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".dsv4-write-probe"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(
            f"cannot write the checkpoint directory {out} ({exc.strerror or exc}): "
            "give an OUT_DIR you can create and write"
        ) from exc
    return out


def write_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    with_tokenizer: bool = True,
    progress: bool = False,
) -> Path:
    """Write config.json, sharded safetensors + index, and tokenizer.json into `out_dir`.
    `progress`: tqdm bars on stderr while weights are drawn and shards written (a Flash-shaped
    checkpoint takes minutes on a CPU)."""
    check_seed(seed)
    out = output_dir(out_dir)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    bar = {"file": sys.stderr, "disable": not progress, "mininterval": 0.5, "dynamic_ncols": True}
    for spec in tqdm(model_tensors(cfg), desc="drawing weights", unit="tensor", **bar):
        stored = encode_tensor(spec.name, random_tensor(spec, cfg, gen), spec.fmt, cfg)
        size = sum(t.numel() * t.element_size() for t in stored.values())
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1].update(stored)
        shard_bytes += size
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for i, shard in enumerate(tqdm(shards, desc="writing shards", unit="shard", **bar)):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for key, tensor in shard.items():
            weight_map[key] = fname
            total_bytes += tensor.numel() * tensor.element_size()
    expected = {s.name for s in checkpoint_tensors(cfg)}
    assert expected == set(weight_map), "writer and inventory disagree"
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    write_model_spec(out, cfg, with_tokenizer)
    return out


def write_model_spec(out_dir: str | Path, cfg: ModelConfig, with_tokenizer: bool = True) -> Path:
    """config.json (+ tokenizer.json) without weights: served as `--model random:DIR`, every
    process draws the same weights from model.seed on its device (large random-weight shapes
    that would take minutes to write and read)."""
    out = output_dir(out_dir)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
    if with_tokenizer:
        tok = build_tokenizer(cfg.vocab_size, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id)
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": "<bos>",
                    "eos_token": "<eos>",
                }
            )
        )
    return out


def shape_config(shape: str, linear_dtype: str, expert_dtype: str) -> ModelConfig:
    """'tiny' (CPU tests) or 'flash' (V4-Flash dims, 4 layers) with the chosen storage formats."""
    base = {"tiny": tiny_config, "flash": flash_config}.get(shape)
    if base is None:
        raise ValueError(f"unknown shape {shape!r}: use tiny or flash")
    return base().with_overrides(linear_dtype=linear_dtype, expert_dtype=expert_dtype)


def random_model(
    cfg: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    *,
    draw_on_device: bool = False,
    expert_weights: str = "bf16",
    linear_weights: str = "bf16",
    offload: ExpertOffload | None = None,
    routing: str = "uniform",
):
    """A model filled in memory from the same initialisers as the checkpoint writer (no I/O).

    GPU benchmarks use this for Flash-shaped models that would take minutes to write to disk;
    `draw_on_device` draws the values with a generator on `device` (other values than the CPU
    stream of the same seed, but no host-side fill of tens of GB). `expert_weights` "checkpoint"
    (`features.expert_weights`) holds the routed experts as `cfg.expert_dtype` says a checkpoint
    stores them (MXFP4 / FP8): each expert's draw is quantised into the stacked storage, so
    they equal a written checkpoint's experts (other weights stay unrounded) and no dense copy
    exists. `linear_weights` "checkpoint" (`features.linear_weights`) likewise holds the FP8
    linears of an FP8 config as `FP8Linear` (each draw quantised as the writer stores it).
    Every other value is the same draw as with "bf16". `offload` splits the routed experts at
    load time (`dsv4.model.offload_load`): each draw goes straight into its resident device
    blob or its host blob, with the values the stacked storage would hold. `routing` "zipf1" then re-biases the
    routers so expert popularity per layer falls as 1/rank (`dsv4.model.skew`); "uniform"
    keeps the draws (near-uniform popularity).
    """
    if routing not in ("uniform", "zipf1"):
        raise ValueError(f"routing {routing!r}: use uniform or zipf1")
    from dsv4.model.deepseek_v4 import DeepseekV4

    gen = torch.Generator(device if draw_on_device else "cpu").manual_seed(seed)
    with torch.device("meta"):
        model = DeepseekV4(cfg).cast_(dtype)  # final dtypes first: no fp32 copy of the model
    fmt = served_expert_format(cfg, expert_weights)
    if served_linear_format(cfg, linear_weights) == "fp8":
        quantized_linears_(model, device)
    if offload is not None:  # routed experts straight into device / host blobs
        offload_experts_empty_(model, offload, fmt, dtype, device)
    blocks = (*model.layers, *model.mtp) if offload is None else ()
    for block in blocks:  # routed experts straight into stacked storage:
        if fmt == "bf16":  # stacking them later would hold them twice at once
            stack_experts_(block.ffn, device)
        else:
            quantized_experts_(block.ffn, fmt, device)
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)
    state = model.state_dict()
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    with torch.no_grad():
        for spec in model_tensors(cfg, include_mtp=bool(len(model.mtp))):
            # the last draw is dropped before the next: on a GPU the embedding and head draws
            # (1.97 GiB each at Flash's shape) would otherwise overlap in the load's peak
            value = None
            value = random_tensor(spec, cfg, gen)
            target = state.get(spec.name)
            if target is not None and target.dtype == torch.float8_e4m3fn:  # an FP8Linear
                for name, t in encode_tensor(spec.name, value, "bf16", cfg).items():
                    state[name].copy_(t)  # weight and scale as the writer stores them
                continue
            if target is not None:
                target.copy_(value)  # rounds as .to(dtype)
                continue
            prefix, _, rest = spec.name.partition(".experts.")  # a quantised routed expert
            e, part, _ = rest.split(".")
            moe = moes[prefix]
            held = moe.stacked_experts if moe.expert_store is None else moe.expert_store
            weight, scale = held.parts(int(e))[part]
            # a cold expert's host blob is pinned: drawn on the device, its copy need not wait
            # (the draws of the next experts queue behind it; synchronised below)
            async_copy = draw_on_device and weight.device.type == "cpu"
            if scale is None:  # a dense offloaded blob: rounds as .to(dtype), as modules do
                weight.copy_(value, non_blocking=async_copy)
                continue
            stored = encode_tensor(spec.name, value, "bf16", cfg)  # as the writer stores it
            weight.copy_(stored[spec.name], non_blocking=async_copy)
            scale.copy_(stored[spec.name.removesuffix("weight") + "scale"],
                        non_blocking=async_copy)  # fmt: skip
    if draw_on_device and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)  # the host blobs' copies have landed
    if routing == "zipf1":
        from dsv4.model.skew import zipf_routing_

        zipf_routing_(model, seed)
    return model.eval()
