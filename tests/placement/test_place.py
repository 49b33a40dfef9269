"""Placement filters in the manual's order (role, availability, exclusions, projected
SLO), picks the least cost, breaks ties by id, and records unserved placements."""

from __future__ import annotations

import attrs

from narwhal.placement import NoPlacement, Placement, Policy, choose

from ..support import engine_view

view = engine_view


FLEET = (
    view("p1", "prefill"),
    view("p0", "prefill"),
    view("d0", "decode"),
    view("d1", "decode"),
)


def test_ties_break_by_engine_id() -> None:
    assert choose(FLEET) == Placement("disaggregated", "p0", "d0")


def test_lowest_cost_wins() -> None:
    fleet = (
        view("p0", "prefill", prefill_tokens_inflight=900),
        view("p1", "prefill", prefill_tokens_inflight=100),
        view("d0", "decode", decode_active=3),
        view("d1", "decode", decode_active=2),
    )
    assert choose(fleet) == Placement("disaggregated", "p1", "d1")


def test_availability_is_per_phase() -> None:
    fleet = (
        view("p0", "prefill", prefill_blocked="breaker open"),
        view("p1", "prefill"),
        view("d0", "decode", decode_blocked="drained"),
        view("d1", "decode"),
    )
    assert choose(fleet) == Placement("disaggregated", "p1", "d1")


def test_exclusions_apply_after_availability() -> None:
    assert choose(FLEET, excluded=frozenset({"p0", "d0"})) == Placement("disaggregated", "p1", "d1")
    result = choose(FLEET, excluded=frozenset({"p0", "p1"}))
    assert result == NoPlacement("every available prefill engine already failed this request")


def test_no_engine_reasons_name_the_filter_that_emptied_the_set() -> None:
    fleet = (view("p0", "prefill", prefill_blocked="quarantined"), view("d0", "decode"))
    assert choose(fleet) == NoPlacement("no prefill engine is available (p0: quarantined)")
    assert choose((view("d0", "decode"),)) == NoPlacement("no engine has the prefill role")


def test_projected_slo_filter_prefers_compliant_engines() -> None:
    policy = Policy(prefill_ok=lambda v: v.id != "p0")
    assert choose(FLEET, policy=policy) == Placement("disaggregated", "p1", "d0")


def test_unserved_placement_falls_back_to_least_cost() -> None:
    policy = Policy(prefill_ok=lambda v: False)
    assert choose(FLEET, policy=policy) == Placement("disaggregated", "p0", "d0", unserved=True)


def test_aggregate_engine_when_no_pair_is_available() -> None:
    fleet = (
        view("p0", "prefill", prefill_blocked="drained"),
        view("d0", "decode"),
        view("b0", "both"),
    )
    assert choose(fleet) == Placement("aggregate", None, "b0")
    assert choose((view("b0", "both"),)) == Placement("aggregate", None, "b0")


def test_live_role_change_affects_the_next_placement() -> None:
    moved = tuple(attrs.evolve(v, role="decode") if v.id == "p1" else v for v in FLEET)
    assert choose(moved, excluded=frozenset({"p0"})) == NoPlacement(
        "every available prefill engine already failed this request"
    )
    assert choose(moved) == Placement("disaggregated", "p0", "d0")


def test_placed_but_not_started_decodes_count_as_load() -> None:
    """A burst placed during one prefill must not all land on the lowest-id decode engine."""
    from narwhal.config import load_config
    from narwhal.fleet import Fleet

    config = load_config(
        {
            "engines": [
                {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                {"id": "d0", "url": "http://127.0.0.1:2", "role": "decode"},
                {"id": "d1", "url": "http://127.0.0.1:3", "role": "decode"},
            ]
        }
    )
    fleet = Fleet(config)
    chosen = []
    for _ in range(4):
        placement = choose(fleet.views(0.0))
        assert isinstance(placement, Placement)
        chosen.append(placement.decode)
        engine = fleet.get(placement.decode)
        assert engine is not None
        engine.load.decode_placed(100)  # what the request path does at placement
    assert chosen == ["d0", "d1", "d0", "d1"]
