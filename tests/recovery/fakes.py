"""A scripted `Prober` and helpers for driving recovery under a MockClock (no sockets)."""

from __future__ import annotations

import math
from typing import Any

import attrs
import trio

from narwhal._errors import EngineFailed
from narwhal.config import Config, diff, load_config
from narwhal.fleet import EngineState
from narwhal.recovery import (
    ContextReading,
    KeyCheck,
    LoadSample,
    ProbeResult,
    Recovery,
    ScrapeError,
    VerifyPair,
    VerifyResult,
)
from narwhal.serving import ServingContext
from narwhal.supervisor._reload import apply_config

from ..support import FakeFileLimit

HEALTHY = ProbeResult("ok", "GET /health returned HTTP 200", True, (("instance_id", "a"),))
UNHEALTHY = ProbeResult("failed", "GET /health returned HTTP 503", True)
REFUSED = ProbeResult("failed", "GET /health: connect failed: connection refused", False)
EXHAUSTED = ProbeResult("inconclusive", "control pool of d0 exhausted (2/2 in use)", None)
VERIFIED = VerifyResult("ok", "completed")
KEY_ACCEPTED = KeyCheck("accepted", "GET /v1/models returned HTTP 200")
CONTEXT = ContextReading(8192, "GET /v1/models max_model_len")
# How recovery words a refusal of the key Narwhal sends (`fleet.explain_refusal`).
WRONG_KEY = (
    "the engine refused narwhal's API key (HTTP 401: Unauthorized); check "
    "engine.api_key_file against the engine's --api-key"
)
KEY_REFUSED = KeyCheck("refused", f"GET /v1/models: {WRONG_KEY}")


@attrs.define
class Verification:
    subject: str
    phase: str
    prefill: str
    decode: str
    at: float


def timed_out(where: str, setting: str, deadline_s: float) -> str:
    return f"{where}: no answer within {setting}={deadline_s}"


class FakeProber:
    def __init__(self) -> None:
        # Engines that never answer their probes and scrapes (`hung`) or verification legs
        # (`hung_legs`): each runs out its deadline (engine.health_timeout_s,
        # engine.first_token_timeout_s), as a hung engine's would.
        self.hung: set[str] = set()
        self.hung_legs: set[str] = set()
        self.health_of: dict[str, ProbeResult] = {}
        # Seconds a probe of the engine takes before it answers.
        self.health_delay: dict[str, float] = {}
        self.verify_of: dict[str, VerifyResult] = {}
        # Results handed out one per verification, before verify_of applies.
        self.verify_next: dict[str, list[VerifyResult]] = {}
        self.key_of: dict[str, KeyCheck] = {}
        self.load_of: dict[str, LoadSample | Exception] = {}
        # Seconds a scrape takes to answer; one at or past engine.health_timeout_s runs
        # it out (math.inf: /metrics accepts the connection and never answers).
        self.scrape_delay_of: dict[str, float] = {}
        self.probes: list[tuple[str, float]] = []
        self.scrapes: list[tuple[str, float]] = []
        self.verifications: list[Verification] = []
        self.key_checks: list[tuple[str, float]] = []
        self.context_of: dict[str, ContextReading] = {}
        self.context_reads: list[tuple[str, float]] = []

    async def health(self, engine: EngineState, config: Config) -> ProbeResult:
        await trio.lowlevel.checkpoint()
        self.probes.append((engine.id, trio.current_time()))
        if engine.id in self.hung:
            limit = config.engine.health_timeout_s
            await trio.sleep(limit)
            detail = timed_out("GET /health", "engine.health_timeout_s", limit)
            return ProbeResult("failed", detail, None, deadline_s=limit)
        await trio.sleep(self.health_delay.get(engine.id, 0.0))
        return self.health_of.get(engine.id, HEALTHY)

    async def scrape(self, engine: EngineState, config: Config) -> LoadSample:
        await trio.lowlevel.checkpoint()
        self.scrapes.append((engine.id, trio.current_time()))
        delay = math.inf if engine.id in self.hung else self.scrape_delay_of.get(engine.id, 0.0)
        limit = config.engine.health_timeout_s
        if delay >= limit:
            await trio.sleep(limit)
            raise ScrapeError(timed_out("GET /metrics", "engine.health_timeout_s", limit))
        if delay:
            await trio.sleep(delay)
        result = self.load_of.get(engine.id, LoadSample(1.0, 0.0, 0.1))
        if isinstance(result, Exception):
            raise result
        return result

    async def verify(self, pair: VerifyPair, config: Config) -> VerifyResult:
        await trio.lowlevel.checkpoint()
        self.verifications.append(
            Verification(
                pair.subject.id, pair.phase, pair.prefill.id, pair.decode.id, trio.current_time()
            )
        )
        if pair.subject.id in self.hung_legs:
            limit = config.engine.first_token_timeout_s
            await trio.sleep(limit)
            where = f"{pair.phase} leg on {pair.subject.id}"
            detail = timed_out(where, "engine.first_token_timeout_s", limit)
            return VerifyResult("failed", detail, pair.subject.id, deadline_s=limit)
        queued = self.verify_next.get(pair.subject.id)
        if queued:
            return queued.pop(0)
        return self.verify_of.get(pair.subject.id, VERIFIED)

    async def check_key(self, engine: EngineState, config: Config) -> KeyCheck:
        await trio.lowlevel.checkpoint()
        self.key_checks.append((engine.id, trio.current_time()))
        return self.key_of.get(engine.id, KEY_ACCEPTED)

    async def context(self, engine: EngineState, config: Config) -> ContextReading:
        await trio.lowlevel.checkpoint()
        self.context_reads.append((engine.id, trio.current_time()))
        return self.context_of.get(engine.id, CONTEXT)


