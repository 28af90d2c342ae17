"""The model's hot ops: the functions a Triton kernel may stand in for, handed to the model.

The model calls its hot ops (routing, mHC pre/post, FP8 linears, sparse attention, compressor
windows, indexer scores / top-k) through `HotOps`, a frozen set of callables with the
signatures of the torch references in dsv4/ops. Every module that calls one holds the model's
`HotOps` as `.ops` (the references, `REFERENCE_OPS`, until told otherwise). Whoever builds the
model resolves the implementations once from the kernel config (the runner's
`dsv4.runner.kernel_bridge.hot_ops`) and hands them over with `DeepseekV4.use_hot_ops`; the
model itself never imports kernels/.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from dsv4.ops.attention import sparse_attention
from dsv4.ops.compressor import compress_windows
from dsv4.ops.fp8 import fp8_grouped_linear, fp8_linear
from dsv4.ops.hyper import hc_post, hc_pre
from dsv4.ops.indexer import indexer_scores, indexer_topk
from dsv4.ops.moe import route

Op = Callable[..., Any]


@dataclass(frozen=True)
class HotOps:
    """One implementation per hot op, each with its dsv4/ops reference's signature and
    shapes (the model's [B, S, ...] batches); the defaults are those references."""

    route: Op = route
    hc_pre: Op = hc_pre
    hc_post: Op = hc_post
    fp8_linear: Op = fp8_linear
    fp8_grouped_linear: Op = fp8_grouped_linear
    sparse_attention: Op = sparse_attention
    compress_windows: Op = compress_windows
    indexer_scores: Op = indexer_scores
    indexer_topk: Op = indexer_topk

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


REFERENCE_OPS = HotOps()
