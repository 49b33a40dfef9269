"""narwhal-check's preflight: verify a configured fleet before serving.

Checks, in order (each row names the check, the engine or ordered pair, pass/fail, the
measured number and the limit it was held to):

* ``health``: ``/health`` answers 200 within ``engine.health_timeout_s``.
* ``launch-mode`` (SGLang): the ``disaggregation_mode`` ``/get_server_info`` reports is
  the configured role (``prefill``/``decode``; ``null`` for ``both``). An SGLang prefill
  or decode server answers only bootstrap pairs, so every generation request below that
  targets one is its leg of a pair with the first healthy engine of the other role whose
  launch mode checked out (`EngineClient.partner`).
* ``tokenize``: ``/tokenize`` answers with an exact integer count within
  ``engine.tokenize_timeout_s``, equal to the ``usage.prompt_tokens`` the engine charges
  for the same prompt. On SGLang the note also says whether the build's ``/tokenize``
  takes chat messages (newer builds) or refuses them, so that Narwhal estimates that
  engine's chat requests; an unexpected answer to the messages form makes the row a warn.
* ``metrics``: ``/metrics`` answers within ``engine.health_timeout_s`` with the load gauges
  the monitor reads every pass (running and waiting requests), parsed as the monitor
  parses them. The note names the restart signals found there
  (``process_start_time_seconds``, the prompt-token counter). An engine the monitor cannot
  observe is reported missing every pass, and a fleet of them puts Narwhal in the degraded
  state after ``controller.monitor_failure_limit`` passes.
* ``profile``: the profile store has a usable profile for the engine (url, model,
  dialect as configured) measured on the engine's current build. A usable profile whose
  prefill or decode fit misses its own measurements (model-error p90 above
  `narwhal.profiles.POOR_FIT_RESIDUAL_P90`) is a warn, naming the phase and the residual.
* ``cached-prefill``: for an engine whose profile records its prefix cache (measured by
  narwhal-profile, `narwhal.probe._cached`; no row for an older store), the residual of
  the cached-prefill law on the measured points. Above `POOR_FIT_RESIDUAL_P90` at the
  p90 it is a warn naming the engine and the numbers: cache-aware pricing would then
  mislead admission on that engine. An engine seen to keep no prefix cache passes, and
  the note says so.
* ``handoff``: a complete prefill and decode verification leg on every crossed pair
  (`crossed_pairs`: every ordered pair of distinct engines, the self pair for one engine;
  for SGLang prefill/decode servers only prefill -> decode), each leg within
  ``engine.first_token_timeout_s`` (prefill: the whole leg; decode: to the first token).
  A vLLM engine that answers the router's prefill leg with ``kv_transfer_params: null``
  has no KV connector and is in no pair: one row for it, a skip (``n/a: no KV
  connector``) for an aggregate engine (role both), a fail for a prefill or decode one.
  Its ``lease`` and ``handoff-wait`` rows are skips too, and so is ``first-token`` when
  no pair is left.
* ``lease``: the producer's KV lease, measured: a prefill whose KV is never pulled, then
  the time until the producer's ``vllm:nixl_num_kv_expired_reqs`` counter shows the
  release. The verified lease is a lower bound (from the prefill response to the last
  poll before the release was seen); ``serving.handoff_timeout_s`` must be below it.
  Measured before the pairs (its row is listed after them): that prefill is also what
  tells an engine without a KV connector. With ``--no-lease`` each engine gets one
  prefill leg for that alone, which the others pull (`kv_connectors`).
* ``handoff-wait``: a decode sent ``serving.handoff_timeout_s`` after its prefill started
  still succeeds (the cap is safe in practice, not only on paper), once per engine as the
  producer, with the next engine in the config as the consumer. SGLang sends both legs at
  once, so nothing waits: each engine's row is a skip and names the engine alone.
* ``first-token``: ``engine.first_token_timeout_s`` is above the crossed-handoff p99
  (decode request to first token) measured here and, when present, in the profile store.

Engines that fail ``health`` are left out of the later checks; their rows say so.
"""

from __future__ import annotations

import datetime
import math
import textwrap
from collections.abc import Awaitable, Callable
from typing import Generic, Literal, TypeVar, get_args

import attrs
import trio

from .._errors import ENGINE_AUTH_STATUSES
from ..config import Config
from ..engines import Json, parse_error_body
from ..engines._dialects import chat_tokenize_refused, tokenize_count
from ..fleet import explain_refusal
from ..profiles import (
    POOR_FIT_RESIDUAL_P90,
    CachedPrefill,
    MeasuredFacts,
    ProfileStore,
    check_store,
    crossed_pairs,
    poor_fits,
    read_store,
)
from ..recovery import METRICS_BODY_LIMIT, ScrapeError, parse_load
from ._cached import cached_law_warning, cached_summary
from ._client import (
    NULL_PARAMS,
    EngineClient,
    ProbeError,
    crossed_handoff,
    decode_leg,
    kv_connectors,
    mode_mismatch,
    prefill_leg,
)
from ._texts import TextMaker

Status = Literal["pass", "fail", "warn", "skip"]
T = TypeVar("T")
Progress = Callable[[str], None]

_VERIFY_PROMPT_TOKENS = 32
# The key test's answer (on /v1/models, the served models); the bound is for a broken engine.
_MODELS_LIMIT = 1024 * 1024


@attrs.frozen
class CheckRow:
    check: str
    target: str
    status: Status
    measured: str
    limit: str
    note: str = ""
    # The measured number in seconds (or a count), for machine use.
    value: float | None = None


