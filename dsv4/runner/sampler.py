"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

Every request samples from its own `torch.Generator` when it carries a seed, so its output
does not depend on which other requests share the batch. Temperature 0 is greedy (argmax, ties
to the lowest id). The distribution of a row is `dsv4.ops.sampling.filtered_probs`, the
reference the batched kernels must agree with.

Batched sampling (`batched`, on by default where the logits live on CUDA): the unseeded
non-greedy rows of a step are sampled together on the device — FlashInfer's sampling kernels
when installed, else batched torch (`kernels.sampling`) — and one host copy returns every
row's token. The row-by-row path copies each row's filtered 129K-entry distribution to the
host for a CPU multinomial, so its cost grows with the batch (it inflated the served decode
steps of the H200 e2e run at temperature 1, docs/BENCHMARKS.md). Seeded rows stay on their
own CPU generators (batch independence). Rows with penalties first have their logits shifted
by their prompt and output tokens (`penalized_logits`), then take the same paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4.ops.sampling import SamplingSpec, filtered_probs, penalized_logits
from kernels import sampling as sampling_kernels


class Sampler:
    """Samples one token per row of a logits batch; owns the per-request generators."""

    def __init__(self, default_seed: int = 0, batched: bool | None = None) -> None:
        """`batched`: None = on for CUDA logits; True also on CPU (tests); False = row by row."""
        self._default = torch.Generator().manual_seed(default_seed)
        self._generators: dict[str, torch.Generator] = {}
        self.batched = batched
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, request_id: str, spec: SamplingSpec) -> torch.Generator:
        if spec.seed is None:
            return self._default
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(spec.seed)
            self._generators[request_id] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], specs: list[SamplingSpec],
        histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    ) -> list[int]:  # fmt: skip
        """logits [B, V] (any device) -> B token ids. Greedy rows never touch a generator.
        `histories`: each row's (prompt ids, output ids so far), needed by rows with penalties."""
        if logits.shape[0] != len(specs) or len(specs) != len(request_ids):
            raise ValueError("one request id and one SamplingSpec per logits row")
        penalized = [i for i, s in enumerate(specs) if s.has_penalties]
        if penalized:
            if histories is None or len(histories) != len(specs):
                raise ValueError("rows with penalties need their (prompt, output) token ids")
            logits = logits.to(torch.float32, copy=True)  # [B, V]; the caller's stays as is
            for i in penalized:
                logits[i] = penalized_logits(logits[i], specs[i], *histories[i])
        out: list[int] = []
        picked = logits.argmax(dim=-1) if logits.shape[0] else logits.new_empty(0).long()
        on = self.batched if self.batched is not None else logits.is_cuda
        together = [i for i, s in enumerate(specs) if on and not s.is_greedy and s.seed is None]
        if together:
            rows = torch.tensor(together, device=logits.device)
            picked = picked.index_copy(0, rows, self._sample_rows(logits.index_select(0, rows),
                                                                  [specs[i] for i in together]))  # fmt: skip
        done = set(together)
        chosen = picked.tolist()  # the step's one device -> host copy
        for row, (rid, spec) in enumerate(zip(request_ids, specs)):
            if spec.is_greedy or row in done:
                out.append(int(chosen[row]))
                continue
            probs = filtered_probs(logits[row], spec).cpu()
            out.append(int(torch.multinomial(probs, 1, generator=self._generator(rid, spec))))
        return out

    def _sample_rows(self, logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
        """Unseeded non-greedy rows [R, V] on their device -> token ids [R] int64 (same device)."""
        dev = logits.device
        # one host -> device copy for the three per-row parameters (top_k is exact in fp32)
        params = torch.tensor([(s.temperature, s.top_p, s.top_k) for s in specs]).to(dev)
        temperature, top_p, top_k = params[:, 0], params[:, 1], params[:, 2].int()
        gen = self._device_generators.get(dev)
        if gen is None:  # seeded from the default stream: reproducible per worker start
            seed = int(torch.randint(0, 2**62, (), generator=self._default))
            gen = self._device_generators[dev] = torch.Generator(dev).manual_seed(seed)
        if logits.is_cuda and sampling_kernels.flashinfer_available():
            return sampling_kernels.sample(logits, temperature, top_p, top_k, generator=gen)
        return sampling_kernels.sample_torch(logits, temperature, top_p, top_k, generator=gen)

    def probs(self, logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
        """[B, V] filtered probabilities (used by speculative rejection sampling)."""
        if not specs:
            return logits.float()
        return torch.stack([filtered_probs(logits[i], s) for i, s in enumerate(specs)])

    def uniform(self, request_id: str, spec: SamplingSpec) -> float:
        """One U(0,1) draw from the request's generator (speculative acceptance tests)."""
        return float(torch.rand((), generator=self._generator(request_id, spec)))

    def categorical(self, probs: torch.Tensor, request_id: str, spec: SamplingSpec) -> int:
        """One draw from a [V] distribution with the request's generator."""
        return int(
            torch.multinomial(probs.float().cpu(), 1, generator=self._generator(request_id, spec))
        )

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(request_id, None)

    @property
    def num_live_generators(self) -> int:
        return len(self._generators)


class RequestRandom:
    """A request's random stream, drawn from the sampler's per-request generator."""

    def __init__(self, sampler: Sampler, request_id: str, spec: SamplingSpec) -> None:
        self._sampler, self._request_id, self._spec = sampler, request_id, spec

    def uniform(self) -> float:
        return self._sampler.uniform(self._request_id, self._spec)

    def categorical(self, probs: torch.Tensor) -> int:
        return self._sampler.categorical(probs, self._request_id, self._spec)
