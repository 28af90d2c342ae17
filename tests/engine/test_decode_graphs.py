"""The paged decode step as static passes (`dsv4.runner.paged.decode_graphs`), run eagerly on
CPU (`capture=False`): exactly what a CUDA graph replays — inputs only from the static
buffers, host decisions only from the bucket, padding rows on the scratch blocks. fp32 caches:
the tokens must equal the reference model's greedy decode. The GPU test captures for real."""

from __future__ import annotations

import pytest
import torch

from dsv4.config.model import tiny_config
from dsv4.model.tiny import random_model
from dsv4.runner.paged.decode_graphs import GraphOptions
from dsv4.runner.paged.graphs import batch_buckets, bucket_of, context_buckets
from tests.engine.conftest import greedy_request, make_core, run_to_completion
from tests.engine.test_engine_core import NEW_TOKENS
from tests.engine.test_paged_forward import reference  # noqa: F401  (fixture)
from tests.engine.test_paged_forward import run as _run
from tests.leak import assert_no_leaks

STATIC = GraphOptions(max_batch=4, max_model_len=2048, capture=False)


def test_buckets() -> None:
    assert batch_buckets(1) == (1,) and batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert batch_buckets(64)[-3:] == (48, 56, 64)
    assert context_buckets(2049, 16) == (64, 256, 1024, 2049)
    assert context_buckets(131_076, 512) == (2048, 8192, 32768, 131_076)
    assert context_buckets(1000, 512) == (1000,)
    assert bucket_of(3, (1, 2, 4)) == 4 and bucket_of(5, (1, 2, 4)) is None


def test_static_decode_steps_give_the_reference_tokens(tiny, reference) -> None:  # noqa: F811
    """Five requests (1..300-token prompts) with max batch 4: decode-only steps of 1..4
    requests run as static passes (padding rows in bucket 4 for 3), steps of 5 eagerly."""
    core = make_core(tiny, budget=64, paged={}, graphs=STATIC)
    target = core.runner.forward.graphs.passes["target"]
    assert _run(core, tiny) == reference
    assert target.num_runs >= NEW_TOKENS // 2


@pytest.mark.parametrize("switch", ["no-skip-topk", "metadata-per-layer"])
def test_static_steps_with_switches_at_baseline(tiny, reference, switch) -> None:  # noqa: F811
    from dsv4.runner.paged import MetadataSwitches, PagedSwitches

    paged = ({"switches": PagedSwitches(skip_topk=False)} if switch == "no-skip-topk"
             else {"metadata": MetadataSwitches(shared=False)})  # fmt: skip
    core = make_core(tiny, budget=64, paged=paged, graphs=STATIC)
    assert _run(core, tiny) == reference
    assert core.runner.forward.graphs.passes["target"].num_runs > 0


def test_padding_rows_write_only_scratch_blocks(tiny) -> None:
    """A step of padding rows only (what every capture runs) at a full context leaves every
    block a request can own untouched."""
    core = make_core(tiny, budget=64, paged={}, graphs=STATIC)
    cache, graphs = core.runner.cache, core.runner.forward.graphs
    cache.backing.random_(0, 256, generator=torch.Generator().manual_seed(0))
    before = cache.backing.clone()
    target = graphs.passes["target"]
    for key in target.graphs or [(4, 2049), (1, 64)]:
        target.inputs.write((), padding_start=key[1] - 1)
        target._call(key)
    scratch = list(cache.scratch_block_ids)
    owned = slice(0, cache.num_blocks)
    assert torch.equal(cache.backing[owned], before[owned])
    assert not torch.equal(cache.backing[scratch], before[scratch])
    assert_no_leaks(core)


def test_warm_up_leaves_nothing_behind(tiny, reference) -> None:  # noqa: F811
    """Workers on CUDA serve one throw-away request at start-up (compile, autotune)."""
    core = make_core(tiny, budget=64, paged={}, graphs=STATIC)
    sampler = core.runner.sampler
    sampler.batched = True  # as on CUDA: the batched path is what must build at start-up
    batched_rows: list[int] = []
    sample_rows = sampler._sample_rows
    sampler._sample_rows = lambda logits, specs: (batched_rows.append(len(specs)),
                                                  sample_rows(logits, specs))[1]  # fmt: skip
    core.warm_up((16, 100))
    assert core.num_steps > 8 and core.kv.num_free_blocks == core.kv.num_blocks
    assert batched_rows and set(batched_rows) == {1}  # the first request sampled, alone
    sampler.batched = None
    assert _run(core, tiny) == reference


def test_colocated_warm_up_runs_mixed_prefill_and_decode_steps(tiny) -> None:
    """`mixed_lengths`: each prompt's first chunk shares a step with a decoding request, so
    the mixed steps of chunked prefill compile at start-up (not in a client's TTFT)."""
    core = make_core(tiny, budget=64, paged={})
    schedule, seen = core.scheduler.schedule, []

    def recording():
        batch = schedule()
        seen.append((len(batch.decodes), sum(p.num_tokens for p in batch.prefills)))
        return batch

    core.scheduler.schedule = recording
    core.warm_up((16,), mixed_lengths=(40, 100))
    mixed = [tokens for decodes, tokens in seen if decodes and tokens]
    assert mixed[:1] == [40] and 63 in mixed  # 100 tokens: a 63-token chunk beside the decode
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert_no_leaks(core)


@pytest.mark.gpu
def test_captured_decode_graphs_match_eager_on_the_gpu() -> None:
    """CUDA graphs for real: the served formats (fp8 KV, MXFP4 keys), Triton kernels; the
    greedy tokens of graph replays equal those of the eager paged forward."""
    from kernels.backend import KernelBackendConfig

    cfg = tiny_config().with_overrides(num_nextn_predict_layers=0)
    model = random_model(cfg, seed=5, dtype=torch.bfloat16, device="cuda")
    kernels = KernelBackendConfig(default="triton")
    gen = torch.Generator().manual_seed(2)
    plist = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 130, 300)]
    outs = []
    for graphs in (None, GraphOptions(max_batch=4, max_model_len=1024)):
        core = make_core(model, kv="fp8", index="mxfp4", budget=512, paged={}, kernels=kernels,
                         graphs=graphs, max_num_seqs=4)  # fmt: skip
        for i, p in enumerate(plist):
            core.add_request(greedy_request(f"r{i}", p, 8))
        outs.append(run_to_completion(core))
        if graphs is not None:
            assert core.runner.forward.graphs.num_graphs > 0
            assert core.runner.forward.graphs.passes["target"].num_runs >= 6
        assert_no_leaks(core)
    assert outs[0] == outs[1]


def test_batched_sampling_switch_reaches_the_sampler(tiny) -> None:
    """features.batched_sampling: on = batch unseeded rows where the logits are on CUDA (None:
    decided per step), off = the row-by-row CPU sampler everywhere."""
    assert make_core(tiny).runner.sampler.batched is None
    assert make_core(tiny, batched_sampling=False).runner.sampler.batched is False
