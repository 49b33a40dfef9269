"""The promises a campaign checks once its load has drained, written once.

Pure functions over plain data, so the in-process campaigns and the soak (which reads
the same documents over HTTP) share them:

- what each client saw (`Exchange`, from tests/reliability/client.py);
- the simulator engines' `/_sim/state` documents (counters, gauges and the outcome
  ring: one entry per leg with its request id, phase and how it ended);
- Narwhal's `/narwhal/state` document once the router is idle.

Checks (each named in the report):

well_formed       every request ended with a success (a JSON body with choices, or an
                  SSE stream whose last event is `[DONE]` and that has no error event),
                  or a well-formed error: an HTTP status with a JSON envelope carrying
                  error.message/type/code, or a 200 SSE stream whose last event is an
                  error envelope and that has no `[DONE]`. Requests the client hung up
                  on are exempt; a client that had to give up waiting is a violation.
deadline          no request lived longer than serving.request_timeout_s plus a small
                  bound (the last write, bounded by serving.client_stall_s), measured on
                  the client. A client whose upload was cut by the answer (it reads only
                  once a write fails, as httpx does) may take the server's linger
                  after that answer (at most 1 s) longer.
no_retry_after_output
                  a stream the client saw any output on had exactly one decode leg
                  (over every engine, by request id); a committed stream never more
                  than one. Decode legs that ended before the response head
                  reached the client (wall clocks) do not count: an SGLang pair
                  sends its decode leg with its prefill, before the stream commits,
                  so a pair that failed then leaves a decode leg nobody saw, and the
                  retry that follows is one before any output. (The last leg may
                  end before the head too: its output waits for the prefill's answer.)
aborts_seen       every leg the router had to cancel (the client left mid-leg, a
                  prefill/first-token/gap/request deadline fired on a stalled engine)
                  ended `aborted` at the engine, or ended by the engine's own doing (an
                  error, or done) no later than the router's answer to the client
                  (wall clocks, RACE_SLACK_S): a race in which nothing outlived the
                  request. The expected, seen and engine-first counts are reported.
legs_end_with_request
                  no leg outlived the response the router gave: every leg the engine
                  ended by its own doing (done, or an error) ended no later than the
                  client's end (wall clocks, RACE_SLACK_S). A leg the router gave up on
                  without closing would run on. This covers the legs aborts_seen cannot
                  name from the client's verdict: an SGLang pair's other leg, cancelled
                  when one leg fails (a prefill left waiting in its bootstrap room ends
                  only at SGLang's bootstrap timeout). Clients that hung up are left
                  out: their end is theirs, not the router's.
engines_settled   no leg is left running or waiting on any engine, every leg an
                  engine accepted has exactly one outcome, the counters balance, and
                  (when asked) every KV lease of a live instance was released or
                  expired.
router_idle       nothing retained, admitted or queued; no phase slot, token count,
                  handoff or serving-pool connection held on any engine.
accounted         the router counted exactly one outcome per request it received.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs
import trio

from narwhal.fleet import LoadStatistics
from narwhal.serving import ServingContext
from narwhal.serving._server import _LINGER_S

from .client import Exchange, is_error_event

# Failure codes for which the router cancels a leg whose engine is still working on it
# (the campaigns make sure the engine cannot finish on its own: the leg is stalled).
_CANCELS_PREFILL = frozenset({"prefill_timeout"})
_CANCELS_DECODE = frozenset({"first_token_timeout", "decode_stalled"})
_DECODE_PHASES = ("decode", "aggregate")


@attrs.define
class Check:
    name: str
    checked: int = 0
    violations: list[str] = attrs.Factory(list)
    notes: dict[str, object] = attrs.Factory(dict)

    @property
    def passed(self) -> bool:
        return not self.violations

    def fail(self, message: str) -> None:
        self.violations.append(message)

    def to_json(self) -> dict[str, object]:
        return {
            "passed": self.passed,
            "checked": self.checked,
            "violations": len(self.violations),
            "examples": self.violations[:10],
            **self.notes,
        }


@attrs.define
class Report:
    checks: dict[str, Check] = attrs.Factory(dict)
    outcomes: Counter[str] = attrs.Factory(Counter)

    def check(self, name: str) -> Check:
        if name not in self.checks:
            self.checks[name] = Check(name)
        return self.checks[name]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks.values())

    def to_json(self) -> dict[str, object]:
        return {
            "passed": self.passed,
            "outcomes": dict(sorted(self.outcomes.items())),
            "checks": {name: check.to_json() for name, check in sorted(self.checks.items())},
        }

    def assert_ok(self) -> None:
        if self.passed:
            return
        lines = [
            f"{check.name}: {violation}"
            for check in self.checks.values()
            for violation in check.violations[:15]
        ]
        raise AssertionError(
            f"{sum(len(c.violations) for c in self.checks.values())} invariant violation(s):\n"
            + "\n".join(lines)
        )


# ---------------------------------------------------------------------------- clients


@attrs.frozen
class Verdict:
    """How one exchange ended: ok, error (HTTP), stream_error, hung_up, worker_lost or
    malformed."""

    kind: str
    code: str | None = None
    visible_output: bool = False
    why: str = ""

    @property
    def label(self) -> str:
        return self.kind if self.code is None else f"{self.kind}:{self.code}"


def _envelope_code(document: object) -> str | None:
    """The error code of a well-formed envelope, else None."""
    if not isinstance(document, dict) or set(document) != {"error"}:
        return None
    error = document["error"]
    if not isinstance(error, dict):
        return None
    message, kind, code = error.get("message"), error.get("type"), error.get("code")
    if not (isinstance(message, str) and message and isinstance(kind, str) and kind):
        return None
    if not isinstance(code, str) or not code:
        return None
    return code


def verdict(ex: Exchange) -> Verdict:
    events = ex.events() if ex.stream and ex.status == 200 else []
    visible = any(e != "[DONE]" and not is_error_event(e) for e in events)
    if ex.hung_up is not None:
        return Verdict("hung_up", visible_output=visible, why=ex.hung_up)
    if ex.timed_out:
        return Verdict("malformed", why=f"client gave up after {ex.duration:.2f}s")
    if ex.status is None:
        return Verdict("malformed", why=f"no response: {ex.cut}")
    if not ex.complete:
        return Verdict("malformed", visible_output=visible, why=f"cut short: {ex.cut}")
    content_type = ex.headers.get("content-type", "")
    if ex.status != 200:
        try:
            document = json.loads(ex.body)
        except (ValueError, RecursionError):
            return Verdict("malformed", why=f"HTTP {ex.status} body is not JSON: {ex.body[:80]!r}")
        code = _envelope_code(document)
        if code is None or not content_type.startswith("application/json"):
            return Verdict("malformed", why=f"HTTP {ex.status} without an envelope: {document}")
        return Verdict("error", code)
    if not ex.stream:
        try:
            document = json.loads(ex.body)
        except (ValueError, RecursionError):
            return Verdict("malformed", why=f"200 body is not JSON: {ex.body[:80]!r}")
        if not isinstance(document, dict) or not isinstance(document.get("choices"), list):
            return Verdict("malformed", why=f"200 body without choices: {ex.body[:120]!r}")
        return Verdict("ok")
    if not content_type.startswith("text/event-stream"):
        return Verdict("malformed", why=f"stream with content-type {content_type!r}")
    if not events or not ex.body.endswith(b"\n\n"):
        return Verdict(
            "malformed", visible_output=visible, why=f"stream ends mid-event: {ex.body[-80:]!r}"
        )
    errors = [e for e in events if is_error_event(e)]
    if events[-1] == "[DONE]":
        if errors or events.count("[DONE]") != 1:
            return Verdict("malformed", visible_output=visible, why="[DONE] after an error event")
        return Verdict("ok", visible_output=visible)
    if "[DONE]" in events:
        return Verdict("malformed", visible_output=visible, why="events after [DONE]")
    code = _envelope_code(_loads(events[-1]))
    if code is None:
        return Verdict(
            "malformed",
            visible_output=visible,
            why=f"stream ends without [DONE]: {events[-1][:120]}",
        )
    if len(errors) != 1:
        return Verdict("malformed", visible_output=visible, why="more than one error event")
    return Verdict("stream_error", code, visible)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


# ---------------------------------------------------------------------------- engines


@attrs.frozen
class Leg:
    engine: str
    request_id: str
    phase: str
    outcome: str
    status: int
    tokens: int
    at: float
    accepted: bool  # the engine admitted it (an injected error or a refusal is not)
    wall: float | None = None  # time.time() when the engine recorded it, if it says


def legs_by_request(states: Iterable[Mapping[str, Any]]) -> dict[str, list[Leg]]:
    """Every leg in the engines' outcome rings, grouped by X-Request-Id, oldest first."""
    out: dict[str, list[Leg]] = {}
    for state in states:
        for entry in state["outcomes"]:
            leg = Leg(
                engine=str(state["engine"]),
                request_id=entry["request_id"],
                phase=entry["phase"],
                outcome=entry["outcome"],
                status=entry["status"],
                tokens=entry["tokens"],
                at=entry["at"],
                accepted=entry["internal_id"] is not None,
                wall=entry.get("wall"),
            )
            out.setdefault(leg.request_id, []).append(leg)
    for legs in out.values():
        legs.sort(key=lambda leg: leg.at)
    return out