@attrs.frozen(kw_only=True)
class CheckPlan:
    # Extra crossed handoffs per pair and context size, for the first-token p99.
    handoff_samples: int = 2
    # Prompt sizes of those handoffs; None: a short prompt and the longest the engines take.
    handoff_sizes: tuple[int, ...] | None = None
    # Longest wait for a producer to release an abandoned handoff.
    lease_max_s: float = 120.0
    lease_poll_s: float = 0.05
    measure_lease: bool = True
    # Bound on every other probe request (identity, metrics, handoff samples).
    request_timeout_s: float = 60.0
    seed: int = 0


@attrs.frozen
class CheckReport:
    rows: tuple[CheckRow, ...]
    lease_by_engine: dict[str, float]
    crossed_p99_s: float | None
    builds: dict[str, str]

    @property
    def failed(self) -> bool:
        return any(row.status == "fail" for row in self.rows)

    @property
    def lease_s(self) -> float | None:
        return min(self.lease_by_engine.values()) if self.lease_by_engine else None

    def facts(self) -> MeasuredFacts:
        return MeasuredFacts(
            measured_at=_now(),
            lease_s=self.lease_s,
            lease_by_engine=dict(self.lease_by_engine),
            crossed_handoff_p99_s=self.crossed_p99_s,
            builds=dict(self.builds),
        )


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


def _s(seconds: float) -> str:
    return f"{seconds:g} s"


class _Rows:
    def __init__(self, progress: Progress) -> None:
        self.rows: list[CheckRow] = []
        self._progress = progress

    def add(self, row: CheckRow) -> None:
        self.rows.append(row)
        self._progress(f"{row.check} {row.target}: {row.status} {row.measured}")


@attrs.frozen
class _Outcome(Generic[T]):
    """A bounded probe: its value, or why there is none (error or timeout)."""

    value: T | None
    why: str = ""
    timed_out: bool = False


async def _bounded(seconds: float, call: Awaitable[T]) -> _Outcome[T]:
    with trio.move_on_after(seconds):
        try:
            return _Outcome(await call)
        except ProbeError as exc:
            return _Outcome(None, str(exc))
    return _Outcome(None, f"no answer in {_s(seconds)}", timed_out=True)


async def run_check(
    config: Config,
    plan: CheckPlan,
    *,
    store: ProfileStore | None = None,
    store_problems: list[str] | None = None,
    progress: Progress = lambda _: None,
) -> CheckReport:
    """Run every check; the report (never raises on a failing engine).

    ``store``/``store_problems`` are the parsed profile store (`read_store`); by default
    it is read from ``config.profiles.path``.
    """
    if store is None and store_problems is None:
        store, store_problems = await trio.to_thread.run_sync(read_store, config.profiles.path)
    rows = _Rows(progress)
    clients = {spec.id: EngineClient(spec, config.engine) for spec in config.engines}
    try:
        return await _run(config, plan, clients, store, store_problems or [], rows)
    finally:
        for client in clients.values():
            await client.aclose()


async def _run(
    config: Config,
    plan: CheckPlan,
    clients: dict[str, EngineClient],
    store: ProfileStore | None,
    store_problems: list[str],
    rows: _Rows,
) -> CheckReport:
    eng = config.engine
    healthy = await _health(clients, eng.health_timeout_s, rows)
    launched = await _launch_modes(clients, healthy, plan, rows)
    # An SGLang engine launched in another mode than its role joins no pair as configured:
    # its partner would wait out SGLang's bootstrap timeout. It is not exercised further.
    misfits = {
        e for e, c in clients.items() if c.spec.dialect == "sglang" and e in healthy
    } - launched
    for client in clients.values():
        if client.pd_role is not None and client.id not in misfits:
            other = "decode" if client.pd_role == "prefill" else "prefill"
            client.partner = next(
                (c for c in clients.values() if c.pd_role == other and c.id in launched), None
            )
    ratios = []
    for engine_id in clients:
        if engine_id not in healthy or engine_id in misfits:
            bound = f"exact count within {_s(eng.tokenize_timeout_s)} (engine.tokenize_timeout_s)"
            why = "unhealthy" if engine_id not in healthy else "failed its launch-mode check"
            rows.add(CheckRow("tokenize", engine_id, "fail", "not checked", bound, why))
            continue
        ratio = await _tokenize(clients[engine_id], eng.tokenize_timeout_s, plan, rows)
        if ratio is not None:
            ratios.append(ratio)
    if eng.vocab_size is None:
        for engine_id, client in clients.items():
            if client.spec.dialect == "sglang":
                rows.add(_unchecked_vocabulary(engine_id))
    for engine_id, client in clients.items():
        rows.add(
            await _metrics(client, eng.health_timeout_s)
            if engine_id in healthy
            else CheckRow("metrics", engine_id, "fail", "not checked", _METRICS_BOUND, "unhealthy")
        )
    # Prompt texts are sized with the most pessimistic ratio seen, so the longest handoff
    # prompt stays inside max_model_len.
    cpt = min(ratios) if ratios else 3.0
    builds = await _profiles(config, clients, healthy, store, store_problems, plan, rows)
    leased = await _leases(config, clients, healthy, plan)
    none, leases = leased.none, leased.leases
    samples = await _pairs(config, clients, healthy, launched, builds, none, cpt, plan, rows)
    p99 = max(samples) if samples else None
    for engine_id in clients:
        rows.add(leased.rows[engine_id])
    await _handoff_wait(config, clients, healthy, none, leases, plan, rows)
    _first_token(config, p99, store, none, rows)
    return CheckReport(tuple(rows.rows), leases, p99, builds)


