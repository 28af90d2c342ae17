"""The repository explains itself: no tracked file points at a document a clone does not have.

Model facts live in docs/model.md, design and platform facts in docs/architecture.md,
deployment in docs/operations.md, measurements in docs/BENCHMARKS.md. This test fails when a
comment, docstring or doc cites one of the design notes that once lived outside the repository,
or anything under `../shared/`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THIS_FILE = Path(__file__).resolve().relative_to(REPO).as_posix()

# Names of the outside documents (case-sensitive: docs/architecture.md is ours).
OUTSIDE_DOCUMENTS = (
    "DSV4_ARCH",
    "PLATFORM_NOTES",
    "STYLE.md",
    "ARCHITECTURE.md",
    "OPTIMIZATIONS.md",
    "PEERS.md",
    "FLASHINFER_SM90",
    "shared/design",
    "../shared/",
)
OUTSIDE_PATTERN = re.compile("|".join(re.escape(name) for name in OUTSIDE_DOCUMENTS))


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no tracked-file list")
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30
    )
    return [name for name in listing.stdout.decode().split("\0") if name]


def test_no_tracked_file_references_a_document_outside_the_repo() -> None:
    offenders = []
    for name in _tracked_files():
        path = REPO / name
        if name == THIS_FILE or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (images, weights): no references to check
        for number, line in enumerate(text.splitlines(), start=1):
            match = OUTSIDE_PATTERN.search(line)
            if match:
                offenders.append(f"{name}:{number}: {match.group(0)}")
    assert not offenders, "point into docs/ instead:\n" + "\n".join(offenders)


def test_the_pattern_catches_each_outside_name() -> None:
    for name in OUTSIDE_DOCUMENTS:
        assert OUTSIDE_PATTERN.search(f"see {name} for details")
    assert not OUTSIDE_PATTERN.search("see docs/architecture.md#platform-notes and docs/model.md")


def test_no_tracked_symlink_leaves_the_repo_or_points_at_itself() -> None:
    """A tracked `.venv` symlink to itself (ignore rules with a trailing slash match only
    directories) once failed CI's first `make` step; tracked links stay inside the clone."""
    offenders = []
    for name in _tracked_files():
        path = REPO / name
        if not path.is_symlink():
            continue
        target = (path.parent / path.readlink()).resolve(strict=False)
        if target == path.absolute() or not target.is_relative_to(REPO) or not target.exists():
            offenders.append(f"{name} -> {path.readlink()}")
    assert not offenders, "tracked links must point at files of this repo:\n" + "\n".join(offenders)