def expected_abort(ex: Exchange, v: Verdict) -> str | None:
    """The phase whose leg the router had to cancel, when that is certain."""
    if ex.hung_up is not None:
        return ex_expect(ex)
    if v.kind in ("error", "stream_error"):
        if v.code in _CANCELS_PREFILL:
            return "prefill"
        if v.code in _CANCELS_DECODE:
            return "decode"
        if v.code == "expired" and v.visible_output:
            return "decode"
    return ex_expect(ex)


def ex_expect(ex: Exchange) -> str | None:
    """A campaign that stalls a leg on purpose names it in the label: `abort:<phase>`."""
    for part in ex.label.split():
        if part.startswith("abort:"):
            return part[len("abort:") :]
    return None


# ---------------------------------------------------------------------------- checks


def check_clients(
    report: Report,
    exchanges: Sequence[Exchange],
    *,
    request_timeout_s: float,
    slack_s: float,
    lost: Collection[str] = (),
) -> dict[str, Verdict]:
    """`lost`: requests in flight on a worker process killed on purpose: a connection it
    took with it (no response, or one cut short) is its verdict `worker_lost`."""
    well_formed = report.check("well_formed")
    deadline = report.check("deadline")
    deadline.notes["bound_s"] = round(request_timeout_s + slack_s, 3)
    verdicts: dict[str, Verdict] = {}
    longest = 0.0
    for ex in exchanges:
        v = verdict(ex)
        if ex.request_id in lost and (ex.status is None or not ex.complete) and not ex.timed_out:
            v = Verdict("worker_lost", visible_output=v.visible_output, why=ex.cut or "")
        verdicts[ex.request_id] = v
        report.outcomes[v.label] += 1
        well_formed.checked += 1
        if v.kind == "malformed":
            well_formed.fail(f"{ex.request_id} ({ex.label or 'no label'}): {v.why}")
        deadline.checked += 1
        longest = max(longest, ex.duration)
        # The server reads and drops what such a client still sends before it
        # closes, so its write fails, and it reads its answer, up to _LINGER_S later.
        slack = slack_s + (_LINGER_S if ex.upload_cut else 0.0)
        if ex.duration > request_timeout_s + slack:
            deadline.fail(
                f"{ex.request_id} lived {ex.duration:.3f}s > "
                f"request_timeout_s={request_timeout_s} + {slack}"
            )
    deadline.notes["longest_s"] = round(longest, 3)
    return verdicts