async def _health(clients: dict[str, EngineClient], limit: float, rows: _Rows) -> set[str]:
    healthy: set[str] = set()
    results: dict[str, CheckRow] = {}

    async def one(client: EngineClient) -> None:
        start = trio.current_time()
        answer = await _bounded(limit, client.health())
        took = trio.current_time() - start
        bound = f"200 within {_s(limit)} (engine.health_timeout_s)"
        if answer.timed_out:
            row = CheckRow("health", client.id, "fail", answer.why, bound)
        elif answer.value is None:
            row = CheckRow("health", client.id, "fail", "unreachable", bound, answer.why)
        elif answer.value != 200:
            row = CheckRow("health", client.id, "fail", f"HTTP {answer.value}", bound, value=took)
        elif (refused := await _key_refused(client, limit)) is not None:
            row = CheckRow("health", client.id, "fail", refused[0], bound, refused[1], took)
        else:
            healthy.add(client.id)
            row = CheckRow("health", client.id, "pass", f"200 in {_ms(took)}", bound, value=took)
        results[client.id] = row

    async with trio.open_nursery() as nursery:
        for client in clients.values():
            nursery.start_soon(one, client)
    for engine_id in clients:
        rows.add(results[engine_id])
    return healthy


_MODE_BOUND = "disaggregation_mode = engines[].role (null for both)"


async def _launch_modes(
    clients: dict[str, EngineClient], healthy: set[str], plan: CheckPlan, rows: _Rows
) -> set[str]:
    """The ``launch-mode`` rows of the SGLang engines; the healthy ones that passed."""
    passed: set[str] = set()
    for engine_id, client in clients.items():
        if client.spec.dialect != "sglang":
            continue
        if engine_id not in healthy:
            rows.add(
                CheckRow("launch-mode", engine_id, "fail", "not checked", _MODE_BOUND, "unhealthy")
            )
            continue
        answer = await _bounded(plan.request_timeout_s, client.launch_mode())
        if answer.value is None:
            why = answer.why or "/get_server_info names no disaggregation_mode"
            rows.add(CheckRow("launch-mode", engine_id, "fail", "unknown", _MODE_BOUND, why))
            continue
        mismatch = mode_mismatch(client.spec, answer.value)
        status: Status = "fail" if mismatch else "pass"
        rows.add(
            CheckRow("launch-mode", engine_id, status, answer.value, _MODE_BOUND, mismatch or "")
        )
        if mismatch is None:
            passed.add(engine_id)
    return passed


async def _key_refused(client: EngineClient, limit: float) -> tuple[str, str] | None:
    """(measured, note) when the engine refuses Narwhal's API key, or wants one and none
    is configured. Health routes are open on engines started with --api-key (vLLM and
    SGLang alike), so a healthy engine can still refuse every request; the dialect's
    key_check_path is guarded by both, and is what recovery's key check asks."""
    path = client.dialect.key_check_path.decode()
    answer = await _bounded(limit, client.get(path, limit=_MODELS_LIMIT))
    if answer.value is None or answer.value[0] not in ENGINE_AUTH_STATUSES:
        return None
    status, raw = answer.value
    message = parse_error_body(status, raw).message
    sends_key = client.pool.sends_api_key
    why = explain_refusal(status, sends_key=sends_key, message=message)
    measured = "API key refused" if sends_key else "API key required, none configured"
    return f"{measured} (HTTP {status})", f"the engine {why}"


async def _tokenize(
    client: EngineClient, limit: float, plan: CheckPlan, rows: _Rows
) -> float | None:
    """The tokenisation check; the text's measured chars per token when it passed."""
    text = TextMaker(f"check/{plan.seed}/{client.id}").text(160)
    bound = f"exact count within {_s(limit)} (engine.tokenize_timeout_s)"
    start = trio.current_time()
    answer = await _bounded(limit, client.tokenize(text))
    took = trio.current_time() - start
    if answer.value is None:
        measured = answer.why if answer.timed_out else "error"
        rows.add(CheckRow("tokenize", client.id, "fail", measured, bound, answer.why))
        return None
    count, doc = answer.value
    tokens = doc.get("tokens") if isinstance(doc, dict) else None
    if count is None:
        rows.add(CheckRow("tokenize", client.id, "fail", "no integer count", bound, repr(doc)))
        return None
    if isinstance(tokens, list) and len(tokens) != count:
        rows.add(
            CheckRow(
                "tokenize",
                client.id,
                "fail",
                f"count {count} but {len(tokens)} token ids",
                bound,
            )
        )
        return None
    charged = await _bounded(
        plan.request_timeout_s, client.complete(client.completion_body(text, 1, stream=False))
    )
    prompt_tokens = charged.value.prompt_tokens if charged.value is not None else None
    if prompt_tokens != count:
        rows.add(
            CheckRow(
                "tokenize",
                client.id,
                "fail",
                f"{count} tokens",
                bound,
                f"the engine charged usage.prompt_tokens={prompt_tokens} for the same prompt",
            )
        )
        return None
    note = f"= usage.prompt_tokens {prompt_tokens}"
    status: Status = "pass"
    if client.dialect.chat_tokenize_optional:
        chat_status, chat_note = await _chat_tokenize(client, limit, text)
        note = f"{note}; {chat_note}"
        status = "warn" if chat_status == "warn" else status
    rows.add(
        CheckRow(
            "tokenize",
            client.id,
            status,
            f"{count} tokens in {_ms(took)}",
            bound,
            note,
            value=took,
        )
    )
    return len(text) / count if count > 0 else None


_SHOWN = {"vllm": "vLLM", "sglang": "SGLang"}


