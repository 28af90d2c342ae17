"""Meta-tests: every registered op has a reference and a test; the backend switch; the
benchmark script's CPU dry run; file line budgets."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import kernels
from dsv4.errors import ConfigError
from kernels import registry
from kernels.backend import KernelBackendConfig, dispatch, resolve, select_backend
from tests.kernels.bench_dry_run import dry_run_records

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("spec", registry.all_ops(), ids=lambda s: s.name)
def test_every_op_has_ref_and_test(spec):
    assert callable(spec.triton_fn) and callable(spec.ref_fn) and callable(spec.baseline)
    assert spec.ref_fn is not spec.triton_fn
    assert spec.ref_fn.__name__ == f"{spec.name}_ref"
    assert (ROOT / "kernels" / f"{spec.family}.py").is_file()
    test_file = TESTS / f"test_{spec.family}.py"
    assert test_file.is_file(), f"{spec.name}: missing {test_file}"
    text = test_file.read_text()
    assert spec.name in text and "pytest.mark.gpu" in text, f"{spec.name} untested in {test_file}"
    fast, ref = inspect.signature(spec.triton_fn), inspect.signature(spec.ref_fn)
    positional = [p for p in fast.parameters.values() if p.kind != p.KEYWORD_ONLY]
    assert [p.name for p in positional] == list(ref.parameters)[: len(positional)]


def test_exported_ops_are_registered():
    exported = {n for n in kernels.__all__ if callable(getattr(kernels, n)) and n in registry._OPS}
    assert exported == set(registry.op_names())


def test_select_backend():
    assert select_backend("route", "ref", {}) == "ref"
    assert select_backend("route", "ref", {"route": "triton"}) == "triton"
    assert select_backend("hc_pre", "auto", {"route": "ref"}, device="cpu") == "ref"
    assert select_backend("hc_pre", "auto", {}, device="cuda:0") == "triton"
    with pytest.raises(ConfigError):
        select_backend("route", "cuda", {})


def test_config_parse_and_validation():
    cfg = KernelBackendConfig.parse("triton, route=ref,hc_pre=auto")
    assert cfg.default == "triton" and dict(cfg.overrides) == {"route": "ref", "hc_pre": "auto"}
    assert KernelBackendConfig.parse("") == KernelBackendConfig()
    with pytest.raises(ConfigError):
        KernelBackendConfig.parse("ref,not_an_op=triton")
    with pytest.raises(ConfigError):
        KernelBackendConfig(default="fast")
    with pytest.raises(TypeError):
        cfg.overrides["route"] = "triton"  # frozen


def test_dispatch_through_the_switch():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logits, bias = torch.randn(3, 8, device=dev), torch.rand(8, device=dev)
    ref = dispatch("route", KernelBackendConfig(default="ref"), logits, bias, 2, 1.5)
    tri = dispatch("route", KernelBackendConfig(default="ref", overrides={"route": "triton"}),
                   logits, bias, 2, 1.5)  # fmt: skip
    assert torch.equal(ref[1].sort(1).values, tri[1].sort(1).values)
    assert resolve("hc_post", KernelBackendConfig(), "cpu") is registry.get_op("hc_post").ref_fn
    cuda = resolve("hc_post", KernelBackendConfig(), "cuda")
    assert cuda is registry.get_op("hc_post").triton_fn


def test_benchmark_dry_run(tmp_path):
    records = dry_run_records(tmp_path, "bench_kernels", "--only", "route")
    assert {r["name"] for r in records} == {"route", "hash_route"}


def test_line_budget():
    files = [
        *(ROOT / "kernels").glob("*.py"),
        *TESTS.glob("*.py"),
        ROOT / "benchmarks/bench_kernels.py",
    ]
    for path in files:
        assert len(path.read_text().splitlines()) <= 500, path
