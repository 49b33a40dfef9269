"""Predictive admission pricing (manual 4.1), on hand-made latency curves."""

from __future__ import annotations

import math

import attrs
import pytest

from narwhal.admission import (
    NO_ALLOWANCE,
    Allowance,
    BacklogBook,
    FirstTokenLag,
    KvTurnover,
    PathQuote,
    Priced,
    ProjectionErrors,
    WindowStatistics,
    band_label,
    error_band,
    judge,
    placement_policy,
    quote_paths,
    shared_overhead_s,
)
from narwhal.admission._pricing import (
    ERROR_BANDS,
    ERROR_MIN_SAMPLES,
    ERROR_WINDOW,
    ERROR_WINDOW_S,
    unstreamed_tokens,
)

from ..support import engine_view


@attrs.frozen
class Linear:
    """prefill_s(n) = per_token·n; measured for n in [lo, hi]."""

    per_token: float
    lo: int = 1
    hi: int = 8192

    def prefill_s(self, n: int) -> float:
        return self.per_token * n

    def in_domain(self, n: int) -> bool:
        return self.lo <= n <= self.hi


@attrs.frozen
class Flat:
    interval: float
    max_active: int = 256

    def interval_s(self, active: float, kv_tokens: float) -> float:
        return self.interval

    def in_domain(self, active: int, kv_tokens: int) -> bool:
        return active <= self.max_active


view = engine_view


def fleet(backlog_p0: float = 0.0, backlog_p1: float = 0.0) -> list[Priced]:
    return [
        Priced(view("p0", "prefill"), Linear(0.0001), Flat(0.01), backlog_p0),
        Priced(view("p1", "prefill"), Linear(0.0002), Flat(0.01), backlog_p1),
        Priced(view("d0", "decode"), Linear(0.0001), Flat(0.02)),
        Priced(view("d1", "decode"), Linear(0.0001), Flat(0.01)),
    ]


def test_projected_ttft_adds_wait_prefill_handoff_and_the_first_decode_step() -> None:
    quotes = quote_paths(fleet(backlog_p0=0.2), prompt_tokens=1000, handoff_s=0.005)
    assert [(q.engine, q.mode) for q in quotes] == [
        ("p1", "disaggregated"),
        ("p0", "disaggregated"),
    ]
    p1, p0 = quotes
    assert p0.ttft_s == pytest.approx(0.2 + 0.1 + 0.005 + 0.01)  # cheapest decode first step
    assert p0.idle_ttft_s == pytest.approx(0.1 + 0.005 + 0.01)
    assert p1.ttft_s == pytest.approx(0.2 + 0.005 + 0.01)


def test_ties_break_by_engine_id() -> None:
    engines = [
        Priced(view("p1", "prefill"), Linear(0.0001), None),
        Priced(view("p0", "prefill"), Linear(0.0001), None),
        Priced(view("d0", "decode"), None, Flat(0.01)),
    ]
    assert [q.engine for q in quote_paths(engines, prompt_tokens=10, handoff_s=0)] == ["p0", "p1"]


def test_admitted_when_the_cheapest_path_fits() -> None:
    quotes = quote_paths(fleet(), prompt_tokens=1000, handoff_s=0.0)
    verdict = judge(quotes, prompt_tokens=1000, ttft_target_s=0.2, margin=0.0)
    assert verdict.admitted
    assert verdict.quote is not None
    assert verdict.quote.engine == "p0"


def test_backlog_refusal_carries_the_projected_wait() -> None:
    quotes = quote_paths(fleet(backlog_p0=1.0, backlog_p1=2.0), prompt_tokens=1000, handoff_s=0.0)
    verdict = judge(quotes, prompt_tokens=1000, ttft_target_s=0.5, margin=0.0)
    assert not verdict.admitted
    assert verdict.code == "ttft_budget"
    # p0: 1.0 wait + 0.1 prefill + 0.01 first step = 1.11 s; budget 0.5 s.
    assert verdict.retry_after_s == pytest.approx(0.61)
    assert "exceeds the TTFT budget 0.500s" in verdict.message