def check_legs(
    report: Report,
    exchanges: Sequence[Exchange],
    verdicts: Mapping[str, Verdict],
    legs: Mapping[str, list[Leg]],
) -> None:
    retry = report.check("no_retry_after_output")
    aborts = report.check("aborts_seen")
    within = report.check("legs_end_with_request")
    expected = seen = engine_first = 0
    for ex in exchanges:
        v = verdicts[ex.request_id]
        mine = legs.get(ex.request_id, [])
        if ex.hung_up is None and ex.ended_wall and v.kind != "worker_lost":
            for leg in mine:
                within.checked += 1
                if leg.outcome != "aborted" and not ended_by(leg, ex.ended_wall + RACE_SLACK_S):
                    within.fail(
                        f"{ex.request_id} ({v.label}, {ex.label or 'no label'}): its {leg.phase} "
                        f"leg on engine {leg.engine} ended {leg.outcome!r} after the response"
                    )
        decodes = [leg for leg in mine if leg.phase in _DECODE_PHASES]
        if ex.stream and ex.status == 200:
            retry.checked += 1
            # The last decode leg is the one that may have fed the stream; every earlier
            # one must have ended before the stream was committed.
            late = [leg for leg in decodes[:-1] if not ended_before_commit(leg, ex)]
            if v.visible_output and (not decodes or late):
                retry.fail(
                    f"{ex.request_id}: client saw output but the engines saw "
                    f"{len(decodes)} decode legs, {len(late)} of them before the last "
                    f"ending after the commit: {decodes}"
                )
            elif late:
                retry.fail(
                    f"{ex.request_id}: committed stream with {len(late) + 1} decode legs "
                    f"after the commit: {decodes}"
                )
        phase = expected_abort(ex, v)
        if phase is None:
            continue
        expected += 1
        aborts.checked += 1
        wanted = _DECODE_PHASES if phase == "decode" else (phase,)
        candidates = [leg for leg in mine if leg.phase in wanted]
        if not candidates:
            aborts.fail(
                f"{ex.request_id} ({v.label}, {ex.label}): no {phase} leg reached an engine"
            )
            continue
        last = candidates[-1]
        if last.outcome != "aborted" and ended_first(last, ex):
            engine_first += 1
        elif last.outcome != "aborted":
            aborts.fail(
                f"{ex.request_id} ({v.label}, {ex.label}): the router cancelled its "
                f"{phase} leg but engine {last.engine} recorded {last.outcome!r}"
            )
        else:
            seen += 1
    aborts.notes.update(expected=expected, seen=seen, engine_first=engine_first)


