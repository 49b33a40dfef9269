"""The two ways to a pair request's first token when its decode engine holds most of the
prompt (docs/design.md#prefix-caching), priced without sockets: the decode engine
prefilling the rest itself, or the prefill engine's path and a handoff."""

from __future__ import annotations

import attrs
import pytest

from narwhal.admission import Priced
from narwhal.serving._admit import local_path_prices
from narwhal.serving._prefix import prefills_locally

from ..admission.test_pricing import Flat, Linear
from ..support import engine_view

# 1,000 tokens: 0.1 s on the prefill engine, 0.01 s decode steps, a 0.02 s handoff.
TOKENS, HANDOFF = 1000, 0.02


def engines(backlog_s: float = 0.0, first_token_lag_s: float = 0.0) -> tuple[Priced, Priced]:
    """p0 and d0; d0 holds 900 of the prompt's tokens."""
    local = Priced(
        engine_view("d0", "decode"),
        Linear(0.0001),
        Flat(0.01),
        backlog_s=backlog_s,
        first_token_lag_s=first_token_lag_s,
        cached_tokens=900,
    )
    return local, Priced(engine_view("p0", "prefill"), Linear(0.0001), Flat(0.01))


def test_an_idle_decode_engine_prefills_the_uncached_rest_as_its_curve_prices_it() -> None:
    local, remote = engines()
    prices = local_path_prices(local, remote, TOKENS, HANDOFF)
    assert prices.local_wait_s == 0.0
    assert prices.local_s == pytest.approx(0.01)  # 100 uncached tokens
    assert prices.remote_s == pytest.approx(0.1 + HANDOFF + 0.01)


@attrs.frozen
class PerActive:
    """A decode step of 10 ms plus 1 ms per request in it."""

    def interval_s(self, active: float, kv_tokens: float) -> float:
        return 0.01 + 0.001 * active

    def in_domain(self, active: int, kv_tokens: int) -> bool:
        return True


def test_a_prefill_riding_a_decode_batch_pays_what_the_batch_adds_to_its_step() -> None:
    # 20 requests decoding: a step takes 31 ms against an idle engine's 11 ms, whose
    # fixed cost the prefill curve already holds.
    local, remote = engines()
    busy = attrs.evolve(
        local, view=engine_view("d0", "decode", decode_active=20), decode=PerActive()
    )
    prices = local_path_prices(busy, remote, TOKENS, HANDOFF)
    assert prices.local_s == pytest.approx(0.01 + 0.02)
    assert prices.remote_s == pytest.approx(0.1 + HANDOFF + 0.031)


def test_the_decode_engine_s_delays_are_the_local_path_s_wait_and_the_remote_path_s_too() -> None:
    # Lately 0.31 s to a first token against a modelled 0.03: 0.28 s of lag, which no
    # path overlaps.
    local, remote = engines(first_token_lag_s=0.31)
    lagging = local_path_prices(local, remote, TOKENS, HANDOFF)
    assert lagging.local_wait_s == pytest.approx(0.28)
    assert lagging.local_s == pytest.approx(0.28 + 0.01)
    assert lagging.remote_s == pytest.approx(0.13 + 0.28)
    # 0.3 s of its own prefills booked: the remote path's 0.12 s to the handoff overlaps
    # them, the local prefill waits for them all.
    local, remote = engines(backlog_s=0.3)
    booked = local_path_prices(local, remote, TOKENS, HANDOFF)
    assert booked.local_wait_s == pytest.approx(0.3)
    assert booked.local_s == pytest.approx(0.3 + 0.01)
    assert booked.remote_s == pytest.approx(0.3 + 0.01)
    # Both ways wait for the booked prefills; the local one is then no slower, and
    # spares the prefill engine (cache.local_prefill_share 0.5).
    assert booked.local_s == pytest.approx(booked.remote_s)
    assert prefills_locally(900, TOKENS, 0.5, lambda: booked) is booked
    # A lag no path overlaps leaves the local path cheaper by the handoff and the step.
    assert prefills_locally(900, TOKENS, 0.5, lambda: lagging) is lagging