def test_margin_widens_the_budget() -> None:
    quotes = quote_paths(fleet(backlog_p0=0.4, backlog_p1=0.4), prompt_tokens=1000, handoff_s=0.0)
    assert quotes[0].ttft_s == pytest.approx(0.51)
    assert not judge(quotes, prompt_tokens=1000, ttft_target_s=0.45, margin=0.0).admitted
    assert judge(quotes, prompt_tokens=1000, ttft_target_s=0.45, margin=0.2).admitted


def test_a_prompt_too_long_for_the_target_at_zero_backlog() -> None:
    quotes = quote_paths(fleet(backlog_p0=3.0), prompt_tokens=8000, handoff_s=0.0)
    verdict = judge(quotes, prompt_tokens=8000, ttft_target_s=0.5, margin=0.0)
    assert verdict.code == "prompt_exceeds_ttft_target"
    assert verdict.retry_after_s is None
    assert verdict.final
    assert "shorten the prompt or raise the TTFT target" in verdict.message
    assert "0.810s to its first token even on an idle engine" in verdict.message


def test_excluded_and_blocked_engines_are_not_priced() -> None:
    engines = fleet()
    engines[0] = attrs.evolve(
        engines[0], view=view("p0", "prefill", prefill_blocked="breaker open")
    )
    quotes = quote_paths(engines, prompt_tokens=10, handoff_s=0, excluded=frozenset({"p1"}))
    assert quotes == []
    verdict = judge(quotes, prompt_tokens=10, ttft_target_s=1.0, margin=0.0)
    assert verdict.code == "no_priced_path"


def test_aggregate_paths_stay_inside_the_measured_region() -> None:
    both = [Priced(view("b0", "both"), Linear(0.0001, lo=16, hi=4096), Flat(0.01))]
    inside = quote_paths(both, prompt_tokens=4000, handoff_s=0.5)
    assert [(q.engine, q.mode) for q in inside] == [("b0", "aggregate")]
    assert inside[0].ttft_s == pytest.approx(0.41)
    assert quote_paths(both, prompt_tokens=5000, handoff_s=0.0) == []


def test_engines_without_profiles_cannot_be_priced() -> None:
    engines = [
        Priced(view("p0", "prefill"), None, None),
        Priced(view("d0", "decode"), None, Flat(0.01)),
    ]
    assert quote_paths(engines, prompt_tokens=10, handoff_s=0) == []


def test_backlog_book_is_a_virtual_finish_time() -> None:
    book: BacklogBook[str] = BacklogBook()
    book.commit("p0", 1.0, now=10.0)
    book.commit("p0", 0.5, now=10.2)
    assert book.wait_s("p0", 10.4) == pytest.approx(1.1)
    book.release("p0")
    assert book.wait_s("p0", 11.0) == pytest.approx(0.5)
    book.release("p0")  # the last leg ended early: the error is forgotten
    assert book.wait_s("p0", 11.2) == 0.0
    assert book.waits(11.2) == {}  # and so is the engine, until its next leg
    assert book.wait_s("unknown", 11.2) == 0.0
    book.commit("p0", 0.3, now=20.0)
    assert book.wait_s("p0", 20.0) == pytest.approx(0.3)


def test_every_replicas_commits_to_an_engine_make_one_queue() -> None:
    book: BacklogBook[str] = BacklogBook()
    book.commit("p0", 1.0, now=10.0)
    book.heard("p0", 1.0, now=10.0)  # another replica booked as much at the same time
    # One engine works through both at one second per second: 2 s of work, not 1 + 1
    # each draining on its own.
    assert book.fleet_wait_s("p0", 11.0) == pytest.approx(1.0)
    assert book.wait_s("p0", 11.0) == 0.0
    assert book.booked_s == {"p0": 1.0}  # what this replica booked, for the others
    # Overdue past the queue's finish (12.0), not past this replica's own (11.0).
    assert book.fleet_wait_s("p0", 13.0) == pytest.approx(1.0)
    assert book.wait_s("p0", 13.0) == pytest.approx(2.0)
    # Work heard on an idle engine starts now.
    book.heard("p1", 0.5, now=20.0)
    assert book.fleet_wait_s("p1", 20.2) == pytest.approx(0.3)
    assert book.wait_s("p1", 20.2) == 0.0


