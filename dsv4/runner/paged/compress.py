"""The compressors of a step on the paged cache: entries of tokens that close a window go into
the cache, every token's [a | z + ape] row into the compressor's state ring (#48957).

Per compress ratio and step (`CompressorTables`, shared by every compressor of that ratio):
which tokens get a compress program (boundary tokens only, or every token for the
always-launch baseline / a graph-captured step), their in-step counts, the ring slots of their
candidate positions, where their entry goes and its rope angle. Per compressor the kernels map
the ring slots to element offsets of that layer's state page and the entries' block-table
columns to cache rows (`kernels.ring_offsets.PagedAddress`), add ape to the gate and read kv and
gate as the two halves of the projection: a call is the GEMM and the two compressor launches.
An eager step builds the tables on the host (numpy) and uploads them once; a captured step,
whose replays bring new positions, builds them on the device in one launch
(`kernels.step_tables`). Both add two launches: the angles' cos and sin.

A token's state row is saved only if no later token of its request in the same step reuses the
ring slot (p >= end - slots): the save kernel writes rows in parallel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from dsv4.config.model import ModelConfig
from dsv4.model.compressor import Compressor
from dsv4.model.layers import linear_fp32
from dsv4.model.rope import inv_freq
from dsv4.runner.paged.geometry import CompressorGeometry
from dsv4.runner.paged.step_metadata import StepMetadata, ragged, upload_packed
from dsv4.runner.paged.weights import CompressorWeights
from kernels import compressor as compressor_kernels
from kernels.backend import resolve
from kernels.ring_offsets import PagedAddress


@dataclass(frozen=True)
class CompressorTables:
    ratio: int
    all_tokens: bool  # one program per token (non-boundary ones idle) instead of boundaries
    tokens: torch.Tensor  # [NB] int32: flat token of each compress program
    reqs: torch.Tensor  # [NB] int64: its request
    num_in_step: torch.Tensor  # [NB] int32
    cand_slots: torch.Tensor  # [NB, c*r] int64 ring slots of positions p-c*r+1..p (-1 if < 0)
    # entry i = (p + 1) // r - 1: block-table column of its token block (clamped to the
    # table), its row in the block; the kernel reads the block (`PagedAddress`)
    entry_col: torch.Tensor  # [NB] int64
    entry_row: torch.Tensor  # [NB] int64
    cos: torch.Tensor  # [NB, rope/2] fp32 at the entry position r * i
    sin: torch.Tensor
    save_slots: torch.Tensor  # [T] int64 ring slot per token, -1 = not saved
    phase: torch.Tensor  # [T] int64 position mod ratio: each token's ape row


def compressor_tables(meta: StepMetadata, ratio: int, *, all_tokens: bool) -> CompressorTables:
    """Built once per step and ratio: on the host for an eager step, from the device tensors
    for a captured one (a replay has new inputs and no host work; every token a program)."""
    if meta.tokens is None or meta.shape.host_positions is None:
        assert all_tokens, "boundary tokens come from host positions"
        return _device_tables(meta, ratio)
    return _host_tables(meta, ratio, all_tokens)


def _host_tables(meta: StepMetadata, ratio: int, all_tokens: bool) -> CompressorTables:
    """Everything but the rope's cos/sin from host-known starts and ends (numpy), in one
    upload: 2 launches instead of ~36 (the formulas of `_device_tables`, the same values and
    dtypes)."""
    tokens, t = meta.tokens, meta.t
    cfg = meta.geo.layout.model
    num_cand = cfg.overlap(ratio) * ratio
    slots = num_cand + meta.geo.layout.options.num_speculative_tokens
    starts = np.asarray(tokens.starts, dtype=np.int64)  # [B]
    ends = np.asarray(tokens.ends, dtype=np.int64)
    treq, local = ragged(ends - starts)  # [T] each token's request, index in the step
    pos = starts[treq] + local  # [T]
    idx = np.arange(len(pos)) if all_tokens else np.flatnonzero((pos + 1) % ratio == 0)  # [NB]
    req, p = treq[idx], pos[idx]
    cand = p[:, None] - num_cand + 1 + np.arange(num_cand)  # [NB, c*r]
    entry = np.maximum((p + 1) // ratio - 1, 0)  # [NB]
    epb = meta.geo.layout.block_size // ratio
    # fp32 angles as rope_cos_sin forms them (an exact product: the same bits on any device)
    angles = (entry * ratio).astype(np.float32)[:, None] * _host_inv_freq(cfg, ratio)
    # a token's state row is saved unless a later token of its request reuses the ring slot
    save = np.where(pos >= ends[treq] - slots, pos % slots, -1)  # [T]
    tok_d, req_d, nis, cand_slots, col, row, angles_d, save_d, phase = upload_packed([
        idx.astype(np.int32), req, (p - starts[req] + 1).astype(np.int32),
        np.where(cand >= 0, cand % slots, -1),
        np.minimum(entry // epb, t.block_tables.shape[1] - 1), entry % epb,  # block column, row
        angles, save, pos % ratio,
    ], t.positions.device)  # fmt: skip
    return CompressorTables(ratio, all_tokens, tok_d, req_d, nis, cand_slots, col, row,
                            angles_d.cos(), angles_d.sin(), save_d, phase)  # fmt: skip


@functools.lru_cache(maxsize=16)
def _host_inv_freq(cfg: ModelConfig, ratio: int) -> np.ndarray:
    """[rope/2] fp32 (numpy: a host array, never read back from a device tensor)."""
    return inv_freq(cfg, ratio).numpy().copy()


def _device_tables(meta: StepMetadata, ratio: int) -> CompressorTables:
    """Every token a program, from the step's device tensors only (captured decode steps): one
    launch (`kernels.step_tables`) and the angles' cos and sin."""
    t = meta.t
    cfg = meta.geo.layout.model
    dev = t.positions.device
    num_cand = cfg.overlap(ratio) * ratio
    fn = resolve("compressor_tables", meta.kernels, dev)
    tab = fn(t.positions, t.token_to_req, t.starts, t.ends, inv_freq(cfg, ratio, dev),
             ratio=ratio, num_cand=num_cand,
             slots=num_cand + meta.geo.layout.options.num_speculative_tokens,
             entries_per_block=meta.geo.layout.block_size // ratio,
             max_col=t.block_tables.shape[1] - 1)  # fmt: skip
    return CompressorTables(ratio, True, tab.tokens, tab.reqs, tab.num_in_step, tab.cand_slots,
                            tab.entry_col, tab.entry_row, tab.angles.cos(), tab.angles.sin(),
                            tab.save_slots, tab.phase)  # fmt: skip


