"""Indexer logits + top-k streamlined (issue 25 item 4): `indexer_logits` then `indexer_topk`
(kernels/indexer.py, kernels/indexer_select.py) with their issue-25 variants switched on.

Logits (`fast=True`, the `FAST` constexpr of `_logits_kernel`; same programs and key reads):
- FP8 keys ("fp8_fp32scale"): e4m3 codes become fp16 with one `cvt` per two codes (the default
  goes e4m3 -> f16 -> f32 -> bf16) and the dot runs in fp16. q's bf16 values are fp16 values
  for 2^-14 <= |q| <= 65504 (below, fp16 keeps 2^-24 absolute: a query element that small
  moves a score by less than the fp32 summation noise). The row scale (> 0) multiplies the
  head sum instead of the [keys, heads] dots: relu(s d) = s relu(d).
- MXFP4 keys: each nibble is placed straight into fp32 bits (a value times 2^-126, exact, the
  code for 0.5 a subnormal), then two multiplies: a few integer ops a value instead of the
  default's float select chain.
Top-k (`radix=True`, the `RADIX` constexpr of `_topk_kernel`; off in `indexer_logits_topk`
unless asked for, RADIX_DEFAULT): the k-th largest score by an
8-bit radix select (4 histogram rounds over the row) instead of up to 32 bitwise count rounds;
it also knows how many ties to keep (no counting pass), and the compaction (ties to the lower
index) runs one packed scan instead of two, at 8 warps (16 spill on sm_90).

Measured (an H100, Triton 3.6, T = 64, 8192 keys; benchmarks/results/attention-variants-h100.json):
the fast logits ran 1.08x (FP8 keys) and 1.84x (MXFP4 keys) of the default, the radix top-k
0.64x: compiled by Triton 3.6 for sm_90 it takes 255 registers and spills 176 bytes at 8 warps
(Triton 3.9 does not spill it), so the served variant is the fast logits with the default top-k.

A per-program partial top-k was considered: a split of 1024 of 8192 keys keeps its own top 512,
so a merge would still see half the keys, and the scores round trip costs 4 bytes a key against
68-132 bytes of key: the two launches stay.
"""

from __future__ import annotations

from kernels.indexer import indexer_logits, indexer_logits_ref
from kernels.indexer_select import indexer_topk, indexer_topk_ref
from kernels.registry import register_op

RADIX_DEFAULT = False  # the radix top-k ran 0.64x of the count rounds on the card (module doc)


def indexer_logits_topk(q, weights, keys, block_table, token_to_req, lengths, k,
                        entries_per_block, *, key_format, num_cols, slots_per_block=None,
                        slot_base=0, variant=True, radix=None):  # fmt: skip
    """q [T, H_I, d], weights [T, H_I], paged keys, block_table, token_to_req, lengths (as
    `indexer_logits`) -> (slots [T, k] int32 global slots of the top-k entries, -1 padded; lens
    [T] int32), as `indexer_topk(indexer_logits(...), ...)`. `num_cols`: the static score width
    (most visible entries). `variant` False: the default kernels (the benchmark's baseline);
    True: the fast logits, and the radix top-k when `radix` (default RADIX_DEFAULT)."""
    scores = indexer_logits(q, weights, keys, block_table, token_to_req, lengths,
                            key_format=key_format, num_cols=num_cols, write_tail=False,
                            fast=variant)  # fmt: skip
    return indexer_topk(scores, lengths, k, token_to_req, block_table, entries_per_block,
                        slots_per_block=slots_per_block, slot_base=slot_base,
                        radix=variant and (RADIX_DEFAULT if radix is None else radix))  # fmt: skip


def indexer_logits_topk_ref(q, weights, keys, block_table, token_to_req, lengths, k,
                            entries_per_block, *, key_format, num_cols, slots_per_block=None,
                            slot_base=0, variant=True, radix=None):  # fmt: skip
    scores = indexer_logits_ref(q, weights, keys, block_table, token_to_req, lengths,
                                key_format=key_format, num_cols=num_cols)  # fmt: skip
    return indexer_topk_ref(scores, lengths, k, token_to_req, block_table, entries_per_block,
                            slots_per_block=slots_per_block, slot_base=slot_base)  # fmt: skip


register_op("indexer_logits_topk", indexer_logits_topk, indexer_logits_topk_ref,
            family="indexer_fused")  # fmt: skip