def test_the_fleets_queue_forgets_its_error_once_no_replica_has_a_leg_there() -> None:
    book: BacklogBook[str] = BacklogBook()
    book.others_say("p0", busy=True)
    book.commit("p0", 1.0, now=10.0)
    book.heard("p0", 2.0, now=10.0)
    book.release("p0")  # this replica's leg ended early; the others' work may not have
    assert book.fleet_wait_s("p0", 10.5) == pytest.approx(2.5)
    book.others_say("p0", busy=False)  # theirs ended too: the engine is idle
    assert book.fleet_wait_s("p0", 10.5) == 0.0
    # The other way round: the others finished first, then this replica's last leg.
    book.commit("p0", 1.0, now=20.0)
    book.heard("p0", 2.0, now=20.0)
    book.others_say("p0", busy=False)
    assert book.fleet_wait_s("p0", 20.5) == pytest.approx(2.5)  # this replica's leg runs
    book.release("p0")
    assert book.fleet_wait_s("p0", 20.5) == 0.0


def test_a_prompt_queued_behind_backlog_shares_the_per_request_overhead() -> None:
    book: BacklogBook[str] = BacklogBook()
    # Idle engine: the whole prediction, overhead included.
    book.commit("p0", 0.010, now=0.0, shared_s=0.006)
    assert book.wait_s("p0", 0.0) == pytest.approx(0.010)
    # Behind it, packed into the same steps: without the shared part.
    book.commit("p0", 0.010, now=0.001, shared_s=0.006)
    assert book.wait_s("p0", 0.001) == pytest.approx(0.009 + 0.004)
    # A shared part larger than the prediction adds nothing, never negative work.
    book.commit("p0", 0.002, now=0.001, shared_s=0.006)
    assert book.wait_s("p0", 0.001) == pytest.approx(0.013)
    # Once the backlog has drained the engine is idle again: all of it is charged.
    for _ in range(3):
        book.release("p0")
    book.commit("p0", 0.010, now=1.0, shared_s=0.006)
    assert book.wait_s("p0", 1.0) == pytest.approx(0.010)


def test_a_prompt_pays_the_share_of_a_step_its_tokens_fill() -> None:
    # A quarter of a 2048-token step shares three quarters of the step's fixed cost.
    assert shared_overhead_s(0.008, 512, 2048) == pytest.approx(0.006)
    assert shared_overhead_s(0.008, 1, 2048) == pytest.approx(0.008 * 2047 / 2048)
    # A chunk or more fills its own steps: nothing shared.
    assert shared_overhead_s(0.008, 2048, 2048) == 0.0
    assert shared_overhead_s(0.008, 9000, 2048) == 0.0


def lagging_fleet(lag_d0: float, lag_d1: float) -> list[Priced]:
    return [
        Priced(view("p0", "prefill"), Linear(0.0001), Flat(0.01)),
        Priced(view("d0", "decode"), None, Flat(0.01), first_token_lag_s=lag_d0),
        Priced(view("d1", "decode"), None, Flat(0.01), first_token_lag_s=lag_d1),
    ]


def test_a_slow_decode_side_is_priced_as_wait_on_the_least_lagging_engine() -> None:
    # Modelled decode side: 0.005 handoff + 0.01 first step = 0.015 s. d0 lately took
    # 0.6 s to a first token, d1 0.3 s: the path is priced on d1, 0.285 s over the model.
    quotes = quote_paths(lagging_fleet(0.6, 0.3), prompt_tokens=1000, handoff_s=0.005)
    (p0,) = quotes
    assert p0.idle_ttft_s == pytest.approx(0.1 + 0.015)
    assert p0.wait_s == pytest.approx(0.285)
    assert p0.ttft_s == pytest.approx(0.1 + 0.3)
    # A lag below the model changes nothing.
    (fast,) = quote_paths(lagging_fleet(0.01, 0.01), prompt_tokens=1000, handoff_s=0.005)
    assert fast.wait_s == 0.0
    assert fast.ttft_s == pytest.approx(0.115)


