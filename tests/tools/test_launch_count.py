"""tools/launch_count.py: the counting rules (tools/launch_counter.py) on hand-made tensor code,
then the tiny model's prefill step: deterministic, every launch in a layer or the step with a
named component, the known per-layer structure, layers of a kind that add the same launches,
syncs reported."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    """A tools/ script as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / f"tools/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lc = _load("launch_count")
counters = _load("launch_counter")

SLICE = (0, 4, 128, 4)  # the V4-Flash slice's layer kinds
PROMPT = 160  # crosses a C128 window and C4 entries; fewer than top-k 512: no indexer top-k


def test_counting_rules_on_host_tables_uploads_and_device_ops():
    """Host tables cost nothing, uploads a memcpy (and a sync when blocking), device ops a
    launch each (views none, a same-dtype contiguous copy a memcpy), scalar reads a sync."""
    c = counters.LaunchCounter()
    dev = torch.device("cpu")  # the step's device, as the forward passes it
    weight = torch.arange(8.0)  # older than the step: a device tensor (weights, cache)
    with counters.Residency(c), counters.Launches(c):
        c.counting = True
        host = torch.tensor([3, 1, 2]) * 2  # host table and host math
        assert not host.is_cuda and weight.is_cuda
        idx = host.to(dev)  # blocking upload
        ids = torch.tensor([0, 1], device=dev)  # built on the host, uploaded
        rows = weight.view(2, 4).t()  # views
        picked = weight[idx] * 2  # index, mul
        ring = torch.zeros(3, device=dev)  # fill
        copy = picked.clone()  # memcpy DtoD
        total = int(picked.sum())  # sum, then a scalar read
        large = weight[weight > 5]  # gt, index by a mask: its size read back
        staged = host.to(dev, non_blocking=True)  # upload, no sync
        c.counting = False
    assert rows.shape == (4, 2) and total == 2 * (6 + 2 + 4) and ring.shape == copy.shape
    assert ids.tolist() == [0, 1] and staged.tolist() == [6, 2, 4] and large.tolist() == [6, 7]
    kernels = [op for kind, op, *_ in c.events if kind == "kernel"]
    assert kernels == ["aten::index", "aten::mul", "aten::zeros", "aten::sum", "aten::gt",
                       "aten::index"]  # fmt: skip
    memcpys = Counter(op for kind, op, *_ in c.events if kind == "memcpy")
    assert memcpys == {"memcpy HtoD": 3, "memcpy DtoD": 1, "memcpy DtoH": 2}
    assert [s[0] for s in c.syncs] == [
        "Tensor.to to the device without non_blocking", "torch.tensor(device=)",
        "aten::_local_scalar_dense", "aten::index",
    ]  # fmt: skip
    assert all(e[2] == "step" and e[3] == "other" for e in c.events)  # outside the forward


@pytest.fixture(scope="module")
def bf16_slice() -> dict:
    return lc.count_step("bf16", PROMPT, SLICE, experts=8)


def test_counts_are_deterministic(bf16_slice):
    assert lc.count_step("bf16", PROMPT, SLICE, experts=8) == bf16_slice


def test_every_launch_has_a_layer_or_the_step_and_a_component(bf16_slice):
    rec = bf16_slice
    assert rec["regions"] == ["layer0", "layer1", "layer2", "layer3", "step"]
    assert "other" not in rec["components"] and not rec["value_mismatches"]
    cells = sum(n for row in rec["components"].values() for n in row.values())
    assert cells == rec["launches"] == rec["kernels"] + rec["triton"] > 0
    assert rec["token_parallel"] + rec["attention_side"] + rec["rest"] == rec["launches"]


