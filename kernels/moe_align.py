"""`moe_align`: the MoE routing metadata (kernels/moe.py step 1) in one launch for decode sizes.

Contract (shared by the kernel and `moe_align_ref`): expert_ids [T, K] -> n = T*K pairs, pair
p = t*K + k routed to expert expert_ids[t, k].
- sorted_ids [max_tiles * block_m] int32: the pairs sorted by expert, stably (a run's pairs
  ascending), each expert's run padded to a multiple of block_m with the sentinel n;
- tile_e [max_tiles] int32: the expert of each block_m-row tile, -1 for the unused tail tiles;
- max_tiles = n // block_m + min(n, E): a static bound, so no host sync (CUDA-graph capturable).

`moe_align_ref` builds this from ~14 torch ops. In a CUDA-graph decode step (n = 6..384 pairs)
those are ~14 launches per MoE layer of pure launch gaps, so up to MAX_PAIRS pairs (and
MAX_EXPERTS experts) one Triton program does it all, bit-identical to the reference:
1. counts[e] = histogram of the ids; tiles[e] = ceil(counts[e] / block_m); exclusive prefix
   sums give each expert's first pair (in sorted order) and first tile.
2. sort keys e * BLOCK_N + p: sorted position j holds pair p of expert e, and the stable order
   comes for free. Its destination is j + pad_before[e], pad_before[e] = first_tile[e] * block_m
   - first_pair[e] (the padding rows of the experts before e), gathered from registers.
3. fill sorted_ids with the sentinel, barrier, scatter the pairs to their destinations.
4. tile_e[t] = #{e : tile_end[e] <= t} (searchsorted right) = inclusive cumsum of the
   histogram of tile_end over tiles; -1 from the last used tile on.
Above MAX_PAIRS (prefill steps from ~342 tokens of V4-Flash) three launches do the same in
CHUNK-pair chunks, bit-identical again (the reference's ~27 torch ops, a sort and two scans
among them, were a prefill step's largest source of launches: tools/launch_count.py):
A. per chunk c: counts[c, e] (a histogram of its ids);
B. one program: base[c, e] = first_slot[e] + the pairs of e in chunks before c (a running sum
   down the chunks), first_slot[e] = (tile_end[e] - tiles[e]) * block_m; it also keeps
   counts[e] and tile_end[e] for C;
C. programs < num_chunks: sort their chunk as in 2., a pair's rank among its expert's pairs in
   the chunk is j - (exclusive cumsum of the chunk's histogram)[e], its slot base[c, e] + rank;
   the other programs own BLOCK_TT tiles each: tile_e by a search of tile_end, the sentinel into
   the padding slots of their tiles (slot offset >= counts[e] in its expert's run, or past the
   used tiles). Those slots are never a pair's, so both halves run in one launch.
Above MAX_PAIRS_CHUNKED (or E > MAX_EXPERTS, or no kernel backend) the reference runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.registry import register_op
from kernels.specialize import sizes_vary

# H200, CUDA graphs: 2.7 us at 6-96 pairs, 4.9 at 384 (E 256), 21-26 at 2048 (8 warps) against
# 48-85 us for the torch ops; the sort is one [BLOCK_N] block in registers (8 keys per thread)
MAX_PAIRS = 2048
MAX_EXPERTS = 512
_FILL_BLOCK = 2048  # sentinel-fill chunk (sorted_ids can be (n/bm + E) * bm >> BLOCK_N rows)
CHUNK = 2048  # pairs a program sorts on the chunked path (the one-program path's largest sort)
MAX_PAIRS_CHUNKED = 1 << 20  # 64 chunks of 16K-token V4-Flash steps fit many times over
_TILE_BLOCK = 64  # tiles a program of launch C owns (tile_e, padding sentinels)


@triton.jit
def _sort(x, LOG_N: tl.constexpr):
    """Ascending bitonic sort of x [2**LOG_N] (non-negative int32 < 2**30).

    tl.sort's network on the [2] * LOG_N hypercube, but each step finds its partner as
    (pair sum) - self where tl.sort uses xor_sum: the interpreter runs tl.sum in numpy and
    xor_sum one element at a time (8 s for 2048 keys); on GPU both are the same size-2 reduce.
    Written flat: each nested jit call costs the interpreter ~2 ms."""
    h = tl.reshape(x, [2] * LOG_N)
    for stage in tl.static_range(1, LOG_N + 1):
        # blocks of 2**stage alternate direction (flip = bit `stage`); the last pass ascends
        if stage < LOG_N:
            flip = tl.reshape(tl.arange(0, 2), [1] * (LOG_N - stage - 1) + [2] + [1] * stage)
        else:
            flip = 0
        for step in tl.static_range(stage):
            # compare-exchange across bit stage-1-step of the flat index = hypercube axis
            # LOG_N-stage+step (NOTE: inline: a named constexpr here compiles as a tensor)
            partner = tl.sum(h, LOG_N - stage + step, keep_dims=True) - h
            is_right = tl.reshape(
                tl.arange(0, 2), [1] * (LOG_N - stage + step) + [2] + [1] * (stage - 1 - step)
            )
            h = tl.where((h > partner) != (flip ^ is_right).to(tl.int1), partner, h)
    return tl.reshape(h, [2**LOG_N])


@triton.jit(**sizes_vary("n", "max_tiles"))
def _align_kernel(
    # Pointers: expert ids [n] (the flattened [T, K], int32 or int64); outputs sorted_ids
    # [max_tiles * block_m] int32 and tile_e [max_tiles] int32
    ids_ptr, sorted_ptr, tile_e_ptr,
    # Sizes
    n, num_experts, block_m, max_tiles,
    # Meta-parameters: BLOCK_N >= n, BLOCK_E >= E, BLOCK_T > max_tiles (powers of two)
    BLOCK_N: tl.constexpr, LOG_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    j = tl.arange(0, BLOCK_N)
    is_pair = j < n
    # padding lanes get expert E: their keys sort after every real pair's
    expert = tl.load(ids_ptr + j, mask=is_pair, other=0).to(tl.int32)
    expert = tl.where(is_pair, expert, num_experts)
    e = tl.arange(0, BLOCK_E)
    counts = tl.histogram(expert, BLOCK_E, mask=is_pair)  # [BLOCK_E], 0 for e >= E
    tiles = (counts + block_m - 1) // block_m
    tile_end = tl.cumsum(tiles, 0)  # [BLOCK_E] inclusive
    pad_before = (tile_end - tiles) * block_m - (tl.cumsum(counts, 0) - counts)

    key = _sort(expert * BLOCK_N + j, LOG_N)  # [BLOCK_N]; distinct keys, so the order is stable
    sorted_e = tl.minimum(key // BLOCK_N, BLOCK_E - 1)  # padding lanes: any in-range index
    dest = j + tl.gather(pad_before, sorted_e, 0)

    num_slots = max_tiles * block_m
    sentinel = tl.zeros([BLOCK_S], tl.int32) + n
    for s0 in range(0, num_slots, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        tl.store(sorted_ptr + s, sentinel, mask=s < num_slots)
    # NOTE: the scatter overwrites slots that other threads just filled: the barrier orders
    # this CTA's global writes (grid = 1, so no other CTA writes here).
    tl.debug_barrier()
    tl.store(sorted_ptr + dest, key % BLOCK_N, mask=is_pair)

    # tile_end <= max_tiles < BLOCK_T, so every used expert lands in a bin
    ends = tl.histogram(tile_end, BLOCK_T, mask=e < num_experts)  # [BLOCK_T]
    t = tl.arange(0, BLOCK_T)
    tile_e = tl.where(t < tl.sum(tiles, 0), tl.cumsum(ends, 0), -1)
    tl.store(tile_e_ptr + t, tile_e, mask=t < max_tiles)


@triton.jit(**sizes_vary("n"))
def _chunk_counts_kernel(ids_ptr, counts_ptr, n, num_experts,
                         CHUNK_C: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    # launch A: counts [num_chunks, BLOCK_E] int32, row c = the histogram of chunk c's ids
    c = tl.program_id(0)
    p = c * CHUNK_C + tl.arange(0, CHUNK_C)
    expert = tl.load(ids_ptr + p, mask=p < n, other=0).to(tl.int32)
    counts = tl.histogram(expert, BLOCK_E, mask=p < n)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit(**sizes_vary("num_chunks"))
def _chunk_bases_kernel(counts_ptr, base_ptr, stats_ptr, num_chunks, num_experts, block_m,
                        BLOCK_E: tl.constexpr):  # fmt: skip
    # launch B (one program): base [num_chunks, BLOCK_E] int32 = each chunk's first slot per
    # expert; stats [2, BLOCK_E] = (counts[e], tile_end[e]) for launch C
    e = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], tl.int32)
    for c in range(0, num_chunks):
        total += tl.load(counts_ptr + c * BLOCK_E + e)
    tiles = (total + block_m - 1) // block_m
    tile_end = tl.cumsum(tiles, 0)
    running = (tile_end - tiles) * block_m  # first_slot[e]
    for c in range(0, num_chunks):
        tl.store(base_ptr + c * BLOCK_E + e, running)
        running += tl.load(counts_ptr + c * BLOCK_E + e)
    tl.store(stats_ptr + e, total)
    tl.store(stats_ptr + BLOCK_E + e, tl.where(e < num_experts, tile_end, 1 << 30))


@triton.jit(**sizes_vary("n", "max_tiles", "num_chunks"))
def _chunk_scatter_kernel(
    ids_ptr, base_ptr, stats_ptr, sorted_ptr, tile_e_ptr,
    n, num_experts, block_m, max_tiles, num_chunks,
    CHUNK_C: tl.constexpr, LOG_C: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_TT: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # launch C: programs < num_chunks scatter their chunk's pairs; the rest own BLOCK_TT tiles
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    if pid < num_chunks:
        j = tl.arange(0, CHUNK_C)
        p = pid * CHUNK_C + j
        is_pair = p < n
        expert = tl.load(ids_ptr + p, mask=is_pair, other=0).to(tl.int32)
        expert = tl.where(is_pair, expert, num_experts)  # padding lanes sort last
        hist = tl.histogram(expert, BLOCK_E, mask=is_pair)
        key = _sort(expert * CHUNK_C + j, LOG_C)  # stable: ascending pairs within an expert
        sorted_e = tl.minimum(key // CHUNK_C, BLOCK_E - 1)
        rank = j - tl.gather(tl.cumsum(hist, 0) - hist, sorted_e, 0)
        dest = tl.load(base_ptr + pid * BLOCK_E + sorted_e) + rank
        in_chunk = tl.sum(is_pair.to(tl.int32), 0)  # sorted lanes >= this are padding
        tl.store(sorted_ptr + dest, pid * CHUNK_C + key % CHUNK_C, mask=j < in_chunk)
    else:
        t = (pid - num_chunks) * BLOCK_TT + tl.arange(0, BLOCK_TT)  # [BLOCK_TT] tiles
        tile_end = tl.load(stats_ptr + BLOCK_E + e)  # [BLOCK_E], 2**30 past E
        owner = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), 1)  # searchsorted right
        used = owner < num_experts
        tl.store(tile_e_ptr + t, tl.where(used, owner, -1), mask=t < max_tiles)
        safe = tl.minimum(owner, num_experts - 1)
        count = tl.load(stats_ptr + safe)
        first = tl.load(stats_ptr + BLOCK_E + safe) - (count + block_m - 1) // block_m
        r = tl.arange(0, BLOCK_M)
        # NOTE: names differ from the other branch's (the compiler merges same-named values)
        tile_slot = t[:, None] * block_m + r[None, :]  # [BLOCK_TT, BLOCK_M]
        pad = (~used[:, None]) | (tile_slot - first[:, None] * block_m >= count[:, None])
        ok = (t[:, None] < max_tiles) & (r[None, :] < block_m) & pad
        tl.store(sorted_ptr + tile_slot, tl.zeros([BLOCK_TT, BLOCK_M], tl.int32) + n, mask=ok)


def _block(size: int) -> int:
    """Power-of-two block >= size, at least 128 (one element per thread of 4 warps): fewer
    compiled variants across decode batch sizes."""
    return max(triton.next_power_of_2(size), 128)


def _can_launch(t: torch.Tensor) -> bool:
    """CUDA, or CPU under TRITON_INTERPRET=1 (tests): the kernel's decoration tells which."""
    return t.is_cuda or isinstance(_align_kernel, InterpretedFunction)


