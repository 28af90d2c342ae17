"""The memory plan's `paged_fp32_weights` is what the paged forward really copies at load:
the fp32 compressor and router tensors `prepare_weights` makes for every layer (MTP too) of a
bf16 model, as served on a GPU (an fp32 CPU model's `.float()` copies nothing)."""

from __future__ import annotations

import torch

from dsv4.config.model import tiny_config
from dsv4.model.tiny import random_model
from dsv4.plan import PlanRequest, plan_memory
from dsv4.plan.budget import paged_fp32_copies
from dsv4.runner.paged.weights import prepare_weights


def test_the_plan_counts_the_paged_forwards_fp32_copies_to_the_byte() -> None:
    cfg = tiny_config()
    model = random_model(cfg, seed=0, dtype=torch.bfloat16)
    weights = prepare_weights(model)
    copies = []
    for layer in weights:
        copies.append(layer.gate_weight)
        copies += [c.proj for c in (layer.compressor, layer.indexer_compressor) if c is not None]
    assert len(weights) == cfg.num_hidden_layers + (1 if cfg.has_mtp else 0)
    params = {p.data_ptr() for p in model.parameters()}
    assert not any(t.data_ptr() in params for t in copies)  # new tensors, held beside the model
    assert sum(t.numel() * t.element_size() for t in copies) == paged_fp32_copies(cfg).nbytes

    def buffers(paged: bool) -> set[str]:
        request = PlanRequest(cfg, gpu_mem_gib=8.0, max_model_len=256, max_num_seqs=2,
                              max_num_batched_tokens=64, paged_fp32_copies=paged)  # fmt: skip
        return {b.name for b in plan_memory(request).buffers}

    assert "paged_fp32_weights" in buffers(True) and "paged_fp32_weights" not in buffers(False)