def paged_address(meta: StepMetadata, g: CompressorGeometry,
                  tables: CompressorTables) -> PagedAddress:  # fmt: skip
    """Where g's state rows and entries live for the kernels (no tensor work: views only)."""
    t, ring = meta.t, g.state
    return PagedAddress(t.ring_ids, t.block_tables, t.token_to_req, tables.reqs,
                        tables.entry_row, ring.ring_block_index, ring.entries_per_block,
                        meta.geo.stride, ring.offset_bytes, ring.entry_bytes, g.entry_stride,
                        g.entry_unit, g.entry_base)  # fmt: skip


def run_compressor(
    module: Compressor,
    weights: CompressorWeights,
    g: CompressorGeometry,
    tables: CompressorTables,
    meta: StepMetadata,
    x: torch.Tensor,
) -> None:
    """x [T, D] (the attention input) -> entries of the boundary tokens into the cache and
    state rows into the ring. `weights`: wkv and wgate stacked (one GEMM, fp32 out), ape."""
    t, geo = meta.t, meta.geo
    proj = linear_fp32(x, weights.proj)  # [T, 2 c d'] fp32
    kv, gate = proj.chunk(2, dim=1)  # [T, c d'] views: the kernels take the row stride
    fn = resolve("compressor_step", meta.kernels, x.device)
    if tables.all_tokens:
        on_triton = fn is compressor_kernels.compressor_step
        fn = (compressor_kernels.compressor_step_always if on_triton
              else compressor_kernels.compressor_step_always_ref)  # fmt: skip
    fn(
        kv, gate, t.positions, geo.state_rows(g), tables.save_slots, tables.tokens,
        tables.num_in_step, tables.cand_slots, module.norm.weight, tables.cos, tables.sin,
        geo.entry_rows(g), tables.entry_col, ratio=g.ratio, fmt=g.entry_format,
        rope_dim=geo.layout.model.qk_rope_head_dim, eps=module.cfg.rms_norm_eps,
        entry_dtype=x.dtype, ape=weights.ape, phase=tables.phase,
        paged=paged_address(meta, g, tables),
    )  # fmt: skip
