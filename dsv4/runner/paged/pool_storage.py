"""Where an expert pool's rows come from: a MoE layer's experts, as the loader left them, in the
grouped-GEMM layout of `dsv4.model.moe.ExpertWeights` (parts w13, w2 and, quantised, their
scales), one expert at a time.

A layer holds its experts either as one stacked storage (`moe.stacked_experts`: a model loaded
whole, bf16 / MXFP4 / FP8) or as an offload store (`dsv4.model.offload.OffloadedExperts`:
resident blobs on the device, cold blobs in pinned host memory, dense or MXFP4). `ExpertRows`
reads expert e's parts from either, and `fill_` copies them into a pool's device rows and its
pinned host rows; the source is dropped afterwards, so the experts exist once.

An offload store's cold blobs are already pinned host memory, one [K, nbytes] allocation a
layer with w1 | w3 side by side (`ExpertFormat`): `adopt_host_rows` hands them to the pool as
its host rows (strided views, no copy) wherever the pool's cold experts are the store's, so a
43-layer model does not copy ~100 GB host to host at start-up nor hold it twice meanwhile. A
"halves" layout re-packs those blobs in place, a few experts at a time on the pool's device
(re-packing on the host, expert by expert into fresh pinned rows, took ~15 ms an expert: 100 s
of a 43-layer H200 start-up with 125 cold experts a layer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dsv4.errors import ConfigError
from dsv4.model.moe import MoE, mxfp4_format, mxfp4_layout_
from dsv4.model.offload import OffloadedExperts
from dsv4.model.offload_load import host_blobs
from dsv4.ops.quant import halves_block, halves_scales_fit, repack_halves

Parts = tuple[torch.Tensor, ...]  # (w13, w2) or (w13, w2, w13_scale, w2_scale) of one expert
# experts re-packed at a time on the device: ~12 MiB of V4-Flash codes each, ~4x that in the
# re-pack's temporaries (one byte a code), beside a device the plan has nearly filled
REPACK_CHUNK = 4


def _store_scales_fit(store: OffloadedExperts, num: int) -> bool:
    """Whether every expert of an MXFP4 offload store may take a "halves" layout
    (`halves_scales_fit`): its scales read once, expert by expert, before any row is made."""
    for e in range(num):
        views = store.parts(e)
        if not halves_scales_fit(*(views[name][1] for name in ("w1", "w2", "w3"))):
            return False
    return True


@dataclass(frozen=True)
class ExpertRows:
    """One layer's experts as pool rows: `format` ("bf16": the model dtype, "mxfp4",
    "mxfp4_halves128", "fp8")
    and `parts(e)`, expert e's parts in the stacked layout (views or fresh tensors)."""

    format: str
    parts: Callable[[int], Parts]
    num_experts: int


def expert_rows_of(moe: MoE, mxfp4_layout: str = "stored") -> ExpertRows:
    """The layer's experts as pool rows, from its offload store or its stacked storage; MXFP4
    experts in `mxfp4_layout` (`dsv4.model.moe.MXFP4_LAYOUTS`: an offload store's rows, kept as
    stored, are re-packed an expert at a time as they are read, the stacked storage in place),
    so the device rows and the host rows the pool copies from share one layout."""
    num = moe.cfg.n_routed_experts
    store = moe.expert_store
    if isinstance(store, OffloadedExperts):
        fmt = mxfp4_format(moe.cfg, mxfp4_layout) if store.fmt.is_mxfp4 else "bf16"
        if halves_block(fmt) and not _store_scales_fit(store, num):
            fmt = "mxfp4"  # as `mxfp4_layout_` decides for a stacked storage

        def from_store(e: int) -> Parts:
            views = store.parts(e)
            (w1, s1), (w2, s2), (w3, s3) = views["w1"], views["w2"], views["w3"]
            if fmt == "bf16":
                return _stack_rows(w1, w3), w2
            w13 = _stack_rows(w1, w3)
            if fmt != "mxfp4":  # row by row: w1's rows then w3's, as stacked
                w13, w2 = repack_halves(w13, 128), repack_halves(w2, 128)
            return w13, w2, _stack_rows(s1, s3), s2

        return ExpertRows(fmt, from_store, num)
    if store is not None:
        raise ConfigError("forward", "paged", f"an expert store {type(store).__name__} cannot "
                          "be pooled: offload with dsv4.model.offload")  # fmt: skip
    stacked = moe.stacked_experts
    if stacked is None:
        from dsv4.model.moe import stack_experts_

        stacked = stack_experts_(moe)
    stacked = mxfp4_layout_(moe, mxfp4_layout)
    tensors = [t for t in (stacked.w13, stacked.w2, stacked.w13_scale, stacked.w2_scale)
               if t is not None]  # fmt: skip
    return ExpertRows(stacked.format, lambda e: tuple(t[e] for t in tensors), num)