def test_a_decode_lag_refusal_is_a_backlog_refusal_not_a_prompt_too_long() -> None:
    quotes = quote_paths(lagging_fleet(0.8, 0.9), prompt_tokens=1000, handoff_s=0.0)
    verdict = judge(quotes, prompt_tokens=1000, ttft_target_s=0.5, margin=0.0)
    assert not verdict.admitted
    assert verdict.code == "ttft_budget"
    assert verdict.retry_after_s is not None
    assert verdict.retry_after_s > 0


def test_placement_steers_decode_away_from_a_lagging_engine() -> None:
    priced = {p.view.id: p for p in lagging_fleet(0.5, 0.0)}
    policy = placement_policy(
        priced, prompt_tokens=100, handoff_s=0.0, ttft_budget_s=1.0, tpot_target_s=0.05
    )
    d0, d1 = priced["d0"].view, priced["d1"].view
    assert policy.decode_cost(d0) > policy.decode_cost(d1)
    assert policy.decode_ok(d0)  # the lag is a TTFT matter, not a TPOT one


def test_first_token_lag_is_a_decaying_weighted_mean() -> None:
    lags: FirstTokenLag[str] = FirstTokenLag(tau_s=2.0, alpha=0.5)
    assert lags.lag_s("d0", 0.0) == 0.0
    lags.observe("d0", 1.0, now=10.0)
    assert lags.lag_s("d0", 10.0) == pytest.approx(1.0)
    lags.observe("d0", 0.0, now=10.0)
    assert lags.lag_s("d0", 10.0) == pytest.approx(0.5)
    # Forgotten with time constant tau_s when nothing new is seen.
    assert lags.lag_s("d0", 12.0) == pytest.approx(0.5 * math.exp(-1.0))
    lags.observe("d0", -3.0, now=12.0)  # a negative observation counts as zero
    assert lags.lag_s("d0", 12.0) == pytest.approx(0.5 * math.exp(-1.0) * 0.5)
    assert set(lags.value) == {"d0"}


def kv_decode(
    engine_id: str, committed: int, rate: float = 10_000.0, interval: float = 0.01
) -> Priced:
    """A decode engine with a 100,000-token KV cache holding `committed` tokens and lately
    freeing `rate` tokens/s."""
    return Priced(
        view(engine_id, "decode", decode_tokens=committed),
        None,
        Flat(interval),
        kv_capacity_tokens=100_000,
        kv_release_per_s=rate,
    )


def kv_fleet(committed: int, rate: float, *, prefill_per_token: float = 0.0001) -> list[Priced]:
    """One prefill engine and `kv_decode`."""
    return [
        Priced(view("p0", "prefill"), Linear(prefill_per_token), None),
        kv_decode("d0", committed, rate),
    ]


def test_a_decode_engine_with_kv_room_adds_no_wait() -> None:
    # 90,000 committed + 1,000 prompt fits under 98 % of 100,000.
    (quote,) = quote_paths(kv_fleet(90_000, 10_000.0), prompt_tokens=1000, handoff_s=0.0)
    assert quote.wait_s == 0.0
    assert quote.ttft_s == pytest.approx(0.1 + 0.01)


def test_a_kv_full_decode_engine_is_priced_as_the_time_to_free_the_overflow() -> None:
    # 99,000 + 1,000 - 98,000 = 2,000 tokens over; freed at 10,000 tokens/s: the decode
    # side is ready 0.2 s from now. The 0.1 s prefill overlaps it, so 0.1 s is wait.
    (quote,) = quote_paths(kv_fleet(99_000, 10_000.0), prompt_tokens=1000, handoff_s=0.0)
    assert quote.wait_s == pytest.approx(0.1)
    assert quote.ttft_s == pytest.approx(0.2 + 0.01)
    assert quote.idle_ttft_s == pytest.approx(0.1 + 0.01)
    # A prefill longer than the KV wait hides it entirely.
    (slow,) = quote_paths(
        kv_fleet(99_000, 10_000.0, prefill_per_token=0.001), prompt_tokens=1000, handoff_s=0.0
    )
    assert slow.wait_s == 0.0