# How much later than the client's end an engine may record a leg and still count as
# having ended it before the router's close reached it: the router closes the leg before
# it ends the client's response, so only the two processes' scheduling lies between.
RACE_SLACK_S = 0.05


def ended_before_commit(leg: Leg, ex: Exchange) -> bool:
    """Whether a leg had ended before the response head reached the client, so that
    nothing of it can have reached the stream."""
    if leg.wall is None or not ex.head_wall:
        return False
    return leg.wall < ex.head_wall


def ended_by(leg: Leg, wall: float) -> bool:
    """Whether the engine recorded the leg by `wall` (unknown without its wall clock)."""
    return leg.wall is None or leg.wall <= wall


def ended_first(leg: Leg, ex: Exchange) -> bool:
    """Whether the engine ended a leg the router cancelled on its own (an error, or done)
    before the router's close could reach it: nothing outlived the request."""
    if leg.wall is None or not ex.ended_wall:
        return False
    return leg.outcome != "aborted" and leg.wall <= ex.ended_wall + RACE_SLACK_S


def check_engines(
    report: Report, states: Sequence[Mapping[str, Any]], *, leases_released: bool = True
) -> None:
    settled = report.check("engines_settled")
    for state in states:
        settled.checked += 1
        name = f"engine {state['engine']} (gen {state.get('generation', 0)})"
        for key in ("running", "waiting", "pulling"):
            if state[key]:
                settled.fail(f"{name}: {state[key]} request(s) still {key}")
        counters = state["counters"]
        accepted = sum(counters["requests"].values())
        ended = (
            sum(counters["completed"].values())
            + sum(counters["aborted"].values())
            + sum(counters["errors"].values())
        )
        refused = counters["errors_injected"] + counters["rejected_queue_full"]
        if ended != accepted + refused:
            settled.fail(f"{name}: {accepted} legs accepted + {refused} refused but {ended} ended")
        ring = state["outcomes"]
        if len(ring) == ended:
            in_ring = sum(1 for entry in ring if entry["internal_id"] is not None)
            if in_ring != accepted:
                settled.fail(f"{name}: {accepted} legs accepted, {in_ring} outcomes recorded")
        if leases_released and not state.get("retired") and state["leases"]["held"]:
            settled.fail(f"{name}: {state['leases']['held']} KV lease(s) still held")


