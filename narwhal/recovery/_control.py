"""Requests on an engine's control pool, which never wait for a free connection.

Owns
  The checks and GETs the prober and the verification legs share: `check_free`,
  `get`, `get_json`, the headers recovery sends, and how a refused key is worded.

Invariants
  Everything runs on `EngineState.control_pool`, the connections reserved for health
  and recovery (engine.control_connections), so probes never queue behind client
  traffic and client traffic never waits for a probe. A request is sent only when the
  pool has a free connection, checked synchronously right before it, so the pool hands
  one out without waiting.

Errors
  `Exhausted`: no free connection; the caller reports `inconclusive` (docs/design.md#deadlines:
  probe exhaustion leaves the engine verdict unchanged). A GET that gets no answer returns the
  failed or inconclusive `ProbeResult` instead of raising.
"""

from __future__ import annotations

import json

from ..engines import (
    ConnectError,
    ConnectionPool,
    PoolTimeout,
    RemoteProtocolError,
    ResponseTooLarge,
)
from ..fleet import EngineState, explain_refusal
from ._evidence import KeyRefusal, ProbeResult

SMALL_BODY = 64 * 1024
# SGLang's /get_server_info lists every server arg (some 20-40 KB); a /v1/models answer
# grows with the LoRA adapters loaded. The bound is for a broken engine.
INFO_BODY = 1024 * 1024


class Exhausted(Exception):
    pass


def _free(pool: ConnectionPool) -> bool:
    stats = pool.statistics()
    return stats.in_use < stats.max_connections


def check_free(engine: EngineState) -> None:
    # Checked synchronously right before the request: the pool then hands out a slot
    # without waiting, so a probe never waits on an exhausted control pool.
    if not _free(engine.control_pool):
        stats = engine.control_pool.statistics()
        raise Exhausted(
            f"control pool of {engine.id} exhausted ({stats.in_use}/{stats.max_connections} "
            "in use; engine.control_connections)"
        )


async def get(
    engine: EngineState, path: bytes, limit: int = SMALL_BODY
) -> tuple[int, bytes] | ProbeResult:
    """GET `path` on the control pool: the status and body, or the failed or
    inconclusive probe result when there is no answer."""
    where = f"GET {path.decode()}"
    try:
        check_free(engine)
        async with engine.control_pool.request(b"GET", path, headers()) as response:
            return response.status, await response.aread(limit)
    except (Exhausted, PoolTimeout) as exc:
        return ProbeResult("inconclusive", str(exc), None)
    except ConnectError as exc:
        return ProbeResult("failed", f"{where}: {exc}", False)
    except (RemoteProtocolError, ResponseTooLarge) as exc:
        return ProbeResult("failed", f"{where}: {exc}", True)


async def get_json(engine: EngineState, path: bytes) -> object:
    """GET `path` on the control pool: its JSON answer, or (a str) why there is none."""
    where = f"GET {path.decode()}"
    answer = await get(engine, path, INFO_BODY)
    if isinstance(answer, ProbeResult):
        return answer.detail
    status, raw = answer
    if status != 200:
        return f"{where} returned HTTP {status}"
    try:
        document: object = json.loads(raw)
    except (ValueError, RecursionError):
        return f"{where} returned a body that is not JSON"
    return document


def headers(request_id: str | None = None) -> list[tuple[bytes, bytes]]:
    sent = [(b"accept", b"*/*")]
    if request_id is not None:
        sent += [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]
    return sent


def refused_detail(where: str, refusal: KeyRefusal) -> str:
    # The control pool carries the engine's one configured key, as the serving pool does.
    sends_key = refusal.engine.control_pool.sends_api_key
    why = explain_refusal(refusal.status, sends_key=sends_key, message=refusal.message)
    return f"{where}: the engine {why}"
