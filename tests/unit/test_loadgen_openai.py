"""`dsv4 loadtest --backend openai|openai-chat` against a real OpenAI-compatible HTTP server: a
small aiohttp app on a loopback port, in its own thread and event loop, that streams
deterministic tokens as server-sent events per the OpenAI spec (`data: {chunk}` ... usage
chunk ... `data: [DONE]`), answers every fifth request with a 429 OpenAI error object, and
tallies what it sent, so the client's counts and token totals can be checked against the
server's own. Also: vLLM's flag spellings, the result file, and fail-fast on a closed port."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web

from dsv4.commands.cluster import free_port
from loadgen.cli import add_loadtest_args, run_loadtest

MODEL = "fake/tiny-model"
NUM_PROMPTS = 10
REJECT_EVERY = 5  # the 5th, 10th, ... request the server sees gets a 429


class FakeOpenAIServer:
    """Completions stream one token per event; chat streams two per event (a server that
    batches tokens, like MTP), so the client must take the count from `usage`."""

    def __init__(self) -> None:
        self.num_requests = 0
        self.num_rejected = 0
        self.completion_tokens_sent = 0
        self.prompt_tokens_ok = 0
        self.bodies: list[dict] = []
        self.authorization: Counter[str] = Counter()

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": MODEL, "object": "model", "owned_by": "test", "max_model_len": 4096}]
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, is_chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, is_chat=True)

    async def _stream(self, request: web.Request, is_chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.num_requests += 1
        self.authorization[request.headers.get("Authorization", "")] += 1
        if self.num_requests % REJECT_EVERY == 0:
            self.num_rejected += 1
            error = {"message": "too many requests", "type": "rate_limit_error", "code": 429}
            return web.json_response({"error": error}, status=429)
        if body.get("model") != MODEL or body.get("stream") is not True:
            error = {"message": "unknown model or not streamed", "code": 400}
            return web.json_response({"error": error}, status=400)
        if is_chat:
            prompt_tokens = len(body["messages"][0]["content"].split())
            n_out, per_event = body["max_completion_tokens"], 2
        else:
            prompt_tokens = len(body["prompt"])  # token ids
            n_out, per_event = body["max_tokens"], 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if is_chat else "text_completion"

        async def send(choices: list, usage: dict | None = None) -> None:
            chunk = {"id": "cmpl-1", "object": kind, "created": 0, "model": MODEL}
            chunk |= {"choices": choices, **({"usage": usage} if usage else {})}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        if is_chat:
            await send([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
        sent = 0
        while sent < n_out:
            await asyncio.sleep(0.001)
            k = min(per_event, n_out - sent)
            text = "".join(f" t{sent + j}" for j in range(k))
            sent += k
            finish = "length" if sent == n_out else None
            if is_chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            await send([choice])
        # tallied before the last events: a client may finish its whole run on [DONE] before
        # this coroutine resumes after writing it (seen once on a loaded machine)
        self.completion_tokens_sent += sent
        self.prompt_tokens_ok += prompt_tokens
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sent}
        await send([], usage | {"total_tokens": prompt_tokens + sent})
        await response.write(b"data: [DONE]\n\n")
        return response


@contextlib.contextmanager
def serve_fake_openai():
    """Yield (server, port) of the aiohttp app running in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = FakeOpenAIServer()
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat)
    runner = web.AppRunner(app)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield server, port
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture
def fake_openai():
    with serve_fake_openai() as served:
        yield served


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_loadtest_args(parser)
    return parser.parse_args(list(argv))


