"""Prefill attention over per-chunk bf16 workspaces (vLLM #45061; docs/model.md#prefill-workspaces).

The scheduler's chunk plan groups consecutive prefill requests; a chunk's attention runs as one
sparse-kernel launch over a workspace of M = N + G rows per request:
    [ compressed entries 0..n-1 (N rows) | window prefix (<= W - 1 rows) + the chunk's own rows ]
The entries (this step's new ones included: the compressor ran first) and the window prefix are
decoded from the cache, the chunk's rows are the fresh K=V rows. Every query's candidates (its
window, then all visible C128 entries or the C4 top-k) are workspace rows. The tables below
depend only on the ratio, so all layers of a kind share them (#45863); each layer adds its own
page offsets when it gathers (`comp_base`, its window ring page).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.runner.paged.step_metadata import StepMetadata
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


def chunk_tables(meta: StepMetadata, ratio: int, chunk: PrefillChunk) -> ChunkTables:
    tokens, t = meta.tokens, meta.t
    cfg = meta.geo.layout.model
    w, dev = cfg.sliding_window, t.positions.device
    ring_slots = meta.geo.layers[0].window.slots
    first = tokens.num_decode_requests + chunk.start
    reqs = range(first, first + chunk.num_requests)
    starts = [tokens.starts[b] for b in reqs]
    ends = [tokens.ends[b] for b in reqs]
    n_comp = [e // ratio if ratio else 0 for e in ends]
    prefix = [min(s, w - 1) for s in starts]
    big_n = max(chunk.max_compressed_len, max(n_comp))
    m = big_n + max(chunk.max_gather_len, max(p + e - s for p, s, e in zip(prefix, starts, ends)))
    lo = tokens.first_token[first]
    hi = tokens.first_token[reqs[-1]] + ends[-1] - starts[-1]
    host = torch.tensor([starts, prefix], dtype=torch.int64)  # [2, R]
    # NOTE: the gathered rows' indices are built on the host from the sizes it knows (n_comp,
    # prefix): a boolean-mask selection on the device reads its count back (a host sync, five a
    # ratio, each draining the stream in the middle of the forward)
    r_comp, i_comp = _ragged(n_comp)  # [n1]: each compressed entry's request, its index i
    r_win, j_win = _ragged(prefix)  # [n2]: each window-prefix row's request, its offset j
    epb = meta.geo.layout.block_size // max(ratio, 1)
    first_tok = torch.tensor([tokens.first_token[b] for b in reqs], dtype=torch.int64)
    on_dev = torch.cat((  # one upload of everything the host knows
        host.flatten(),  # starts, prefix
        r_comp + first, i_comp // epb, i_comp % epb, r_comp * m + i_comp,  # comp_dst
        (host[0][r_win] - host[1][r_win] + j_win) % ring_slots,  # win_src: ring slot
        first_tok[r_win], r_win * m + big_n + j_win,  # win_token, win_dst
    )).to(dev, non_blocking=True)  # fmt: skip
    nr, n1, n2 = chunk.num_requests, len(i_comp), len(j_win)
    start_d, prefix_d = on_dev[: 2 * nr].view(2, nr)
    comp_req, comp_blk, comp_off, comp_dst = on_dev[2 * nr : 2 * nr + 4 * n1].view(4, n1)
    win_src, win_token, win_dst = on_dev[2 * nr + 4 * n1 :].view(3, n2)
    base = torch.arange(nr, device=dev) * m  # [R]
    bt = t.block_tables.long()
    blocks = bt[comp_req, comp_blk.clamp(max=bt.shape[1] - 1)]  # [n1] each entry's cache block
    comp_src = blocks * meta.geo.slots_per_block + comp_off
    # the chunk's tokens
    treq = t.token_to_req[lo:hi].long() - first  # [T_c] request within the chunk
    p = t.positions[lo:hi]
    own0 = base[treq] + big_n + prefix_d[treq] - start_d[treq]  # + position = own row
    query_dst = own0 + p
    q = p[:, None] - w + 1 + torch.arange(w, device=dev)
    cand = torch.where(q >= 0, own0[:, None] + q, -1)
    if ratio == 128:
        width = max(max(n_comp), 1)
        k = torch.arange(width, device=dev)
        vis = k[None, :] < ((p + 1) // 128)[:, None]
        cand = torch.cat((cand, torch.where(vis, base[treq][:, None] + k, -1)), dim=1)
    return ChunkTables(lo, hi, chunk.num_requests * m, comp_src, comp_dst, win_src, win_token,
                       win_dst, query_dst, base[treq], cand.int())  # fmt: skip


def _ragged(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU int64 ([sum(counts)] the owner r of each item, [sum(counts)] its index < counts[r]),
    request-major: the order a row-major boolean mask over [R, max(counts)] selects in."""
    n = torch.tensor(counts, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(counts)), n)
    start = torch.cumsum(n, 0) - n
    return owner, torch.arange(len(owner)) - start[owner]


def chunks_of(meta: StepMetadata, batch_plans, ratio: int) -> tuple[PrefillChunk, ...]:
    """The scheduler's chunks for `ratio`, or one chunk of every prefill (no plan given)."""
    for plan in batch_plans:
        if plan.ratio == ratio:
            return plan.chunks
    n = meta.shape.num_prefill_requests
    return (PrefillChunk(0, n, 0, 0),) if n else ()
