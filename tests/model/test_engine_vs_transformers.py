"""The paged engine (continuous batching, chunked prefill) against transformers directly.

A batch of mixed-length prompts runs through `dsv4.engine.offline.generate_batch` with a small token
budget, so prefills are chunked across window (32) and compression (4, 128) boundaries and
decodes batch together; every greedy continuation must equal transformers' `generate`.
"""

from __future__ import annotations

import torch

from dsv4.engine.offline import generate_batch
from dsv4.model.weights import load_model
from dsv4.ops.sampling import SamplingSpec

LENGTHS = (3, 64, 129, 257)
NEW_TOKENS = 16


def test_engine_batch_equals_transformers_generate(hf_checkpoint) -> None:
    path, hf = hf_checkpoint
    model, _ = load_model(path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in LENGTHS]
    results = generate_batch(
        model, prompts, [SamplingSpec()] * len(prompts), NEW_TOKENS, max_num_batched_tokens=96
    )
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        assert list(result.output_token_ids) == expected[0, len(prompt) :].tolist()
