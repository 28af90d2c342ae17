"""dsv4.serving.metrics, dsv4.serving.logs and dsv4.serving.rpc_guard without processes: the exporter serves and stops,
log lines carry the request and worker ids (JSON and text), hostile ids cannot forge lines, and
bytes that are not a message get INVALID_ARGUMENT from a router in front of scripted workers."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import urllib.request

import grpc
import pytest

from dsv4.commands.cluster import free_port
from dsv4.serving.logs import (
    ContextFilter,
    JsonFormatter,
    bind_request_id,
    request_id_var,
    set_worker_id,
)
from dsv4.serving.metrics import MetricsExporter, RouterMetrics, new_registry
from tests.router_fakes.harness import generate_request, scripted_cluster
from tests.router_fakes.scripted_workers import ScriptedDecodeWorker, ScriptedPrefillWorker


def test_exporter_serves_the_registry_and_stops() -> None:
    registry = new_registry()
    RouterMetrics.create(registry).prefill_retries.inc(3)
    exporter = MetricsExporter(registry, "127.0.0.1", free_port())
    exporter.start()
    try:
        url = f"http://127.0.0.1:{exporter.port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        exporter.stop()
    assert "dsv4_router_prefill_retries_total 3.0" in text
    assert "process_resident_memory_bytes" in text and "_created" not in text
    assert not exporter.is_running
    exporter.stop()  # idempotent
    MetricsExporter(registry, "127.0.0.1", 0).start()  # port 0: off, nothing bound


def _logged(formatter: logging.Formatter, request_id: str) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(formatter)
    logger = logging.getLogger("dsv4.test_logs")
    logger.addHandler(handler)
    logger.propagate = False
    token = request_id_var.set("")
    try:
        set_worker_id("decode-7")
        bind_request_id(request_id)
        logger.warning("hello %s", "world")
    finally:
        request_id_var.reset(token)
        set_worker_id("")
        logger.removeHandler(handler)
    return stream.getvalue()


def test_json_lines_carry_request_and_worker_ids() -> None:
    line = json.loads(_logged(JsonFormatter(), "req-1"))
    assert line["msg"] == "hello world" and line["level"] == "WARNING"
    assert line["request_id"] == "req-1" and line["worker_id"] == "decode-7"
    assert line["logger"] == "dsv4.test_logs" and line["ts"].endswith("+00:00")


def test_hostile_request_ids_cannot_forge_text_lines() -> None:
    text = _logged(logging.Formatter("%(request_id)s|%(message)s"), "a\nFORGED " + "b" * 500)
    assert text.count("\n") == 1 and len(text.split("|")[0]) == 128


@pytest.mark.parametrize("method", ["Generate", "Abort", "GetModelInfo"])
def test_bytes_that_are_not_a_message_are_invalid_argument(method: str) -> None:
    async def body() -> None:
        async with scripted_cluster(
            [ScriptedPrefillWorker("p0")], [ScriptedDecodeWorker("d0")]
        ) as c:
            make = c.channel.unary_stream if method == "Generate" else c.channel.unary_unary
            call = make(f"/dsv4.v1.Router/{method}", request_serializer=bytes)
            payloads = [b"\xff\xff", b"\x0a"]  # not protobuf; truncated
            if method != "GetModelInfo":  # field 1 (request_id) holding invalid UTF-8
                payloads += [b"\x0a\x01\xff", b"\x0a\x02\xc3\x28"]
            for payload in payloads:
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    response = call(payload, timeout=5)
                    if method == "Generate":
                        [m async for m in response]
                    else:
                        await response
                assert failure.value.code() is grpc.StatusCode.INVALID_ARGUMENT, payload
                assert "not a valid protobuf message" in failure.value.details()
            ok = [m async for m in c.stub.Generate(generate_request(2, [5, 6, 7]))]
            assert sum(len(m.token_ids) for m in ok) == 2

    asyncio.run(asyncio.wait_for(body(), 20))


def test_default_metrics_port_falls_back_to_a_free_one_and_vllm_names_carry_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    from prometheus_client import generate_latest

    from dsv4.engine.core import EngineLoad
    from dsv4.errors import PortInUse
    from dsv4.serving.metrics import DEFAULT_PORT, DEFAULT_PORTS, EngineGauges

    router = new_registry()
    RouterMetrics.create(router, model_name="m").prompt_tokens.inc(7)
    assert 'vllm:prompt_tokens_total{model_name="m"} 7.0' in generate_latest(router).decode()
    registry = new_registry()  # a worker's
    load = EngineLoad(num_free_blocks=6, num_total_blocks=8, num_running=2, num_waiting=3,
                      num_queued_prefill_tokens=0, num_held=0)  # fmt: skip
    registry.register(EngineGauges("m", lambda: load))
    with socket.socket() as taken:  # another process holds the role's default port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setitem(DEFAULT_PORTS, "prefill", taken.getsockname()[1])
        exporter = MetricsExporter(registry, "127.0.0.1", DEFAULT_PORT, role="prefill")
        exporter.start()
        try:
            assert exporter.port not in (0, taken.getsockname()[1])
            text = urllib.request.urlopen(exporter.url, timeout=5).read().decode()
        finally:
            exporter.stop()
        with pytest.raises(PortInUse, match=r"pick a free metrics\.prometheus_port"):
            MetricsExporter(registry, "127.0.0.1", taken.getsockname()[1]).start()  # user's: no
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'vllm:num_requests_waiting{model_name="m"} 3.0' in text
    assert 'vllm:num_requests_running{model_name="m"} 2.0' in text
