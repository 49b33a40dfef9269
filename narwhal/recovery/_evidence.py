"""What recovery's requests to an engine found out: probe, check and verification results.

Owns
  The result records (`ProbeResult`, `LoadSample`, `ContextReading`, `KeyCheck`,
  `VerifyResult`), the refusals they carry (`KeyRefusal`, `ModelRefusal`), the
  `VerifyPair` a verification runs on, and the `Prober` protocol that produces them.

Invariants
  Records are frozen and hold no I/O. `inconclusive` is no evidence either way: the
  verdict it would have fed stays as it was (docs/design.md#deadlines).

Errors
  `ScrapeError`: an engine's load could not be observed in this pass.
"""

from __future__ import annotations

from typing import Literal, Protocol

import attrs

from ..config import Config
from ..fleet import EngineState
from ._health import Identity

Outcome = Literal["ok", "failed", "inconclusive"]
VerifyOutcome = Literal["ok", "failed", "inconclusive", "refused"]
KeyOutcome = Literal["accepted", "refused", "failed", "inconclusive"]


@attrs.frozen
class KeyRefusal:
    """An engine answered one of recovery's requests with HTTP 401/403: it refused
    Narwhal's API key, as it would the request path's (`fleet.key_refused`)."""

    engine: EngineState
    status: int
    message: str  # the engine's, from its error body


@attrs.frozen
class ModelRefusal:
    """An engine answered one of recovery's legs with a 404 naming the model: it does
    not serve its engines[].model, as the request path would find (`fleet.model_refused`)."""

    engine: EngineState
    message: str  # the engine's, from its error body


@attrs.frozen
class ProbeResult:
    outcome: Outcome
    detail: str
    # False: the connection was refused or failed; None: cannot tell (a timeout).
    reachable: bool | None
    identity: Identity | None = None
    # The identity check (GET /version) was refused: SGLang guards /version with its
    # --api-key, unlike its health route.
    refusal: KeyRefusal | None = None
    # "failed" for want of an answer within this deadline (engine.health_timeout_s).
    deadline_s: float | None = None


@attrs.frozen
class LoadSample:
    """The engine's own view of its load (its /metrics)."""

    running: float
    waiting: float
    kv_usage: float | None
    # prometheus_client's process collector (vLLM with one API server); None when absent.
    started_at: float | None = None
    # The prompt-token counter per series (its label text, one per rank): it restarts
    # from zero with the engine. None when absent.
    prompt_tokens: tuple[tuple[str, float], ...] | None = None
    # The engine has not published its running and waiting gauges yet, which a fresh
    # SGLang server does only once its scheduler first reports (a decode server after
    # 40 decode steps or an idle tick, `_GAUGES_LATER`): read as no load, not a fault.
    gauges_pending: bool = False


@attrs.frozen
class ContextReading:
    """What an engine says of its context length: `length` and where it was read, or
    None and why not. `final`: the answer settles it until the engine restarts; a failed
    request is asked again at the next good probe."""

    length: int | None
    detail: str
    final: bool = True
    # Whether the /v1/models answer lists the configured model; None when there was no
    # model list to read (`model_refused` takes an engine out by a 404, this readmits it).
    listed: bool | None = None


class ScrapeError(Exception):
    """This engine's load could not be observed in this pass."""


@attrs.frozen
class KeyCheck:
    """Whether an engine takes Narwhal's API key: accepted (HTTP 200), refused (401/403),
    failed (any other answer, or none) or inconclusive (no free control connection)."""

    outcome: KeyOutcome
    detail: str


@attrs.frozen
class VerifyResult:
    # refused: an engine of the pair refused Narwhal's API key or the model (`refusal`
    # names it), which says nothing of either engine's health.
    outcome: VerifyOutcome
    detail: str
    # "failed" only: the engine the failure is certainly due to; None when the other
    # engine of the pair may have caused it (`_pairs`).
    culprit: str | None = None
    refusal: KeyRefusal | ModelRefusal | None = None
    # "failed" for want of an answer within this deadline (engine.first_token_timeout_s).
    deadline_s: float | None = None


@attrs.frozen(eq=False)
class VerifyPair:
    """Which engine runs which verification leg; `subject` is the one being judged.

    `standby`: the partner is out of service itself (it answers its health probe but has
    not passed a verification), so it is no known-good reference for the subject."""

    subject: EngineState
    phase: str
    prefill: EngineState
    decode: EngineState
    request_id: str
    standby: bool = False

    @property
    def local(self) -> bool:
        return self.prefill is self.decode

    @property
    def partner(self) -> EngineState | None:
        if self.local:
            return None
        return self.decode if self.prefill is self.subject else self.prefill

    def describe(self) -> str:
        if self.local:
            return f"local pair on {self.subject.id}"
        text = f"prefill on {self.prefill.id}, decode on {self.decode.id}"
        if self.standby:
            text += " (standby partner: itself out of service)"
        return text


class Prober(Protocol):
    """Engine I/O used by recovery and the monitor; tests inject fakes."""

    async def health(self, engine: EngineState, config: Config) -> ProbeResult: ...

    async def scrape(self, engine: EngineState, config: Config) -> LoadSample: ...

    async def verify(self, pair: VerifyPair, config: Config) -> VerifyResult: ...

    async def check_key(self, engine: EngineState, config: Config) -> KeyCheck: ...

    async def context(self, engine: EngineState, config: Config) -> ContextReading: ...
