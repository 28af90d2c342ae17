"""NIXL per-lease grants, with P in a spawned child process and real UCX (CPU): a reader
addresses only the blocks of a lease it was handed, nothing from P's public endpoint alone,
and a released lease's blocks are deregistered and fail the pull. Also pinned: what UCX on CPU
cannot revoke (a stale grant still reads the addresses), as docs/operations.md says."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from kv_producer import ChildProducer, Geometry, make_pattern

from dsv4.errors import TransferError
from dsv4.transfer import ExportedBlocks, PullStatus, make_transport, wait_pull

GEOMETRY = Geometry(num_blocks=16, block_stride_bytes=64 * 1024, seed=77)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def producer():
    producer = ChildProducer("nixl", GEOMETRY)
    yield producer
    producer.close()


@pytest.fixture
def reader():
    """A NIXL agent of its own, as any other process holding P's endpoint would have."""
    transport = make_transport("nixl", pull_timeout_s=3.0)
    backing = torch.zeros(GEOMETRY.num_blocks, GEOMETRY.block_stride_bytes, dtype=torch.uint8)
    transport.register(backing)
    yield transport, backing
    transport.close()
    assert transport.usage().num_pending_pulls == 0


def pull(transport, producer, exported: ExportedBlocks, dst_ids: list[int]):
    return wait_pull(transport, transport.start_pull(producer.endpoint(), exported, dst_ids))


def test_a_reader_addresses_only_the_blocks_its_lease_grants(producer, reader) -> None:
    transport, backing = reader
    pattern = make_pattern(GEOMETRY)
    lease_a = producer.export("lease-a", [1, 2, 3])
    lease_b = producer.export("lease-b", [9, 12])
    assert producer.usage().num_grants == 2
    assert pull(transport, producer, lease_a, [0, 1, 2]).status is PullStatus.DONE
    assert torch.equal(backing[[0, 1, 2]], pattern[[1, 2, 3]])
    with pytest.raises(TransferError, match="not granted"):  # lease A's grant, B's blocks
        transport.start_pull(
            producer.endpoint(), dataclasses.replace(lease_b, grant=lease_a.grant), [5, 6]
        )
    with pytest.raises(TransferError, match="carries no grant"):  # P's public endpoint only
        transport.start_pull(producer.endpoint(), dataclasses.replace(lease_b, grant=b""), [5, 6])
    assert not backing[[5, 6]].any()
    assert pull(transport, producer, lease_b, [5, 6]).status is PullStatus.DONE
    assert torch.equal(backing[[5, 6]], pattern[[9, 12]])
    for request_id in ("lease-a", "lease-b"):
        producer.release(request_id)
    assert (producer.usage().num_exports, producer.usage().num_grants) == (0, 0)


def test_release_deregisters_the_blocks_and_fails_the_pull(producer, reader) -> None:
    transport, _ = reader
    lease = producer.export("lease-released", [4, 5])
    assert producer.release("lease-released")
    assert producer.usage().num_grants == 0
    state = pull(transport, producer, lease, [0, 1])
    assert state.status is PullStatus.FAILED and "released or is unknown" in state.message


def test_cpu_ucx_does_not_revoke_a_stale_grant(producer, reader) -> None:
    """What NIXL cannot restrict, pinned: UCX over TCP / shared memory does not check memory
    keys, so raw READs with a grant taken before `release` still read the addresses. Only
    the lease check (a honest D) and RDMA hardware (where deregistration revokes keys) stop it."""
    transport, backing = reader
    pattern = make_pattern(GEOMETRY)
    lease = producer.export("lease-stale", [7])
    producer.release("lease-stale")
    box = transport._box  # the raw agent: what a process bypassing the lease check can do
    peer = transport._connect(producer.endpoint())
    box.load_metadata(lease.grant, peer.name)
    xfer, dlist = box.make_data_read(peer, lease.bytes_per_block, (3,), lease.block_ids)
    status = box.post(xfer)
    give_up_s = time.monotonic() + 10
    while status == "PROC" and time.monotonic() < give_up_s:
        status = box.state(xfer)
    box.release_xfer(xfer)
    box.release_dlist(dlist)
    assert status == "DONE" and torch.equal(backing[3], pattern[7])
