"""Token sampling for a batch of rows: greedy, temperature, top-k, top-p (FlashInfer).

`sample` runs FlashInfer's sampling kernels on CUDA and the torch reference elsewhere:
    scaled = logits / temperature;  top-k mask (`top_k_mask_logits`);  softmax;
    top-p rejection sampling (`top_p_sampling_from_probs`)
through `flashinfer.sampling.top_k_top_p_sampling_from_logits(filter_apply_order="top_k_first")`,
the order of `dsv4.runner.sampler.filtered_probs`. top_k is always passed as a per-row TENSOR:
an int top_k <= 256 on a vocabulary >= 65,536 (DeepSeek-V4: 129,280) takes FlashInfer's
"top_k_first" fast path, which loads its separate `topk` JIT module (10+ minutes to build).
top_k 0 (off) becomes the vocabulary size (FlashInfer copies such rows unmasked). Greedy rows
(temperature <= 0) take the argmax (lowest id on ties), selected with torch.where, no sync.

Randomness: on CUDA either one torch.cuda generator (`generator`) or per-row Philox `seeds` /
`offsets` int64 tensors (CUDA-graph safe; the caller advances the offsets); FlashInfer mixes
the row index into the stream, so a seeded row depends on its batch slot. On CPU `generator`
may be a list with one torch.Generator (or None) per row, as the engine's `Sampler` keeps them,
and `sample_ref` draws exactly as `Sampler.sample` does.

`sample_torch` (the benchmark's baseline) is the batched torch version on the device: two
full-vocabulary sorts, cumsum and `torch.multinomial`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from dsv4.ops.limits import MIN_TEMPERATURE, MIN_TOP_P
from dsv4.ops.sampling import SamplingSpec, filtered_probs, or_argmax
from kernels.registry import register_op

Generators = torch.Generator | Sequence[torch.Generator | None] | None


@functools.cache
def _flashinfer_sampling():
    """flashinfer.sampling, or None; imported only on the first CUDA call."""
    try:
        import flashinfer.sampling as fs
    except ImportError:
        return None
    return fs


def flashinfer_available() -> bool:
    return torch.cuda.is_available() and _flashinfer_sampling() is not None


def _prepared(logits, temperature, top_k):
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature.clamp_min(MIN_TEMPERATURE))
    scaled = logits.float() / temp.float()[:, None]
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k, vocab).clamp_max(vocab).to(torch.int32)
    return greedy, scaled, k


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: Generators = None,
    *,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V], temperature [B] fp32 (<= 0: greedy), top_p [B] fp32, top_k [B] int
    (0: off) -> token ids [B] int64 on the logits' device."""
    fs = _flashinfer_sampling() if logits.is_cuda else None
    if fs is None or isinstance(generator, Sequence):
        return sample_ref(logits, temperature, top_p, top_k, generator)
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    greedy, scaled, k = _prepared(logits, temperature, top_k)
    # a top_p that rounds to 0 keeps only the top token, as in the torch paths
    top_p = top_p.float().clamp_min(MIN_TOP_P).contiguous()
    ids = fs.top_k_top_p_sampling_from_logits(
        scaled, k, top_p, filter_apply_order="top_k_first",
        deterministic=True, generator=generator, seed=seeds, offset=offsets,
    ).long()  # fmt: skip
    # A row the kernel cannot sample (NaN / +inf logits) keeps its argmax, as `or_argmax` does.
    vocab = logits.shape[1]
    unsampleable = (scaled.isnan() | scaled.isposinf()).any(-1) | (ids < 0) | (ids >= vocab)
    return torch.where(greedy | unsampleable, logits.argmax(dim=-1), ids)


def sample_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Batched torch sampling on the logits' device (the unfused slow path)."""
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    greedy, scaled, k = _prepared(logits, temperature, top_k)
    ordered = scaled.sort(dim=-1, descending=True).values
    kth = ordered.gather(1, (k.long() - 1)[:, None])
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.float()[:, None]
    drop_sorted[:, 0] = False  # the top token always stays (top_p may round to 0 in fp32)
    probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), 0.0)
    ids = torch.multinomial(or_argmax(probs, logits), 1, generator=generator).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), ids)


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: Generators = None,
) -> torch.Tensor:
    """Reference: row by row as `dsv4.runner.sampler.Sampler.sample` (filtered_probs, then
    torch.multinomial on the CPU with the row's generator; argmax for greedy rows)."""
    num_rows = logits.shape[0]
    out = torch.empty(num_rows, dtype=torch.int64)
    if num_rows == 0:
        return out.to(logits.device)
    gens = generator if isinstance(generator, Sequence) else [generator] * num_rows
    greedy = logits.argmax(dim=-1).tolist()
    temps, ps, ks = temperature.tolist(), top_p.tolist(), top_k.tolist()
    for row in range(num_rows):
        spec = SamplingSpec(temperature=temps[row], top_p=ps[row], top_k=int(ks[row]))
        if spec.is_greedy:
            out[row] = greedy[row]
            continue
        probs = filtered_probs(logits[row], spec).cpu()
        out[row] = int(torch.multinomial(probs, 1, generator=gens[row]))
    return out.to(logits.device)


register_op("sample", sample, sample_ref, family="sampling", baseline_fn=sample_torch)
