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
own CPU generators (batch independence). Rows with a logit bias or penalties first have their
logits shifted, then take the same paths: the bias first, then the penalties, as vLLM's sampler
does (`dsv4.ops.sampling.biased_logits`). A biased request keeps its bias on the logits'
device (`LogitBias`, uploaded once); a penalized one a `PenaltyState` there that counts only
the output tokens added since its last step, bit-identical to the reference `penalized_logits`
without its per-step O(prompt + output) host work and upload (3.5 ms a step on CPU for a
32K-token prompt). Both are freed with the request's generator (`release`).

Rows that ask for logprobs (`SamplingSpec.logprobs`) have them computed from the raw logits,
before any shift, on the device, and brought back in the step's one copy (`StepLogprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.ops.sampling import SamplingSpec, filtered_probs
from dsv4.runner.logprobs import StepLogprobs
from dsv4.types import TokenLogprobs
from kernels import sampling as sampling_kernels


@dataclass(frozen=True)
class SampledRows:
    """One step's sampling: a token per logits row and, where the row asked, its logprobs."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...]  # None: the row did not ask


class Sampler:
    """Samples one token per row of a logits batch; owns the per-request generators."""

    def __init__(self, default_seed: int = 0, batched: bool | None = None) -> None:
        """`batched`: None = on for CUDA logits; True also on CPU (tests); False = row by row."""
        self._default = torch.Generator().manual_seed(default_seed)
        self._generators: dict[str, torch.Generator] = {}
        self._penalties: dict[str, PenaltyState] = {}
        self._biases: dict[str, LogitBias] = {}
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
        """logits [B, V] (any device) -> B token ids (`sample_rows` without the logprobs)."""
        return list(self.sample_rows(logits, request_ids, specs, histories).token_ids)

    def sample_rows(
        self, logits: torch.Tensor, request_ids: list[str], specs: list[SamplingSpec],
        histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    ) -> SampledRows:  # fmt: skip
        """logits [B, V] (any device) -> B token ids, and the logprobs of the rows that ask.
        Greedy rows never touch a generator. `histories`: each row's (prompt ids, output ids
        so far), needed by rows with penalties."""
        if logits.shape[0] != len(specs) or len(specs) != len(request_ids):
            raise ValueError("one request id and one SamplingSpec per logits row")
        asked = StepLogprobs.of(logits, specs)  # from the raw logits, before any shift
        shifted = [i for i, s in enumerate(specs) if s.shifts_logits]
        if any(specs[i].has_penalties for i in shifted) and (
            histories is None or len(histories) != len(specs)
        ):
            raise ValueError("rows with penalties need their (prompt, output) token ids")
        if shifted:
            logits = logits.to(torch.float32, copy=True)  # [B, V]; the caller's stays as is
        for i in shifted:  # each in place on a view of the copy's row: the bias, then penalties
            if specs[i].logit_bias:
                self._logit_bias(request_ids[i], specs[i], logits).apply(logits[i])
            if specs[i].has_penalties:
                assert histories is not None
                state = self._penalty_state(request_ids[i], *histories[i], logits)
                state.apply(logits[i], specs[i])
        out: list[int] = []
        picked = logits.argmax(dim=-1) if logits.shape[0] else logits.new_empty(0).long()
        on = self.batched if self.batched is not None else logits.is_cuda
        together = [i for i, s in enumerate(specs) if on and not s.is_greedy and s.seed is None]
        if together:
            rows = torch.tensor(together, device=logits.device)
            picked = picked.index_copy(0, rows, self._sample_rows(logits.index_select(0, rows),
                                                                  [specs[i] for i in together]))  # fmt: skip
        done = set(together)
        # the step's one device -> host copy (the logprobs that rows asked for ride along)
        chosen = picked.tolist() if asked is None else asked.fetch(picked)
        drawn_on_host = []
        for row, (rid, spec) in enumerate(zip(request_ids, specs)):
            if spec.is_greedy or row in done:
                out.append(int(chosen[row]))
                continue
            probs = filtered_probs(logits[row], spec).cpu()
            out.append(int(torch.multinomial(probs, 1, generator=self._generator(rid, spec))))
            drawn_on_host.append(row)
        if asked is None:
            return SampledRows(tuple(out), (None,) * len(out))
        return SampledRows(tuple(out), tuple(asked.finish(out, set(drawn_on_host))))

    def _penalty_state(self, request_id: str, prompt_ids: Sequence[int],
                       output_ids: Sequence[int], logits: torch.Tensor) -> PenaltyState:  # fmt: skip
        """The request's state, brought up to `output_ids` (built anew when it does not extend
        what the state counted: a new request, or an id reused without `release`)."""
        state = self._penalties.get(request_id)
        if state is None or not state.extended_by(prompt_ids, output_ids, logits):
            state = self._penalties[request_id] = PenaltyState(prompt_ids, logits)
        state.count(output_ids)
        return state

    def _logit_bias(self, request_id: str, spec: SamplingSpec, logits: torch.Tensor) -> LogitBias:
        bias = self._biases.get(request_id)
        if bias is None or not bias.holds(spec, logits):  # new, or an id reused without release
            bias = self._biases[request_id] = LogitBias(spec, logits)
        return bias

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
        """Forget a finished (or aborted) request's generator, penalty state and logit bias."""
        self._generators.pop(request_id, None)
        self._penalties.pop(request_id, None)
        self._biases.pop(request_id, None)

    @property
    def num_live_generators(self) -> int:
        return len(self._generators)

    @property
    def num_live_penalty_states(self) -> int:
        return len(self._penalties)

    @property
    def num_live_logit_biases(self) -> int:
        return len(self._biases)

    def find_leaks(self) -> list[str]:
        """Per-request state still held (`tests/leak.py`). A runner releases a request with
        the next batch after it finished, so check once every finished id was delivered."""
        leaks = []
        if self._generators:
            leaks.append(f"{len(self._generators)} generators: {sorted(self._generators)[:8]}")
        if self._penalties:
            leaks.append(f"{len(self._penalties)} penalty states: {sorted(self._penalties)[:8]}")
        if self._biases:
            leaks.append(f"{len(self._biases)} logit biases: {sorted(self._biases)[:8]}")
        return leaks


