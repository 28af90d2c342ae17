"""The wire contract: generated code is fresh, protos follow the house rules, stubs work."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from dsv4 import wire
from dsv4.rpc.v1 import common_pb2, kv_pb2, router_pb2, router_pb2_grpc, worker_pb2
from dsv4.types import FinishReason, RequestLimits, StreamChunk, Usage

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "dsv4" / "rpc" / "v1"
PROTO_DIR = REPO / "protos" / "dsv4" / "v1"
MODULES = (common_pb2, kv_pb2, router_pb2, worker_pb2)
# Lines that only record the generator's version; a newer grpcio-tools changes nothing else.
_VERSION_LINE = re.compile(r"Protobuf Python Version|GRPC_GENERATED_VERSION =|^\s+\d+,\s*$")


def _normalised(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not _VERSION_LINE.search(line)]


def test_committed_code_matches_protos(tmp_path: Path) -> None:
    """Regenerate in a subprocess (grpc_tools must not share a process with nixl) and diff."""
    out = tmp_path / "v1"
    subprocess.run(
        [sys.executable, str(REPO / "protos" / "gen.py"), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    fresh = {p.name for p in out.glob("*.py*")}
    committed = {p.name for p in GENERATED.glob("*.py*")}
    assert fresh == committed, "run `make protos` (python protos/gen.py) and commit the result"
    stale = [n for n in sorted(fresh) if _normalised(out / n) != _normalised(GENERATED / n)]
    assert not stale, f"stale generated code {stale}: run `make protos` and commit the result"


def test_generated_modules_import_under_dsv4_rpc() -> None:
    for module in MODULES:
        assert module.__name__.startswith("dsv4.rpc.v1.")
        assert module.DESCRIPTOR.package == "dsv4.v1"
    assert router_pb2.GenerateRequest.__module__ == "dsv4.rpc.v1.router_pb2"


def test_enums_start_with_unspecified_and_carry_their_prefix() -> None:
    for module in MODULES:
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
            assert enum.values[0].number == 0
            assert enum.values[0].name == prefix + "UNSPECIFIED"
            assert all(v.name.startswith(prefix) for v in enum.values), enum.name


_DECLARATION = re.compile(
    r"^\s*(message|enum|service|rpc|oneof|optional|repeated|string|bytes|bool|int32|int64|"
    r"uint32|uint64|double|float|[A-Z]\w*\s+\w+\s*=|[A-Z][A-Z0-9_]+\s*=)"
)


@pytest.mark.parametrize("proto", sorted(PROTO_DIR.glob("*.proto")), ids=lambda p: p.name)
def test_every_declaration_has_a_doc_comment(proto: Path) -> None:
    lines = proto.read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        documented = lines[i - 1].strip().startswith("//")
        is_unspecified = re.match(r"\s*\w+_UNSPECIFIED = 0;", line)
        if _DECLARATION.match(line) and not documented and not is_unspecified:
            missing.append(f"{proto.name}:{i + 1}: {line.strip()}")
    assert not missing, "add a // comment above:\n" + "\n".join(missing)
    assert "package dsv4.v1;" in lines


def test_services_have_the_agreed_shape() -> None:
    services = {
        **router_pb2.DESCRIPTOR.services_by_name,
        **worker_pb2.DESCRIPTOR.services_by_name,
    }
    shape = {
        name: {m.name: m.server_streaming for m in svc.methods} for name, svc in services.items()
    }
    assert shape == {
        "Router": {"Generate": True, "Abort": False, "GetModelInfo": False},
        "PrefillWorker": {
            "Prefill": False,
            "Release": False,
            "Info": False,
            "Drain": False,
            "Undrain": False,
        },
        "DecodeWorker": {
            "Decode": True,
            "Abort": False,
            "Info": False,
            "Drain": False,
            "Undrain": False,
        },
    }


class _EchoRouter(router_pb2_grpc.RouterServicer):
    """Converts at the boundary exactly as a real servicer must."""

    async def Generate(self, request, context):
        limits = RequestLimits(vocab_size=100, max_model_len=64)
        req = wire.generate_request_from_proto(request, limits)
        for token in req.prompt_token_ids:
            yield wire.generate_response_to_proto(StreamChunk(token_ids=(token,), text=str(token)))
        usage = Usage(prompt_tokens=req.num_prompt_tokens, completion_tokens=3)
        last = StreamChunk(finish_reason=FinishReason.LENGTH, usage=usage)
        yield wire.generate_response_to_proto(last)


async def _roundtrip() -> list[StreamChunk]:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(_EchoRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            call = stub.Generate(wire.generate_request_to_proto([5, 6, 7], request_id="r1"))
            return [wire.generate_response_from_proto(msg) async for msg in call]
    finally:
        await server.stop(None)


def test_stubs_stream_over_a_real_channel() -> None:
    chunks = asyncio.run(_roundtrip())
    assert [c.token_ids for c in chunks] == [(5,), (6,), (7,), ()]
    assert chunks[-1].is_last and chunks[-1].usage == Usage(prompt_tokens=3, completion_tokens=3)