def config(**sections: Any) -> Config:
    document: dict[str, Any] = {
        "engines": [
            {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
            {"id": "d0", "url": "http://127.0.0.1:10", "role": "decode"},
        ],
        "recovery": {
            "restart_hold_s": 5.0,
            "health": {"interval_s": 1.0, "failure_threshold": 3, "readmit_successes": 2},
            "breaker": {"failure_threshold": 3, "window_s": 10.0, "open_s": 4.0},
        },
    }
    return load_config(merge(document, sections))


async def reload(ctx: ServingContext, recovery: Recovery, new: Config) -> list[EngineState]:
    """Apply `new` as `narwhalctl reload` would; returns the engines it retired (their
    resident requests are left to the caller: there is no supervisor to retire them)."""
    retired: list[EngineState] = []
    descriptors = FakeFileLimit().limit().fit(new)
    await apply_config(
        ctx, recovery, new, diff(ctx.config, new), retired.append, descriptors=descriptors
    )
    return retired


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def first_token_timeout(engine: str, phase: str, deadline_s: float) -> EngineFailed:
    return EngineFailed(
        f"{phase} engine {engine}: no first token within engine.first_token_timeout_s={deadline_s}",
        status=504,
        engine_id=engine,
        phase=phase,
        retryable=True,
        counts_against_engine=True,
        code="first_token_timeout",
        public=f"{phase} engine: no first token within engine.first_token_timeout_s={deadline_s}",
        deadline_s=deadline_s,
    )


def failure(engine: str, phase: str, *, status: int = 502, counts: bool = True) -> EngineFailed:
    return EngineFailed(
        f"{phase} engine {engine} returned HTTP {status}",
        status=status,
        engine_id=engine,
        phase=phase,
        retryable=True,
        counts_against_engine=counts,
        code=f"engine_http_{status}",
        public=f"{phase} engine returned HTTP {status}",
    )


def unreachable(engine: str, phase: str, timeout_s: float | None = None) -> EngineFailed:
    """What the request path reports for a leg whose connection was refused, or (with
    `timeout_s`) whose connect ran out engine.connect_timeout_s."""
    detail = (
        "failed: connection refused"
        if timeout_s is None
        else f"exceeded engine.connect_timeout_s={timeout_s}"
    )
    return EngineFailed(
        f"{phase} engine {engine}: connect to 127.0.0.1:10 {detail}",
        status=502,
        engine_id=engine,
        phase=phase,
        retryable=True,
        counts_against_engine=True,
        code="engine_unreachable",
        public=f"{phase} engine: could not connect",
        deadline_s=timeout_s,
    )


def scrape_error(text: str) -> ScrapeError:
    return ScrapeError(text)
