"""Running a campaign: a simulated fleet and Narwhal in this process, a bounded load
loop of recorded exchanges, then settle and check every invariant.

Faults are injected as a function of the request index (the plan for request i may
set a fault first), never on a timer, so a campaign's fault mix does not depend on how
fast the box is; a campaign's own assertions check that the faults really happened.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

import attrs
import trio

from narwhal.admission import ProfileSource
from narwhal.config import Config, load_config
from narwhal.sim import Fleet, SimEngine, SimEngineSpec, serve_fleet
from narwhal.supervisor import Supervisor

from ..serving.conftest import MODEL, Stack, fleet_config
from ..support import wait_for
from .client import Exchange, HangUp, exchange
from .hostile import Behaviour, HostileEngine
from .invariants import Report, check_all, verdict

# Tight, test-sized settings: every timer fires within a second or two, retries are on
# and cheap, recovery reacts fast. Campaigns override what they exercise.
BASE: dict[str, Any] = {
    "serving": {
        "request_timeout_s": 4.0,
        "prefill_timeout_s": 1.0,
        "max_attempts": 3,
        "handoff_timeout_s": 1.0,
        "retry_base_s": 0.005,
        "retry_cap_s": 0.05,
        "retry_budget": 1000,
        "retry_replenish": 1.0,
        "client_stall_s": 0.5,
    },
    "engine": {
        "first_token_timeout_s": 1.0,
        "decode_read_timeout_s": 0.5,
        "tokenize_timeout_s": 0.5,
        "health_timeout_s": 0.5,
        "pool_timeout_s": 2.0,
        "connect_timeout_s": 0.5,
    },
    "recovery": {
        "restart_hold_s": 0.2,
        "health": {"interval_s": 0.05, "failure_threshold": 2, "readmit_successes": 2},
        "breaker": {"failure_threshold": 5, "window_s": 5.0, "open_s": 0.3},
        "shutdown_grace_s": 1.0,
    },
    "controller": {"enabled": False, "monitor_interval_s": 0.1},
}
# The last write after a deadline is bounded by serving.client_stall_s; the rest is
# scheduling noise on a shared two-core box.
SLACK_S = 1.0


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


Plan = Callable[[int], Awaitable[object]]


@attrs.define(eq=False)
class Campaign:
    """One stack under one campaign; `run` may be called several times before `check`."""

    name: str
    stack: Stack
    rng: random.Random
    exchanges: list[Exchange] = attrs.Factory(list)
    retired: list[SimEngine] = attrs.Factory(list)
    outcomes_before: dict[str, int] = attrs.Factory(dict)
    sent: int = 0
    _restarting: trio.Lock = attrs.Factory(trio.Lock)

    @property
    def fleet(self) -> Fleet:
        return self.stack.fleet

    @property
    def config(self) -> Config:
        return self.stack.ctx.config

    def request_id(self, index: int) -> str:
        self.sent += 1
        return f"{self.name}-{index}-{self.sent}"

    def body(self, *, stream: bool, max_tokens: int = 8, chat: bool = False) -> dict[str, Any]:
        prompt = " ".join(self.rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(12))
        if chat:
            return {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "stream": stream,
            }
        return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}

    async def send(
        self, index: int, body: dict[str, Any], *, label: str = "", **kw: Any
    ) -> Exchange:
        """One recorded exchange; it is in `exchanges` from the moment it starts."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        kw.setdefault("give_up_s", self.config.serving.request_timeout_s + 10.0)
        return await exchange(
            self.stack.url,
            body,
            request_id=self.request_id(index),
            path=path,
            label=label,
            on_start=self.exchanges.append,
            **kw,
        )

    async def run(self, count: int, plan: Plan, *, concurrency: int, within_s: float) -> None:
        """Run plan(0..count-1) with `concurrency` workers; no new request starts after
        `within_s`, and every exchange is bounded by its own give-up time."""
        next_index = 0
        stop_at = trio.current_time() + within_s

        async def worker() -> None:
            nonlocal next_index
            while next_index < count and trio.current_time() < stop_at:
                index = next_index
                next_index += 1
                await plan(index)

        bound = within_s + self.config.serving.request_timeout_s + 20.0
        with trio.fail_after(bound):
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)

    async def restart(self, index: int) -> None:
        """Restart a simulated engine, keeping the old instance's outcome ring."""
        async with self._restarting:
            old = self.fleet[index].engine
            await self.fleet[index].restart()
            self.retired.append(old)

    def router_released(self, label: str) -> HangUp:
        """Hang up once the router has let go of the request (it had it first)."""
        records = self.stack.ctx.records

        async def hang_up(ex: Exchange) -> str:
            def held() -> bool:
                return any(r.id == ex.request_id for r in records.values())

            await wait_for(held, within_s=10)
            await wait_for(lambda: not held(), within_s=30)
            return label

        return hang_up

    def at_stage(self, stage: str, also: Callable[[], bool] = lambda: True) -> HangUp:
        """Hang up once the router reports the request at `stage` (and `also` holds)."""
        records = self.stack.ctx.records

        async def hang_up(ex: Exchange) -> str:
            def there() -> bool:
                return also() and any(
                    r.id == ex.request_id and r.stage == stage for r in records.values()
                )

            await wait_for(there, within_s=10)
            return stage

        return hang_up

    def exchanges_by_label(self) -> dict[str, int]:
        """Client verdicts of this campaign so far, counted by `kind:code`."""
        out: dict[str, int] = {}
        for ex in self.exchanges:
            label = verdict(ex).label
            out[label] = out.get(label, 0) + 1
        return out

    def label_of(self, ex: Exchange) -> str:
        return verdict(ex).label

    def engine_states(self) -> list[dict[str, Any]]:
        # A retired instance's KV went with it (its process is gone, in real life), so
        # its leases are not expected to expire: it is marked for the check.
        retired = [{**e.state(), "retired": True} for e in self.retired]
        return retired + [h.state() for h in self.fleet]

    def total(self, counter: str) -> int:
        """A simulator counter summed over every engine instance (dict counters too)."""
        out = 0
        for state in self.engine_states():
            value = state["counters"][counter]
            out += sum(value.values()) if isinstance(value, dict) else value
        return out

    async def settle(self, *, within_s: float = 15.0) -> None:
        """Wait (bounded) until the router holds nothing and no engine works on anything
        or holds KV for anyone: every lease released or expired."""
        ctx = self.stack.ctx
        await wait_for(lambda: ctx.retained == 0, within_s=within_s)
        # Recovery sends verification legs of its own to engines it distrusts; with the
        # faults gone it readmits every engine, and after that it sends no more.
        for handle in self.fleet:
            handle.clear_faults()
        await wait_for(
            lambda: all(e.unavailable_reason(trio.current_time()) is None for e in ctx.fleet),
            within_s=within_s,
        )

        def engines_idle() -> bool:
            for handle in self.fleet:
                state = handle.state(outcomes=0)
                if state["running"] or state["waiting"] or state["pulling"]:
                    return False
                if state["leases"]["held"]:
                    return False
                # A leg stalled inside the engine is neither running nor waiting; it has
                # ended only once its outcome is recorded.
                counters = state["counters"]
                accepted = sum(counters["requests"].values())
                refused = counters["errors_injected"] + counters["rejected_queue_full"]
                ended = sum(
                    sum(counters[key].values()) for key in ("completed", "aborted", "errors")
                )
                if ended < accepted + refused:
                    return False
            return True

        await wait_for(engines_idle, within_s=within_s)

    async def check(
        self, *, leases_released: bool = True, other_legs: Sequence[Mapping[str, Any]] = ()
    ) -> Report:
        await self.settle()
        router_state = await self.stack.state()
        return check_all(
            self.exchanges,
            request_timeout_s=self.config.serving.request_timeout_s,
            slack_s=SLACK_S,
            engine_states=self.engine_states(),
            router_state=router_state,
            outcomes_before=self.outcomes_before,
            leases_released=leases_released,
            ctx=self.stack.ctx,
            other_legs=other_legs,
        )


