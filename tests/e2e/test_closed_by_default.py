"""Closed by default: a cluster started like `dsv4 up` with no secret configured. Every worker
RPC without the generated secret ends UNAUTHENTICATED and works with it; the secret never shows
on a command line; drain and undrain (deploy/scripts/drain.py) need it; no worker listens on a
non-loopback interface (UCX included); a worker started alone without a secret refuses to start
with one line. The cluster serves a normal request after all of it."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from e2e_cluster import assert_no_worker_leaks, generate, greedy

from dsv4 import wire
from dsv4.commands.cluster import free_port
from dsv4.commands.service_args import split_secret
from dsv4.rpc.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from dsv4.types import DecodeRequest, GenerateRequest
from tests.services.worker_cluster import PROMPTS, WORKER_ARGS, start_cluster, tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[2]
DRAIN = REPO / "deploy" / "scripts" / "drain.py"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    no_secret, _ = split_secret(WORKER_ARGS)
    assert "--shared-secret" not in no_secret and "DSV4_SHARED_SECRET" not in os.environ
    cluster = start_cluster(model_dir, router_port=free_port(), service_args=no_secret)
    yield cluster
    cluster.stop()


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket of `pid` in LISTEN state (/proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(address_hex)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(raw)), int(port_hex, 16)))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (a dual-stack socket)
    return (mapped or ip).is_loopback


def stubs(cluster, role: str):
    channel = grpc.insecure_channel(cluster.addresses(role)[0])
    stub_class = (
        worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    )
    return channel, stub_class(channel)


def request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, tuple(PROMPTS[0]), greedy(3))


def worker_calls(prefill, decode):
    """Every worker RPC as (name, call(metadata))."""
    prefill_msg = wire.prefill_request_to_proto(request("closed-p"))
    decode_msg = wire.decode_request_to_proto(DecodeRequest(request=request("closed-d")))
    return [
        ("P.Info", lambda m: prefill.Info(worker_pb2.InfoRequest(), metadata=m, timeout=10)),
        ("P.Prefill", lambda m: prefill.Prefill(prefill_msg, metadata=m, timeout=30)),
        ("P.Release", lambda m: prefill.Release(
            worker_pb2.ReleaseRequest(lease_id="none"), metadata=m, timeout=10)),
        ("P.Drain", lambda m: prefill.Drain(worker_pb2.DrainRequest(), metadata=m, timeout=10)),
        ("P.Undrain", lambda m: prefill.Undrain(
            worker_pb2.UndrainRequest(), metadata=m, timeout=10)),
        ("D.Info", lambda m: decode.Info(worker_pb2.InfoRequest(), metadata=m, timeout=10)),
        ("D.Decode", lambda m: list(decode.Decode(decode_msg, metadata=m, timeout=30))),
        ("D.Abort", lambda m: decode.Abort(
            common_pb2.AbortRequest(request_id="none"), metadata=m, timeout=10)),
        ("D.Drain", lambda m: decode.Drain(worker_pb2.DrainRequest(), metadata=m, timeout=10)),
        ("D.Undrain", lambda m: decode.Undrain(
            worker_pb2.UndrainRequest(), metadata=m, timeout=10)),
    ]  # fmt: skip


def test_the_generated_secret_is_private(cluster) -> None:
    path = Path(cluster.secret_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == cluster.shared_secret and len(cluster.shared_secret) >= 32
    for service in cluster.services:
        cmdline = Path(f"/proc/{service.process.pid}/cmdline").read_bytes()
        assert cluster.shared_secret.encode() not in cmdline, service.name


def test_every_worker_rpc_needs_the_secret(cluster) -> None:
    prefill_channel, prefill = stubs(cluster, "prefill")
    decode_channel, decode = stubs(cluster, "decode")
    with prefill_channel, decode_channel:
        for name, call in worker_calls(prefill, decode):
            for metadata in ((), (("x-dsv4-token", "wrong"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    call(metadata)
                assert refused.value.code() is UNAUTHENTICATED, (name, refused.value.details())
            call(cluster.worker_metadata)  # raises if refused
        reply = prefill.Prefill(
            wire.prefill_request_to_proto(request("closed-lease")),
            metadata=cluster.worker_metadata, timeout=30,
        )  # fmt: skip
        release = worker_pb2.ReleaseRequest(lease_id=reply.handle.lease_id)
        assert prefill.Release(release, metadata=cluster.worker_metadata, timeout=10).was_found
    asyncio.run(assert_no_worker_leaks(cluster))


def run_drain(cluster, role: str, *flags: str, secret: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    if secret is not None:
        env["DSV4_SHARED_SECRET"] = secret
    command = [sys.executable, str(DRAIN), "--address", cluster.addresses(role)[0], *flags]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def is_draining(cluster, role: str) -> bool:
    channel, stub = stubs(cluster, role)
    with channel:
        return stub.Info(worker_pb2.InfoRequest(), metadata=cluster.worker_metadata).is_draining


def test_drain_and_undrain_need_the_secret(cluster) -> None:
    for role in ("prefill", "decode"):
        refused = run_drain(cluster, role, "--timeout-s", "5", secret=None)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
        assert not is_draining(cluster, role)
        drained = run_drain(cluster, role, "--timeout-s", "10", secret=cluster.shared_secret)
        assert drained.returncode == 0, drained.stderr
        assert is_draining(cluster, role)
        refused = run_drain(cluster, role, "--undrain", secret="wrong")
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
        assert is_draining(cluster, role)
        undrained = run_drain(cluster, role, "--undrain", secret=cluster.shared_secret)
        assert undrained.returncode == 0, undrained.stderr
        assert not is_draining(cluster, role)


def test_no_worker_listens_beyond_loopback_and_the_cluster_serves(cluster) -> None:
    for service in cluster.services:
        addresses = listening_addresses(service.process.pid)
        assert addresses, f"{service.name} listens nowhere?"
        outside = [a for a in addresses if not is_loopback(a[0])]
        assert not outside, f"{service.name} listens on {outside}"

    async def body() -> None:
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            for _ in range(50):  # the router sees an undrained worker at its next probe
                outcome = await generate(channel, PROMPTS[1], greedy(4), timeout_s=60)
                if outcome.code is not grpc.StatusCode.UNAVAILABLE:
                    break
                await asyncio.sleep(0.2)
        assert outcome.code is grpc.StatusCode.OK and len(outcome.token_ids) == 4, outcome.details
        await assert_no_worker_leaks(cluster)

    asyncio.run(asyncio.wait_for(body(), 90))


def test_a_worker_without_a_secret_refuses_to_start_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    command = [
        sys.executable,
        "-m",
        "dsv4.commands.cli",
        "prefill",
        "--model",
        "tiny",
        "--worker-port",
        "0",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "DSV4_SHARED_SECRET" in lines[0], done.stderr
