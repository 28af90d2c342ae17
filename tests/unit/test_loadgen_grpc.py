"""`dsv4 loadtest` against a real gRPC peer: a tiny grpc.aio `dsv4.v1.Router` servicer on a
loopback port, in its own thread and event loop. It streams deterministic tokens (one or two
per message, like MTP), rejects some requests with RESOURCE_EXHAUSTED / INVALID_ARGUMENT, stalls
one past the client deadline, and tallies what it sent, so the client's counts and token
totals can be checked against the server's own."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import shutil
import subprocess
import threading
from collections import Counter

import grpc
import pytest

from dsv4.rpc.v1 import common_pb2, router_pb2, router_pb2_grpc
from loadgen.cli import add_loadtest_args, run_loadtest

VOCAB_SIZE = 1000
NUM_PROMPTS = 20
STALLED_INDEX = 19  # sleeps past --timeout-s before its first token


def expected_status(request_id: str) -> str:
    """What the fake router answers for a benchmark request id `req-N`."""
    prefix, _, index = request_id.partition("-")
    if prefix != "req":
        return "OK"  # warm-ups always succeed
    i = int(index)
    if i == STALLED_INDEX:
        return "DEADLINE_EXCEEDED"
    if i % 5 == 3:
        return "RESOURCE_EXHAUSTED"
    if i % 7 == 6:
        return "INVALID_ARGUMENT"
    return "OK"


class FakeRouter(router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.num_requests = 0
        self.completion_tokens_sent = 0
        self.prompt_tokens_ok = 0
        self.authorization: Counter[str] = Counter()
        self.bad_token_ids = 0

    async def Generate(self, request, context):
        self.num_requests += 1
        self.authorization[dict(context.invocation_metadata()).get("authorization", "")] += 1
        ids = list(request.prompt_token_ids.ids)
        self.bad_token_ids += sum(not 0 <= t < VOCAB_SIZE for t in ids)
        status = expected_status(request.request_id)
        if status == "RESOURCE_EXHAUSTED":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "admission queue full")
        if status == "INVALID_ARGUMENT":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt rejected")
        if status == "DEADLINE_EXCEEDED":
            await asyncio.sleep(2.0)
        if not request.sampling.ignore_eos:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "loadgen must set ignore_eos")
        n_out, sent, step = request.sampling.max_new_tokens, 0, 0
        while sent < n_out:
            await asyncio.sleep(0.001)
            k = min(1 + step % 2, n_out - sent)  # 1, 2, 1, 2, ... tokens per message
            msg = router_pb2.GenerateResponse(token_ids=[(sent + j) % VOCAB_SIZE for j in range(k)])
            sent, step = sent + k, step + 1
            if sent == n_out:
                msg.finish_reason = common_pb2.FINISH_REASON_LENGTH
                msg.usage.prompt_tokens = len(ids)
                msg.usage.completion_tokens = sent
            yield msg
        if request.request_id.startswith("req-"):
            self.completion_tokens_sent += sent
            self.prompt_tokens_ok += len(ids)

    async def GetModelInfo(self, request, context):
        return router_pb2.ModelInfo(model_name="fake", vocab_size=VOCAB_SIZE, max_model_len=4096)


@contextlib.contextmanager
def serve_fake_router(credentials=None):
    """Yield (servicer, port) of a grpc.aio server running in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servicer = FakeRouter()

    async def start():
        server = grpc.aio.server(options=[("grpc.server.max_pending_requests", 10000)])
        router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
        if credentials is None:
            port = server.add_insecure_port("127.0.0.1:0")
        else:
            port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield servicer, port
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture
def fake_router():
    with serve_fake_router() as served:
        yield served


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_loadtest_args(parser)
    return parser.parse_args(list(argv))


def test_loadtest_against_real_grpc_server(fake_router, tmp_path):
    servicer, port = fake_router
    args = _args(
            "--target", f"127.0.0.1:{port}", "--num-prompts", str(NUM_PROMPTS),
            "--random-input-len", "16", "--random-output-len", "8",
            "--max-concurrency", "8", "--num-warmups", "2", "--timeout-s", "0.5",
            "--api-key", "secret-key", "--goodput", "ttft:10000",
            "--result-json", str(tmp_path / "r.json"),
            "--per-request-jsonl", str(tmp_path / "r.jsonl"),
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert run_loadtest(args, out=out, err=err) == 0, err.getvalue()

    expected = Counter(expected_status(f"req-{i}") for i in range(NUM_PROMPTS))
    num_ok = expected.pop("OK")
    summary = json.loads((tmp_path / "r.json").read_text())
    assert (summary["completed"], summary["failed"]) == (num_ok, NUM_PROMPTS - num_ok)
    assert summary["failed_by_status"] == dict(expected)
    assert set(expected) == {"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED"}
    # Token totals match what the server sent and counted.
    assert summary["total_output_tokens"] == servicer.completion_tokens_sent == 8 * num_ok
    assert summary["total_input_tokens"] == servicer.prompt_tokens_ok == 16 * num_ok
    assert summary["num_server_usage_reports"] == num_ok
    assert summary["num_token_count_mismatches"] == 0
    assert summary["mean_tokens_per_chunk"] == pytest.approx(8 / 6)  # 1+2+1+2+1+1
    assert summary["num_good_requests"] == num_ok
    assert summary["mean_ttft_ms"] > 0 and summary["p99_itl_ms"] > 0
    # Server saw every request once, with the API key and in-vocabulary ids.
    assert servicer.num_requests == NUM_PROMPTS + 2
    assert servicer.authorization == {"Bearer secret-key": NUM_PROMPTS + 2}
    assert servicer.bad_token_ids == 0
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["status_code"] for r in rows] == [
        expected_status(f"req-{i}") for i in range(NUM_PROMPTS)
    ]
    ok_row = next(r for r in rows if r["status_code"] == "OK")
    assert ok_row["finish_reason"] == "length"
    assert ok_row["chunk_num_tokens"] == [1, 2, 1, 2, 1, 1]
    assert ok_row["server_usage"]["completion_tokens"] == 8
    assert "admission queue full" in next(
        r["error"] for r in rows if r["status_code"] == "RESOURCE_EXHAUSTED"
    )
    assert "RESOURCE_EXHAUSTED:" in out.getvalue()


def test_unreachable_server_fails_before_sending(tmp_path):
    args = _args(
            "--target", "127.0.0.1:1", "--num-prompts", "3", "--vocab-size", "100",
            "--no-progress", "--result-json", str(tmp_path / "r.json"),
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert run_loadtest(args, out=out, err=err) == 2
    assert out.getvalue() == "" and not (tmp_path / "r.json").exists()  # no table of n/a
    assert err.getvalue() == (
        "loadtest: cannot reach 127.0.0.1:1 (Connection refused): is the server up? "
        "(check --target / --base-url)\n"
    )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_with_ca_file(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    with serve_fake_router(creds) as (servicer, port):
        args = _args(
            "--target", f"localhost:{port}", "--tls-ca", str(cert), "--num-prompts", "3",
            "--random-input-len", "4", "--random-output-len", "3", "--no-progress",
            "--result-json", str(tmp_path / "r.json"),
        )  # fmt: skip
        assert run_loadtest(args, out=io.StringIO(), err=io.StringIO()) == 0
    summary = json.loads((tmp_path / "r.json").read_text())
    assert (summary["completed"], summary["failed"]) == (3, 0)
    assert summary["total_output_tokens"] == servicer.completion_tokens_sent == 9
    assert servicer.authorization == {"": 3}  # no --api-key: no authorization metadata
