"""The lightning indexer of a C4 layer on the paged cache: logits over the cached keys, top-k.

Decode tokens get their top-k as `block * SPB + i % E` slots (the attention kernel adds the
layer's page offset), prefill tokens as local entry indices (their chunk's workspace rows are
`ws_base + i`). When no token of a part sees more than k entries, the top-k is "all of them"
(#49486): no q projection, no logits, no top-k; `kernels.indexer_select_all` writes the same
slots. Score rows are computed in slices so a long prefill chunk's [T, N] fp32 scores stay
under `MAX_SCORE_ELEMENTS`.
"""

from __future__ import annotations

import torch

from dsv4.model.indexer import Indexer
from dsv4.runner.paged.forward_state import ForwardState
from dsv4.runner.paged.geometry import LayerGeometry
from kernels.backend import resolve

MAX_SCORE_ELEMENTS = 1 << 28  # 1 GiB of fp32 scores per slice


def indexer_topk(indexer: Indexer, fs: ForwardState, g: LayerGeometry, x, qr, cos, sin):
    """-> (decode slots [T_d, K] | None, prefill local indices [T_p, K] | None), int32."""
    meta = fs.meta
    shape, t = meta.shape, meta.t
    k = indexer.cfg.index_topk
    n_dec, n_all = shape.num_decode_tokens, x.shape[0]
    epb = meta.geo.layout.block_size // 4
    parts = (
        (0, n_dec, t.block_tables, meta.geo.slots_per_block),  # decode: relative cache slots
        (n_dec, n_all, meta.local_block_table, epb),  # prefill: local entry i = j * E + i % E
    )
    q = weights = None
    out = []
    for lo, hi, table, spb in parts:
        if hi == lo:
            out.append(None)
            continue
        max_vis = shape.max_position_plus_one(lo, hi) // 4  # most entries a token sees
        lens, t2r = meta.c4_lens[lo:hi], t.token_to_req[lo:hi]
        if fs.switches.skip_topk and max_vis <= k:
            select = resolve("indexer_select_all", meta.kernels, x.device)
            out.append(select(lens, k, t2r, table, epb, slots_per_block=spb)[0])
            continue
        if q is None:
            q, weights = _queries(indexer, x, qr, cos, sin, meta.kernels)
        out.append(_topk_slices(meta, g, q, weights, lo, hi, max_vis, k, table, spb,
                                fs.switches.indexer_variants))  # fmt: skip
    return out[0], out[1]


def _queries(indexer: Indexer, x, qr, cos, sin, kernels):
    num_t = x.shape[0]
    q = indexer.wq_b(qr).view(num_t, indexer.num_heads, indexer.head_dim)
    q = resolve("rope", kernels, x.device)(q, cos, sin)  # [T, H_I, d_I]
    scale = (indexer.head_dim * indexer.num_heads) ** -0.5
    return q, indexer.weights_proj(x).float() * scale  # [T, H_I] fp32


def _topk_slices(meta, g, q, weights, lo, hi, max_vis, k, table, spb, variants):
    """Scores and top-k of tokens lo..hi in slices; `variants`: issue 25's fast logits and
    radix top-k (kernels/indexer_fused.py; the references ignore the flags)."""
    t = meta.t
    epb = meta.geo.layout.block_size // 4
    logits = resolve("indexer_logits", meta.kernels, q.device)
    topk = resolve("indexer_topk", meta.kernels, q.device)
    keys = meta.geo.indexer_keys(g)
    step = max(1, MAX_SCORE_ELEMENTS // max(max_vis, 1))
    slices = []
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        lens, t2r = meta.c4_lens[a:b], t.token_to_req[a:b]
        scores = logits(q[a:b].contiguous(), weights[a:b].contiguous(), keys, t.block_tables,
                        t2r, lens, key_format=g.indexer_key_format, num_cols=max_vis,
                        write_tail=False, fast=variants)  # fmt: skip
        slices.append(topk(scores, lens, k, t2r, table, epb, slots_per_block=spb,
                           radix=variants)[0])  # fmt: skip
    return slices[0] if len(slices) == 1 else torch.cat(slices)
