"""Presence, frequency and repetition penalties on the served path against transformers.

A worker's engine (`build_worker_runtime`, exact cache formats) serves greedy requests with
and without penalties in one batch, on the paged and the reference forward. Repetition
penalty: `DeepseekV4ForCausalLM.generate(repetition_penalty=...)` is the oracle (it divides
positive and multiplies negative logits of every prompt and output token, as vLLM does).
Presence / frequency: a greedy loop over the transformers model's logits with OpenAI's
definition written out here (logit - frequency x count - presence x [count > 0] over the
output so far). Requests without penalties keep their plain greedy tokens (per-row).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.runtime_tokens import runtime_greedy_tokens
from dsv4.config import load_config
from dsv4.worker.build import build_worker_runtime

NEW_TOKENS = 12
EXACT = {"cache.kv_dtype": "fp32", "cache.indexer_key_dtype": "fp32", "cache.num_blocks": 64,
         "cache.block_size": 128}  # fmt: skip


def _served(path: str, prompts, sampling, forward: str) -> list[list[int]]:
    values = {"model.path": path, "scheduler.max_num_seqs": len(prompts),
              "features.forward": forward, **EXACT}  # fmt: skip
    runtime = build_worker_runtime(load_config(values), with_transport=False)
    return runtime_greedy_tokens(runtime, prompts, NEW_TOKENS, sampling)


def _openai_penalties_greedy(hf, prompt: list[int], presence: float, frequency: float):
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            for token in set(out):
                logits[token] -= frequency * out.count(token) + presence
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.mark.parametrize("forward", ["paged", "reference"])
def test_penalties_equal_their_transformers_oracles(hf_checkpoint, forward: str) -> None:
    path, hf = hf_checkpoint
    gen = torch.Generator().manual_seed(11)
    base = torch.randint(0, 1024, (9,), generator=gen).tolist()
    prompts = [base * 3, base * 2 + [5, 6], base[:5] * 4]
    # The random model never repeats a token greedily, so penalties against repeats would not
    # show: these favour repeats (still in range) and change the continuations.
    sampling = [{"repetition_penalty": 0.3}, {"presence_penalty": -1.5, "frequency_penalty": -0.4},
                {}]  # fmt: skip
    served = _served(str(path), prompts, sampling, forward)
    ids = torch.tensor([prompts[0]])
    repetition = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                             repetition_penalty=0.3, eos_token_id=None)[0, ids.shape[1]:]  # fmt: skip
    assert served[0] == repetition.tolist()
    assert served[1] == _openai_penalties_greedy(hf, prompts[1], -1.5, -0.4)
    plain = hf.generate(torch.tensor([prompts[2]]), max_new_tokens=NEW_TOKENS, do_sample=False,
                        eos_token_id=None)[0, len(prompts[2]):]  # fmt: skip
    assert served[2] == plain.tolist()
    # the penalties changed something (else the oracles above would prove nothing)
    unpenalized = _served(str(path), prompts[:2], None, forward)
    assert unpenalized[0] != served[0] and unpenalized[1] != served[1]
