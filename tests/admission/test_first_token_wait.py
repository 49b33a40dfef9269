"""An overdue first token on a decode engine is seen before it arrives."""

from __future__ import annotations

import pytest

from narwhal.admission import price_fleet
from narwhal.config import Config, EngineSpec
from narwhal.fleet import EngineState

from ..support import engine_view
from .test_pricing import Flat, Linear


class Source:
    def prefill_curve(self, engine_id: str) -> Linear:
        return Linear(0.0001)

    def decode_curve(self, engine_id: str) -> Flat:
        return Flat(0.01)

    def handoff_s(self, prompt_tokens: int) -> float:
        return 0.0

    def decode_correction(self, engine_id: str) -> float:
        return 1.0

    def kv_capacity_tokens(self, engine_id: str) -> int | None:
        return None


async def test_the_oldest_waiting_decode_leg_sets_the_wait() -> None:
    spec = EngineSpec(id="d0", url="http://127.0.0.1:9", role="decode")
    engine = EngineState(spec, Config(engines=(spec,)))
    assert engine.load.first_token_wait_s(5.0) == 0.0
    with engine.load.awaiting_first_token(1.0) as first:
        with engine.load.awaiting_first_token(2.0):
            assert engine.view(5.0).first_token_wait_s == pytest.approx(4.0)
            first.release()  # the older leg got its token: the younger one is the oldest now
            assert engine.load.first_token_wait_s(5.0) == pytest.approx(3.0)
        assert engine.load.first_token_wait_s(5.0) == 0.0  # a leg that ends stops waiting
    assert engine.load.first_token_wait_s(5.0) == 0.0
    await engine.aclose()


def test_pricing_takes_the_overdue_wait_as_a_lower_bound_on_the_lag() -> None:
    views = [
        engine_view("d0", "decode", first_token_wait_s=0.5),
        engine_view("d1", "decode"),
    ]
    priced = price_fleet(views, Source(), first_token_lag_s={"d0": 0.2})
    assert priced["d0"].first_token_lag_s == pytest.approx(0.5)
    assert priced["d1"].first_token_lag_s == 0.0
    priced = price_fleet(views, Source(), first_token_lag_s={"d0": 0.2, "d1": 0.3})
    assert priced["d1"].first_token_lag_s == pytest.approx(0.3)