class PenaltyState:
    """One penalized request's tokens so far, on its logits' device: `seen` [V] bool (prompt
    and output: repetition penalty) and `counts` [V] int32 (output: frequency and presence).
    The prompt is set once; each step adds only the output tokens not yet counted. Memory:
    V x (1 + 4) bytes, ~650 KB per penalized request at V = 129K (freed on `release`)."""

    def __init__(self, prompt_ids: Sequence[int], logits: torch.Tensor) -> None:
        vocab, device = logits.shape[-1], logits.device
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        if prompt_ids:
            self.seen[torch.tensor(prompt_ids, dtype=torch.long).to(device)] = True
        self.num_prompt = len(prompt_ids)
        self.num_counted = 0  # output tokens in `counts`
        self.last: int | None = None  # the last of them (a cheap check that `output` extends them)

    def extended_by(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
                    logits: torch.Tensor) -> bool:  # fmt: skip
        """Whether this history continues the one counted (same prompt length, the counted
        output its prefix as far as its last token tells) on the same device and vocabulary."""
        n = self.num_counted
        return (len(prompt_ids) == self.num_prompt and len(output_ids) >= n
                and (n == 0 or output_ids[n - 1] == self.last)
                and self.seen.device == logits.device and self.seen.shape[0] == logits.shape[-1])  # fmt: skip

    def count(self, output_ids: Sequence[int]) -> None:
        new = output_ids[self.num_counted :]
        if not new:
            return
        ids = torch.tensor(new, dtype=torch.long).to(self.seen.device)
        self.seen[ids] = True
        self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.num_counted, self.last = len(output_ids), output_ids[-1]

    def apply(self, logits: torch.Tensor, spec: SamplingSpec) -> None:
        """Penalize a [V] fp32 row in place, bit for bit as `penalized_logits` does."""
        if spec.repetition_penalty != 1.0:
            r = spec.repetition_penalty
            scaled = torch.where(logits > 0, logits / r, logits * r)
            logits.copy_(torch.where(self.seen, scaled, logits))
        if self.num_counted and (spec.frequency_penalty or spec.presence_penalty):
            counts = self.counts.float()
            logits -= spec.frequency_penalty * counts + spec.presence_penalty * (counts > 0).float()


class LogitBias:
    """One request's `logit_bias` on its logits' device: token ids [N] int64, biases [N] fp32."""

    def __init__(self, spec: SamplingSpec, logits: torch.Tensor) -> None:
        self.pairs, vocab = spec.logit_bias, logits.shape[-1]
        ids, biases = zip(*self.pairs, strict=True)
        if not 0 <= min(ids) <= max(ids) < vocab:  # the engine refuses them: a bug if here
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}): got {ids}")
        self.ids = torch.tensor(ids, dtype=torch.long).to(logits.device)
        self.biases = torch.tensor(biases, dtype=torch.float32).to(logits.device)

    def holds(self, spec: SamplingSpec, logits: torch.Tensor) -> bool:
        return self.pairs == spec.logit_bias and self.ids.device == logits.device

    def apply(self, logits: torch.Tensor) -> None:
        """Bias a [V] fp32 row in place, bit for bit as `biased_logits` does."""
        logits[self.ids] += self.biases


class RequestRandom:
    """A request's random stream, drawn from the sampler's per-request generator."""

    def __init__(self, sampler: Sampler, request_id: str, spec: SamplingSpec) -> None:
        self._sampler, self._request_id, self._spec = sampler, request_id, spec

    def uniform(self) -> float:
        return self._sampler.uniform(self._request_id, self._spec)

    def categorical(self, probs: torch.Tensor) -> int:
        return self._sampler.categorical(probs, self._request_id, self._spec)
