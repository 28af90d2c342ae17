"""D's client of prefill workers: Release a lease after a pull (one channel per P address).

Used by the decode servicer's owned cleanup tasks, on the event loop. Release is best effort:
with NIXL, P has usually ended the lease already on the pull notice (`was_found` False then),
and a P that is gone has nothing left to free; failures are logged at debug level.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from dsv4 import wire
from dsv4.config import ServeConfig
from dsv4.rpc.v1 import worker_pb2_grpc
from dsv4.serving.logs import request_metadata
from dsv4.types import ReleaseRequest
from dsv4.worker.server import TOKEN_METADATA_KEY

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0


class PrefillClients:
    def __init__(self, config: ServeConfig) -> None:
        s = config.security
        self._metadata = ((TOKEN_METADATA_KEY, s.shared_secret),) if s.shared_secret else ()
        self._credentials = None
        if s.tls_ca_path or s.require_client_cert:
            root = Path(s.tls_ca_path).read_bytes() if s.tls_ca_path else None
            if s.require_client_cert:
                key, cert = Path(s.tls_key_path).read_bytes(), Path(s.tls_cert_path).read_bytes()
                self._credentials = grpc.ssl_channel_credentials(root, key, cert)
            else:
                self._credentials = grpc.ssl_channel_credentials(root)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            if self._credentials is not None:
                channel = grpc.aio.secure_channel(address, self._credentials)
            else:
                channel = grpc.aio.insecure_channel(address)
            self._channels[address] = channel
        return worker_pb2_grpc.PrefillWorkerStub(channel)

    async def release(self, address: str, lease_id: str, request_id: str) -> bool:
        """Release a lease on P; False when unknown there or P is unreachable."""
        request = wire.release_request_to_proto(ReleaseRequest(lease_id, request_id))
        try:
            msg = await self._stub(address).Release(
                request,
                timeout=RELEASE_TIMEOUT_S,
                metadata=self._metadata + request_metadata(request_id),
            )
        except grpc.aio.AioRpcError as exc:
            logger.debug("Release %s on %s failed: %s", lease_id, address, exc.code().name)
            return False
        return wire.release_result_from_proto(msg).was_found

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()