async def _chat_tokenize(client: EngineClient, limit: float, text: str) -> tuple[Status, str]:
    """Whether the engine's /tokenize counts chat messages, for a dialect where only some
    builds' does (SGLang): (pass or warn, the note). A build without the form gets its chat
    requests estimated at the chars ratio, which Narwhal learns from its first refusal."""
    body: Json = {"model": client.spec.model, "messages": [{"role": "user", "content": text}]}
    path = client.dialect.tokenize_path.decode()
    answer = await _bounded(limit, client.post_json(path, body))
    if answer.value is None:
        return "warn", f"chat: no answer from /tokenize's messages form ({answer.why})"
    status, doc = answer.value
    if status == 200:
        count = tokenize_count(doc)
        if count is not None:
            return "pass", f"chat: exact, {count} tokens from /tokenize's messages form"
        return "warn", f"chat: /tokenize's messages form gave no integer count: {doc!r}"
    message = str(doc)
    if chat_tokenize_refused(client.dialect, status, message):
        return "pass", (
            f"chat: estimated at the chars ratio: this {_SHOWN[client.dialect.name]} build's "
            f"/tokenize takes no messages (HTTP {status})"
        )
    return "warn", f"chat: /tokenize's messages form answered {status}: {message}"


_METRICS_BOUND = "load gauges within engine.health_timeout_s (the monitor's scrape)"


def _unchecked_vocabulary(engine_id: str) -> CheckRow:
    """SGLang (0.5.23) does not check a prompt's token ids: one its model lacks kills the
    scheduler. Without engine.vocab_size Narwhal can refuse only negative ones."""
    return CheckRow(
        "vocabulary",
        engine_id,
        "warn",
        "token ids unchecked",
        "engine.vocab_size set",
        "SGLang passes a prompt's token ids to the model unchecked and one out of range "
        "kills its scheduler: set engine.vocab_size (the model config's vocab_size) so "
        "Narwhal refuses them",
    )


async def _metrics(client: EngineClient, limit: float) -> CheckRow:
    answer = await _bounded(limit, client.get("/metrics", limit=METRICS_BODY_LIMIT))
    if answer.value is None:
        measured = answer.why if answer.timed_out else "error"
        return CheckRow("metrics", client.id, "fail", measured, _METRICS_BOUND, answer.why)
    return metrics_row(client.id, client.spec.dialect, *answer.value)


def metrics_row(engine_id: str, dialect: str, status: int, raw: bytes) -> CheckRow:
    """The ``metrics`` row for one /metrics answer, read by the monitor's own parser."""
    hint = {
        "vllm": "vLLM publishes them unless started with --disable-log-stats",
        "sglang": "SGLang publishes them when started with --enable-metrics",
    }.get(dialect)
    unobserved = "the monitor would report this engine missing every pass" + (
        f" ({hint})" if hint else ""
    )
    if status != 200:
        return CheckRow("metrics", engine_id, "fail", f"HTTP {status}", _METRICS_BOUND, unobserved)
    try:
        sample = parse_load(raw, dialect)
    except ScrapeError as exc:
        note = f"{exc}; {unobserved}"
        return CheckRow("metrics", engine_id, "fail", "no load gauges", _METRICS_BOUND, note)
    signals = [
        name
        for name, present in (
            ("process_start_time_seconds", sample.started_at is not None),
            ("prompt_tokens_total", sample.prompt_tokens is not None),
        )
        if present
    ]
    if sample.gauges_pending:
        note = (
            "a fresh SGLang server publishes its running and waiting gauges once its "
            "scheduler first reports (a decode server: after 40 decode steps); the monitor "
            "reads no load until then"
        )
        return CheckRow("metrics", engine_id, "pass", "not yet published", _METRICS_BOUND, note)
    measured = f"running {sample.running:g}, waiting {sample.waiting:g}"
    if not signals:
        note = (
            "no restart signal: a restart quicker than recovery.health.interval_s shows only "
            "if /version names the instance"
        )
        return CheckRow("metrics", engine_id, "warn", measured, _METRICS_BOUND, note)
    note = f"restart signals: {', '.join(signals)}"
    return CheckRow("metrics", engine_id, "pass", measured, _METRICS_BOUND, note)


async def _profiles(
    config: Config,
    clients: dict[str, EngineClient],
    healthy: set[str],
    store: ProfileStore | None,
    store_problems: list[str],
    plan: CheckPlan,
    rows: _Rows,
) -> dict[str, str]:
    """Profile present and matching each engine (url/model/dialect and build)."""
    check = check_store(store, store_problems, config)
    builds: dict[str, str] = {}
    source = config.profiles.path
    for engine_id, client in clients.items():
        limit = f"usable profile in {source}"
        if engine_id not in healthy:
            rows.add(CheckRow("profile", engine_id, "fail", "not checked", limit, "unhealthy"))
            continue
        identity = await _bounded(plan.request_timeout_s, client.identity())
        if identity.value is None:
            why = identity.why
            rows.add(CheckRow("profile", engine_id, "fail", "identity unknown", limit, why))
            continue
        build = identity.value.build_identity
        builds[engine_id] = build
        own = [m for m in check.messages if f"engine {engine_id!r}" in m]
        if check.store is None:
            note = "; ".join(check.messages) or "no profile store"
            rows.add(CheckRow("profile", engine_id, "fail", "no store", limit, note))
            continue
        if engine_id not in check.usable:
            note = "; ".join(own) or "not usable"
            rows.add(CheckRow("profile", engine_id, "fail", "mismatch", limit, note))
            continue
        profile = check.store.profile(engine_id)
        assert profile is not None
        if profile.build != build:
            rows.add(
                CheckRow(
                    "profile",
                    engine_id,
                    "fail",
                    "stale",
                    limit,
                    f"engine build is {build!r}, profiled on {profile.build!r}; "
                    "run narwhal-profile again",
                )
            )
            continue
        fits = poor_fits(profile)
        if fits:
            note = "; ".join(f.message() for f in fits)
            rows.add(CheckRow("profile", engine_id, "warn", "poor fit", limit, note))
        else:
            rows.add(CheckRow("profile", engine_id, "pass", "build matches", limit, build))
        if profile.cached is not None:
            rows.add(cached_row(engine_id, profile.cached))
    # Problems that name no configured engine (schema, unknown store engines) still show.
    others = [m for m in check.messages if not any(f"engine {e!r}" in m for e in clients)]
    if check.store is not None:
        for message in others:
            rows.add(CheckRow("profile", "store", "warn", "note", "", message))
    return builds