def test_a_kv_full_refusal_is_a_backlog_refusal_with_a_finite_retry_after() -> None:
    # Nothing released lately: the whole cache is assumed to turn over in 60 s, so the
    # 2,000-token overflow takes 1.2 s, and the refusal still names a finite wait.
    quotes = quote_paths(kv_fleet(99_000, 0.0), prompt_tokens=1000, handoff_s=0.0)
    assert quotes[0].ttft_s == pytest.approx(1.2 + 0.01)
    verdict = judge(quotes, prompt_tokens=1000, ttft_target_s=0.5, margin=0.0)
    assert verdict.code == "ttft_budget"
    assert verdict.retry_after_s == pytest.approx(0.71)


def test_kv_wait_and_first_token_lag_are_not_added_together() -> None:
    # Both describe the same decode queue: the larger one counts.
    engines = kv_fleet(99_000, 10_000.0)
    lagging = attrs.evolve(engines[1], first_token_lag_s=0.5)
    (quote,) = quote_paths([engines[0], lagging], prompt_tokens=1000, handoff_s=0.0)
    assert quote.ttft_s == pytest.approx(0.1 + 0.5)


def test_a_decode_engine_s_own_prefills_delay_a_handoff_beyond_the_remote_prefill() -> None:
    # d0 has 0.3 s of prompts it prefills itself booked (cache.local_prefill_share): a
    # handoff's first step runs once they are through. The 0.1 s remote prefill overlaps
    # them, so 0.2 s is wait; a remote prefill longer than the booking hides it.
    p0, d0 = kv_fleet(0, 0.0)
    busy = attrs.evolve(d0, backlog_s=0.3)
    (quote,) = quote_paths([p0, busy], prompt_tokens=1000, handoff_s=0.0)
    assert quote.wait_s == pytest.approx(0.2)
    assert quote.ttft_s == pytest.approx(0.3 + 0.01)
    slow = attrs.evolve(p0, prefill=Linear(0.001))
    (hidden,) = quote_paths([slow, busy], prompt_tokens=1000, handoff_s=0.0)
    assert hidden.wait_s == 0.0
    # Like the KV wait, it is the same queue the first-token lag sees: the larger counts.
    lagging = attrs.evolve(busy, first_token_lag_s=0.5)
    (lag,) = quote_paths([p0, lagging], prompt_tokens=1000, handoff_s=0.0)
    assert lag.ttft_s == pytest.approx(0.1 + 0.5)


def test_placement_steers_a_handoff_away_from_a_decode_engine_busy_prefilling() -> None:
    priced = {p.view.id: p for p in lagging_fleet(0.0, 0.0)}
    priced["d0"] = attrs.evolve(priced["d0"], backlog_s=0.2)
    policy = placement_policy(
        priced, prompt_tokens=100, handoff_s=0.0, ttft_budget_s=1.0, tpot_target_s=0.05
    )
    assert policy.decode_cost(priced["d0"].view) == pytest.approx(0.01 + 0.2)
    assert policy.decode_cost(priced["d1"].view) == pytest.approx(0.01)


def unstreamed(committed: int, age_s: float, cap: float, *, interval: float = 0.01) -> Priced:
    """`kv_decode` with non-streaming decode legs that have run `age_s` seconds in all."""
    engine = kv_decode("d0", committed, interval=interval)
    return attrs.evolve(
        engine, view=attrs.evolve(engine.view, unstreamed_age_s=age_s, unstreamed_cap=cap)
    )


def test_non_streaming_legs_are_taken_to_make_one_token_per_decode_step() -> None:
    # 3 s of non-streaming decode at 10 ms a step: 300 tokens nobody has seen yet.
    assert unstreamed(1_000, 3.0, math.inf).decode_tokens == pytest.approx(1_300)
    # ... but never more than the legs' max_tokens allow.
    assert unstreamed(1_000, 3.0, 120.0).decode_tokens == pytest.approx(1_120)
    # A decode engine running slower than profiled makes fewer.
    slow = attrs.evolve(unstreamed(1_000, 3.0, math.inf), decode_correction=2.0)
    assert slow.decode_tokens == pytest.approx(1_150)
    # No legs, or no profile to count steps by: only what the router counted.
    assert unstreamed(1_000, 0.0, math.inf).decode_tokens == 1_000
    blind = unstreamed(1_000, 3.0, math.inf)
    assert unstreamed_tokens(blind.view, None, 1.0) == 0.0
    assert unstreamed_tokens(blind.view, Flat(0.0), 1.0) == 0.0


