"""Benchmarks write their records where the user runs them: a default output path is relative
to the working directory (`benchmarks/results/...` from the repository root, as the docs run
them), never built from the package's own location, which for an installed wheel is
site-packages."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import benchmarks.harness

PACKAGE = Path(benchmarks.harness.__file__).resolve().parent  # a namespace package
SOURCES = sorted(PACKAGE.glob("*.py"))


def _assigns(tree: ast.Module, name: str) -> bool:
    return any(
        isinstance(node, ast.Assign) and any(getattr(t, "id", "") == name for t in node.targets)
        for node in tree.body
    )


DEFAULT_OUT_MODULES = [p.stem for p in SOURCES if _assigns(ast.parse(p.read_text()), "DEFAULT_OUT")]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_benchmark_builds_a_path_from_its_own_file(path: Path) -> None:
    tree = ast.parse(path.read_text())
    uses = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "__file__"]
    assert not uses, f"{path.name}:{uses}: paths from __file__ land inside an installed package"


def test_the_modules_with_a_default_output_are_found() -> None:
    assert {"bench_kernels", "bench_offload", "bench_prefill"} <= set(DEFAULT_OUT_MODULES)


@pytest.mark.parametrize("name", DEFAULT_OUT_MODULES)
def test_a_default_output_is_under_the_working_directory(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default_out = Path(importlib.import_module(f"benchmarks.{name}").DEFAULT_OUT)
    assert not default_out.is_absolute(), default_out
    monkeypatch.chdir(tmp_path)
    resolved = default_out.resolve()
    assert resolved.is_relative_to(tmp_path.resolve()), resolved
    assert not resolved.is_relative_to(PACKAGE), f"{name}: {resolved} is inside {PACKAGE}"
    assert default_out.parts[:2] == ("benchmarks", "results"), "the docs' path from the repo root"