def cached_row(engine_id: str, record: CachedPrefill) -> CheckRow:
    """The ``cached-prefill`` row of an engine whose profile records its prefix cache."""
    limit = f"law residual p90 <= {100 * POOR_FIT_RESIDUAL_P90:.0f}%"
    if not record.seen:
        note = f"{cached_summary(record)}: cache-aware pricing must credit it nothing"
        return CheckRow("cached-prefill", engine_id, "pass", "no prefix cache", limit, note)
    measured = f"law residual p90 {100 * record.residual_p90:.1f}%"
    warning = cached_law_warning(engine_id, record)
    status: Status = "pass" if warning is None else "warn"
    note = warning or cached_summary(record)
    return CheckRow(
        "cached-prefill", engine_id, status, measured, limit, note, value=record.residual_p90
    )


NO_CONNECTOR = "n/a: no KV connector"


async def _connectors(
    clients: dict[str, EngineClient], healthy: set[str], plan: CheckPlan
) -> dict[str, str]:
    """The healthy vLLM engines without a KV connector (`kv_connectors`), each with what
    showed it. An engine whose probe failed is not among them: its pairs fail saying why.
    One whose probe ran out of time neither."""
    checked = [c for e, c in clients.items() if e in healthy]
    prompt = TextMaker(f"check/{plan.seed}/connectors").text(_VERIFY_PROMPT_TOKENS * 4)
    answer = await _bounded(
        plan.request_timeout_s * max(1, len(checked)), kv_connectors(checked, prompt)
    )
    found = answer.value or {}
    return {e: c.detail for e, c in found.items() if c.present is False}


def _handoff_sizes(plan: CheckPlan, max_model_len: int) -> list[int]:
    # Texts are sized with a chars/token ratio measured on one short text; keep a margin
    # so the longest prompt stays inside max_model_len on a tokenizer that disagrees.
    top = max(1, int((max_model_len - 3) * 0.9))
    if plan.handoff_sizes is not None:
        return sorted({min(n, top) for n in plan.handoff_sizes})
    return sorted({min(64, top), top})


async def _pairs(
    config: Config,
    clients: dict[str, EngineClient],
    healthy: set[str],
    launched: set[str],
    builds: dict[str, str],
    none: dict[str, str],
    cpt: float,
    plan: CheckPlan,
    rows: _Rows,
) -> list[float]:
    """Verification legs and first-token samples on every crossed pair (sequentially, so
    pairs do not load each other's engines). An engine without a KV connector (`none`)
    joins no pair: for an aggregate engine (role both) that is how it serves, and its
    row says the check does not apply; a prefill or decode engine without one fails."""
    limit = config.engine.first_token_timeout_s
    bound = f"each leg < {_s(limit)} (engine.first_token_timeout_s)"
    firsts: list[float] = []
    max_len = _max_model_len(builds)
    texts = TextMaker(f"check/{plan.seed}/pairs")
    for spec in config.engines:
        if spec.id not in none:
            continue
        if spec.role == "both":
            note = f"{none[spec.id]}; an aggregate engine, in no crossed pair"
            rows.add(CheckRow("handoff", spec.id, "skip", NO_CONNECTOR, bound, note))
        else:
            note = (
                f"{none[spec.id]}; a {spec.role} engine hands KV over only with a KV connector "
                "(vLLM --kv-transfer-config), or its role should be both"
            )
            rows.add(CheckRow("handoff", spec.id, "fail", "no KV connector", bound, note))
    pairs = crossed_pairs(config.engines, no_connector=frozenset(none))
    if not pairs and not none:
        rows.add(
            CheckRow(
                "handoff",
                "fleet",
                "fail",
                "no pair",
                bound,
                "SGLang prefill and decode servers pair only with a server of the other role",
            )
        )
    for p_id, d_id in pairs:
        target = f"{p_id} -> {d_id}"
        down = [e for e in (p_id, d_id) if e not in healthy]
        if down:
            rows.add(
                CheckRow("handoff", target, "fail", "not attempted", bound, f"{down[0]} unhealthy")
            )
            continue
        # An SGLang server launched in another mode than its role would not join the pair:
        # its partner would wait out the bootstrap timeout. The launch-mode row says why.
        misfit = [
            e for e in (p_id, d_id) if clients[e].spec.dialect == "sglang" and e not in launched
        ]
        if misfit:
            note = f"{misfit[0]} failed its launch-mode check"
            rows.add(CheckRow("handoff", target, "fail", "not attempted", bound, note))
            continue
        p, d = clients[p_id], clients[d_id]
        ok, measured, note = await _verify_pair(p, d, texts.text(_VERIFY_PROMPT_TOKENS * 4), limit)
        if not ok:
            rows.add(CheckRow("handoff", target, "fail", measured, bound, note))
            continue
        pair_firsts: list[float] = []
        failure = None
        for size in _handoff_sizes(plan, max_len):
            for _ in range(plan.handoff_samples):
                sample = await _sample(p, d, texts.text(max(1, round(size * cpt))), plan)
                if isinstance(sample, str):
                    failure = sample
                    break
                pair_firsts.append(sample)
            if failure:
                break
        if failure:
            rows.add(CheckRow("handoff", target, "fail", measured, bound, failure))
            continue
        firsts.extend(pair_firsts)
        worst = max(pair_firsts) if pair_firsts else None
        extra = (
            f"first token up to {_ms(worst)} over {len(pair_firsts)} samples to "
            f"{max(_handoff_sizes(plan, max_len))} tokens"
            if worst is not None
            else ""
        )
        note = "; ".join(part for part in (note, extra) if part)
        rows.add(CheckRow("handoff", target, "pass", measured, bound, note, worst))
    return firsts


