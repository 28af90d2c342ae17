"""The paged forward on a worker of 2 ranks (gloo, CPU) gives the 1-rank paged tokens (issue 26).

Each case builds the engine exactly as a worker does (`build_worker_runtime`: rank 0 here, one
follower process that builds rank 0's forward from its `EngineSetup`) on the tiny model in
fp32 with fp32 caches, and serves greedy requests through rank 0's core: a 260-token prompt
prefilled in 64-token chunks beside the decodes of shorter ones (mixed steps), then decode up
to the C128 boundary. Tokens must equal the 1-rank paged forward's and the reference forward's
(sharding reorders only fp32 sums: the all-reduces of the attention output and of the MoE).
Each case ends with the leak check of rank 0's core and checks that the follower left cleanly
(exit 0: one orderly group teardown) and that rank 0's paged weights are only its shard.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.config import load_config
from dsv4.config.model import tiny_config
from dsv4.scheduler.request import Request
from dsv4.worker.build import build_worker_runtime
from tests.engine.conftest import run_to_completion
from tests.leak import assert_no_leaks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT_LENGTHS = (12, 260, 7)
NEW_TOKENS = 8
SETTINGS = {
    "model.path": "tiny", "model.device": "cpu", "model.dtype": "fp32", "model.kernels": "ref",
    "cache.kv_dtype": "fp32", "cache.indexer_key_dtype": "fp32", "cache.num_blocks": 24,
    "cache.block_size": 128, "scheduler.max_num_batched_tokens": 64, "scheduler.max_num_seqs": 8,
    "model.max_model_len": 1024,
    "model.collective_timeout_s": 60, "model.distributed_backend": "gloo",
}  # fmt: skip


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def served_tokens(forward: str, ranks: int = 1, expert_parallel: bool = False,
                  settings: dict | None = None):  # fmt: skip
    """(greedy tokens per prompt, rank 0's PagedForward or None, graph-pass replays) of a
    worker's engine; `settings` override SETTINGS."""
    config = load_config({**SETTINGS, **(settings or {}), "features.forward": forward,
                          "model.tensor_parallel_size": ranks,
                          "model.expert_parallel": expert_parallel}, None, {})  # fmt: skip
    runtime = build_worker_runtime(config, with_transport=False, name=f"{forward}-{ranks}")
    core = runtime.engine.core
    try:
        for i, prompt in enumerate(prompts()):
            core.add_request(Request(f"r{i}", tuple(prompt), NEW_TOKENS, eos_token_id=None))
        out = run_to_completion(core)
        assert_no_leaks(core)
    finally:
        if runtime.ranks is not None:
            runtime.ranks.close()
    if runtime.ranks is not None:
        assert [p.returncode for p in runtime.ranks.followers] == [0] * (ranks - 1)
    forward_of = getattr(core.runner, "runner", core.runner).forward
    tokens = [out[f"r{i}"] for i in range(len(PROMPT_LENGTHS))]
    return tokens, getattr(forward_of, "paged", None), core.runner.num_graph_replays


@pytest.fixture(scope="module")
def one_rank() -> list[list[int]]:
    paged, _, _ = served_tokens("paged")
    reference, _, _ = served_tokens("reference")
    assert paged == reference
    assert all(len(tokens) == NEW_TOKENS for tokens in paged)
    return paged


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-experts", "ep"])
def test_two_ranks_paged_equal_one_rank(one_rank, expert_parallel: bool) -> None:
    tokens, paged, _ = served_tokens("paged", 2, expert_parallel)
    assert tokens == one_rank
    cfg = tiny_config()
    for lw in paged.weights:  # rank 0's shard only: half the heads, half of every expert
        assert lw.attn_sink.shape == (cfg.num_attention_heads // 2,)
        stacked = lw.experts.w13 if lw.experts.w13_all is None else lw.experts.w13_all
        # the grouped GEMM's storage holds the rank's experts only, no view of the full one
        assert stacked.untyped_storage().nbytes() == stacked.numel() * stacked.element_size()
        experts, inter = lw.experts.w13.shape[:2]
        if expert_parallel:
            assert (experts, inter) == (cfg.n_routed_experts // 2, 2 * cfg.moe_intermediate_size)
        else:
            assert (experts, inter) == (cfg.n_routed_experts, cfg.moe_intermediate_size)


def test_two_ranks_static_decode_graph_steps_equal_one_rank(one_rank, monkeypatch) -> None:
    """Rank 0's graph options reach the follower in its `EngineSetup`: both ranks run decode
    steps as the graphs' static passes (capture False: eagerly, as on CPU), padded to the same
    buckets, so their all-reduces pair up."""
    from dsv4.runner.paged.decode_graphs import GraphOptions

    static = GraphOptions(max_batch=4, max_model_len=1024, capture=False)
    monkeypatch.setattr("dsv4.worker.options.graph_options", lambda config: static)
    tokens, _, replays = served_tokens("paged", 2, expert_parallel=True)
    assert tokens == one_rank
    assert replays > 0


def test_ranks_check_runs_on_cpu(tmp_path) -> None:
    """The one-GPU correctness script (`benchmarks.ranks_check`) as a CPU smoke test."""
    import json

    from benchmarks.ranks_check import main

    out = tmp_path / "ranks_check.json"
    args = ["--device", "cpu", "--kernels", "ref", "--forwards", "paged", "--experts", "ep"]
    assert main([*args, "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["forward"] == "paged" and record["equal"]
    assert record["tokens_1_rank"] == record["tokens_2_ranks"]


@pytest.mark.gpu
@pytest.mark.timeout(1200)  # 12 engines, Triton compiles included
def test_two_gloo_ranks_on_one_gpu_equal_one_rank(tmp_path) -> None:
    """`benchmarks.ranks_check` on the GPU: both forwards, both kernel backends, EP and sliced
    experts, 2 gloo ranks on one card against 1 rank (fp32: the same greedy tokens)."""
    from benchmarks.ranks_check import main

    assert main(["--device", "cuda", "--out", str(tmp_path / "ranks_check.json")]) == 0


@pytest.mark.gpu
def test_decode_graphs_captured_over_nccl_equal_eager_decode_steps() -> None:
    """2 ranks on 2 GPUs over NCCL, bf16 and the Triton kernels as served: decode steps
    replayed from graphs that captured the all-reduces give the tokens of the same 2 ranks
    running them eager (the same sums in the same order)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL)")
    served = {"model.device": "cuda", "model.dtype": "bf16", "model.kernels": "triton",
              "model.distributed_backend": "nccl", "cache.kv_dtype": "auto",
              "cache.indexer_key_dtype": "mxfp4"}  # fmt: skip
    graphs, _, replays = served_tokens("paged", 2, True, {**served, "features.cuda_graphs": True})
    eager, _, none = served_tokens("paged", 2, True, {**served, "features.cuda_graphs": False})
    assert replays > 0 and none == 0
    assert graphs == eager