def test_kv_made_by_non_streaming_legs_is_priced_like_counted_kv() -> None:
    # 96,000 counted + 1,000 prompt fit under 98,000; 20 s of unseen decode at 10 ms a
    # step adds 2,000 tokens: 1,000 over, freed at 10,000 tokens/s, so the decode side
    # is ready 0.1 s from now, as if the router had counted those tokens itself.
    engines = kv_fleet(96_000, 10_000.0, prefill_per_token=0.00001)
    (roomy,) = quote_paths(engines, prompt_tokens=1000, handoff_s=0.0)
    assert roomy.wait_s == 0.0
    busy = attrs.evolve(unstreamed(96_000, 20.0, math.inf), kv_release_per_s=10_000.0)
    (quote,) = quote_paths([engines[0], busy], prompt_tokens=1000, handoff_s=0.0)
    counted = kv_decode("d0", 98_000)
    (same,) = quote_paths([engines[0], counted], prompt_tokens=1000, handoff_s=0.0)
    assert quote.wait_s == pytest.approx(same.wait_s)
    assert quote.wait_s == pytest.approx(0.1 - 0.01)


def test_placement_prefers_the_decode_engine_with_kv_room() -> None:
    full = kv_decode("d0", 99_500)
    roomy = kv_decode("d1", 10_000, interval=0.02)
    priced = {p.view.id: p for p in (full, roomy)}
    policy = placement_policy(
        priced, prompt_tokens=1000, handoff_s=0.0, ttft_budget_s=1.0, tpot_target_s=0.05
    )
    assert policy.decode_cost(roomy.view) == pytest.approx(0.02)
    assert policy.decode_cost(full.view) == pytest.approx(0.01 + 0.25)


def test_kv_turnover_is_a_decayed_release_rate() -> None:
    kv: KvTurnover[str] = KvTurnover(tau_s=2.0)
    assert kv.rate_per_s("d0", 0.0) == 0.0
    kv.observe("d0", 4000, now=10.0)
    assert kv.rate_per_s("d0", 10.0) == pytest.approx(2000.0)
    kv.observe("d0", 2000, now=12.0)
    assert kv.rate_per_s("d0", 12.0) == pytest.approx((4000 * math.exp(-1.0) + 2000) / 2.0)
    assert kv.rate_per_s("d0", 14.0) == pytest.approx(
        (4000 * math.exp(-1.0) + 2000) * math.exp(-1.0) / 2.0
    )
    kv.observe("d0", -5, now=14.0)  # nothing negative is ever released
    assert set(kv.value) == {"d0"}
    assert kv.rate_per_s("d0", 14.0) > 0


def backlogged(errors: ProjectionErrors, now: float) -> float:
    """What is added on a path with backlog (any prompt size)."""
    return errors.allowance(50, now).backlog_s


def test_projection_errors_allow_for_the_recent_overrun_quantile_in_seconds() -> None:
    # The quantile is half way from slo.percentile to 1: misses at the edge of the budget
    # at half the rate the SLO allows.
    assert ProjectionErrors().quantile == pytest.approx(0.95)
    errors = ProjectionErrors(percentile=0.8, budget_s=0.5)
    assert errors.quantile == pytest.approx(0.9)
    for _ in range(ERROR_MIN_SAMPLES - 1):
        errors.observe(50, 0.1, 0.05, 0.2, now=0.0)
    assert backlogged(errors, 0.0) == 0.0  # too few samples to trust
    errors.observe(50, 0.1, 0.05, 0.2, now=0.0)
    assert backlogged(errors, 0.0) == pytest.approx(0.1)
    # 95 % of recent first tokens came within 25 ms of their projection, 5 % 300 ms over.
    for k in range(ERROR_WINDOW):
        errors.observe(50, 0.1, 0.05, 0.125 if k % 20 else 0.4, now=1.0)
    assert backlogged(errors, 1.0) == pytest.approx(0.025)
    errors.reconfigure(0.9, budget_s=0.5)
    assert backlogged(errors, 1.0) == pytest.approx(0.25)  # 300 ms, capped at half the budget
    errors.reconfigure(0.9, budget_s=1.0)
    assert backlogged(errors, 1.0) == pytest.approx(0.3)
    # Pessimistic projections never loosen admission.
    for _ in range(ERROR_WINDOW):
        errors.observe(50, 0.2, 0.05, 0.1, now=2.0)
    assert backlogged(errors, 2.0) == 0.0
    errors.observe(50, 0.0, 0.0, 0.1, now=2.0)  # nothing to compare
    assert errors.statistics(2.0).backlog.samples == ERROR_WINDOW


