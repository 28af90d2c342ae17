"""One attention layer of the paged forward: every token of the step at once, on the cache.

Order inside a layer (each step reads only what an earlier step of this list wrote):
1. projections and rope for all T tokens (q [T, H, d], K=V rows kv [T, d]);
2. the compressors: the step's new entries / indexer keys into the cache, state rows saved;
3. C4: the indexer's top-k over the cached keys (or the IndexCache source layer's top-k);
4. prefill chunks: workspaces gathered from the cache (entries, window prefix) + fresh rows
   round-tripped through the cache's entry format (what a later chunk would gather), one
   `kv_workspace` launch a chunk;
5. every token's K=V row into the window ring (prefill: only the last R of a request), in the
   first workspace launch when no workspace reads a slot it stores (a fresh prompt's);
6. decode tokens attend straight on the cache (window ring rows incl. their own, entries);
   prefill tokens attend on their chunk's workspace;
7. inverse rope of the output, grouped low-rank projection.
Decode tokens therefore read their own row as stored (fp8 in production, as vLLM's FlashMLA
path does), and prefill tokens see their chunk's rows the same way, so no token's inputs depend
on the chunk size; bf16/fp32 caches make that lossless, which the exactness tests use.
"""

from __future__ import annotations

import torch

from dsv4.model.attention import Attention
from dsv4.runner.paged import kv_rows
from dsv4.runner.paged.compress import run_compressor
from dsv4.runner.paged.forward_state import ForwardState
from dsv4.runner.paged.indexer import indexer_topk
from dsv4.runner.paged.weights import LayerWeights
from kernels.backend import resolve


def attention_layer(attn: Attention, lw: LayerWeights, fs: ForwardState, x: torch.Tensor):
    """x [T, D] (attn_norm applied) -> [T, D]."""
    cfg, meta = attn.cfg, fs.meta
    layer_id, ratio = attn.layer_id, attn.ratio
    g = meta.geo.layers[layer_id]
    num_t = x.shape[0]
    h, hd = cfg.num_attention_heads, cfg.head_dim  # a rank's shard: its view, H / W heads
    cos, sin = fs.rope(ratio)  # [T, rope/2]
    # norm (+ rope) in one launch each: rms_norm then apply_rope on the reference backend
    norm_rope, rope = (
        resolve("norm_rope", meta.kernels, x.device),
        resolve("rope", meta.kernels, x.device),
    )
    qr = norm_rope(attn.wq_a(x), attn.q_norm.weight, attn.q_norm.eps)  # [T, q_lora]
    q = norm_rope(attn.wq_b(qr).view(num_t, h, hd), None, cfg.rms_norm_eps, cos, sin)  # [T, H, hd]
    kv = norm_rope(attn.wkv(x), attn.kv_norm.weight, attn.kv_norm.eps, cos, sin)  # [T, hd]
    if attn.compressor is not None:
        run_compressor(attn.compressor, lw.compressor, g.compressor, fs.compressor_tables(ratio),
                       meta, x)  # fmt: skip
    topk_dec = topk_pre = None
    if ratio == 4:
        topk_dec, topk_pre = _topk(attn, lw, fs, x, qr, cos, sin)
    chunks = fs.prefill_chunks(ratio)
    workspaces = [_workspace(fs, g, c, kv) for c in chunks]
    fs.store_window(g, kv)
    n_dec = meta.shape.num_decode_tokens
    # a decode-only step takes the decode kernel's output as is (no [T, H, hd] copy a layer)
    out = None if 0 < n_dec == num_t else torch.empty_like(q)
    scale = hd**-0.5
    sink = lw.attn_sink  # [H] fp32
    if n_dec:
        table = meta.decode_candidates(ratio)
        if topk_dec is not None:
            table = torch.cat((table, topk_dec), dim=1)
        all_heads = (fs.switches.attention_all_heads and meta.geo.kv_rows.dtype == torch.uint8
                     and h <= 64)  # fmt: skip
        op = "sparse_attention_decode_all_heads" if all_heads else "sparse_attention_decode"
        decode = resolve(op, meta.kernels, x.device)
        o_dec = decode(
            q[:n_dec].contiguous(), meta.geo.kv_rows, table, sink, scale,
            rope_dim=cfg.qk_rope_head_dim, win_base=meta.win_base[layer_id, :n_dec].contiguous(),
            num_win=cfg.sliding_window, comp_base=g.comp_base,
        )  # fmt: skip
        if out is None:
            out = o_dec
        else:
            out[:n_dec] = o_dec
    prefill = resolve("sparse_attention_prefill", meta.kernels, x.device)
    for chunk, ws in zip(chunks, workspaces):
        lo, hi = chunk.token_lo, chunk.token_hi
        table = chunk.candidates
        if topk_pre is not None:
            local = topk_pre[lo - n_dec : hi - n_dec]
            mapped = torch.where(local >= 0, chunk.ws_base[:, None] + local, -1).int()
            table = torch.cat((table, mapped), dim=1)
        out[lo:hi] = prefill(q[lo:hi].contiguous(), ws, table, sink, scale,
                             rope_dim=cfg.qk_rope_head_dim)  # fmt: skip
    out = rope(out, cos, sin, inverse=True)
    return attn._project_out(out.unsqueeze(0)).squeeze(0)


