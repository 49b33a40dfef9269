"""The production prober: HTTP requests to each engine on its control pool.

Owns
  `HttpProber`: health probes (GET /health, then GET /version for the engine's
  identity), /metrics scrapes, key checks (the dialect's key_check_path, which the
  engine guards with its --api-key), context-length readings and verification pairs
  (`_pairs`).

Invariants
  A health probe, a scrape and a key check each get engine.health_timeout_s in total;
  each verification leg gets engine.first_token_timeout_s. No request waits for a
  control connection (`_control`). SGLang guards /version with its --api-key: a
  refusal there is reported with the probe, which still passes.

Errors
  Reported in the results, never raised, but for `ScrapeError` from `scrape`.
"""

from __future__ import annotations

import json

import trio

from .._errors import ENGINE_AUTH_STATUSES
from ..config import Config
from ..engines import (
    ConnectError,
    PoolTimeout,
    RemoteProtocolError,
    ResponseTooLarge,
    parse_error_body,
)
from ..engines._dialects import card_context, lists_model, truncates_requests
from ..fleet import EngineState
from ._control import Exhausted, check_free, get, get_json, headers, refused_detail
from ._evidence import (
    ContextReading,
    KeyCheck,
    KeyRefusal,
    LoadSample,
    ProbeResult,
    ScrapeError,
    VerifyPair,
    VerifyResult,
)
from ._health import Identity
from ._load import METRICS_BODY_LIMIT, parse_load
from ._pairs import verify_pair

_IDENTITY_KEYS = ("version", "build", "instance_id")


class HttpProber:
    """The production `Prober`: HTTP on each engine's control pool."""

    async def health(self, engine: EngineState, config: Config) -> ProbeResult:
        timeout = config.engine.health_timeout_s
        path = engine.dialect.health_path.decode()
        with trio.move_on_after(timeout):
            answer = await get(engine, engine.dialect.health_path)
            if isinstance(answer, ProbeResult):
                return answer
            status, _ = answer
            if status != 200:
                return ProbeResult("failed", f"GET {path} returned HTTP {status}", True)
            identity = await self._identity(engine)
            detail = f"GET {path} returned HTTP 200"
            if isinstance(identity, KeyRefusal):
                refused = refused_detail("GET /version", identity)
                return ProbeResult("ok", f"{detail}; {refused}", True, None, identity)
            return ProbeResult("ok", detail, True, identity)
        return ProbeResult(
            "failed",
            f"GET {path}: no answer within engine.health_timeout_s={timeout}",
            None,
            deadline_s=timeout,
        )

    async def check_key(self, engine: EngineState, config: Config) -> KeyCheck:
        """GET the dialect's key_check_path, which the engine guards with its --api-key,
        within engine.health_timeout_s."""
        timeout = config.engine.health_timeout_s
        path = engine.dialect.key_check_path
        where = f"GET {path.decode()}"
        with trio.move_on_after(timeout):
            answer = await get(engine, path)
            if isinstance(answer, ProbeResult):
                unknown = answer.outcome == "inconclusive"
                return KeyCheck("inconclusive" if unknown else "failed", answer.detail)
            status, raw = answer
            if status == 200:
                return KeyCheck("accepted", f"{where} returned HTTP 200")
            if status in ENGINE_AUTH_STATUSES:
                refusal = KeyRefusal(engine, status, parse_error_body(status, raw).message)
                return KeyCheck("refused", refused_detail(where, refusal))
            return KeyCheck("failed", f"{where} returned HTTP {status}")
        return KeyCheck("failed", f"{where}: no answer within engine.health_timeout_s={timeout}")

    async def context(self, engine: EngineState, config: Config) -> ContextReading:
        """The engine's context length from its /v1/models card (`card_context`), within
        engine.health_timeout_s; None for an SGLang server that truncates over-long
        requests instead of refusing them (`truncates_requests`), or when it will not
        say."""
        timeout = config.engine.health_timeout_s
        with trio.move_on_after(timeout):
            answer = await get_json(engine, b"/v1/models")
            if isinstance(answer, str):
                return ContextReading(None, answer, final=False)
            listed = lists_model(answer, engine.spec.model)
            length = card_context(answer, engine.spec.model)
            if isinstance(length, str):
                return ContextReading(None, length, listed=listed)
            path = engine.dialect.truncation_path
            if path is None:
                return ContextReading(length, "GET /v1/models max_model_len", listed=listed)
            answer = await get_json(engine, path)
            if isinstance(answer, str):
                return ContextReading(None, answer, final=False, listed=listed)
            truncates = truncates_requests(answer)
            if isinstance(truncates, str):
                return ContextReading(None, truncates, listed=listed)
            if truncates:
                return ContextReading(
                    None,
                    f"it cuts over-long requests down instead of refusing them "
                    f"(allow_auto_truncate in GET {path.decode()}), its max_model_len "
                    f"{length} notwithstanding",
                    listed=listed,
                )
            return ContextReading(length, "GET /v1/models max_model_len", listed=listed)
        return ContextReading(
            None, f"no answer within engine.health_timeout_s={timeout}", final=False
        )

    async def _identity(self, engine: EngineState) -> Identity | KeyRefusal | None:
        """(key, value) pairs of /version that name the running instance, if any; the
        refusal when the engine refused Narwhal's API key there."""
        answer = await get(engine, b"/version")
        if isinstance(answer, ProbeResult):
            return None
        status, raw = answer
        if status in ENGINE_AUTH_STATUSES:
            return KeyRefusal(engine, status, parse_error_body(status, raw).message)
        if status != 200:
            return None
        try:
            document = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(document, dict):
            return None
        pairs = tuple(
            (key, str(document[key]))
            for key in _IDENTITY_KEYS
            if key in document and document[key] is not None
        )
        return pairs or None

    async def scrape(self, engine: EngineState, config: Config) -> LoadSample:
        timeout = config.engine.health_timeout_s
        try:
            check_free(engine)
        except Exhausted as exc:
            raise ScrapeError(str(exc)) from None
        with trio.move_on_after(timeout):
            try:
                async with engine.control_pool.request(b"GET", b"/metrics", headers()) as response:
                    raw = await response.aread(METRICS_BODY_LIMIT)
                    if response.status != 200:
                        raise ScrapeError(f"GET /metrics returned HTTP {response.status}")
            except (ConnectError, RemoteProtocolError, ResponseTooLarge, PoolTimeout) as exc:
                raise ScrapeError(f"GET /metrics: {exc}") from None
            return parse_load(raw, engine.dialect.name)
        raise ScrapeError(f"GET /metrics: no answer within engine.health_timeout_s={timeout}")

    async def verify(self, pair: VerifyPair, config: Config) -> VerifyResult:
        return await verify_pair(pair, config)
