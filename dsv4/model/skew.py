"""Skewed routing for random models: expert popularity ~ Zipf(alpha = 1) per MoE layer.

Random gate weights route almost uniformly, so an expert offload measured on a random model
would see no hot experts. `zipf_routing_` gives each MoE layer a random popularity order
(rank 1 = hottest) and
- scored layers a gate bias b_e = a * log(1 / rank_e) (the bias only selects: the weights stay
  the unbiased scores, docs/model.md#moe), with the one scale `a` fitted so the selection
  shares on gate logits of the random model's scale (g ~ N(0, 1): u is RMS-normed and
  W_g ~ N(0, 1/D)) are closest to 1/rank (total variation);
- hash layers a token->experts table drawn per token without replacement with probability
  ~ 1/rank (so ~1/rank over the vocabulary, slightly flattened by the k distinct experts).
"""

from __future__ import annotations

import math

import torch

from dsv4.config.model import ModelConfig
from dsv4.config.sections import SEED_LIMIT
from dsv4.ops.moe import route

CALIBRATION_TOKENS = 4096
FIT_STEPS = 30
MAX_SCALE = 4.0


def zipf_ranks(num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """rank [E] float: expert e's popularity rank, 1 = most selected (a random order)."""
    return torch.randperm(num_experts, generator=gen).double() + 1


def zipf_layer_ranks(num_layers: int, num_experts: int, seed: int) -> list[torch.Tensor]:
    """Each MoE layer's ranks [E] (layers 0..L-1, then the MTP layer), from their own generator
    of `seed`: `zipf_routing_` draws them so, and an offload benchmark reads them before the
    model exists (`zipf_expected_counts`)."""
    gen = torch.Generator().manual_seed(seed)
    return [zipf_ranks(num_experts, gen) for _ in range(num_layers)]


def zipf_expected_counts(ranks: torch.Tensor, selections: int = 1_000_000) -> list[int]:
    """counts [E]: a layer's selections per expert out of `selections` at exact 1/rank shares,
    what the worker's routing statistics converge to (a residency file's counts)."""
    share = (1.0 / ranks) / (1.0 / ranks).sum()
    return [round(float(x)) for x in share * selections]


def zipf_distance(scale: float, cfg: ModelConfig, logits: torch.Tensor) -> float:
    """Total variation between the selection shares with the bias -scale * log(rank) (expert i
    has rank i + 1 here) on gate logits [T, E] and the exact 1/rank shares."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    rank = torch.arange(1, e + 1, dtype=torch.float64)
    bias = (-scale * torch.log(rank)).float()
    _, ids = route(logits, bias, logits.new_empty(0), None, k, 1.0)  # [T, K]
    share = torch.bincount(ids.reshape(-1), minlength=e).double() / ids.numel()
    target = (1 / rank) / (1 / rank).sum()
    return float((share - target).abs().sum() / 2)


def fit_zipf_scale(cfg: ModelConfig, gen: torch.Generator) -> float:
    """The bias scale `a` whose selection shares are closest to 1/rank (golden-section search:
    the distance falls, then rises, as `a` grows)."""
    logits = torch.randn(CALIBRATION_TOKENS, cfg.n_routed_experts, generator=gen)
    lo, hi = 0.0, MAX_SCALE
    phi = (math.sqrt(5) - 1) / 2
    for _ in range(FIT_STEPS):
        a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
        if zipf_distance(a, cfg, logits) < zipf_distance(b, cfg, logits):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


def zipf_table(cfg: ModelConfig, ranks: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """tid2eid [V, K] int64: each token's k distinct experts drawn with probability ~ 1/rank."""
    weights = (1.0 / ranks).float().expand(cfg.vocab_size, -1)
    return torch.multinomial(weights, cfg.num_experts_per_tok, replacement=False, generator=gen)


@torch.no_grad()
def zipf_routing_(model: torch.nn.Module, seed: int) -> None:
    """Re-bias every MoE layer of `model` (a `DeepseekV4`) for Zipf(1) expert popularity; the
    draws come from their own CPU generators of `seed` (other weights keep their values): the
    ranks (`zipf_layer_ranks`), then the scale and the hash tables."""
    from dsv4.model.moe import MoE

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    layer_ranks = zipf_layer_ranks(len(moes), moes[0].cfg.n_routed_experts, seed)
    # seed + 1 wrapped into uint64: the largest allowed seed must not overflow torch's seed
    gen = torch.Generator().manual_seed((seed + 1) % SEED_LIMIT)
    scale = fit_zipf_scale(moes[0].cfg, gen)
    for moe, ranks in zip(moes, layer_ranks):
        gate, cfg = moe.gate, moe.cfg
        if gate.is_hash:
            gate.tid2eid.copy_(zipf_table(cfg, ranks, gen))
        else:
            gate.bias.copy_((-scale * torch.log(ranks)).float())


def zipf_share(num_experts: int, top: int) -> float:
    """Share of selections the `top` most popular experts take under an exact 1/rank law."""
    harmonic = lambda n: sum(1.0 / r for r in range(1, n + 1))  # noqa: E731
    return harmonic(top) / harmonic(num_experts) if num_experts else math.nan