def moe_align(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """expert_ids [T, K] -> (sorted_ids [max_tiles * block_m] int32, tile_e [max_tiles] int32);
    see the module doc. One launch for 0 < T*K <= MAX_PAIRS and E <= MAX_EXPERTS on CUDA (or
    the interpreter), three up to MAX_PAIRS_CHUNKED, else `moe_align_ref`. No host sync."""
    flat = expert_ids.reshape(-1)
    n = flat.numel()
    if not (0 < n <= MAX_PAIRS_CHUNKED and num_experts <= MAX_EXPERTS and _can_launch(flat)):
        return moe_align_ref(expert_ids, num_experts, block_m)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.long()
    if n > MAX_PAIRS:
        return _moe_align_chunked(flat.contiguous(), num_experts, block_m)
    max_tiles = n // block_m + min(n, num_experts)
    sorted_ids = torch.empty(max_tiles * block_m, dtype=torch.int32, device=flat.device)
    tile_e = torch.empty(max_tiles, dtype=torch.int32, device=flat.device)
    block_n = _block(n)
    _align_kernel[(1,)](
        flat.contiguous(), sorted_ids, tile_e,
        n, num_experts, block_m, max_tiles,
        BLOCK_N=block_n, LOG_N=block_n.bit_length() - 1, BLOCK_E=_block(num_experts),
        BLOCK_T=_block(max_tiles + 1), BLOCK_S=_FILL_BLOCK, num_warps=4 if block_n <= 512 else 8,
    )  # fmt: skip
    return sorted_ids, tile_e


def _moe_align_chunked(flat: torch.Tensor, num_experts: int, block_m: int):
    """The three-launch path (module doc, A-C) for MAX_PAIRS < n <= MAX_PAIRS_CHUNKED."""
    n, dev = flat.numel(), flat.device
    max_tiles = n // block_m + min(n, num_experts)
    num_chunks = triton.cdiv(n, CHUNK)
    block_e = _block(num_experts)
    sorted_ids = torch.empty(max_tiles * block_m, dtype=torch.int32, device=dev)
    tile_e = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    # one scratch: counts [chunks, BLOCK_E], base [chunks, BLOCK_E], stats [2, BLOCK_E]
    scratch = torch.empty((2 * num_chunks + 2) * block_e, dtype=torch.int32, device=dev)
    counts = scratch[: num_chunks * block_e]
    base = scratch[num_chunks * block_e : 2 * num_chunks * block_e]
    stats = scratch[2 * num_chunks * block_e :]
    _chunk_counts_kernel[(num_chunks,)](flat, counts, n, num_experts, CHUNK_C=CHUNK,
                                        BLOCK_E=block_e, num_warps=8)  # fmt: skip
    _chunk_bases_kernel[(1,)](counts, base, stats, num_chunks, num_experts, block_m,
                              BLOCK_E=block_e, num_warps=4)  # fmt: skip
    grid = (num_chunks + triton.cdiv(max_tiles, _TILE_BLOCK),)
    _chunk_scatter_kernel[grid](
        flat, base, stats, sorted_ids, tile_e, n, num_experts, block_m, max_tiles, num_chunks,
        CHUNK_C=CHUNK, LOG_C=CHUNK.bit_length() - 1, BLOCK_E=block_e, BLOCK_TT=_TILE_BLOCK,
        BLOCK_M=triton.next_power_of_2(block_m), num_warps=8,
    )  # fmt: skip
    return sorted_ids, tile_e


def moe_align_ref(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """Reference (and the path above the limits): the same outputs from torch ops."""
    flat = expert_ids.reshape(-1).long()
    n = flat.numel()
    dev = flat.device
    # NOTE: not torch.bincount: on CUDA it reads max() back to size its output (a host sync
    # that CUDA graph capture refuses).
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    max_tiles = n // block_m + min(n, num_experts)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    dest = (tile_end - tiles)[sorted_e] * block_m + rank
    sorted_ids = torch.full((max_tiles * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    tile_e = torch.searchsorted(tile_end, torch.arange(max_tiles, device=dev), right=True)
    tile_e = torch.where(tile_e < num_experts, tile_e, -1).to(torch.int32)
    return sorted_ids, tile_e


register_op("moe_align", moe_align, moe_align_ref, family="moe_align")
