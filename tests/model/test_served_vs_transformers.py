"""The served path with the exact cache formats equals transformers.

A worker's engine is built exactly as `dsv4 up` builds it (`build_worker_runtime` from a
`ServeConfig`: `--kv-dtype fp32 --indexer-key-dtype fp32`, chunked prefill at
`--max-num-batched-tokens 50`) on the transformers checkpoint, and serves a batch of greedy
requests through its `AsyncEngine`; every continuation must equal `DeepseekV4ForCausalLM.generate`.
"""

from __future__ import annotations

import torch

from benchmarks.runtime_tokens import runtime_greedy_tokens
from dsv4.config import load_config
from dsv4.worker.build import build_worker_runtime

LENGTHS = (3, 64, 129, 257)
NEW_TOKENS = 16


def served_tokens(model_dir: str, prompts: list[list[int]], **flags: object) -> list[list[int]]:
    overrides = {"model.path": model_dir, "cache.num_blocks": 64, "cache.block_size": 128,
                 "scheduler.max_num_seqs": len(prompts), **flags}  # fmt: skip
    runtime = build_worker_runtime(load_config(overrides), with_transport=False)
    return runtime_greedy_tokens(runtime, prompts, NEW_TOKENS)


def test_served_exact_formats_equal_transformers_generate(hf_checkpoint) -> None:
    path, hf = hf_checkpoint
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in LENGTHS]
    served = served_tokens(str(path), prompts, **{"cache.kv_dtype": "fp32",
                           "cache.indexer_key_dtype": "fp32",
                           "scheduler.max_num_batched_tokens": 50})  # fmt: skip
    for prompt, tokens in zip(prompts, served):
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        assert tokens == expected[0, len(prompt) :].tolist()
