"""Fixtures of the deploy/ tests (helpers live in k8s_objects.py)."""

from __future__ import annotations

import pytest
from k8s_objects import OVERLAYS, Obj, render_overlay


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Obj]]:
    """Every kustomization under deploy/k8s, rendered once per test session."""
    return {name: render_overlay(name) for name in OVERLAYS}
