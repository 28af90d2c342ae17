"""Fixtures of the deploy/ tests (helpers live in k8s_objects.py)."""

from __future__ import annotations

import pytest
from k8s_objects import CANNOT_RENDER, OVERLAYS, Obj, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Obj]]:
    """Every kustomization under deploy/k8s, rendered once per test session by kubectl."""
    if CANNOT_RENDER:
        pytest.skip(CANNOT_RENDER)
    return {name: render(path) for name, path in OVERLAYS.items()}
