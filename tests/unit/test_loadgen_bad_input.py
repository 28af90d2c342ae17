"""Bad input to `dsv4 loadtest` ends in one line that says what to fix: every request refused
(the server's own message is shown), the wrong protocol on the target port, a --tls-ca file that
is not a PEM certificate. Servers run on loopback in a background thread."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import shutil
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator

import grpc
import pytest
from aiohttp import web

from loadgen.cli import add_loadtest_args, run_loadtest
from loadgen.client import RecordBuilder, RequestRecord, TokenListener
from loadgen.workloads import LoadRequest

LONG_MESSAGE = "prompt too long:\n" + "x" * 500


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_loadtest_args(parser)
    return parser.parse_args(list(argv))


def _run(*argv: str, client_factory=None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    kwargs = {} if client_factory is None else {"client_factory": client_factory}
    args = _args(*argv, "--num-prompts", "4", "--vocab-size", "50", "--no-progress")
    code = run_loadtest(args, out=out, err=err, **kwargs)
    return code, out.getvalue(), err.getvalue()


class RefusingClient:
    """Refuses every request as a server does a bad flag: odd ids one way, even another."""

    async def generate(
        self, request: LoadRequest, listener: TokenListener | None = None
    ) -> RequestRecord:
        builder = RecordBuilder(request, listener)
        if int(request.request_id.rpartition("-")[2]) % 2:
            return builder.build("INVALID_ARGUMENT", "temperature -1.0: must be >= 0")
        return builder.build("HTTP_400", LONG_MESSAGE)


def test_every_failed_request_shows_one_example_of_the_servers_message():
    # (a negative --temperature is refused before the run; this server refuses what it gets)
    code, out, _ = _run("--temperature", "3", client_factory=lambda o: RefusingClient())
    assert code == 1
    lines = out.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("  INVALID_ARGUMENT:")))
    assert lines[at + 1] == "    e.g. temperature -1.0: must be >= 0"
    at = lines.index(next(x for x in lines if x.startswith("  HTTP_400:")))
    example = lines[at + 1]
    assert example.startswith("    e.g. prompt too long: xxx") and example.endswith("...")
    assert len(example) < 140  # one line, cut short
    assert out.count("e.g.") == 2  # one example per status code, not one per request


@contextlib.contextmanager
def serve_in_thread(start: Callable[[], Awaitable[tuple[int, Callable]]]) -> Iterator[int]:
    """Yield the port of a server `start()` brings up on a background event loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port, stop = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


async def _start_http() -> tuple[int, Callable]:
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return site._server.sockets[0].getsockname()[1], runner.cleanup  # type: ignore[union-attr]


async def _start_grpc() -> tuple[int, Callable]:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return port, lambda: server.stop(0)


def test_grpc_backend_on_an_http_port_says_it_is_not_grpc():
    with serve_in_thread(_start_http) as port:
        code, out, err = _run("--target", f"127.0.0.1:{port}")
    assert (code, out) == (2, "")
    assert err == (
        f"loadtest: 127.0.0.1:{port} does not speak gRPC (is it the HTTP front? "
        "use --backend openai)\n"
    )


@pytest.mark.parametrize("model", [(), ("--model", "m")])
def test_openai_backend_on_a_grpc_port_says_it_is_grpc(model):
    with serve_in_thread(_start_grpc) as port:
        code, out, err = _run("--backend", "openai", "--target", f"127.0.0.1:{port}", *model)
    assert (code, out) == (2, "")
    assert err == (
        f"loadtest: 127.0.0.1:{port} speaks gRPC, not HTTP (is it the router's gRPC port? "
        "use --backend grpc)\n"
    )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_grpc_backend_with_tls_ca_on_a_plaintext_port_says_drop_it(tmp_path):
    cert = tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(tmp_path / "key.pem"), "-out", str(cert), "-days", "1",
         "-subj", "/CN=localhost"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    with serve_in_thread(_start_grpc) as port:
        code, out, err = _run("--target", f"127.0.0.1:{port}", "--tls-ca", str(cert))
    assert (code, out) == (2, "")
    assert err == (
        f"loadtest: 127.0.0.1:{port} speaks gRPC without TLS: drop --tls-ca "
        "(or give its TLS port)\n"
    )


@pytest.mark.parametrize("backend", ["grpc", "openai"])
@pytest.mark.parametrize(
    "content, says",
    [
        ("not a certificate\n", "not a PEM certificate"),
        (
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            "a PEM certificate that does not parse",
        ),
        (None, "cannot read it (No such file or directory)"),
    ],
)
def test_tls_ca_that_is_not_a_pem_certificate_is_one_line(backend, content, says, tmp_path):
    ca = tmp_path / "ca.pem"
    if content is not None:
        ca.write_text(content)
    # port 1: nothing listens; the file is checked before anything connects
    code, out, err = _run("--backend", backend, "--target", "127.0.0.1:1", "--tls-ca", str(ca))
    assert (code, out) == (2, "")
    assert err.startswith(f"loadtest: --tls-ca {ca}: {says}") and err.count("\n") == 1
    assert "give the PEM file of the CA" in err


def test_a_negative_seed_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        _args("--seed", "-1")
    assert exc.value.code == 2
    assert "argument --seed: -1 must be at least 0" in capsys.readouterr().err


@pytest.mark.parametrize(("rate", "says"), [("abc", "'abc' is not a number"),
                                            ("0", "request rate must be > 0 or inf")])  # fmt: skip
def test_a_bad_request_rate_says_what_to_give(rate, says, capsys):
    """A word used to read "invalid rate_from_text value: 'abc'", naming our function."""
    with pytest.raises(SystemExit) as exc:
        _args("--request-rate", rate)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --request-rate: {says}" in err and "rate_from_text" not in err, err


async def _start_silent() -> tuple[int, Callable]:
    """Accepts connections and never answers (a wedged server, a port forward to nothing)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)

    async def stop() -> None:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()

    return server.sockets[0].getsockname()[1], stop


def test_openai_backend_on_a_silent_server_says_it_did_not_answer():
    # it used to say the server "lists no model: pass --model", which it never said
    with serve_in_thread(_start_silent) as port:
        code, out, err = _run("--backend", "openai", "--target", f"127.0.0.1:{port}")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "lists no model" not in err
    assert "did not answer GET /v1/models" in err and f"127.0.0.1:{port}" in err