def _max_model_len(builds: dict[str, str]) -> int:
    lengths = []
    for build in builds.values():
        _, _, tail = build.rpartition("max_model_len=")
        if tail.isdigit():
            lengths.append(int(tail))
    return min(lengths) if lengths else 2048


async def _verify_pair(
    p: EngineClient, d: EngineClient, prompt: str, limit: float
) -> tuple[bool, str, str]:
    """(ok, measured, note) for one complete P leg + decode leg, each within `limit`."""
    if p.spec.dialect == "sglang":
        return await _verify_concurrent_pair(p, d, prompt, limit)
    leg = await _bounded(limit, prefill_leg(p, prompt))
    if leg.timed_out:
        return False, f"prefill > {_s(limit)}", f"prefill on {p.id} did not finish in time"
    if leg.value is None:
        return False, "prefill failed", leg.why
    prefill, params = leg.value
    if prefill.error is not None:
        return False, "prefill failed", f"prefill on {p.id}: {prefill.error}"
    if params is None and p.spec.dialect == "vllm":
        return False, "no kv_transfer_params", f"prefill on {p.id} returned no kv_transfer_params"
    # The decode leg's budget is the first token; the second token and [DONE] follow it
    # within one decode step, so twice the limit bounds the leg without cutting it short.
    decode = await _bounded(2 * limit, decode_leg(d, prompt, params, max_tokens=2))
    prefill_note = f"prefill {_ms(prefill.seconds)}"
    if decode.timed_out:
        return False, f"{prefill_note}, decode > {_s(limit)}", f"decode on {d.id} timed out"
    stream = decode.value
    if stream is None:
        return False, f"{prefill_note}, decode failed", decode.why
    first = stream.first_token_s
    if not stream.ok or first is None:
        why = stream.error or "no token"
        return False, f"{prefill_note}, decode failed", f"decode on {d.id}: {why}"
    measured = f"{prefill_note}, first token {_ms(first)}"
    if prefill.seconds >= limit or first >= limit:
        return False, measured, "a leg exceeded engine.first_token_timeout_s"
    return True, measured, ""


async def _verify_concurrent_pair(
    p: EngineClient, d: EngineClient, prompt: str, limit: float
) -> tuple[bool, str, str]:
    """SGLang sends both legs at once; each must finish (prefill) or reach its first
    token (decode) within `limit`."""
    outcome = await _bounded(2 * limit, crossed_handoff(p, d, prompt))
    if outcome.timed_out:
        return False, f"no first token in {_s(limit)}", f"pair {p.id} -> {d.id} timed out"
    result = outcome.value
    if result is None:
        return False, "failed", outcome.why
    first, pre = result.first_token_s, result.prefill_s
    if not result.ok or first is None or pre is None:
        return False, "failed", result.error or "handoff failed"
    measured = f"prefill {_ms(pre)}, first token {_ms(first)}"
    if pre >= limit or first >= limit:
        return False, measured, "a leg exceeded engine.first_token_timeout_s"
    return True, measured, ""


async def _sample(p: EngineClient, d: EngineClient, prompt: str, plan: CheckPlan) -> float | str:
    """One crossed handoff's decode-open→first-token seconds, or why it failed."""
    outcome = await _bounded(plan.request_timeout_s, crossed_handoff(p, d, prompt))
    result = outcome.value
    if result is None:
        return f"handoff sample: {outcome.why}"
    if not result.ok or result.first_token_s is None:
        return result.error or "handoff failed"
    return result.first_token_s


@attrs.frozen
class _LeaseRows:
    """The lease rows (added after the handoff rows), the verified leases, and the vLLM
    engines without a KV connector with what showed it."""

    rows: dict[str, CheckRow]
    leases: dict[str, float]
    none: dict[str, str]


async def _leases(
    config: Config, clients: dict[str, EngineClient], healthy: set[str], plan: CheckPlan
) -> _LeaseRows:
    """Measured before the pairs: a lease row's prefill leg is also how an engine shows
    it has no KV connector (`kv_transfer_params: null`), which the pairs need to know.
    Its KV is left for the lease to run out, as it must be, and the row ends when it
    has, so no other leg overlaps it. Without a lease measurement (--no-lease) the
    engines are probed (`kv_connectors`) instead."""
    cap = config.serving.handoff_timeout_s
    bound = f"> {_s(cap)} (serving.handoff_timeout_s)"
    out = _LeaseRows({}, {}, {})
    if not plan.measure_lease:
        out = attrs.evolve(out, none=await _connectors(clients, healthy, plan))

    async def one(client: EngineClient) -> None:
        out.rows[client.id] = await _lease(client, config, plan, out)

    async with trio.open_nursery() as nursery:
        for engine_id, client in clients.items():
            if engine_id not in healthy:
                out.rows[engine_id] = CheckRow(
                    "lease", engine_id, "fail", "not measured", bound, "unhealthy"
                )
            elif engine_id in out.none:
                out.rows[engine_id] = _no_connector_lease(engine_id, bound, out.none)
            else:
                nursery.start_soon(one, client)
    return out


