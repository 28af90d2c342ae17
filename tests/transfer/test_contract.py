"""One contract suite for every `KVTransport`: local (one process), nixl (P in a spawned child
process, D here) and cuda_ipc (GPU only). Every test ends with `assert_no_leaks`."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass

import pytest
import torch
from kv_producer import ChildProducer, Geometry, InProcessProducer, make_pattern

from dsv4.errors import InvalidRequest, LayoutMismatch, NotFound, TransferError
from dsv4.transfer import (
    ExportedBlocks,
    KVTransport,
    PullStatus,
    TransportEndpoint,
    make_transport,
    wait_pull,
)

logger = logging.getLogger(__name__)

GEOMETRY = Geometry(num_blocks=128, block_stride_bytes=512 * 1024)  # P: 64 MiB
D_NUM_BLOCKS = 160
PULL_TIMEOUT_S = 3.0
KINDS = ["local", "nixl", pytest.param("cuda_ipc", marks=pytest.mark.gpu)]

pytestmark = pytest.mark.timeout(120)


@dataclass
class Consumer:
    transport: KVTransport
    backing: torch.Tensor  # [D_NUM_BLOCKS, block_stride_bytes] uint8


def _device(kind: str) -> str:
    return "cuda" if kind == "cuda_ipc" else "cpu"


def _make_producer(kind: str) -> InProcessProducer | ChildProducer:
    producer_class = InProcessProducer if kind == "local" else ChildProducer
    return producer_class(kind, GEOMETRY, _device(kind))


def _make_consumer(kind: str) -> Consumer:
    transport = make_transport(kind, pull_timeout_s=PULL_TIMEOUT_S)
    shape = (D_NUM_BLOCKS, GEOMETRY.block_stride_bytes)
    backing = torch.zeros(shape, dtype=torch.uint8, device=_device(kind))
    transport.register(backing)
    return Consumer(transport, backing)


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def pattern() -> torch.Tensor:
    return make_pattern(GEOMETRY)


@pytest.fixture(scope="module")
def producer(kind: str):
    producer = _make_producer(kind)
    yield producer
    producer.close()


@pytest.fixture(scope="module")
def consumer(kind: str):
    consumer = _make_consumer(kind)
    yield consumer
    consumer.transport.close()
    usage = consumer.transport.usage()
    assert (usage.num_exports, usage.num_pending_pulls, usage.num_peers) == (0, 0, 0)


def assert_no_leaks(consumer: Consumer, producer) -> None:
    d_usage = consumer.transport.usage()
    assert d_usage.num_pending_pulls == 0, d_usage
    assert d_usage.num_exports == 0, d_usage
    p_usage = producer.usage()
    assert (p_usage.num_exports, p_usage.num_grants) == (0, 0), p_usage


def _pull(consumer: Consumer, endpoint: TransportEndpoint, exported: ExportedBlocks, dst_ids):
    return wait_pull(consumer.transport, consumer.transport.start_pull(endpoint, exported, dst_ids))


def _assert_blocks_equal(consumer: Consumer, dst_ids, pattern: torch.Tensor, src_ids, nbytes=None):
    got = consumer.backing[list(dst_ids)].cpu()
    want = pattern[list(src_ids)]
    if nbytes is not None:
        got, want = got[:, :nbytes], want[:, :nbytes]
    assert torch.equal(got, want)


def _wait_pulled_notice(producer, request_id: str, kind: str) -> None:
    if kind == "cuda_ipc":
        return  # no notification channel: P learns of pulls through the service's Release
    deadline = time.monotonic() + 5.0
    seen: list[str] = []
    while request_id not in seen and time.monotonic() < deadline:
        seen += producer.pulled()
        time.sleep(0.002)
    assert request_id in seen, f"P never heard that {request_id} was pulled"


def test_random_blocks_arrive_exactly(kind, producer, consumer, pattern) -> None:
    rng = random.Random(7)
    src_ids = rng.sample(range(GEOMETRY.num_blocks), 16)
    dst_ids = rng.sample(range(D_NUM_BLOCKS), 16)
    exported = producer.export("req-random", src_ids)
    assert ExportedBlocks.from_bytes(exported.to_bytes()) == exported
    state = _pull(consumer, producer.endpoint(), exported, dst_ids)
    assert state.status is PullStatus.DONE, state.message
    assert state.stats is not None and state.stats.num_bytes == 16 * GEOMETRY.block_stride_bytes
    _assert_blocks_equal(consumer, dst_ids, pattern, src_ids)
    _wait_pulled_notice(producer, "req-random", kind)
    assert producer.release("req-random")
    assert_no_leaks(consumer, producer)


def test_prefix_of_each_block_only(kind, producer, consumer, pattern) -> None:
    src_ids, dst_ids, nbytes = [5, 9, 100], [150, 3, 77], 1000
    consumer.backing[dst_ids] = 0xAB
    exported = producer.export("req-prefix", src_ids, nbytes)
    state = _pull(consumer, producer.endpoint(), exported, dst_ids)
    assert state.status is PullStatus.DONE, state.message
    _assert_blocks_equal(consumer, dst_ids, pattern, src_ids, nbytes)
    assert bool((consumer.backing[dst_ids, nbytes:] == 0xAB).all())
    producer.release("req-prefix")
    assert_no_leaks(consumer, producer)


def test_many_concurrent_pulls(kind, producer, consumer, pattern) -> None:
    rng = random.Random(11)
    endpoint = producer.endpoint()
    dst_pool = rng.sample(range(D_NUM_BLOCKS), D_NUM_BLOCKS)
    pulls = []
    for i in range(32):
        src_ids = rng.sample(range(GEOMETRY.num_blocks), 4)
        dst_ids = dst_pool[4 * i : 4 * i + 4]
        exported = producer.export(f"req-many-{i}", src_ids)
        pulls.append((consumer.transport.start_pull(endpoint, exported, dst_ids), src_ids, dst_ids))
    assert consumer.transport.usage().num_pending_pulls <= 32
    for handle, src_ids, dst_ids in pulls:
        state = wait_pull(consumer.transport, handle)
        assert state.status is PullStatus.DONE, state.message
        _assert_blocks_equal(consumer, dst_ids, pattern, src_ids)
    for i in range(32):
        assert producer.release(f"req-many-{i}")
    assert_no_leaks(consumer, producer)


def test_release_frees_the_export(kind, producer, consumer) -> None:
    producer.export("req-release", [1, 2])
    assert producer.usage().num_exports == 1
    with pytest.raises(InvalidRequest, match="already exported"):
        producer.export("req-release", [3])
    assert producer.release("req-release") is True
    assert producer.release("req-release") is False
    assert_no_leaks(consumer, producer)


def test_pull_after_release_fails_cleanly(kind, producer, consumer) -> None:
    exported = producer.export("req-released", [4, 6])
    producer.release("req-released")
    state = _pull(consumer, producer.endpoint(), exported, [0, 1])
    assert state.status is PullStatus.FAILED
    assert "released or is unknown" in state.message
    assert_no_leaks(consumer, producer)


def test_pull_of_unknown_request_fails_cleanly(kind, producer, consumer) -> None:
    endpoint = producer.endpoint()
    made_up = ExportedBlocks("req-unknown", endpoint.peer_id, (1, 2), 4096, 7, 12345)
    if kind == "nixl":  # no grant names these blocks: refused before any READ
        with pytest.raises(TransferError, match="carries no grant"):
            consumer.transport.start_pull(endpoint, made_up, [0, 1])
    else:
        state = _pull(consumer, endpoint, made_up, [0, 1])
        assert state.status is PullStatus.FAILED
        assert "released or is unknown" in state.message
    assert_no_leaks(consumer, producer)


def test_finished_pull_is_reported_once(kind, producer, consumer) -> None:
    exported = producer.export("req-once", [2])
    handle = consumer.transport.start_pull(producer.endpoint(), exported, [5])
    assert wait_pull(consumer.transport, handle).status is PullStatus.DONE
    with pytest.raises(NotFound):
        consumer.transport.poll(handle)
    producer.release("req-once")
    assert_no_leaks(consumer, producer)


def test_bad_arguments_are_refused(kind, producer, consumer) -> None:
    endpoint = producer.endpoint()
    with pytest.raises(InvalidRequest):
        producer.export("req-bad", [GEOMETRY.num_blocks])
    with pytest.raises(InvalidRequest):
        producer.export("req-bad", [])
    exported = producer.export("req-bad", [1, 2])
    with pytest.raises(InvalidRequest, match="destination"):
        consumer.transport.start_pull(endpoint, exported, [0])
    with pytest.raises(InvalidRequest):
        consumer.transport.start_pull(endpoint, exported, [0, D_NUM_BLOCKS])
    wrong_stride = dataclasses.replace(endpoint, block_stride_bytes=4096)
    with pytest.raises(LayoutMismatch):
        consumer.transport.start_pull(wrong_stride, exported, [0, 1])
    with pytest.raises(TransferError, match="exported by"):
        consumer.transport.start_pull(endpoint, dataclasses.replace(exported, peer_id="x"), [0, 1])
    assert TransportEndpoint.from_bytes(endpoint.to_bytes()) == endpoint
    producer.release("req-bad")
    assert_no_leaks(consumer, producer)


def test_64mib_pull_bandwidth(kind, producer, consumer, pattern) -> None:
    src_ids = list(range(GEOMETRY.num_blocks))
    dst_ids = list(range(D_NUM_BLOCKS - GEOMETRY.num_blocks, D_NUM_BLOCKS))
    rates = []
    for attempt in range(3):
        exported = producer.export(f"req-bw-{attempt}", src_ids)
        started = time.perf_counter()
        state = _pull(consumer, producer.endpoint(), exported, dst_ids)
        seconds = time.perf_counter() - started
        assert state.status is PullStatus.DONE, state.message
        rates.append(exported.num_bytes / seconds)
        producer.release(f"req-bw-{attempt}")
    _assert_blocks_equal(consumer, dst_ids, pattern, src_ids)
    logger.warning(
        "transport %s: 64 MiB pull (%d blocks of %d KiB): best %.2f GB/s, runs %s",
        kind,
        len(src_ids),
        GEOMETRY.block_stride_bytes // 1024,
        max(rates) / 1e9,
        ", ".join(f"{r / 1e9:.2f}" for r in rates),
    )
    assert_no_leaks(consumer, producer)


def test_peer_killed_mid_transfer_fails_fast(kind, producer, consumer, pattern) -> None:
    victim = _make_producer(kind)
    endpoint = victim.endpoint()
    exports = [victim.export(f"req-kill-{i}", list(range(16 * i, 16 * i + 16))) for i in range(8)]
    before = [
        consumer.transport.start_pull(endpoint, e, list(range(16 * i, 16 * i + 16)))
        for i, e in enumerate(exports[:4])
    ]
    victim.kill()
    after = []
    for i, exported in enumerate(exports[4:], start=4):
        try:
            after.append(
                consumer.transport.start_pull(endpoint, exported, list(range(16 * i, 16 * i + 16)))
            )
        except TransferError as exc:
            logger.info("start_pull after the kill refused: %s", exc)
    started = time.monotonic()
    states = [wait_pull(consumer.transport, handle) for handle in before + after]
    elapsed_s = time.monotonic() - started
    assert elapsed_s < PULL_TIMEOUT_S + 2.0
    assert all(state.is_finished for state in states)
    assert all(state.status is PullStatus.FAILED for state in states[len(before) :])
    victim.close()
    # The consumer is unharmed: a pull from a healthy peer still works.
    exported = producer.export("req-after-kill", [3])
    assert _pull(consumer, producer.endpoint(), exported, [9]).status is PullStatus.DONE
    producer.release("req-after-kill")
    assert consumer.transport.usage().num_peers <= 1
    assert_no_leaks(consumer, producer)


def test_close_leaves_nothing_registered(kind, producer, pattern) -> None:
    consumer = _make_consumer(kind)
    exported = producer.export("req-close", [8, 9])
    state = _pull(consumer, producer.endpoint(), exported, [0, 1])
    assert state.status is PullStatus.DONE, state.message
    producer.release("req-close")
    consumer.transport.export("own", [0])
    consumer.transport.close()
    consumer.transport.close()
    usage = consumer.transport.usage()
    assert (usage.num_exports, usage.num_pending_pulls, usage.num_peers) == (0, 0, 0)
    with pytest.raises(TransferError, match="register"):
        consumer.transport.endpoint()
    p_usage = producer.usage()
    assert (p_usage.num_exports, p_usage.num_grants) == (0, 0), p_usage