def check_router(report: Report, state: Mapping[str, Any]) -> None:
    idle = report.check("router_idle")
    idle.checked += 1
    admission = state["admission"]
    for key in ("retained", "admitted", "queue_depth"):
        if admission[key]:
            idle.fail(f"admission.{key} = {admission[key]}")
    for engine_id, wait in admission.get("prefill_backlog_s", {}).items():
        if wait > 1e-6:
            idle.fail(f"engine {engine_id}: prefill backlog {wait}s left committed")
    if state["requests"]["in_flight"]:
        idle.fail(f"in flight: {state['requests']['in_flight'][:3]}")
    for engine in state["engines"]:
        idle.checked += 1
        where = f"engine {engine['id']}"
        for phase, keys in (
            ("prefill", ("inflight", "tokens_inflight", "slots_in_use")),
            ("decode", ("active", "tokens", "unstreamed_legs", "slots_in_use")),
        ):
            for key in keys:
                if engine[phase][key]:
                    idle.fail(f"{where}: {phase}.{key} = {engine[phase][key]}")
        if engine["handoffs_pending"]:
            idle.fail(f"{where}: handoffs_pending = {engine['handoffs_pending']}")
        serving = engine["pools"]["serving"]
        if serving["in_use"] or serving["waiting"]:
            idle.fail(f"{where}: serving pool {serving}")
        if engine["pools"]["control"]["waiting"]:
            idle.fail(f"{where}: control pool {engine['pools']['control']}")


def check_context(report: Report, ctx: ServingContext) -> None:
    """The same promise from the live objects (in-process campaigns): the limiters,
    the admission gate, the pools and the prefill backlog book, not just what
    /narwhal/state chose to show."""
    idle = report.check("router_idle")
    idle.checked += 1
    if ctx.retained or ctx.records:
        idle.fail(f"ctx: retained={ctx.retained}, records={list(ctx.records.values())[:3]}")
    gate = ctx.gate.statistics()
    if gate.admitted or gate.waiting:
        idle.fail(f"ctx: admission gate {gate}")
    for wait in ctx.backlog.waits(trio.current_time()).values():
        if wait > 1e-6:
            idle.fail(f"ctx: prefill backlog left committed: {wait}")
    for engine in [*ctx.fleet, *ctx.fleet.retiring]:
        for name, limiter in (
            ("prefill", engine.prefill_limiter),
            ("decode", engine.decode_limiter),
        ):
            stats = limiter.statistics()
            if stats.borrowed_tokens or stats.tasks_waiting:
                idle.fail(f"ctx: engine {engine.id} {name} limiter {stats}")
        for name, pool in (("serving", engine.serving_pool), ("control", engine.control_pool)):
            pool_stats = pool.statistics()
            if pool_stats.waiting or (name == "serving" and pool_stats.in_use):
                idle.fail(f"ctx: engine {engine.id} {name} pool {pool_stats}")
        # Every claim on the engine's load given back: queued, placed and running legs,
        # handoffs, resident KV, first-token and unstreamed waits (leg starts only count).
        load = engine.load.statistics()
        if attrs.evolve(load, legs_started=0) != LoadStatistics():
            idle.fail(f"ctx: {engine!r} load left: {load}")
        if engine.view(trio.current_time()).unstreamed_cap:
            idle.fail(f"ctx: {engine!r} {engine.load!r}")


def check_accounting(
    report: Report, before: Mapping[str, int], after: Mapping[str, int], requests: int
) -> None:
    accounted = report.check("accounted")
    accounted.checked += 1
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    counted = sum(delta.values())
    accounted.notes["router_outcomes"] = {k: v for k, v in sorted(delta.items()) if v}
    if counted != requests:
        accounted.fail(f"{requests} requests sent, router counted {counted} outcomes: {delta}")


def check_all(
    exchanges: Sequence[Exchange],
    *,
    request_timeout_s: float,
    slack_s: float,
    engine_states: Sequence[Mapping[str, Any]] = (),
    router_state: Mapping[str, Any] | None = None,
    outcomes_before: Mapping[str, int] | None = None,
    leases_released: bool = True,
    ctx: ServingContext | None = None,
    other_legs: Sequence[Mapping[str, Any]] = (),
    lost: Collection[str] = (),
) -> Report:
    """Every check that the given data allows; see the module docstring.

    `other_legs` are outcome rings of engines that are not simulators (the hostile
    engine): they count for the leg checks only."""
    report = Report()
    verdicts = check_clients(
        report, exchanges, request_timeout_s=request_timeout_s, slack_s=slack_s, lost=lost
    )
    if engine_states or other_legs:
        legs = legs_by_request([*engine_states, *other_legs])
        check_legs(report, exchanges, verdicts, legs)
    if engine_states:
        check_engines(report, engine_states, leases_released=leases_released)
    if router_state is not None:
        check_router(report, router_state)
        if ctx is not None:
            check_context(report, ctx)
        if outcomes_before is not None:
            check_accounting(
                report, outcomes_before, router_state["requests"]["outcomes"], len(exchanges)
            )
    return report
