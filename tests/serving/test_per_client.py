"""Counting per client address on its own: the table, the refusal, the episode logging,
and the address a client is counted under."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from narwhal.serving._per_client import QUIET_S, PerClient, PerClientStatistics, client_key


def bodies(limit: int) -> PerClient:
    return PerClient(
        limit,
        noun="request bodies arriving",
        setting="serving.max_pending_bodies_per_client",
        bound="reads at most {limit} at once",
        code="pending_bodies_per_client",
    )


def test_a_client_is_counted_up_to_its_limit_and_out_again_once() -> None:
    counts = bodies(2)
    first = counts.hold("a")
    second = counts.hold("a")
    counts.hold("b")
    assert (counts.full("a"), counts.full("b")) == (True, False)
    assert repr(counts) == "<PerClient 3 request bodies arriving from 2 client(s), 2 each>"
    first()
    first()  # counted out once, however often it is called
    assert (counts.count("a"), counts.full("a")) == (1, False)
    second()
    # An address leaves the table with its last one: the table is bounded by the count.
    assert counts.statistics() == PerClientStatistics(
        limit=2, counted=1, clients=1, busiest=1, refused=0, refusing=0
    )
    counts.limit = 1  # a reload: what is counted stays, the next one is held to it
    assert counts.full("b")


def test_a_refusal_names_the_client_the_count_and_the_setting() -> None:
    counts = bodies(1)
    counts.hold("192.0.2.7")
    refusal = counts.refusal("192.0.2.7")
    assert (refusal.status, refusal.code) == (429, "pending_bodies_per_client")
    assert refusal.message == (
        "client 192.0.2.7 already has 1 request bodies arriving: narwhal reads at most 1 at "
        "once from one client address (serving.max_pending_bodies_per_client)"
    )
    assert refusal.headers() == [(b"retry-after", b"1")]


def _client_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if getattr(r, "event", None) == "client_limit"
    ]


async def test_refusals_are_counted_each_and_logged_once_per_episode(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.server")
    refused: list[int] = []
    counts = PerClient(
        2,
        noun="connections open",
        setting="listen.max_open_connections_per_client",
        bound="keeps at most {limit} open",
        code="connections_per_client",
        on_refused=lambda: refused.append(1),
    )
    held = [counts.hold("a"), counts.hold("a")]
    # A client held at its limit, however fast it comes back: one line.
    for _ in range(5):
        counts.refused("a")
        await trio.sleep(1)
    held.pop()()  # below the limit, but refused a second ago: the episode goes on
    held.append(counts.hold("a"))
    counts.refused("a")
    assert counts.statistics().refusing == 1
    # Quiet for QUIET_S: the next release below the limit ends it.
    await trio.sleep(QUIET_S)
    held.pop()()
    assert counts.statistics().refusing == 0
    held.append(counts.hold("a"))
    # A new episode; it ends when the client has none left.
    counts.refused("a")
    await trio.sleep(2)
    for release in held:
        release()
    assert len(refused) == counts.statistics().refused == 7
    warning = (
        "WARNING",
        "client a has 2 connections open, listen.max_open_connections_per_client=2: more "
        "are refused with 429 connections_per_client",
    )
    assert _client_lines(caplog) == [
        warning,
        (
            "INFO",
            "client a: 6 refused with 429 connections_per_client over 15.0 s "
            "(connections open now: 1)",
        ),
        warning,
        (
            "INFO",
            "client a: 1 refused with 429 connections_per_client over 2.0 s "
            "(connections open now: 0)",
        ),
    ]
    fields = [
        {k: getattr(r, k, None) for k in ("outcome", "client", "count", "refused", "duration_s")}
        for r in caplog.records
        if getattr(r, "event", None) == "client_limit"
    ]
    assert fields[:2] == [
        {"outcome": "reached", "client": "a", "count": 2, "refused": None, "duration_s": None},
        {"outcome": "cleared", "client": "a", "count": 1, "refused": 6, "duration_s": 15.0},
    ]


async def test_a_refusal_long_after_the_last_one_starts_a_new_episode(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A client that keeps its limit open (a gateway's pooled connections) but comes back
    # for more only now and then: each time is logged, not only the first.
    caplog.set_level(logging.INFO, logger="narwhal.server")
    counts = bodies(1)
    counts.hold("a")
    counts.refused("a")
    await trio.sleep(QUIET_S)
    counts.refused("a")
    assert [level for level, _ in _client_lines(caplog)] == ["WARNING", "INFO", "WARNING"]


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("::ffff:192.0.2.7", "192.0.2.7"),  # a dual-stack listener's IPv4 client
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),  # the same site, another address
        ("fe80::1%eth0", "fe80::/64"),
        ("::1", "::/64"),
        ("not an address", "not an address"),
    ],
)
def test_a_client_is_counted_by_its_address_and_an_ipv6_one_by_its_64_prefix(
    host: str, key: str
) -> None:
    assert client_key(host) == key
