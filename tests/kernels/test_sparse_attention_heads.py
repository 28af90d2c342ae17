"""The all-heads sparse attention decode (kernels/sparse_attention_heads.py) against the
reference of `sparse_attention_decode` and, on the GPU, against the default kernel."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import kernels.sparse_attention_heads as sh
from kernels.sparse_attention import sparse_attention_decode, sparse_attention_decode_ref
from tests.kernels.conftest import DEVICE
from tests.kernels.sm90_build import sass_lines
from tests.kernels.test_sparse_attention import _case, _check
from tests.kernels.tolerances import assert_close

if DEVICE == "cpu":  # kernels imported before TRITON_INTERPRET was set: re-decorate ours
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(sh._attn_heads_kernel, InterpretedFunction):
        sh = importlib.reload(sh)


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "head_dim", "num_cand", "q_dtype"),
    [
        (0, 4, 128, 8, torch.bfloat16),
        (1, 1, 128, 1, torch.bfloat16),
        (3, 4, 128, 40, torch.float32),
        (3, 16, 128, 33, torch.bfloat16),
        (1, 2, 512, 21, torch.float32),
    ],
)
def test_sparse_attention_decode_all_heads_matches_ref(num_tokens, num_heads, head_dim,
                                                       num_cand, q_dtype):  # fmt: skip
    args = _case(num_tokens, num_heads, head_dim, num_cand, seed=num_cand, q_dtype=q_dtype)
    _check(sh.sparse_attention_decode_all_heads(*args), sparse_attention_decode_ref(*args))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_window_bases_and_splits(num_splits):
    """Ring-relative window columns (win_base per token), the rest shifted by comp_base, split-K
    with an all-empty token (output 0: only the sink is left)."""
    q, cache, slots, sink, scale = _case(3, 4, 128, 40, seed=9, q_dtype=torch.float32)
    slots[1] = -1
    slots = torch.where(slots >= 0, slots % 40, slots)  # base + slot stays below 97 rows
    win_base = torch.tensor([3, 50, 17], dtype=torch.int32, device=DEVICE)
    kw = dict(num_splits=num_splits, win_base=win_base, num_win=8, comp_base=21)
    out = sh.sparse_attention_decode_all_heads(q, cache, slots, sink, scale, **kw)
    _check(out, sh.sparse_attention_decode_all_heads_ref(q, cache, slots, sink, scale, **kw))
    assert out[1].abs().max() == 0


@pytest.mark.parametrize("lazy", [True, False])
def test_peaked_logits_rescale(lazy, monkeypatch):
    """q x 12: logits far apart, so the running max grows by more than 2^8 several times (the
    lazy rescale's branch) and most probabilities underflow; the eager path gives the same."""
    q, cache, slots, sink, scale = _case(2, 4, 128, 64, seed=4, q_dtype=torch.float32)
    monkeypatch.setattr(sh, "LAZY_RESCALE", lazy)
    out = sh.sparse_attention_decode_all_heads(q * 12, cache, slots, sink, scale)
    _check(out, sparse_attention_decode_ref(q * 12, cache, slots, sink, scale))


def test_no_candidates_gives_zeros():
    q, cache, _, sink, scale = _case(2, 4, 128, 0, seed=1)
    slots = torch.empty(2, 0, dtype=torch.int32, device=DEVICE)
    out = sh.sparse_attention_decode_all_heads(q, cache, slots, sink, scale)
    assert out.abs().max() == 0 and out.shape == q.shape


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 128])
def test_sparse_attention_decode_all_heads_production_shape_gpu(num_tokens):
    """V4-Flash decode: 64 heads x 512, window 128 + top-512 candidates, packed fp8 rows, ring
    window bases; equal to the reference and to the default kernel within bf16 tolerance."""
    q, cache, slots, sink, scale = _case(num_tokens, 64, 512, 640, seed=num_tokens,
                                         num_slots=60_000)  # fmt: skip
    win_base = torch.randint(0, 1000, (num_tokens,), dtype=torch.int32, device=DEVICE)
    slots = torch.where(slots >= 0, slots % 59_000, slots)
    kw = dict(win_base=win_base, num_win=128, comp_base=7)
    out = sh.sparse_attention_decode_all_heads(q, cache, slots, sink, scale, **kw)
    assert_close(out, sparse_attention_decode_ref(q, cache, slots, sink, scale, **kw),
                 "activation")  # fmt: skip
    assert_close(out, sparse_attention_decode(q, cache, slots, sink, scale, **kw), "activation")
    one_split = sh.sparse_attention_decode_all_heads(q, cache, slots, sink, scale, num_splits=1,
                                                     **kw)  # fmt: skip
    assert_close(one_split, out, "activation")


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU's sm_90 compile; a GPU runs the kernel")
def test_sm90_compile_of_the_served_config_has_no_spills():
    """The point of the variant: 64 heads a program at GPU_CONFIG compiles for sm_90a with no
    local-memory stack (the default kernel's 64-head config spills; tools/attn_sass.py)."""
    block_n, warps, stages = sh.GPU_CONFIG
    name = f"attn new h64 n{block_n} w{warps} s{stages} qkt1 lazy{int(sh.LAZY_RESCALE)}"
    (line,) = sass_lines(name)
    assert " stack    0 " in line, line


def test_variants_benchmark_dry_run(tmp_path):
    """`bench_kernels_attention --variants --dry-run`: the GPU call's code path with tiny shapes
    (the kernels run under the interpreter): every record the H200 run must write, and the
    variants' numerics check passing."""
    from benchmarks import bench_kernels_attention

    out = tmp_path / "variants.json"
    assert bench_kernels_attention.main(["--variants", "--dry-run", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    timed = [r for r in records if "time_us" in r]
    fields = {"name", "T", "variant", "time_us", "baseline_time_us", "speedup", "pct_roofline"}
    assert all(fields <= set(r) for r in timed), timed
    assert {(r["name"], r.get("keys")) for r in timed} >= {
        ("sparse_attention_decode", None), ("indexer_logits+topk", "fp8"),
        ("indexer_logits+topk", "mxfp4"),
    }  # fmt: skip
    numerics = [r for r in records if r["name"] == "attention_variants_numerics"]
    assert all(r.get("max_abs_diff", 0.0) < 3e-2 for r in numerics), numerics  # bf16 ulps
    assert all(r.get("same_topk_as_reference", True) for r in numerics), numerics
