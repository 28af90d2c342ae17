"""`dsv4 up --gpus` hands each worker process its own cards: a `LocalCluster` laid out by
`place_workers` starts real worker processes (tiny model, CPU), and each one's environment, read
from /proc/<pid>/environ while it serves, holds its cards as CUDA_VISIBLE_DEVICES in the
launcher's numbering; a decode worker's second rank process inherits its worker's cards.
CPU only: nothing here opens a card, which is what a host without GPUs can show."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dsv4.commands.placement import CUDA_VISIBLE, place_workers
from tests.parallel.test_ranked_workers import ranked_checkpoint
from tests.services.worker_cluster import start_cluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]
RANKS = ("--tensor-parallel-size", "2")  # the decode worker: rank 0 + a rank process


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)


def rank_processes(pid: int) -> list[int]:
    """The rank processes (`dsv4.worker.follower`) whose parent is `pid` (/proc/N/stat: the
    parent is the second field after the command name)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
            command = (proc / "cmdline").read_bytes()
        except OSError:  # exited while we looked
            continue
        if parent == pid and b"dsv4.worker.follower" in command:
            found.append(int(proc.name))
    return found


def test_each_worker_sees_its_own_cards(tmp_path_factory, monkeypatch) -> None:
    monkeypatch.setenv(CUDA_VISIBLE, "5,6,7")  # the launcher's cards: indices 0, 1, 2
    placement = place_workers((0, 1, 2), [("prefill-0", 1), ("decode-0", 2)])
    model_dir = ranked_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")  # shared
    cluster = start_cluster(
        model_dir, with_router=False, placement=placement, decode_args=RANKS,
        service_args=("--device", "cpu", "--num-blocks", "8", "--drain-timeout-s", "0.5"),
    )  # fmt: skip
    try:
        prefill, decode = cluster.service("prefill-0"), cluster.service("decode-0")
        assert environ(prefill.process.pid)[CUDA_VISIBLE] == "5"
        assert environ(decode.process.pid)[CUDA_VISIBLE] == "6,7"
        (follower,) = rank_processes(decode.process.pid)  # rank 1 of 2
        assert environ(follower)[CUDA_VISIBLE] == "6,7"  # it picks cuda:1 of those
    finally:
        cluster.stop()