StartCampaign = Callable[..., Awaitable[Campaign]]


async def start_campaign(
    nursery: trio.Nursery,
    name: str,
    roles: list[str] | None = None,
    *,
    seed: int = 0,
    speed: float = 20.0,
    sim: dict[str, Any] | None = None,
    extra_engines: list[dict[str, Any]] | None = None,
    profiles: ProfileSource | None = None,
    **sections: Any,
) -> Campaign:
    """`extra_engines` are engine specs (id, url, role) placed before the simulated
    ones in the config: engines that are not simulators (tests/reliability/hostile.py).
    `profiles` prices predictive admission (serving.admission: predictive)."""
    roles = roles or ["prefill", "prefill", "decode", "decode"]
    # A ring large enough for every leg of the longest campaign.
    spec = SimEngineSpec(outcome_ring=200_000)
    fleet: Fleet = await nursery.start(
        partial(serve_fleet, engines=len(roles), speed=speed, model=MODEL, spec=spec, **(sim or {}))
    )
    document = merge(merge(fleet_config(fleet, roles), BASE), sections)
    for spec in reversed(extra_engines or []):
        document["engines"].insert(0, {"model": MODEL, **spec})
    config = load_config(document)
    supervisor: Supervisor = await nursery.start(Supervisor(config, profiles=profiles).run)
    stack = Stack(fleet, supervisor, config)
    campaign = Campaign(name, stack, random.Random(seed))
    campaign.outcomes_before = dict(stack.ctx.outcomes)
    return campaign


async def start_beside_hostile(
    start: StartCampaign,
    nursery: trio.Nursery,
    name: str,
    side: str,
    behaviour: Behaviour,
    **kw: Any,
) -> tuple[Campaign, HostileEngine]:
    """A campaign whose `side` engine ("prefill" or "decode", id "h") is a hostile engine
    running `behaviour`, beside one simulated engine of the other role."""
    engine = HostileEngine()
    await nursery.start(engine.serve)
    engine.behaviours[side] = behaviour
    sim_role = "prefill" if side == "decode" else "decode"
    campaign = await start(
        name, [sim_role], extra_engines=[{"id": "h", "url": engine.url, "role": side}], **kw
    )
    return campaign, engine