def _check_totals(summary: dict, server: FakeOpenAIServer, output_len: int) -> None:
    num_ok = NUM_PROMPTS - server.num_rejected
    assert server.num_requests == NUM_PROMPTS and server.num_rejected == NUM_PROMPTS // 5
    assert (summary["completed"], summary["failed"]) == (num_ok, server.num_rejected)
    assert summary["failed_by_status"] == {"HTTP_429": server.num_rejected}
    assert summary["total_output_tokens"] == server.completion_tokens_sent == output_len * num_ok
    assert summary["total_input_tokens"] == server.prompt_tokens_ok
    assert summary["num_server_usage_reports"] == num_ok
    assert summary["num_token_count_mismatches"] == 0
    assert summary["mean_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0


def test_openai_completions_backend_streams_and_counts(fake_openai, tmp_path):
    server, port = fake_openai
    args = _args(
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "12",
        "--random-output-len", "6", "--max-concurrency", "4", "--api-key", "sk-test",
        "--vocab-size", "500", "--result-json", str(tmp_path / "r.json"),
        "--per-request-jsonl", str(tmp_path / "r.jsonl"),
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert run_loadtest(args, out=out, err=err) == 0, err.getvalue()
    summary = json.loads((tmp_path / "r.json").read_text())
    _check_totals(summary, server, output_len=6)
    assert server.prompt_tokens_ok == 12 * (NUM_PROMPTS - server.num_rejected)  # ids: exact
    assert summary["mean_tokens_per_chunk"] == 1.0
    assert (summary["backend"], summary["model_id"]) == ("openai", MODEL)  # from /v1/models
    assert summary["tokenizer_id"] == MODEL
    assert summary["target"] == f"http://127.0.0.1:{port}/v1/completions"
    assert server.authorization == {"Bearer sk-test": NUM_PROMPTS}
    body = server.bodies[0]
    assert body["max_tokens"] == 6 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert all(2 <= t < 500 for t in body["prompt"])  # token ids in the vocabulary
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    ok = next(r for r in rows if r["status_code"] == "OK")
    assert ok["finish_reason"] == "length" and ok["chunk_num_tokens"] == [1] * 6
    assert "too many requests" in next(r["error"] for r in rows if r["status_code"] != "OK")


def test_openai_chat_backend_with_vllm_spellings_saves_result(fake_openai, tmp_path):
    server, port = fake_openai
    args = _args(
        "--backend", "openai-chat", "--host", "127.0.0.1", "--port", str(port),
        "--model", MODEL, "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "9",
        "--random-output-len", "5", "--request-rate", "500", "--disable-tqdm",
        "--save-result", "--result-dir", str(tmp_path / "results"),
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert run_loadtest(args, out=out, err=err) == 0, err.getvalue()
    (saved,) = (tmp_path / "results").iterdir()
    assert saved.name.startswith("openai-chat-500qps-tiny-model-") and saved.suffix == ".json"
    summary = json.loads(saved.read_text())
    _check_totals(summary, server, output_len=5)
    # two tokens per event: 3 events for 5 tokens; the last takes the count `usage` gives
    assert summary["mean_tokens_per_chunk"] == pytest.approx(5 / 3)
    # no tokenizer: one synthetic word per prompt token, so the server counts 9
    assert server.prompt_tokens_ok == 9 * (NUM_PROMPTS - server.num_rejected)
    body = server.bodies[0]
    assert body["max_completion_tokens"] == 5 and body["messages"][0]["role"] == "user"
    assert server.authorization == {"": NUM_PROMPTS}
    assert "ok=" not in err.getvalue()  # --disable-tqdm: no progress bar


def _loadtest_cli(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "dsv4.commands.cli", "loadtest", *argv],
        capture_output=True, text=True, timeout=30, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    return done, time.monotonic() - started


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_closed_port_fails_fast_with_one_line(backend):
    done, seconds = _loadtest_cli("--backend", backend, "--target", f"127.0.0.1:{free_port()}")
    assert done.returncode != 0 and seconds < 5.0
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("loadtest: cannot reach 127.0.0.1:") and "Connection refused" in line


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--target", "localhost"), "expected HOST:PORT"),
        (("--target", "localhost:99999"), "1..65535"),
        (("--base-url", "localhost:8000", "--backend", "openai"), "http(s)://HOST"),
        (("--target", "a:1", "--port", "2"), "give only one"),
        (("--base-url", "http://a:1"), "--backend openai"),
    ],
)
def test_bad_target_flags_are_one_line(flags, says):
    err = io.StringIO()
    assert run_loadtest(_args(*flags), client_factory=_never, err=err) == 2
    (line,) = err.getvalue().splitlines()
    assert line.startswith("loadtest: ") and says in line


@pytest.mark.parametrize("flag", ["--result-json", "--plot", "--per-request-jsonl"])
def test_an_unwritable_output_path_fails_before_the_run(flag, tmp_path):
    """A typo in an output path costs nothing: refused before any client is made."""
    err = io.StringIO()
    bad = str(tmp_path / "missing" / "out.file")
    assert run_loadtest(_args("--target", "a:1", flag, bad), client_factory=_never, err=err) == 2
    (line,) = err.getvalue().splitlines()
    assert line.startswith(f"loadtest: {flag} {bad}: folder ") and "does not exist" in line
    err = io.StringIO()
    assert run_loadtest(_args("--target", "a:1", flag, str(tmp_path)), client_factory=_never,
                        err=err) == 2  # fmt: skip
    assert "cannot write a file there" in err.getvalue()


def _never(options):
    raise AssertionError("no client may be made for bad flags")


def test_missing_matplotlib_fails_before_the_run(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec: not installed
    err = io.StringIO()
    args = _args("--plot", str(tmp_path / "p.png"))
    assert run_loadtest(args, client_factory=_never, err=err) == 2
    (line,) = err.getvalue().splitlines()
    assert "--plot needs matplotlib" in line and "[plot]" in line