def added(errors: ProjectionErrors, prompt_tokens: int, now: float) -> tuple[float, float]:
    """(with backlog, without) for a prompt of `prompt_tokens`."""
    allowance = errors.allowance(prompt_tokens, now)
    return allowance.backlog_s, allowance.idle_s


def test_with_no_backlog_only_errors_of_the_same_size_with_none_count() -> None:
    errors = ProjectionErrors(percentile=0.8, budget_s=0.5)
    # Short chats on idle paths run 2.5x over their 20 ms projections: a fixed 30 ms.
    for _ in range(100):
        errors.observe(40, 0.02, 0.0, 0.05, now=0.0)
    assert added(errors, 100, 0.0) == pytest.approx((0.03, 0.03))
    # A 6000-token prompt on an idle engine is judged by its own size's record: none.
    assert added(errors, 6000, 0.0) == pytest.approx((0.03, 0.0))
    assert added(errors, 128, 0.0) == pytest.approx((0.03, 0.0))
    # So, projected at 400 ms, it is admitted (x2.5, capped at x2, made it 800 ms); with
    # 10 ms of backlog the chats' 30 ms counts: the load is everyone's.
    idle = PathQuote("p0", "disaggregated", 0.0, ttft_s=0.4, idle_ttft_s=0.4, in_domain=True)
    busy = PathQuote("p1", "disaggregated", 0.01, ttft_s=0.41, idle_ttft_s=0.4, in_domain=True)
    allowance = errors.allowance(6000, 0.0)
    verdict = judge([idle], prompt_tokens=6000, ttft_target_s=0.5, margin=0.0, allowance=allowance)
    assert verdict.admitted
    verdict = judge([busy], prompt_tokens=6000, ttft_target_s=0.43, margin=0.0, allowance=allowance)
    assert verdict.code == "ttft_budget"
    assert verdict.retry_after_s == pytest.approx(0.41 + 0.03 - 0.43)
    # The idle path wins once the allowances are counted, though it projects more.
    cheap = attrs.evolve(busy, ttft_s=0.39)
    verdict = judge(
        [cheap, idle], prompt_tokens=6000, ttft_target_s=0.4, margin=0.0, allowance=allowance
    )
    assert (verdict.admitted, verdict.quote) == (True, idle)
    # Streams that had backlog teach the paths with backlog only; 4096-8191-token ones
    # that had none teach that band.
    for _ in range(ERROR_MIN_SAMPLES):
        errors.observe(5000, 0.4, 0.2, 0.6, now=1.0)
    assert added(errors, 6000, 1.0) == pytest.approx((0.2, 0.0))
    for _ in range(ERROR_MIN_SAMPLES):
        errors.observe(5000, 0.4, 0.0, 0.46, now=1.0)
    assert added(errors, 6000, 1.0) == pytest.approx((0.2, 0.06))
    assert added(errors, 40, 1.0) == pytest.approx((0.2, 0.03))
    stats = errors.statistics(1.0)
    assert stats.backlog.samples == 100 + 2 * ERROR_MIN_SAMPLES
    assert {band: w.samples for band, w in stats.idle.items()} == {
        "0-127": 100,
        "4096-8191": ERROR_MIN_SAMPLES,
    }
    assert [w.overrun_s for w in stats.idle.values()] == pytest.approx([0.03, 0.06])