def test_each_layer_has_its_kernels(bf16_slice):
    """Per layer: both mHC mixes, the grouped experts' two GEMMs and their align, one sparse
    attention launch (one prefill chunk); compressors only in compressed layers; the head and
    the token read in the step."""
    comps = bf16_slice["components"]
    for layer in ("layer0", "layer1", "layer2", "layer3"):
        assert comps["experts_gemm"][layer] == 2 and comps["moe_align"][layer] >= 1
        assert comps["sparse_attention"][layer] >= 1 and comps["hc_post"][layer] == 2
        assert comps["hc_pre"][layer] >= 2 and comps["router"][layer] >= 1
    assert comps["compressor"]["layer0"] == 0 < comps["compressor"]["layer2"]
    assert comps["head"]["step"] > 0 and comps["sampler"]["step"] > 0
    assert bf16_slice["sync_calls"].get("Tensor.tolist") == 1  # the sampled token to the host
    assert bf16_slice["host_syncs"] == sum(bf16_slice["sync_calls"].values())


def test_more_layers_of_a_kind_add_the_same_launches(bf16_slice):
    """Doubling the slice: the first four layers and the step are unchanged, and a C4 layer
    whose ratio's tables exist launches what layer 3 (the slice's second C4 layer) did."""
    twice = lc.count_step("bf16", PROMPT, SLICE * 2, experts=8)
    one, two = bf16_slice["components"], twice["components"]
    column = lambda comps, region: {k: row.get(region, 0) for k, row in comps.items()}  # noqa: E731
    for region in ("layer0", "layer1", "layer2", "layer3", "step"):
        assert {k: v for k, v in column(two, region).items() if v} == {
            k: v for k, v in column(one, region).items() if v}  # fmt: skip
    assert column(two, "layer5") == column(two, "layer7") == column(two, "layer3")
    added = sum(sum(column(two, f"layer{i}").values()) for i in range(4, 8))
    assert twice["launches"] - bf16_slice["launches"] == added > 0


def test_checkpoint_formats_dequantise_the_fp8_linears(bf16_slice):
    """MXFP4 experts + FP8 linears: each FP8 linear of a prefill-sized step is a dequantise
    launch and the bf16 GEMM; everything else launches as with bf16 weights."""
    rec = lc.count_step("checkpoint", PROMPT, SLICE, experts=8)
    dequant = dict(rec["top_ops"]).get("_fp8_dequant_kernel", 0)
    linears_per_layer = 8  # wq_a, wq_b, wkv, wo_a, wo_b, the shared expert's w1, w2, w3
    assert dequant == linears_per_layer * len(SLICE)
    assert rec["launches"] == bf16_slice["launches"] + dequant


def test_a_prefill_step_aligns_in_three_launches_and_syncs_once():
    """400 tokens x top-6: 2400 pairs, past the one-program align (MAX_PAIRS 2048). The
    chunked align is three launches a layer (its torch fallback was 27); the one host sync
    left is the sampled token's (the sample rows' upload queues without one)."""
    rec = lc.count_step("bf16", 400, SLICE, experts=8)
    assert {rec["components"]["moe_align"][f"layer{i}"] for i in range(4)} == {3}
    assert rec["sync_calls"] == {"Tensor.tolist": 1}


def test_a_decode_step_counts_the_static_pass_without_syncs():
    """`--decode-batch 1`: the step a decode graph captures, after the prompt's prefill. Its
    inputs cross in one upload, nothing syncs; per layer the combine adds the shared expert and
    rounds (no zero fill, no add, no cast: kernels/moe.py), and the window candidate table is
    built once for every ratio kind (layer 0's), not again in the C4 and C128 layers."""
    rec = lc.count_step("bf16", PROMPT, SLICE, experts=8, decode_batch=1)
    assert rec["decode_batch"] == 1 and rec["regions"][-1] == "step"
    assert "other" not in rec["components"] and not rec["value_mismatches"]
    assert rec["host_syncs"] == 0 and rec["memcpy"].get("memcpy HtoD") == 1
    comps = rec["components"]
    for layer in ("layer0", "layer1", "layer2", "layer3"):
        assert comps["moe_combine"][layer] == 1 and comps["shared_expert"][layer] == 4
        assert comps["experts_gemm"][layer] == 2 and comps["hc_post"][layer] == 2
    assert "moe_other" not in comps
    # the C128 layer: only its own columns and their cat; the second C4 layer nothing
    assert comps["metadata"]["layer2"] == 2 and comps["metadata"]["layer3"] == 0