def _no_connector_lease(engine_id: str, bound: str, none: dict[str, str]) -> CheckRow:
    note = f"{none[engine_id]}: it holds no KV for a handoff"
    return CheckRow("lease", engine_id, "skip", NO_CONNECTOR, bound, note)


async def _lease(
    client: EngineClient, config: Config, plan: CheckPlan, out: _LeaseRows
) -> CheckRow:
    serving = config.serving
    cap = serving.handoff_timeout_s
    bound = f"> {_s(cap)} (serving.handoff_timeout_s)"
    if client.spec.dialect != "vllm":
        return CheckRow(
            "lease",
            client.id,
            "skip",
            "n/a",
            bound,
            "SGLang keeps no producer lease; bootstrap timeouts bound a handoff instead",
        )
    if not plan.measure_lease:
        return CheckRow("lease", client.id, "skip", "not measured", bound, "--no-lease")
    before = await _bounded(plan.request_timeout_s, client.gauges())
    counter = before.value.kv_expired if before.value is not None else None
    prompt = TextMaker(f"check/{plan.seed}/lease/{client.id}").text(_VERIFY_PROMPT_TOKENS * 4)
    leg = await _bounded(plan.request_timeout_s, prefill_leg(client, prompt))
    if leg.value is None:
        return CheckRow("lease", client.id, "fail", "prefill failed", bound, leg.why)
    prefill, params = leg.value
    if prefill.error is not None:
        return CheckRow("lease", client.id, "fail", "prefill failed", bound, prefill.error)
    if params is None:
        out.none[client.id] = NULL_PARAMS
        return _no_connector_lease(client.id, bound, out.none)
    if counter is None:
        return CheckRow(
            "lease",
            client.id,
            "fail",
            "not verifiable",
            bound,
            "the engine exposes no vllm:nixl_num_kv_expired_reqs counter",
        )
    answered = trio.current_time()
    last_unchanged = answered
    released_at = None
    with trio.move_on_after(plan.lease_max_s):
        # No event crosses the engine boundary: polling the producer's counter is the only
        # way to see the release, and the poll period is the measurement's resolution.
        while True:
            await trio.sleep(plan.lease_poll_s)
            polled = trio.current_time()
            gauges = await client.gauges()
            if gauges.kv_expired is not None and gauges.kv_expired > counter:
                released_at = trio.current_time()
                break
            last_unchanged = polled
    if released_at is None:
        return CheckRow(
            "lease",
            client.id,
            "fail",
            f"no release in {_s(plan.lease_max_s)}",
            bound,
            "the producer did not release an abandoned handoff within --lease-max-s",
        )
    lease = max(0.0, last_unchanged - answered)
    out.leases[client.id] = lease
    seen = f"verified >= {_ms(lease)} (release seen at {_ms(released_at - answered)})"
    if cap > 0:
        status: Status = "pass" if cap < lease else "fail"
        note = "" if status == "pass" else "set serving.handoff_timeout_s below the lease"
        return CheckRow("lease", client.id, status, seen, bound, note, lease)
    deadline = serving.request_timeout_s
    bound = f"> {_s(deadline)} (serving.request_timeout_s caps handoffs at handoff_timeout_s=0)"
    if deadline < lease:
        return CheckRow("lease", client.id, "pass", seen, bound, "", lease)
    return CheckRow(
        "lease",
        client.id,
        "warn",
        seen,
        bound,
        "no positive serving.handoff_timeout_s: a handoff may outlive the lease; set one "
        "below the lease before enabling queueing or retries",
        lease,
    )


async def _handoff_wait(
    config: Config,
    clients: dict[str, EngineClient],
    healthy: set[str],
    none: dict[str, str],
    leases: dict[str, float],
    plan: CheckPlan,
    rows: _Rows,
) -> None:
    cap = config.serving.handoff_timeout_s
    # Engines without a KV connector take no handoff: the consumer is the next one that can.
    ids = [e for e in clients if e not in none]
    results: dict[str, CheckRow] = {}

    async def one(p: EngineClient, d: EngineClient) -> None:
        results[p.id] = await _wait_leg(p, d, cap, config.engine.first_token_timeout_s, plan)

    for engine_id in none:
        results[engine_id] = CheckRow(
            "handoff-wait",
            engine_id,
            "skip",
            NO_CONNECTOR,
            f"decode ok {_s(cap)} after prefill start (serving.handoff_timeout_s)",
            f"{none[engine_id]}: it hands no KV over",
        )
    async with trio.open_nursery() as nursery:
        for i, p_id in enumerate(ids):
            d_id = ids[(i + 1) % len(ids)]
            target = f"{p_id} -> {d_id}"
            bound = f"decode ok {_s(cap)} after prefill start (serving.handoff_timeout_s)"
            if clients[p_id].spec.dialect == "sglang":
                # The rotated pair would put a decode server first and a prefill server
                # after it, and no pair of any order waits here: one row per engine, as
                # the lease rows.
                results[p_id] = CheckRow(
                    "handoff-wait",
                    p_id,
                    "skip",
                    "n/a",
                    bound if cap > 0 else "serving.handoff_timeout_s=0",
                    "SGLang sends both legs at once; no handoff waits between them",
                )
            elif cap <= 0:
                results[p_id] = CheckRow(
                    "handoff-wait", target, "skip", "n/a", "serving.handoff_timeout_s=0", "no cap"
                )
            elif p_id == d_id and len(clients) > 1:
                note = "no other engine has a KV connector to take its handoff"
                results[p_id] = CheckRow("handoff-wait", p_id, "skip", "n/a", bound, note)
            elif p_id not in healthy or d_id not in healthy:
                results[p_id] = CheckRow(
                    "handoff-wait", target, "fail", "not attempted", bound, "engine unhealthy"
                )
            elif p_id in leases and cap >= leases[p_id]:
                results[p_id] = CheckRow(
                    "handoff-wait", target, "skip", "not attempted", bound, "cap above the lease"
                )
            else:
                nursery.start_soon(one, clients[p_id], clients[d_id])
    for engine_id in clients:
        rows.add(results[engine_id])


