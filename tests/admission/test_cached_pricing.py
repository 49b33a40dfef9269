"""Pricing a prompt by the tokens each engine must compute: the cached-prefill law,
admission's credit and placement's affinity (docs/design.md#prefix-caching)."""

from __future__ import annotations

import math

import attrs
import pytest

from narwhal.admission import Priced, cached_prefill_s, placement_policy, quote_paths
from narwhal.fleet import EngineView
from narwhal.placement import DEFAULT_POLICY, Placement, cached_load_policy, choose
from narwhal.profiles import PrefillModel

from ..support import engine_view
from .test_pricing import Flat

QUADRATIC = PrefillModel(
    a_s=0.01, b_s_per_token=1e-4, c_s_per_token2=1e-8, min_tokens=1, max_tokens=8192
)


@attrs.frozen
class Constant:
    seconds: float

    def prefill_s(self, n: int) -> float:
        return self.seconds

    def in_domain(self, n: int) -> bool:
        return True


def test_the_law_charges_new_tokens_and_their_attention_over_the_cached_prefix() -> None:
    # a + b(n-k) + c(n²-k²): 4000 tokens, 3000 cached.
    expected = 0.01 + 1e-4 * 1000 + 1e-8 * (4000**2 - 3000**2)
    assert cached_prefill_s(QUADRATIC, 4000, 3000) == pytest.approx(expected)
    assert cached_prefill_s(QUADRATIC, 4000, 0) == pytest.approx(QUADRATIC.prefill_s(4000))
    # More cached than the prompt (a stale count) saves no more than the whole prompt,
    # and the fixed cost always stays.
    assert cached_prefill_s(QUADRATIC, 4000, 9000) == pytest.approx(0.01)
    assert cached_prefill_s(Constant(0.2), 4000, 3999) == pytest.approx(0.2)


def priced(engine: str, role: str, cached: int, backlog_s: float = 0.0) -> Priced:
    return Priced(engine_view(engine, role), QUADRATIC, Flat(0.01), backlog_s, cached_tokens=cached)


def test_admission_quotes_the_cached_engine_by_what_it_must_compute() -> None:
    engines = [priced("p0", "prefill", 0), priced("p1", "prefill", 3968), priced("d0", "decode", 0)]
    quotes = quote_paths(engines, prompt_tokens=4000, handoff_s=0.0)
    assert [q.engine for q in quotes] == ["p1", "p0"]
    by_engine = {q.engine: q.idle_ttft_s - 0.01 for q in quotes}  # less the decode step
    assert by_engine["p1"] == pytest.approx(cached_prefill_s(QUADRATIC, 4000, 3968))
    assert by_engine["p0"] == pytest.approx(QUADRATIC.prefill_s(4000))
    # With no credit (cache.affinity 0) the cache is invisible to admission.
    blind = quote_paths(engines, prompt_tokens=4000, handoff_s=0.0, credit=0.0)
    assert [q.ttft_s for q in blind] == [pytest.approx(QUADRATIC.prefill_s(4000) + 0.01)] * 2


def test_an_aggregate_engine_is_quoted_by_its_own_cache() -> None:
    engines = [priced("b0", "both", 2048), priced("b1", "both", 0)]
    quotes = quote_paths(engines, prompt_tokens=4000, handoff_s=0.0)
    assert quotes[0].engine == "b0"
    assert quotes[0].idle_ttft_s < quotes[1].idle_ttft_s


def views_of(engines: list[Priced]) -> list[EngineView]:
    return [p.view for p in engines]


def policy(engines: list[Priced], affinity: float, budget_s: float = 10.0) -> Placement:
    prices = {p.view.id: p for p in engines}
    chosen = choose(
        views_of(engines),
        policy=placement_policy(
            prices,
            prompt_tokens=4000,
            handoff_s=0.0,
            ttft_budget_s=budget_s,
            tpot_target_s=1.0,
            affinity=affinity,
        ),
    )
    assert isinstance(chosen, Placement)
    return chosen


def test_affinity_places_on_the_cache_until_its_backlog_costs_more_than_the_hit() -> None:
    saving = QUADRATIC.prefill_s(4000) - cached_prefill_s(QUADRATIC, 4000, 3968)
    hot = [
        priced("p0", "prefill", 0),
        priced("p1", "prefill", 3968, backlog_s=saving / 2),
        priced("d0", "decode", 0),
    ]
    assert policy(hot, affinity=1.0).prefill == "p1"
    # A backlog worth more than the hit sends the prompt elsewhere: the load-balance term.
    hotter = [*hot[:1], priced("p1", "prefill", 3968, backlog_s=saving * 1.5), hot[2]]
    assert policy(hotter, affinity=1.0).prefill == "p0"
    # Above 1 the cache is worth more than its seconds to placement.
    assert policy(hotter, affinity=2.0).prefill == "p1"


@pytest.mark.parametrize("budget_s", [10.0, 0.45, 0.3])
def test_affinity_zero_places_exactly_as_without_caches(budget_s: float) -> None:
    # Budgets where both, one or no prefill engine complies uncached; the cached one
    # would comply at 0.3 s when credited.
    cached = [
        priced("p0", "prefill", 0, backlog_s=0.05),
        priced("p1", "prefill", 3968, backlog_s=0.1),
        priced("d0", "decode", 0),
    ]
    uncached = [attrs.evolve(p, cached_tokens=0) for p in cached]
    assert policy(cached, affinity=0.0, budget_s=budget_s) == policy(
        uncached, affinity=1.0, budget_s=budget_s
    )


def test_the_credit_in_a_projection_never_exceeds_what_the_cache_saves() -> None:
    # affinity 3: placement favours the cache three times its worth, but the projected
    # SLO check still prices it at its worth, so a path is never thought faster than it is.
    engines = [priced("p1", "prefill", 3968), priced("d0", "decode", 0)]
    own = cached_prefill_s(QUADRATIC, 4000, 3968)
    assert policy(engines, affinity=3.0, budget_s=own + 0.01 + 1e-6).unserved is False
    assert policy(engines, affinity=3.0, budget_s=own + 0.01 - 1e-6).unserved is True


def test_the_load_policy_without_profiles_counts_cached_tokens_off_the_backlog() -> None:
    views = [
        engine_view("p0", "prefill", prefill_tokens_inflight=1000),
        engine_view("p1", "prefill", prefill_tokens_inflight=2500),
        engine_view("d0", "decode"),
    ]
    assert cached_load_policy({"p1": 2000}, 0.0) is DEFAULT_POLICY
    assert cached_load_policy({}, 1.0) is DEFAULT_POLICY
    assert choose(views, policy=cached_load_policy({"p1": 1000}, 1.0)).prefill == "p0"  # type: ignore[union-attr]
    assert choose(views, policy=cached_load_policy({"p1": 2000}, 1.0)).prefill == "p1"  # type: ignore[union-attr]


def test_an_engine_without_a_prefill_profile_is_priced_infinite() -> None:
    assert math.isinf(Priced(engine_view("d0", "decode"), None, Flat(0.01)).prefill_s(10))
