"""Prefill attention over per-chunk bf16 workspaces (vLLM #45061; docs/model.md#prefill-workspaces).

The scheduler's chunk plan groups consecutive prefill requests; a chunk's attention runs as one
sparse-kernel launch over a workspace of M = N + G rows per request:
    [ compressed entries 0..n-1 (N rows) | window prefix (<= W - 1 rows) + the chunk's own rows ]
The entries (this step's new ones included: the compressor ran first) and the window prefix are
decoded from the cache, the chunk's rows are the fresh K=V rows. Every query's candidates (its
window, then all visible C128 entries or the C4 top-k) are workspace rows. The tables below
depend only on the ratio, so all layers of a kind share them (#45863); each layer adds its own
page offsets when it gathers (`comp_base`, its window ring page).

All of it is arithmetic on what the host knows (starts, ends, flat token offsets, the
requests' block tables): built with numpy, it crosses in one upload (`upload_packed`) and the
device only gathers, 1-5 launches a table. As device formulas it was 21-33 launches a table,
each paid for on the host (a 1024-token step of the Flash slice: 79); the host arrays stay
small (the [T_c, W] window candidates cross as one [T_c + R (W - 1)] sequence whose W-wide
windows they are). `ws_src` maps every workspace row to its source for the one-launch
workspace (`kernels.kv_workspace`); the other row lists serve the gathers it replaced.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsv4.runner.paged.step_metadata import StepMetadata, ragged, upload_packed
from dsv4.scheduler.batch import PrefillChunk


@dataclass(frozen=True)
class ChunkTables:
    token_lo: int  # the chunk's tokens are flat rows [token_lo, token_hi)
    token_hi: int
    num_rows: int  # workspace rows (num_requests * M)
    comp_src: torch.Tensor  # [n1] int64 `block * SPB + i % E` of the entries to gather
    comp_dst: torch.Tensor  # [n1] int64 workspace rows
    win_src: torch.Tensor  # [n2] int64 ring-relative slots of the window prefix rows
    win_token: torch.Tensor  # [n2] int64 a token of the row's request (for its ring base)
    win_dst: torch.Tensor  # [n2] int64
    query_dst: torch.Tensor  # [T_c] int64 workspace row of each chunk token's own K=V row
    ws_base: torch.Tensor  # [T_c] int64 first workspace row of the token's request
    candidates: torch.Tensor  # [T_c, W (+ N128)] int32 workspace rows, -1 padded
    # [2, num_rows] int32 (slot, tok) of each workspace row (kernels.kv_workspace): (comp_src,
    # -1) an entry, (win_src, win_token) a window-prefix row, (-1, flat token) a fresh row,
    # (-1, -1) padding
    ws_src: torch.Tensor


def chunk_tables(meta: StepMetadata, ratio: int, chunk: PrefillChunk) -> ChunkTables:
    tokens, t = meta.tokens, meta.t
    w, dev = meta.geo.layout.model.sliding_window, t.positions.device
    ring_slots = meta.geo.layers[0].window.slots
    nr = chunk.num_requests
    first = tokens.num_decode_requests + chunk.start
    reqs = slice(first, first + nr)
    starts = np.asarray(tokens.starts[reqs], dtype=np.int64)  # [R]
    ends = np.asarray(tokens.ends[reqs], dtype=np.int64)  # [R]
    first_tok = np.asarray(tokens.first_token[reqs], dtype=np.int64)  # [R]
    lens = ends - starts  # [R] tokens of each request in the chunk
    n_comp = ends // ratio if ratio else np.zeros_like(ends)  # [R] entries 0..n-1
    prefix = np.minimum(starts, w - 1)  # [R] window prefix rows
    big_n = max(chunk.max_compressed_len, int(n_comp.max()))
    m = big_n + max(chunk.max_gather_len, int((prefix + lens).max()))
    lo, hi = int(first_tok[0]), int(first_tok[-1] + lens[-1])
    row0 = np.arange(nr) * m  # [R] first workspace row of each request
    # NOTE: the gathered rows' indices are built on the host from the sizes it knows (n_comp,
    # prefix): a boolean-mask selection on the device reads its count back (a host sync, five a
    # ratio, each draining the stream in the middle of the forward)
    r_comp, i_comp = ragged(n_comp)  # [n1]: each compressed entry's request, its index i
    r_win, j_win = ragged(prefix)  # [n2]: each window-prefix row's request, its offset j
    epb = meta.geo.layout.block_size // max(ratio, 1)
    nb = t.block_tables.shape[1]  # the uploaded block table's width (0 padded)
    blocks = np.zeros((nr, nb), dtype=np.int64)  # [R, nb] the chunk's rows of it
    for i, r in enumerate(tokens.requests[reqs]):
        blocks[i, : len(r.block_table)] = r.block_table
    # [2, n1] each entry's `block * SPB + i % E` (comp_src) and workspace row (comp_dst)
    comp = np.stack((blocks[r_comp, np.minimum(i_comp // epb, nb - 1)] * meta.geo.slots_per_block
                     + i_comp % epb, row0[r_comp] + i_comp))  # fmt: skip
    # [3, n2] each window-prefix row's ring slot (win_src), a token of its request, its row
    win = np.stack((((starts - prefix)[r_win] + j_win) % ring_slots, first_tok[r_win],
                    row0[r_win] + big_n + j_win))  # fmt: skip
    # Window candidates of position p: rows own0 + q, q = p-W+1..p (-1 where q < 0): the
    # W-wide window at p - s of its request's sequence over q = s-W+1..e-1, which is pad =
    # W-1-prefix times -1, then rows row0 + N + 0, 1, ... (sequence i -> i + off where i >= thr)
    seq_len = lens + w - 1  # [R]
    seq_start = np.cumsum(seq_len) - seq_len
    pad = w - 1 - prefix
    thr_off = np.repeat(np.stack((seq_start + pad, row0 + big_n - seq_start - pad)), seq_len,
                        axis=1)  # [2, T_c + R (W - 1)]  # fmt: skip
    i_seq = np.arange(thr_off.shape[1])
    window_seq = np.where(i_seq >= thr_off[0], i_seq + thr_off[1], -1).astype(np.int32)
    # the chunk's flat tokens i = 0..T_c-1: per-request offsets + i -> (query_dst, ws_base,
    # the start of its window in window_seq, its position)
    tok_start = first_tok - lo  # [R]
    per_tok = np.repeat(np.stack((row0 + big_n + prefix - tok_start, row0, seq_start - tok_start,
                                  starts - tok_start)), lens, axis=1)  # [4, T_c]  # fmt: skip
    per_tok[[0, 2, 3]] += np.arange(hi - lo)
    ws_src = np.full((2, nr * m), -1, dtype=np.int32)
    assert not comp.size or comp[0].max() < 2**31, "KV slots past int32"
    ws_src[0, comp[1]] = comp[0]
    ws_src[:, win[2]] = win[:2]
    ws_src[1, per_tok[0]] = np.arange(lo, hi)
    host = [comp, win, per_tok[:3], window_seq, ws_src]
    if ratio == 128:  # then every visible entry k < (p + 1) // 128: row base + k
        width = max(int(n_comp.max()), 1)
        visible = np.stack(((per_tok[3] + 1) // 128, per_tok[1])).astype(np.int32)  # [2, T_c]
        host += [np.arange(width, dtype=np.int32), visible]
    on_dev = upload_packed(host, dev)  # the one upload
    (comp_src, comp_dst), (win_src, win_token, win_dst) = on_dev[:2]
    (query_dst, ws_base, row), seq, ws_src = on_dev[2:5]
    cand = seq.unfold(0, w, 1)[row]  # [T_c, W] int32
    if ratio == 128:
        k, (visible, base) = on_dev[5:]
        c128 = torch.where(k < visible[:, None], base[:, None] + k, -1)  # [T_c, width] int32
        cand = torch.cat((cand, c128), dim=1)
    return ChunkTables(lo, hi, nr * m, comp_src, comp_dst, win_src, win_token, win_dst,
                       query_dst, ws_base, cand, ws_src)  # fmt: skip


def chunks_of(meta: StepMetadata, batch_plans, ratio: int) -> tuple[PrefillChunk, ...]:
    """The scheduler's chunks for `ratio`, or one chunk of every prefill (no plan given)."""
    for plan in batch_plans:
        if plan.ratio == ratio:
            return plan.chunks
    n = meta.shape.num_prefill_requests
    return (PrefillChunk(0, n, 0, 0),) if n else ()
