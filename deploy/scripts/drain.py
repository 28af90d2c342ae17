"""Drain one dsv4 worker before it stops: the Kubernetes preStop hook of prefill and decode pods.

    python /opt/dsv4/drain.py --address 127.0.0.1:50061 --timeout-s 45
    python /opt/dsv4/drain.py --address 127.0.0.1:50061 --undrain   # take requests again

Calls the worker's Drain RPC (dsv4.v1.PrefillWorker or DecodeWorker, found through gRPC health)
once, so it takes no new requests and reports itself draining to the router; then polls Drain
until nothing is running and no KV lease is held, or until --timeout-s. The kubelet sends SIGTERM
after this returns, and the worker's own shutdown (worker.drain_timeout_s) finds it idle.
`--undrain` calls Undrain instead: the worker takes new requests again (refused once it is
shutting down).

Reads the pod's ServeConfig (DSV4_CONFIG + DSV4_* env, as the worker does) for the shared secret
(always required by workers; `dsv4 up` prints the file holding its generated one) and TLS files.
Exit status: 0 drained (or undrained), 1 timed out, refused or the worker could not be reached
(preStop failures are only logged by the kubelet; the pod is stopped either way), 2 bad config.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsv4.config import ServeConfig, load_config
from dsv4.errors import ConfigError
from dsv4.rpc.v1 import worker_pb2, worker_pb2_grpc

TOKEN_METADATA_KEY = "x-dsv4-token"  # dsv4.worker.server.TOKEN_METADATA_KEY (no torch import)
STUBS = {
    "dsv4.v1.PrefillWorker": worker_pb2_grpc.PrefillWorkerStub,
    "dsv4.v1.DecodeWorker": worker_pb2_grpc.DecodeWorkerStub,
}


def open_channel(address: str, config: ServeConfig, server_name: str) -> grpc.Channel:
    s = config.security
    if not s.tls_cert_path:
        return grpc.insecure_channel(address)
    root = Path(s.tls_ca_path).read_bytes() if s.tls_ca_path else None
    pair = (Path(s.tls_key_path).read_bytes(), Path(s.tls_cert_path).read_bytes())
    client_pair = pair if s.require_client_cert else (None, None)  # mTLS: the pod's own cert
    credentials = grpc.ssl_channel_credentials(root, *client_pair)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def find_service(channel: grpc.Channel, timeout_s: float) -> str:
    """The worker service this port serves (health knows it even while draining)."""
    health = health_pb2_grpc.HealthStub(channel)
    for name in STUBS:
        try:
            health.Check(health_pb2.HealthCheckRequest(service=name), timeout=timeout_s)
            return name
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
    raise LookupError("no dsv4 worker service is registered on this port")


def token_metadata(config: ServeConfig) -> tuple[tuple[str, str], ...]:
    secret = config.security.shared_secret
    return ((TOKEN_METADATA_KEY, secret),) if secret else ()


def undrain(address: str, config: ServeConfig, timeout_s: float, server_name: str):
    """Undrain once; returns the DrainResponse (raises grpc.RpcError when refused)."""
    with open_channel(address, config, server_name) as channel:
        stub = STUBS[find_service(channel, timeout_s=min(5.0, timeout_s))](channel)
        status = stub.Undrain(
            worker_pb2.UndrainRequest(), metadata=token_metadata(config), timeout=timeout_s
        )
    print(f"undrain {address}: taking requests ({status.num_running_requests} running)",
          file=sys.stderr)  # fmt: skip
    return status


def drain(address: str, config: ServeConfig, timeout_s: float, poll_s: float, server_name: str):
    """Drain and wait; returns the last DrainResponse, or None when the deadline passed first."""
    metadata = token_metadata(config)
    deadline_s = time.monotonic() + timeout_s
    with open_channel(address, config, server_name) as channel:
        stub = STUBS[find_service(channel, timeout_s=min(5.0, timeout_s))](channel)
        while True:
            left_s = deadline_s - time.monotonic()
            status = stub.Drain(
                worker_pb2.DrainRequest(), metadata=metadata, timeout=max(0.1, min(5.0, left_s))
            )
            print(
                f"drain {address}: {status.num_running_requests} running, "
                f"{status.num_leases} leases",
                file=sys.stderr,
            )
            if status.num_running_requests == 0 and status.num_leases == 0:
                return status
            if time.monotonic() + poll_s >= deadline_s:
                return None
            time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="drain.py", description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50061", help="worker HOST:PORT")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="give up after this")
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--tls-server-name", default="", help="name the worker's cert carries")
    parser.add_argument("--undrain", action="store_true", help="take new requests again")
    args = parser.parse_args(argv)
    try:
        config = load_config(None, os.environ.get("DSV4_CONFIG") or None, os.environ)
    except ConfigError as exc:
        print(f"drain: {exc}", file=sys.stderr)
        return 2
    verb = "undrain" if args.undrain else "drain"
    try:
        if args.undrain:
            undrain(args.address, config, args.timeout_s, args.tls_server_name)
            return 0
        done = drain(args.address, config, args.timeout_s, args.poll_s, args.tls_server_name)
    except grpc.RpcError as exc:
        code, details = exc.code().name, exc.details()  # type: ignore[attr-defined]
        print(f"{verb} {args.address}: refused: {code}: {details}", file=sys.stderr)
        return 1
    except (LookupError, OSError) as exc:
        print(f"{verb} {args.address}: cannot {verb}: {exc}", file=sys.stderr)
        return 1
    if done is None:
        print(f"drain {args.address}: still busy after {args.timeout_s:g} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