async def _wait_leg(
    p: EngineClient, d: EngineClient, cap: float, first_token_s: float, plan: CheckPlan
) -> CheckRow:
    target = f"{p.id} -> {d.id}"
    bound = f"decode ok {_s(cap)} after prefill start (serving.handoff_timeout_s)"
    prompt = TextMaker(f"check/{plan.seed}/wait/{p.id}").text(_VERIFY_PROMPT_TOKENS * 4)
    started = trio.current_time()
    leg = await _bounded(plan.request_timeout_s, prefill_leg(p, prompt))
    if leg.value is None:
        return CheckRow("handoff-wait", target, "fail", "prefill failed", bound, leg.why)
    prefill, params = leg.value
    if prefill.error is not None:
        return CheckRow("handoff-wait", target, "fail", "prefill failed", bound, prefill.error)
    # Decode at the cap: the oldest handoff the router would still send.
    await trio.sleep_until(started + cap)
    waited = trio.current_time() - started
    decode = await _bounded(
        2 * first_token_s + plan.request_timeout_s, decode_leg(d, prompt, params)
    )
    stream = decode.value
    if stream is None or not stream.ok:
        why = decode.why if stream is None else stream.error
        return CheckRow(
            "handoff-wait",
            target,
            "fail",
            f"decode failed after {_ms(waited)}",
            bound,
            f"decode on {d.id}: {why} (the KV did not survive the cap)",
        )
    return CheckRow("handoff-wait", target, "pass", f"decode ok after {_ms(waited)}", bound)


def _first_token(
    config: Config,
    p99: float | None,
    store: ProfileStore | None,
    none: dict[str, str],
    rows: _Rows,
) -> None:
    limit = config.engine.first_token_timeout_s
    bound = f"< {_s(limit)} (engine.first_token_timeout_s)"
    profiled = store.max_handoff_p99_s() if store is not None else None
    values = [v for v in (p99, profiled) if v is not None and math.isfinite(v)]
    if not values and none and not crossed_pairs(config.engines, no_connector=frozenset(none)):
        note = "no crossed pair: no engine pair has KV connectors to hand KV over"
        rows.add(CheckRow("first-token", "fleet", "skip", NO_CONNECTOR, bound, note))
        return
    if not values:
        rows.add(
            CheckRow("first-token", "fleet", "fail", "no measurement", bound, "no crossed pair")
        )
        return
    worst = max(values)
    sources = []
    if p99 is not None:
        sources.append(f"check {_ms(p99)}")
    if profiled is not None:
        sources.append(f"profile {_ms(profiled)}")
    status: Status = "pass" if worst < limit else "fail"
    note = "crossed-handoff p99 from " + " and ".join(sources)
    if status == "fail":
        note += "; raise engine.first_token_timeout_s above it"
    rows.add(CheckRow("first-token", "fleet", status, f"p99 {_ms(worst)}", bound, note, worst))


TABLE_WIDTH = 100
# Widest each column but the note may grow before its cells wrap (together, with their
# gaps, one 100-column line): without a cap one long engine id or limit pushed every
# note off the terminal. The note takes what is left of the line when that is at least
# _NOTE_MIN, else it goes on the lines under its row, indented.
_COLUMN_CAPS = (12, 18, 6, 18, 36)
_NOTE_MIN = 30
_NOTE_INDENT = "    "


def format_table(rows: tuple[CheckRow, ...] | list[CheckRow], width: int = TABLE_WIDTH) -> str:
    """The rows as a table no wider than `width` (long cells wrapped at spaces where they
    can be), and a last line that counts the results."""
    header = ("check", "engine/pair", "result", "measured", "limit", "note")
    table = [header] + [
        (r.check, r.target, r.status.upper(), r.measured, r.limit, r.note) for r in rows
    ]
    widths = [min(cap, max(len(row[i]) for row in table)) for i, cap in enumerate(_COLUMN_CAPS)]
    note_at = sum(widths) + 2 * len(widths)
    beside = width - note_at >= _NOTE_MIN
    lines = []
    for row in table:
        cells = [_wrap(cell, w) for cell, w in zip(row, widths, strict=False)]
        note = _wrap(row[5], width - note_at) if beside else []
        for n in range(max(len(note), *(len(cell) for cell in cells))):
            parts = [
                (cell[n] if n < len(cell) else "").ljust(w)
                for cell, w in zip(cells, widths, strict=True)
            ]
            parts.append(note[n] if n < len(note) else "")
            lines.append("  ".join(parts).rstrip())
        if not beside and row[5]:
            lines.extend(_NOTE_INDENT + line for line in _wrap(row[5], width - len(_NOTE_INDENT)))
    lines.append(summary_line(rows))
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]


def summary_line(rows: tuple[CheckRow, ...] | list[CheckRow]) -> str:
    """`12 checks: 10 pass, 1 warn, 1 fail, 0 skip`: the verdict at a glance."""
    counts = dict.fromkeys(get_args(Status), 0)
    for row in rows:
        counts[row.status] += 1
    tally = ", ".join(f"{n} {status}" for status, n in counts.items())
    return f"{len(rows)} checks: {tally}"
