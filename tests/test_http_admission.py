"""The HTTP API's admission rules (device_agent/http/admission.py), pure: each rule at its boundary."""

from __future__ import annotations

import pytest

from device_agent.http.admission import (
    EVICT_AFTER_S,
    HEALTH_CONNECTIONS,
    BodyBudget,
    Occupancy,
    Placement,
    Slot,
    evictable,
    grace,
    health_check,
    is_health_target,
    place_connection,
)


def occupancy(general=0, reserve=0, general_waiting=0, reserve_waiting=0) -> Occupancy:
    return Occupancy(general, reserve, general_waiting, reserve_waiting)


def test_a_connection_takes_a_general_slot_up_to_the_limit_then_evicts_a_waiting_one():
    assert place_connection(occupancy(general=63), 64) == Placement(Slot.GENERAL)
    assert place_connection(occupancy(general=64, general_waiting=1), 64) == Placement(Slot.GENERAL, Slot.GENERAL)


def test_with_every_general_slot_busy_health_slots_are_taken_up_to_their_count_then_refused():
    full = occupancy(general=64)
    assert place_connection(full, 64) == Placement(Slot.RESERVE)
    assert place_connection(occupancy(general=64, reserve=HEALTH_CONNECTIONS - 1), 64) == Placement(Slot.RESERVE)
    assert place_connection(occupancy(general=64, reserve=HEALTH_CONNECTIONS), 64) == Placement(None)
    assert place_connection(occupancy(general=64, reserve=HEALTH_CONNECTIONS, reserve_waiting=1), 64) == Placement(
        Slot.RESERVE, Slot.RESERVE
    )


def test_a_general_slot_becomes_evictable_after_its_grace_and_a_health_slot_at_once():
    assert not evictable(None, 100.0)  # a request in progress is never evicted
    assert not evictable(100.0, 100.0 + EVICT_AFTER_S - 0.001, grace(Slot.GENERAL))
    assert evictable(100.0, 100.0 + EVICT_AFTER_S, grace(Slot.GENERAL))
    assert evictable(100.0, 100.0, grace(Slot.RESERVE))


@pytest.mark.parametrize(
    ("target", "health"),
    [
        ("/healthz", True),
        ("/metrics?x=1", True),
        (b"/v2/health/ready", True),
        ("/v2/health/live", True),
        ("/predict", False),
        ("/healthz/", False),
        ("/v2/models/m/ready", False),
    ],
)
def test_health_targets_are_the_four_health_routes_only(target, health):
    assert is_health_target(target) is health


def test_body_budget_holds_bytes_up_to_its_limit_and_refuses_one_more():
    budget = BodyBudget(100)
    assert budget.take(60) and budget.take(40) and not budget.take(1)
    assert budget.held == 100
    budget.give(40)
    assert budget.take(40) and budget.held == 100


def test_a_health_slot_serves_health_routes_without_a_body_only():
    assert health_check(b"/healthz", [(b"host", b"agent")])
    assert health_check(b"/metrics", [(b"Content-Length", b"0")])
    assert not health_check(b"/healthz", [(b"content-length", b"1")])
    assert not health_check(b"/healthz", [(b"transfer-encoding", b"chunked")])
    assert not health_check(b"/predict", [])