def test_projection_errors_hold_at_most_a_window_per_band_and_one_for_backlog() -> None:
    errors = ProjectionErrors()
    for k in range(3 * ERROR_WINDOW):
        for tokens in (64 << band for band in range(ERROR_BANDS + 3)):
            errors.observe(tokens, 0.1, 0.0, 0.2, now=k * 0.001)
    stats = errors.statistics(1.0)
    assert stats.backlog.samples == ERROR_WINDOW
    assert [w.samples for w in stats.idle.values()] == [ERROR_WINDOW] * ERROR_BANDS


def test_prompt_size_bands_double_from_128_tokens() -> None:
    cases = [(0, "0-127"), (127, "0-127"), (128, "128-255"), (255, "128-255")]
    cases += [(4096, "4096-8191"), (32767, "16384-32767"), (32768, "32768+"), (10**6, "32768+")]
    assert [(n, band_label(error_band(n))) for n, _ in cases] == cases


def test_a_burst_of_errors_is_forgotten_after_the_window() -> None:
    errors = ProjectionErrors(percentile=0.8)
    for _ in range(ERROR_MIN_SAMPLES):
        errors.observe(50, 0.1, 0.0, 0.18, now=10.0)
    assert added(errors, 50, 10.0 + ERROR_WINDOW_S) == pytest.approx((0.08, 0.08))
    # A quiet service: no new streams, the burst ages out and admission loosens again.
    assert errors.allowance(50, 10.1 + ERROR_WINDOW_S) == NO_ALLOWANCE
    stats = errors.statistics(10.1 + ERROR_WINDOW_S)
    assert (stats.backlog, stats.idle) == (WindowStatistics(0, 0.0), {})


def test_judge_adds_the_allowance_to_the_projection_but_judges_the_prompt_without_it() -> None:
    quote = PathQuote(
        "p0", "disaggregated", wait_s=0.2, ttft_s=0.4, idle_ttft_s=0.2, in_domain=True
    )
    assert judge([quote], prompt_tokens=10, ttft_target_s=0.5, margin=0.0).admitted
    allowance = Allowance(backlog_s=0.2, idle_s=0.05)
    verdict = judge([quote], prompt_tokens=10, ttft_target_s=0.5, margin=0.0, allowance=allowance)
    assert not verdict.admitted
    assert verdict.code == "ttft_budget"
    assert verdict.message == (
        "projected time to first token 0.400s (0.600s allowing for the 0.200s by which "
        "recent first tokens ran over their projections) exceeds the TTFT budget 0.500s "
        "(slo.ttft_s=0.5 with serving.admission_margin=0.0); 0.200s of it is backlog on "
        "the cheapest path"
    )
    assert verdict.retry_after_s == pytest.approx(0.1)
    # An idle projection inside the budget is not the prompt's fault, whatever its
    # size's recent error.
    idle = PathQuote(
        "p0", "disaggregated", wait_s=0.0, ttft_s=0.47, idle_ttft_s=0.47, in_domain=True
    )
    verdict = judge([idle], prompt_tokens=10, ttft_target_s=0.5, margin=0.0, allowance=allowance)
    assert verdict.code == "ttft_budget"
    assert verdict.message.startswith(
        "projected time to first token 0.470s (0.520s allowing for the 0.050s by which "
        "recent first tokens of 0-127-token prompts with no backlog ran over their "
        "projections) exceeds"
    )


def test_overdue_backlog_counts_as_long_again_as_it_is_late() -> None:
    book: BacklogBook[str] = BacklogBook()
    book.commit("p0", 0.1, now=0.0)
    assert book.wait_s("p0", 0.05) == pytest.approx(0.05)
    # Its leg should have ended at 0.1 and has not: a stalled or slow engine is not idle.
    assert book.wait_s("p0", 0.3) == pytest.approx(0.2)
    book.commit("p0", 0.1, now=0.3)  # queued behind the overdue work
    assert book.wait_s("p0", 0.3) == pytest.approx(0.3)
    book.release("p0")
    book.release("p0")
    assert book.wait_s("p0", 0.4) == 0.0  # nothing running: the error is forgotten
    book.commit("p1", 0.1, now=1.0)
    assert book.wait_s("p1", 1.102) == pytest.approx(0.002)  # a healthy engine a bit late
