"""router_svc.choice and router_svc.view: pure routing decisions over plain WorkerView data."""

from __future__ import annotations

import pytest

from dsv4.errors import Unavailable
from dsv4.types import WorkerRole
from router_svc.choice import choose_decode, choose_prefill, choose_route
from router_svc.view import PoolSnapshot, WorkerHealth, WorkerView, describe_pool

P, D, C = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.COLOCATED
HEALTHY, DOWN = WorkerHealth.HEALTHY, WorkerHealth.DOWN


def w(
    address: str, role: WorkerRole = P, health: WorkerHealth = HEALTHY, **load: object
) -> WorkerView:
    fields = {"layout_hash": "h1", "vocab_size": 1000, "max_model_len": 4096, **load}
    return WorkerView(address, f"id-{address}", role, health, **fields)  # type: ignore[arg-type]


def test_prefill_is_least_queued_then_fewest_running_skipping_unroutable() -> None:
    workers = [
        w("a", num_queued_tokens=50),
        w("b", num_queued_tokens=10, num_running_requests=3),
        w("c", num_queued_tokens=10, num_running_requests=1),
        w("d", WorkerRole.PREFILL, WorkerHealth.DRAINING),
        w("e", WorkerRole.PREFILL, DOWN),
        w("f", WorkerRole.PREFILL, WorkerHealth.UNKNOWN),
    ]
    assert choose_prefill(workers).address == "c"
    assert choose_prefill(workers, exclude={"c"}).address == "b"
    assert choose_prefill(workers[3:]) is None


def test_decode_has_most_free_blocks_among_the_same_layout() -> None:
    workers = [
        w("a", D, num_free_blocks=10),
        w("b", D, num_free_blocks=90, layout_hash="h2"),
        w("c", D, num_free_blocks=50),
        w("d", D, DOWN, num_free_blocks=500),
    ]
    assert choose_decode(workers, "h1").address == "c"
    assert choose_decode(workers, "h2").address == "b"
    assert choose_decode(workers, "h1", exclude={"c"}).address == "a"
    assert choose_decode(workers, "h3") is None


def test_route_skips_a_prefill_worker_without_a_compatible_decode() -> None:
    snapshot = PoolSnapshot(
        (
            w("p-odd", layout_hash="h2"),  # least loaded, but no D has h2
            w("p-ok", num_queued_tokens=100),
            w("d", D, num_free_blocks=5),
        )
    )
    route = choose_route(snapshot)
    assert (route.prefill.address, route.decode.address) == ("p-ok", "d")
    assert snapshot.has_route


def test_colocated_stands_in_only_without_a_disaggregated_pair() -> None:
    colocated = w("c", C, num_queued_tokens=3)
    pair = (w("p"), w("d", D))
    assert not choose_route(PoolSnapshot((*pair, colocated))).is_colocated
    route = choose_route(PoolSnapshot((w("p", P, DOWN), w("d", D), colocated)))
    assert route.is_colocated and route.decode.address == "c"
    route = choose_route(PoolSnapshot((*pair, colocated)), exclude_prefill={"p"})
    assert route.is_colocated


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        ((), "both pools are empty or down"),
        ((w("d", D),), "the prefill pool is empty or down"),
        ((w("p"), w("d", D, DOWN)), "decode pool: 0 healthy of 1 (1 down)"),
        ((w("p", layout_hash="h1"), w("d", D, layout_hash="h2")), "incompatible"),
    ],
)
def test_no_route_explains_which_pool_is_the_problem(workers: tuple, expected: str) -> None:
    with pytest.raises(Unavailable, match="retry once workers are up") as info:
        choose_route(PoolSnapshot(workers))
    assert expected in info.value.message


def test_no_route_mentions_failed_attempts_and_stale_discovery() -> None:
    snapshot = PoolSnapshot((w("p"), w("d", D)), is_registry_stale=True)
    with pytest.raises(Unavailable) as info:
        choose_route(snapshot, exclude_prefill={"p"})
    assert "1 worker(s) already failed" in info.value.message
    assert "discovery is unreachable" in info.value.message


def test_model_facts_take_the_smallest_limits_and_fall_back_to_down_workers() -> None:
    snapshot = PoolSnapshot((w("p", max_model_len=2048), w("d", D, vocab_size=900)))
    facts = snapshot.model_facts()
    assert (facts.vocab_size, facts.max_model_len) == (900, 2048)
    only_down = PoolSnapshot((w("p", P, DOWN, max_model_len=100),))
    assert only_down.model_facts().max_model_len == 100
    assert PoolSnapshot((w("p", P, WorkerHealth.UNKNOWN, vocab_size=0),)).model_facts() is None


def test_describe_pool() -> None:
    workers = [w("a"), w("b", P, DOWN), w("c", P, WorkerHealth.UNKNOWN)]
    assert describe_pool(workers, "prefill") == "prefill: 1 healthy of 3 (1 down, 1 unknown)"
    assert describe_pool([], "decode") == "decode: 0 healthy of 0"


def test_a_worker_that_failed_its_last_probe_is_chosen_only_when_nothing_else_is() -> None:
    suspect_p = w("p-suspect", num_queued_tokens=0, num_consecutive_failures=1)
    busy_p = w("p-busy", num_queued_tokens=900)
    assert choose_prefill([suspect_p, busy_p]).address == "p-busy"
    assert choose_prefill([suspect_p]).address == "p-suspect"  # still HEALTHY: not DOWN yet
    suspect_d = w("d-suspect", D, num_free_blocks=900, num_consecutive_failures=2)
    small_d = w("d-small", D, num_free_blocks=3)
    assert choose_decode([suspect_d, small_d], "h1").address == "d-small"
    route = choose_route(PoolSnapshot((suspect_p, busy_p, suspect_d, small_d)))
    assert (route.prefill.address, route.decode.address) == ("p-busy", "d-small")
    colocated = (w("c-suspect", C, num_consecutive_failures=1), w("c-ok", C, num_queued_tokens=50))
    assert choose_route(PoolSnapshot(colocated)).decode.address == "c-ok"