def _stack_rows(top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
    """[top; bottom] along rows, as bytes (no cat kernel for float8_e8m0fnu everywhere)."""
    return torch.cat((top.view(torch.uint8), bottom.view(torch.uint8))).view(top.dtype)


def empty_rows(like: Parts, rows: int, device: torch.device, pin: bool = False) -> Parts:
    """[rows, *part shape] per part: on `device`, or (device cpu) in host memory, pinned and
    mapped when `pin` (one registered allocation per part: `host_blobs`; the copy kernel reads
    it through its device address)."""
    if device.type != "cpu":
        return tuple(torch.empty(rows, *p.shape, dtype=p.dtype, device=device) for p in like)
    out = []
    for p in like:
        blob = host_blobs(rows, p.numel() * p.element_size(), pin, mapped=True)
        out.append(blob.view(p.dtype).view(rows, *p.shape))
    return tuple(out)


def fill_(dst: Parts, row: int, parts: Parts) -> None:
    """dst[i][row] = parts[i] for every part, as bytes (float8_e8m0fnu has no copy kernels
    on every device)."""
    for d, p in zip(dst, parts):
        d[row].view(torch.uint8).copy_(p.reshape(d.shape[1:]).view(torch.uint8))


def adopt_host_rows(
    moe: MoE, rows: ExpertRows, cold: list[int], device: torch.device | None = None
) -> Parts | None:
    """The pool's host rows for experts `cold` (in that order) as views of the layer's offload
    store blobs, or None where they cannot be: no store, another cold set, or blobs that are
    not evenly spaced rows of one allocation. For a "halves" format the views' codes are
    re-packed in place (on `device`, default the host): the store's cold experts are the pool's
    from then on, and the caller drops the store."""
    store = moe.expert_store
    block = halves_block(rows.format)
    if not (cold and isinstance(store, OffloadedExperts)):
        return None
    if rows.format not in ("bf16", "mxfp4") and not block:
        return None
    if sorted(store.host) != cold:
        return None
    first, nbytes = store.host[cold[0]], store.fmt.nbytes
    base = first.data_ptr()
    if any(store.host[e].data_ptr() != base + i * nbytes for i, e in enumerate(cold)):
        return None
    blobs = first.as_strided((len(cold), nbytes), (nbytes, 1))  # [K, nbytes] uint8
    # the pool's parts (w13, w2[, w13_scale, w2_scale]) as runs of the blob's named parts
    groups = [("w1", "w3"), ("w2",)]
    if rows.format != "bf16":
        groups += [("w1_scale", "w3_scale"), ("w2_scale",)]
    spans = {name: (off, math.prod(shape) * dtype.itemsize, dtype)
             for (name, shape, dtype), off in zip(store.fmt.parts, store.fmt.offsets)}  # fmt: skip
    like = rows.parts(cold[0])
    out = []
    for group, want in zip(groups, like):
        start, _, dtype = spans[group[0]]
        end = start
        for name in group:
            if spans[name][0] != end:  # not side by side in this format: copy instead
                return None
            end += spans[name][1]
        out.append(blobs[:, start:end].view(dtype).view(len(cold), *want.shape))
    if block:  # the codes (w13, w2) re-packed; the scales stay as they are
        for codes in out[:2]:
            _repack_in_place_(codes, block, device or torch.device("cpu"))
    return tuple(out)


def _repack_in_place_(codes: torch.Tensor, block: int, device: torch.device) -> None:
    """codes [K, rows, cols/2] int8 (stored MXFP4, a strided view of host blobs) -> the halves
    layout of `block` columns, in place, `REPACK_CHUNK` experts at a time on `device`."""
    with torch.no_grad():
        for lo in range(0, codes.shape[0], REPACK_CHUNK):
            part = codes[lo : lo + REPACK_CHUNK]
            part.copy_(repack_halves(part.to(device), block))


def drop_experts_(moe: MoE) -> None:
    """Free the layer's own copies of its routed experts (the pool now holds them); a shared
    expert that lived in the stacked storage's last slot gets storage of its own first."""
    stacked = moe.stacked_experts
    if stacked is not None and stacked.w13_all is not None:
        for module in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
            module.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=False)
    moe.experts = nn.ModuleList()
    moe.stacked_experts = None
    moe.expert_store = None