def _workspace(fs: ForwardState, g, chunk, kv: torch.Tensor) -> torch.Tensor:
    """The chunk's workspace [rows, d] in kv's dtype: cached entries and window prefix, then the
    fresh rows through the cache's format; one launch (`kernels.kv_workspace`, which may also
    store the layer's window rows: `ForwardState.claim_window_store`) when the op is there."""
    meta, geo = fs.meta, fs.meta.geo
    fused = kv_rows.workspace_op(meta.kernels, kv.device)
    if fused is None:
        return _gathered_workspace(fs, g, chunk, kv)
    return fused(kv, geo.kv_bytes, chunk.ws_src, meta.win_base[g.layer_id],
                 fs.claim_window_store(g), fmt=geo.kv_format,
                 rope_dim=geo.layout.model.qk_rope_head_dim, comp_base=g.comp_base)  # fmt: skip


def _gathered_workspace(fs: ForwardState, g, chunk, kv: torch.Tensor) -> torch.Tensor:
    """`_workspace` without the fused op (the reference path): gathers, round trip, index_puts
    (padding rows left uninitialised: no candidate names them)."""
    meta = fs.meta
    ws = kv.new_empty(chunk.num_rows, kv.shape[1])
    if chunk.comp_src.numel():
        ws[chunk.comp_dst] = kv_rows.gather(meta.geo, chunk.comp_src + g.comp_base, kv.dtype,
                                            meta.kernels)  # fmt: skip
    if chunk.win_src.numel():
        slots = meta.win_base[g.layer_id][chunk.win_token].long() + chunk.win_src
        ws[chunk.win_dst] = kv_rows.gather(meta.geo, slots, kv.dtype, meta.kernels)
    # the chunk's own rows as later chunks and decode steps read them back (chunk invariance)
    ws[chunk.query_dst] = kv_rows.round_trip(meta.geo, kv[chunk.token_lo : chunk.token_hi],
                                             meta.kernels)  # fmt: skip
    return ws


def _topk(attn: Attention, lw: LayerWeights, fs: ForwardState, x, qr, cos, sin):
    """(decode top-k as `block * SPB + i % E` slots, prefill top-k as local entry indices),
    each [n, K] int32 -1 padded (None where there are no such tokens)."""
    layer_id = attn.layer_id
    pattern = fs.index_pattern
    if pattern is not None and pattern.is_shared(layer_id):
        return fs.relay[pattern.source_of(layer_id)]  # no keys, q-proj, logits or top-k
    g = fs.meta.geo.layers[layer_id]
    run_compressor(attn.indexer.compressor, lw.indexer_compressor, g.indexer,
                   fs.compressor_tables(4), fs.meta, x)  # fmt: skip
    result = indexer_topk(attn.indexer, fs, g, x, qr, cos, sin)
    fs.relay[layer_id] = result
    return result
