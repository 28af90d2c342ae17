"""The control plane imports without torch: the router image has none
(docs/architecture.md#conventions).

Each module is imported in a fresh interpreter; modules other sessions are still writing are
checked only once they exist.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ALWAYS = (
    "dsv4.types",
    "dsv4.errors",
    "dsv4.ops.limits",  # the planner and the request validation read it
    "dsv4.config",
    "dsv4.wire",
    "dsv4.rpc",
    "dsv4.rpc.v1.router_pb2_grpc",
    "dsv4.rpc.v1.worker_pb2_grpc",
)
WHEN_PRESENT = ("dsv4.scheduler", "dsv4.cache", "dsv4.discovery", "router_svc")
# `import grpc` imports the empty grpc_tools package; only its protoc extension clashes with nixl.
HEAVY = ("torch", "triton", "nixl", "grpc_tools.protoc")


def _exists(module: str) -> bool:
    return (REPO / module.replace(".", "/") / "__init__.py").exists()


@pytest.mark.parametrize("module", [*ALWAYS, *WHEN_PRESENT])
def test_import_does_not_pull_in_torch(module: str) -> None:
    if module in WHEN_PRESENT and not _exists(module):
        pytest.skip(f"{module} does not exist yet")
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    heavy = result.stdout.strip()
    assert not heavy, f"importing {module} imported {heavy}; keep the control plane torch-free"


def test_helper_finds_packages() -> None:
    assert _exists("dsv4.config") and importlib.util.find_spec("dsv4.wire") is not None
