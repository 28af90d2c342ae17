"""`dsv4 train-tiny`: train the tiny model (main layers and the MTP layer) for a few CPU minutes.

Random weights accept almost no MTP draft, so acceptance is measured on a tiny model trained
on text that every machine has: the Python standard library's own source. The corpus is a
fixed, sorted list of stdlib modules (`TRAIN_MODULES`; `HELDOUT_MODULE` is kept out for
evaluation), byte-level BPE tokenized with the tiny checkpoint's tokenizer.

Objective (docs/model.md#mtp): next-token cross-entropy of the main model plus
`MTP_LOSS_WEIGHT` times the MTP layer's cross-entropy for token i+2 from the target's final
streams at i and token i+1 (gradients flow into the shared embedding / head and the trunk, as
in DeepSeek's MTP training). AdamW, fp32 on CPU, warmup then cosine decay over the time (or
step) budget. Note: the indexer's top-k is not differentiable and has no distillation loss
here, so the indexer keeps its random weights.

The checkpoint follows `dsv4.model.tiny`'s writer conventions (config.json, safetensors +
index, tokenizer.json) and loads with `dsv4.model.weights.load_model`.
"""

from __future__ import annotations

import json
import logging
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dsv4.config.model import ModelConfig, tiny_config
from dsv4.errors import UsageError
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.inventory import model_tensors
from dsv4.model.tiny import check_seed, encode_tensor, output_dir, random_model
from dsv4.text.tokenizer import build_tokenizer

log = logging.getLogger(__name__)

TRAIN_MODULES = (
    "abc", "bisect", "colorsys", "contextlib", "copy", "fnmatch", "functools", "genericpath",
    "glob", "heapq", "numbers", "operator", "posixpath", "queue", "sched", "shlex", "string",
    "textwrap",
)  # fmt: skip
HELDOUT_MODULE = "pprint"
SEQ_LEN = 128
BATCH_SIZE = 2
MTP_LOSS_WEIGHT = 0.3
PEAK_LR = 3e-3
WARMUP_STEPS = 10
HELDOUT_TOKENS = 1024
MXFP4_GROUP = 32  # columns an MXFP4 scale covers: the V4-format re-stores need whole groups
MAX_MOE_INTERMEDIATE = 1024  # past this the "tiny" model stops training in CPU minutes


@dataclass(frozen=True)
class TrainReport:
    """What `train_tiny` did; losses are per step (nats per token)."""

    out_dir: Path
    num_steps: int
    seconds: float
    losses: tuple[float, ...]
    mtp_losses: tuple[float, ...]
    heldout_loss: float
    heldout_mtp_loss: float
    num_corpus_tokens: int

    @property
    def final_loss(self) -> float:
        """Mean main loss over the last 10 steps."""
        tail = self.losses[-10:]
        return sum(tail) / max(1, len(tail))

    @property
    def final_mtp_loss(self) -> float:
        tail = self.mtp_losses[-10:]
        return sum(tail) / max(1, len(tail))

    def summary(self) -> dict[str, object]:
        """JSON-ready: final / held-out losses and the loss curve every 10 steps."""
        return {
            "out_dir": str(self.out_dir),
            "num_steps": self.num_steps,
            "seconds": round(self.seconds, 1),
            "final_loss": round(self.final_loss, 4),
            "final_mtp_loss": round(self.final_mtp_loss, 4),
            "heldout_loss": round(self.heldout_loss, 4),
            "heldout_mtp_loss": round(self.heldout_mtp_loss, 4),
            "loss_curve": [round(x, 3) for x in self.losses[::10]],
            "mtp_loss_curve": [round(x, 3) for x in self.mtp_losses[::10]],
        }


def stdlib_tokens(modules: tuple[str, ...], vocab_size: int) -> torch.Tensor:
    """The listed stdlib modules' source, concatenated in order, as token ids [N] int64."""
    tokenizer = build_tokenizer(vocab_size)
    root = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in modules:
        ids += tokenizer.encode((root / f"{name}.py").read_text(encoding="utf-8")).ids
    return torch.tensor(ids, dtype=torch.long)


