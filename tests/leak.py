"""Shared leak checks: every scheduler, cache, transfer or lease test ends with one.

`assert_no_leaks(*components)` asks each component what it still holds through its
`find_leaks() -> list[str]` (empty: clean) and fails with all findings at once. Components
that implement it: `BlockPool`, `KVCacheManager`, `Scheduler` (and anything else that holds
blocks, requests or leases — give it a `find_leaks`).
"""

from __future__ import annotations

from typing import Protocol


class LeakCheckable(Protocol):
    def find_leaks(self) -> list[str]: ...


def find_all_leaks(*components: LeakCheckable) -> list[str]:
    findings: list[str] = []
    for component in components:
        findings.extend(f"{type(component).__name__}: {leak}" for leak in component.find_leaks())
    return findings


def assert_no_leaks(*components: LeakCheckable) -> None:
    """Fail if any component still holds blocks, live requests or leases."""
    if not components:
        raise AssertionError("assert_no_leaks() needs at least one component to check")
    findings = find_all_leaks(*components)
    if findings:
        raise AssertionError("leaks found:\n  " + "\n  ".join(findings))
