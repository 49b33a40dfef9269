"""Non-streaming decode legs: the KV they generate is estimated from their age, because
the router sees no token of theirs until the whole body arrives."""

from __future__ import annotations

import math

import pytest

from narwhal.admission import price_fleet
from narwhal.config import Config, EngineSpec
from narwhal.fleet import EngineState

from .test_first_token_wait import Source


async def test_an_engine_sums_the_age_and_bounds_of_its_unstreamed_legs() -> None:
    spec = EngineSpec(id="d0", url="http://127.0.0.1:9", role="decode")
    engine = EngineState(spec, Config(engines=(spec,)))
    assert engine.view(5.0).unstreamed_age_s == 0.0
    with engine.load.unstreamed_decode(100, since=1.0):
        with engine.load.unstreamed_decode(50, since=2.0):
            view = engine.view(5.0)
            assert view.unstreamed_age_s == pytest.approx(4.0 + 3.0)
            assert view.unstreamed_cap == 150
            with engine.load.unstreamed_decode(None, since=4.0):
                # A leg without max_tokens may make any number of tokens.
                assert engine.view(5.0).unstreamed_cap == math.inf
            assert engine.view(5.0).unstreamed_cap == 150
        assert engine.view(6.0).unstreamed_age_s == pytest.approx(5.0)
        assert engine.load.unstreamed_legs == 1
    view = engine.view(6.0)
    assert (view.unstreamed_age_s, view.unstreamed_cap, engine.load.unstreamed_legs) == (
        0.0,
        0.0,
        0,
    )
    await engine.aclose()


async def test_pricing_counts_the_estimate_into_the_engines_kv() -> None:
    spec = EngineSpec(id="d0", url="http://127.0.0.1:9", role="decode")
    engine = EngineState(spec, Config(engines=(spec,)))
    engine.load.generated().add(1_000)  # tokens of streams seen so far
    with engine.load.unstreamed_decode(10_000, since=0.0):
        # Source's decode curve steps every 10 ms: 2 s make 200 tokens.
        priced = price_fleet([engine.view(2.0)], Source())
        assert priced["d0"].decode_tokens == pytest.approx(1_200)
    priced = price_fleet([engine.view(2.0)], Source())
    assert priced["d0"].decode_tokens == 1_000
    await engine.aclose()
