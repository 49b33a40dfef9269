"""An engine's load ledger: each claim moves exactly its counters, and gives back exactly
what it took, once, on every way out of its block (a cancellation included)."""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import pytest
import trio
import trio.testing

from narwhal.fleet import Claim, EngineLoad, LoadStatistics

ZERO = LoadStatistics()

# Each claim the request path takes, and what it adds to the ledger while held.
CLAIMS: list[tuple[str, Callable[[EngineLoad], Claim], LoadStatistics]] = [
    (
        "prefill waiting for a slot",
        lambda load: load.prefill_queue(400),
        LoadStatistics(prefill_queued=1, prefill_queued_tokens=400),
    ),
    (
        "prefill leg",
        lambda load: load.prefill(400),
        LoadStatistics(legs_started=1, prefill_inflight=1, prefill_tokens_inflight=400),
    ),
    ("kv handoff", lambda load: load.handoff(), LoadStatistics(handoffs_pending=1)),
    (
        "decode placed before its prefill",
        lambda load: load.decode_placed(300),
        LoadStatistics(decode_pending=1, decode_pending_tokens=300),
    ),
    (
        "decode leg",
        lambda load: load.decode(300),
        LoadStatistics(legs_started=1, decode_active=1, decode_tokens=300),
    ),
    (
        "decode leg before its first token",
        lambda load: load.awaiting_first_token(2.0),
        LoadStatistics(awaiting_first_token=1),
    ),
    (
        "non-streaming decode leg",
        lambda load: load.unstreamed_decode(50, 2.0),
        LoadStatistics(unstreamed_legs=1),
    ),
]
KINDS = [kind for kind, _, _ in CLAIMS]


def held(load: EngineLoad) -> LoadStatistics:
    """The ledger's reading without the one counter no release takes back."""
    return attrs.evolve(load.statistics(), legs_started=0)


@pytest.mark.parametrize(("take", "adds"), [(t, a) for _, t, a in CLAIMS], ids=KINDS)
def test_a_claim_moves_its_counters_and_gives_them_back_once(
    take: Callable[[EngineLoad], Claim], adds: LoadStatistics
) -> None:
    load = EngineLoad()
    claim = take(load)
    assert load.statistics() == adds
    claim.release()
    claim.release()  # a second release gives nothing back twice
    assert not claim.held
    assert held(load) == ZERO
    # Leg starts are a running count: a leg that sees it unchanged at its end ran alone.
    assert load.legs_started == adds.legs_started


@pytest.mark.parametrize("take", [t for _, t, _ in CLAIMS], ids=KINDS)
def test_a_claim_left_by_an_exception_is_given_back(take: Callable[[EngineLoad], Claim]) -> None:
    load = EngineLoad()
    with pytest.raises(KeyError), take(load):
        raise KeyError("x")
    assert held(load) == ZERO


@pytest.mark.parametrize("take", [t for _, t, _ in CLAIMS], ids=KINDS)
async def test_a_cancelled_holder_leaves_every_counter_at_zero(
    take: Callable[[EngineLoad], Claim], autojump_clock: trio.testing.MockClock
) -> None:
    load = EngineLoad()

    async def hold() -> None:
        with take(load), load.generated() as generated:
            generated.add(7)
            await trio.sleep_forever()

    with trio.move_on_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            assert held(load) != ZERO
    assert trio.current_time() == 10
    assert held(load) == ZERO


def test_claims_add_up_and_show_in_the_repr() -> None:
    load = EngineLoad()
    assert repr(load) == (
        "<EngineLoad [prefill 0 (0 tokens), 0 queued (0 tokens) | decode 0 (0 tokens), "
        "0 pending (0 tokens) | 0 handoffs | 0 legs started]>"
    )
    claims = [take(load) for _, take, _ in CLAIMS for _ in range(2)]
    assert load.placed == 2 * 5  # every leg or handoff the engine still owes
    assert repr(load) == (
        "<EngineLoad [prefill 2 (800 tokens), 2 queued (800 tokens) | decode 2 (600 tokens), "
        "2 pending (600 tokens) | 2 handoffs | 4 legs started | 2 unstreamed "
        "| 2 awaiting first token]>"
    )
    for claim in claims:
        claim.release()
    assert held(load) == ZERO
    assert load.placed == 0


def test_generated_tokens_count_until_the_leg_ends_and_no_longer() -> None:
    load = EngineLoad()
    with load.decode(100), load.generated() as generated:
        generated.add(8)
        generated.add(2)
        assert (load.decode_tokens, generated.tokens) == (110, 10)
    assert load.decode_tokens == 0
    generated.add(5)  # a released claim takes no more
    assert (load.decode_tokens, generated.tokens) == (0, 10)


def test_the_oldest_leg_still_waiting_sets_the_first_token_wait() -> None:
    load = EngineLoad()
    assert load.first_token_wait_s(5.0) == 0.0
    older = load.awaiting_first_token(1.0)
    with load.awaiting_first_token(2.0):
        assert load.first_token_wait_s(5.0) == 4.0
        older.release()  # its token came: the younger leg is the oldest now
        assert load.first_token_wait_s(5.0) == 3.0
        assert load.first_token_wait_s(1.5) == 0.0  # never negative
    assert load.first_token_wait_s(5.0) == 0.0


def test_unstreamed_legs_sum_their_age_and_bounds() -> None:
    load = EngineLoad()
    assert (load.unstreamed_age_s(5.0), load.unstreamed_cap) == (0.0, 0.0)
    with load.unstreamed_decode(100, 1.0), load.unstreamed_decode(50, 2.0):
        assert (load.unstreamed_age_s(5.0), load.unstreamed_cap) == (7.0, 150.0)
        with load.unstreamed_decode(None, 4.0):
            assert (load.unstreamed_age_s(5.0), load.unstreamed_cap) == (8.0, math.inf)
        assert load.unstreamed_cap == 150.0
    # The clock sums reset once no leg is left, so they cannot drift.
    assert (load.unstreamed_age_s(1e9), load.unstreamed_cap) == (0.0, 0.0)


def test_statistics_is_a_frozen_record() -> None:
    load = EngineLoad()
    stats = load.statistics()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.decode_active = 1  # type: ignore[misc]
    with load.decode(10):
        assert stats == ZERO  # taken before: a reading, not a view
