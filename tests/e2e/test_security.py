"""Security of a real cluster: every gRPC port on TLS from a CA made here with the `openssl`
CLI, mutual TLS on the worker APIs (`--require-client-cert`), the shared secret, API keys and
a per-client rate limit on the router, and message size limits: refusals get their proper
status (UNAVAILABLE for a failed handshake, UNAUTHENTICATED, RESOURCE_EXHAUSTED with a retry
hint) and the services stay up."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from e2e_cluster import assert_no_worker_leaks, greedy

from dsv4 import wire
from dsv4.commands.cluster import free_port
from dsv4.rpc.v1 import router_pb2_grpc, worker_pb2, worker_pb2_grpc
from dsv4.types import GenerateRequest
from tests.services.worker_cluster import (
    METADATA,
    PROMPTS,
    WORKER_ARGS,
    start_cluster,
    tiny_checkpoint,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
MAX_MESSAGE_BYTES = 256 << 10
KEYS = ("key-one", "key-two")
RATE_BURST = 20


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_ca(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA and one certificate it signs for 127.0.0.1 (server and client use): (ca, cert, key)."""
    directory.mkdir()
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", f"/CN={name} CA", cwd=directory)  # fmt: skip
    openssl("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=localhost",
            cwd=directory)  # fmt: skip
    (directory / "ext.cnf").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
    )
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "node.pem", "-days", "1", "-extfile", "ext.cnf",
            cwd=directory)  # fmt: skip
    return directory / "ca.pem", directory / "node.pem", directory / "node.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    root = tmp_path_factory.mktemp("pki")
    return {"ours": make_ca(root / "ours", "dsv4"), "rogue": make_ca(root / "rogue", "rogue")}


@pytest.fixture(scope="module")
def cluster(pki, tmp_path_factory: pytest.TempPathFactory):
    ca, cert, key = pki["ours"]
    model_dir = tiny_checkpoint(tmp_path_factory.getbasetemp() / "dsv4-cache")
    args = (
        *WORKER_ARGS, "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca),
        "--require-client-cert", "--max-message-bytes", str(MAX_MESSAGE_BYTES),
        "--api-key", KEYS[0], "--api-key", KEYS[1],
        "--rate-limit-rps", "1", "--rate-limit-burst", str(RATE_BURST),
    )  # fmt: skip
    cluster = start_cluster(model_dir, router_port=free_port(), service_args=args)
    yield cluster
    cluster.stop()


def credentials(pki, which: str = "ours", *, client_cert: bool = False) -> grpc.ChannelCredentials:
    ca, cert, key = pki[which]
    if client_cert:
        return grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    return grpc.ssl_channel_credentials(pki["ours"][0].read_bytes())


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def generate_status(channel, prompt, metadata=(), max_new_tokens: int = 4):
    stub = router_pb2_grpc.RouterStub(channel)
    msg = wire.generate_request_to_proto(prompt, greedy(max_new_tokens))
    try:
        replies = [r async for r in stub.Generate(msg, metadata=metadata, timeout=30)]
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details(), exc.trailing_metadata()
    return grpc.StatusCode.OK, sum(len(r.token_ids) for r in replies), None


def test_router_serves_over_tls_with_api_keys_and_refuses_plaintext(cluster, pki) -> None:
    async def body() -> None:
        address = cluster.router_address
        async with grpc.aio.secure_channel(address, credentials(pki)) as channel:
            assert await generate_status(channel, PROMPTS[0], bearer(KEYS[0])) == (
                grpc.StatusCode.OK, 4, None,
            )  # fmt: skip
            for metadata in ((), bearer("wrong")):
                code, _, _ = await generate_status(channel, PROMPTS[0], metadata)
                assert code is grpc.StatusCode.UNAUTHENTICATED
        async with grpc.aio.insecure_channel(address) as plain:
            code, _, _ = await generate_status(plain, PROMPTS[0], bearer(KEYS[0]))
            assert code is grpc.StatusCode.UNAVAILABLE  # no TLS handshake, no service
        await assert_no_worker_leaks(cluster)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_workers_require_a_client_certificate_from_our_ca_and_the_secret(cluster, pki) -> None:
    async def info(address: str, role: str, creds, metadata=METADATA) -> grpc.StatusCode:
        async with grpc.aio.secure_channel(address, creds) as channel:
            stub_class = (
                worker_pb2_grpc.PrefillWorkerStub
                if role == "prefill"
                else worker_pb2_grpc.DecodeWorkerStub
            )
            try:
                await stub_class(channel).Info(
                    worker_pb2.InfoRequest(), metadata=metadata, timeout=5
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    async def body() -> None:
        for role in ("prefill", "decode"):
            address = cluster.addresses(role)[0]
            assert await info(address, role, credentials(pki, client_cert=True)) is (
                grpc.StatusCode.OK
            )
            assert await info(address, role, credentials(pki)) is grpc.StatusCode.UNAVAILABLE
            rogue = credentials(pki, "rogue", client_cert=True)
            assert await info(address, role, rogue) is grpc.StatusCode.UNAVAILABLE
            mtls = credentials(pki, client_cert=True)
            assert await info(address, role, mtls, ()) is grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(asyncio.wait_for(body(), 60))


def test_oversized_messages_are_resource_exhausted_and_the_services_stay_up(cluster, pki) -> None:
    huge_text = "x" * (MAX_MESSAGE_BYTES + 1024)

    async def body() -> None:
        async with grpc.aio.secure_channel(cluster.router_address, credentials(pki)) as channel:
            code, details, _ = await generate_status(channel, huge_text, bearer(KEYS[0]))
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
            assert await generate_status(channel, PROMPTS[1], bearer(KEYS[0])) == (
                grpc.StatusCode.OK, 4, None,
            )  # fmt: skip
        creds = credentials(pki, client_cert=True)
        async with grpc.aio.secure_channel(cluster.addresses("prefill")[0], creds) as channel:
            request = GenerateRequest("huge", tuple(range(100_000, 200_000)), greedy(2))
            msg = wire.prefill_request_to_proto(request)
            assert msg.ByteSize() > MAX_MESSAGE_BYTES
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                    msg, metadata=METADATA, timeout=10
                )
            assert failure.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        await assert_no_worker_leaks(cluster)

    asyncio.run(asyncio.wait_for(body(), 60))
    assert not cluster.dead_services()


def test_rate_limit_is_per_client_and_says_when_to_retry(cluster, pki) -> None:
    async def body() -> None:
        async with grpc.aio.secure_channel(cluster.router_address, credentials(pki)) as channel:
            codes = []
            for _ in range(RATE_BURST + 5):  # invalid requests: the limit applies before work
                code, details, trailers = await generate_status(channel, [], bearer(KEYS[1]))
                codes.append(code)
                if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    break
            assert codes[-1] is grpc.StatusCode.RESOURCE_EXHAUSTED, codes
            assert set(codes[:-1]) == {grpc.StatusCode.INVALID_ARGUMENT}
            assert "rate limit" in details and "retry after" in details
            assert 0 < int(dict(trailers)["grpc-retry-pushback-ms"]) <= 1000
            assert (await generate_status(channel, PROMPTS[0], bearer(KEYS[0])))[0] is (
                grpc.StatusCode.OK
            )  # another client's bucket is untouched

    asyncio.run(asyncio.wait_for(body(), 60))