def lm_losses(model: DeepseekV4, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, S] -> (next-token CE, MTP CE for token i+2 from streams at i and token i+1)."""
    vocab = model.cfg.vocab_size
    out = model(ids)
    main = F.cross_entropy(out.logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    draft = model.mtp_forward(out.streams[:, :-2], ids[:, 1:-1])
    mtp = F.cross_entropy(draft.logits.reshape(-1, vocab), ids[:, 2:].reshape(-1))
    return main, mtp


def _lr_at(step: int, progress: float) -> float:
    warmup = min(1.0, (step + 1) / WARMUP_STEPS)
    return PEAK_LR * warmup * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def check_moe_intermediate_size(size: int) -> None:
    """train-tiny --moe-intermediate-size: a multiple of 32 (the experts re-store as MXFP4,
    one scale per 32 columns) in [32, 1024]; 128 gives experts that take `features.mxfp4_layout
    halves128` (whole 128-column blocks), which the default 64 cannot."""
    if not (MXFP4_GROUP <= size <= MAX_MOE_INTERMEDIATE and size % MXFP4_GROUP == 0):
        raise UsageError(f"--moe-intermediate-size {size}: give a multiple of {MXFP4_GROUP} in "
                         f"[{MXFP4_GROUP}, {MAX_MOE_INTERMEDIATE}], e.g. 64 (the tiny shape) or "
                         "128 (experts that take features.mxfp4_layout halves128)")  # fmt: skip


def tiny_train_config(moe_intermediate_size: int | None = None) -> ModelConfig:
    """The shape train-tiny trains: the tiny config, with the experts' (and shared expert's)
    I = `moe_intermediate_size` when given (`check_moe_intermediate_size`)."""
    if moe_intermediate_size is None:
        return tiny_config()
    check_moe_intermediate_size(moe_intermediate_size)
    return tiny_config().with_overrides(moe_intermediate_size=moe_intermediate_size)


def train_tiny(
    out_dir: str | Path,
    minutes: float = 3.0,
    seed: int = 0,
    steps: int | None = None,
    moe_intermediate_size: int | None = None,
) -> TrainReport:
    """Train from `random_model(tiny_config(), seed)` until `steps` steps or `minutes` of wall
    time (whichever first), evaluate on the held-out module, write the checkpoint.
    `moe_intermediate_size`: the experts' (and shared expert's) I, default the tiny shape's."""
    check_seed(seed)
    cfg = tiny_train_config(moe_intermediate_size)
    if steps is None and not math.isfinite(minutes):  # with --steps, inf: no time limit
        raise UsageError(f"--minutes {minutes}: give a finite budget, or --steps N")
    output_dir(out_dir)  # an unwritable OUT_DIR fails now, not after the training
    torch.manual_seed(seed)
    model = random_model(cfg, seed=seed).train()
    corpus = stdlib_tokens(TRAIN_MODULES, cfg.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.01)
    budget_s, start = minutes * 60.0, time.monotonic()
    losses: list[float] = []
    mtp_losses: list[float] = []
    step = 0
    while steps is None or step < steps:
        elapsed = time.monotonic() - start
        if elapsed >= budget_s:
            break
        progress = step / steps if steps else elapsed / budget_s
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, progress)
        offsets = torch.randint(0, corpus.numel() - SEQ_LEN, (BATCH_SIZE,), generator=gen)
        batch = torch.stack([corpus[o : o + SEQ_LEN] for o in offsets.tolist()])  # [B, S]
        main, mtp = lm_losses(model, batch)
        opt.zero_grad(set_to_none=True)
        (main + MTP_LOSS_WEIGHT * mtp).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(main.item())
        mtp_losses.append(mtp.item())
        if step % 10 == 0:
            log.info(
                "step %d  loss %.3f  mtp %.3f  %.0fs", step, losses[-1], mtp_losses[-1], elapsed
            )
        step += 1
    seconds = time.monotonic() - start
    heldout, heldout_mtp = evaluate(model.eval(), HELDOUT_MODULE)
    out = save_checkpoint(model, cfg, out_dir)
    return TrainReport(
        out, step, seconds, tuple(losses), tuple(mtp_losses), heldout, heldout_mtp, corpus.numel()
    )


@torch.no_grad()
def evaluate(
    model: DeepseekV4, module: str, num_tokens: int = HELDOUT_TOKENS
) -> tuple[float, float]:
    """(main, MTP) mean cross-entropy on the first `num_tokens` tokens of a stdlib module."""
    ids = stdlib_tokens((module,), model.cfg.vocab_size)[:num_tokens]
    rows = ids[: ids.numel() // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
    pairs = [lm_losses(model, row.unsqueeze(0)) for row in rows]
    return (
        sum(p[0].item() for p in pairs) / len(pairs),
        sum(p[1].item() for p in pairs) / len(pairs),
    )


def save_checkpoint(model: DeepseekV4, cfg: ModelConfig, out_dir: str | Path) -> Path:
    """config.json + model.safetensors (+ index) + tokenizer, as `dsv4.model.tiny` writes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for spec in model_tensors(cfg):
        value = state[spec.name].detach().cpu()
        value = value if spec.fmt == "int64" else value.float()
        tensors.update(encode_tensor(spec.name, value, spec.fmt, cfg))
    fname = "model-00001-of-00001.safetensors"
    save_file(tensors, str(out / fname), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(sorted(tensors), fname)}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
    tok = build_tokenizer(cfg.vocab_size, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id)
    tok.save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
                  "eos_token": "<eos>"}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out
