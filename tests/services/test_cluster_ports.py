"""A cluster whose picked port another process took before the service bound it starts again
on fresh ports: the worker exits with PortInUse's code (one line, no traceback) and the
launcher's second start serves. Before, the whole start failed (a CI run lost a cluster test
to a worker's metrics port taken in the seconds between pick and bind)."""

from __future__ import annotations

import logging
import socket

import pytest

from dsv4.commands import cluster as cluster_module
from dsv4.commands.cluster import is_serving
from dsv4.serving.ports import free_port
from tests.services.worker_cluster import start_cluster, tiny_checkpoint


def test_a_taken_metrics_port_costs_one_more_start_on_fresh_ports(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        picks = []

        def pick(host: str = "127.0.0.1") -> int:  # the worker's port, then its metrics port
            picks.append(taken.getsockname()[1] if len(picks) == 1 else free_port(host))
            return picks[-1]

        monkeypatch.setattr(cluster_module, "free_port", pick)
        with caplog.at_level(logging.WARNING, logger=cluster_module.__name__):
            cluster = start_cluster(model_dir, num_decode=0, with_router=False)
        try:
            (worker,) = cluster.services
            assert worker.metrics_port not in (0, taken.getsockname()[1])
            assert is_serving(worker.address, "", credentials=cluster.credentials)
        finally:
            cluster.stop()
    assert len(picks) == 4  # worker + metrics port, twice
    (warning,) = [r.getMessage() for r in caplog.records if "starting again" in r.getMessage()]
    assert warning.startswith(f"prefill-0: cannot serve metrics on 127.0.0.1:{picks[1]} "
                              "(already in use)"), warning  # fmt: skip
    assert warning.endswith("starting again on fresh ports (try 2 of 3)")
    assert cluster.services == []
