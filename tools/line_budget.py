"""Line budget: print lines of code per hand-written Python file; fail above the hard limit.

Soft limit 300 lines (reported), hard limit 500 (fails). Generated protobuf code is excluded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SOFT_LIMIT = 300
HARD_LIMIT = 500
EXCLUDED_PARTS = ("dsv4/rpc/v1/",)


def python_files(root: Path) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [root / p for p in out if not any(part in p for part in EXCLUDED_PARTS)]


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    rows = []
    for path in python_files(root):
        if not path.exists():
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        rows.append((len(lines), path.relative_to(root).as_posix()))
    rows.sort(reverse=True)
    over_hard = [r for r in rows if r[0] > HARD_LIMIT]
    over_soft = [r for r in rows if SOFT_LIMIT < r[0] <= HARD_LIMIT]
    total = sum(n for n, _ in rows)
    print(f"line budget: {len(rows)} files, {total} lines; {len(over_soft)} above {SOFT_LIMIT}")
    for n, p in over_hard:  # first: a reader that stops early still sees them
        print(f"  HARD  {n:5d}  {p}  (limit {HARD_LIMIT}: split it)")
    for n, p in over_soft:
        print(f"  soft  {n:5d}  {p}")
    return 1 if over_hard else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `| head`: the reader has what it wanted, as `cat` would stop
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
