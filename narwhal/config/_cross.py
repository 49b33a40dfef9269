"""Cross-field rules: invariants that relate two or more fields.

Each rule is a small function from a structured `Config` to messages; the loader runs
them all and collects every message. A rule names every field it reads (`reads`), so the
loader can skip it when one of them is invalid (mistyped, missing, or out of its own
range) and a default or placeholder stands in for it: comparing against a value that is
not the file's only adds a second, misleading message for one mistake.
tests/config/test_cross_rules.py records what each rule reads and fails when `reads`
leaves a field out.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from fractions import Fraction

import attrs

from ..engines._dialects import dialect_for
from ._model import Config, EngineSpec
from ._rules import url_problem


@attrs.frozen
class CrossRule:
    check: Callable[[Config], list[str]]
    reads: tuple[str, ...]
    """Field patterns (`engines[].url`) of every value the rule reads."""

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.check) or ""

    def hidden_by(self, broken: set[str]) -> list[str]:
        """The invalid values (field patterns, a whole section or list among them) that
        this rule reads; the rule waits until there are none."""
        return sorted(
            bad
            for bad in broken
            if bad == ""
            or any(read == bad or read.startswith((f"{bad}.", f"{bad}[")) for read in self.reads)
        )


def cross_rules() -> tuple[CrossRule, ...]:
    """Every cross-field rule, in the order its messages are reported."""
    return (
        CrossRule(_engines_present, ("engines",)),
        CrossRule(_engine_ids, ("engines[].id",)),
        CrossRule(_engine_urls, ("engines[].url",)),
        CrossRule(_one_dialect, ("engines[].dialect",)),
        CrossRule(_one_model, ("engines[].model",)),
        CrossRule(_bootstrap_ports, ("engines[].bootstrap_port", "engines[].dialect")),
        CrossRule(_kv_roles, ("engines[].kv_role", "engines[].dialect", "engines[].role")),
        CrossRule(
            _role_floors,
            (
                "controller.min_prefill",
                "controller.min_decode",
                "controller.enabled",
                "controller.advisory",
                "engines[].role",
                "engines[].dialect",
                "engines[].kv_role",
            ),
        ),
        CrossRule(_retry_cap, ("serving.retry_base_s", "serving.retry_cap_s")),
        CrossRule(
            _queueing,
            (
                "serving.queue_capacity",
                "serving.queue_timeout_s",
                "serving.prefill_concurrency",
                "serving.decode_concurrency",
                "engines[].prefill_concurrency",
                "engines[].decode_concurrency",
            ),
        ),
        CrossRule(
            _handoff_cap,
            (
                "serving.queue_capacity",
                "serving.max_attempts",
                "serving.handoff_timeout_s",
                "serving.request_timeout_s",
            ),
        ),
        CrossRule(
            _admission_overrides,
            (
                "serving.max_connections",
                "serving.prefill_concurrency",
                "serving.decode_concurrency",
                "engines[].prefill_concurrency",
                "engines[].decode_concurrency",
            ),
        ),
        CrossRule(_thresholds, ("controller.thresholds.expand", "controller.thresholds.shrink")),
        CrossRule(
            _evidence_spans,
            (
                "controller.reactive.evidence_span_s",
                "controller.reactive.evidence_max_span_s",
                "controller.reactive.window_s",
            ),
        ),
        CrossRule(
            _decode_correction,
            (
                "controller.reactive.decode_correction_min",
                "controller.reactive.decode_correction_max",
            ),
        ),
        CrossRule(
            _health_samples,
            (
                "recovery.health.min_samples",
                "recovery.health.window_s",
                "controller.monitor_interval_s",
            ),
        ),
        CrossRule(
            _open_connections,
            (
                "listen.max_open_connections",
                "serving.max_connections",
                "serving.queue_capacity",
            ),
        ),
        CrossRule(_admin_token, ("admin.token", "admin.token_file")),
        CrossRule(_admin_port, ("listen.host", "listen.port", "admin.host", "admin.port")),
        CrossRule(
            _kv_events,
            ("engines[].kv_events.endpoint", "engines[].kv_events.replay_endpoint"),
        ),
        CrossRule(_cluster_endpoints, ("cluster.endpoints",)),
        CrossRule(_cluster_timeout, ("cluster.request_timeout_s", "cluster.lease_ttl_s")),
    )


def _engines_present(cfg: Config) -> list[str]:
    """`engines` lists at least one engine."""
    if not cfg.engines:
        return ["engines: at least one engine is required"]
    return []


def _engine_ids(cfg: Config) -> list[str]:
    """Engine ids are non-blank and unique."""
    out: list[str] = []
    seen: set[str] = set()
    for index, spec in enumerate(cfg.engines):
        if not spec.id.strip():
            out.append(f"engines[{index}].id: {spec.id!r} must not be empty or blank")
        elif spec.id in seen:
            out.append(f"engines[{index}].id: duplicate id {spec.id!r}")
        seen.add(spec.id)
    return out


def _engine_urls(cfg: Config) -> list[str]:
    """Engine URLs are `http(s)://host[:port]` with no path beyond `/`, no query or
    fragment, and no two engines share one (scheme, host, port); a missing port means
    80 or 443."""
    out: list[str] = []
    seen: dict[tuple[str, str, int], int] = {}
    for index, spec in enumerate(cfg.engines):
        problem, identity = url_problem(spec.url)
        if problem is not None:
            out.append(f"engines[{index}].url: {spec.url!r} {problem}")
        elif identity is not None:
            if identity in seen:
                out.append(
                    f"engines[{index}].url: {spec.url!r} is the same engine as "
                    f"engines[{seen[identity]}].url"
                )
            else:
                seen[identity] = index
    return out


def _one_dialect(cfg: Config) -> list[str]:
    """All engines use one dialect: a vLLM prefill cannot hand KV to an SGLang decode."""
    return _agree_with_first(cfg, "dialect", "kv handoff cannot cross engine dialects")


def _one_model(cfg: Config) -> list[str]:
    """All engines serve one model: KV computed for one model is meaningless to another,
    and demand pricing uses the mean profile across the fleet
    (docs/design.md#reactive-parameters)."""
    return _agree_with_first(cfg, "model", "all engines must serve one model")


def _agree_with_first(cfg: Config, field: str, because: str) -> list[str]:
    if not cfg.engines:
        return []
    first: str = getattr(cfg.engines[0], field)
    out: list[str] = []
    for index, spec in enumerate(cfg.engines):
        value: str = getattr(spec, field)
        if value != first:
            out.append(
                f"engines[{index}].{field}: {value!r} differs from {first!r} "
                f"(engines[0].{field}); {because}"
            )
    return out


def _bootstrap_ports(cfg: Config) -> list[str]:
    """`bootstrap_port` is set only on SGLang engines. Left `null` on an SGLang engine, the
    router uses SGLang's default, 8998. (It may equal the HTTP port: narwhal-sim serves its
    bootstrap endpoints on the engine's own port.)"""
    out: list[str] = []
    for index, spec in enumerate(cfg.engines):
        if spec.bootstrap_port is None:
            continue
        where = f"engines[{index}].bootstrap_port"
        if spec.dialect != "sglang":
            out.append(
                f"{where}: {spec.bootstrap_port} is only used by the sglang dialect "
                f"(dialect is {spec.dialect!r})"
            )
    return out


def _kv_events(cfg: Config) -> list[str]:
    """`kv_events.replay_endpoint` is set only with an `endpoint`, and no two engines
    publish to one endpoint Narwhal binds (each engine's events are told apart by the
    socket they arrive on)."""
    out: list[str] = []
    bound: dict[str, int] = {}
    for index, spec in enumerate(cfg.engines):
        events = spec.kv_events
        if events.endpoint is None:
            if events.replay_endpoint is not None:
                out.append(
                    f"engines[{index}].kv_events.replay_endpoint: set without "
                    "kv_events.endpoint; an engine without events has nothing to replay"
                )
            continue
        if "*" in events.endpoint or events.endpoint.startswith("ipc://"):
            continue
        first = bound.setdefault(events.endpoint, index)
        if first != index:
            out.append(
                f"engines[{index}].kv_events.endpoint: {events.endpoint!r} is also "
                f"engines[{first}]'s; Narwhal binds it once, for one engine"
            )
    return out


def _kv_roles(cfg: Config) -> list[str]:
    """`kv_role` is set only on vLLM engines, and an explicit producer or consumer role
    matches the engine's role: `kv_producer` serves prefill, `kv_consumer` decode."""
    out: list[str] = []
    wants = {"kv_producer": "prefill", "kv_consumer": "decode"}
    for index, spec in enumerate(cfg.engines):
        if spec.kv_role is None:
            continue
        where = f"engines[{index}].kv_role"
        if spec.dialect != "vllm":
            out.append(
                f"{where}: {spec.kv_role!r} is only used by the vllm dialect "
                f"(dialect is {spec.dialect!r})"
            )
        elif spec.kv_role in wants and spec.role != wants[spec.kv_role]:
            out.append(
                f"{where}: {spec.kv_role!r} fixes the engine's role to "
                f"{wants[spec.kv_role]!r}, but its role is {spec.role!r}"
            )
    return out


def _role_floors(cfg: Config) -> list[str]:
    """`controller.min_prefill` and `controller.min_decode` fit the configured fleet
    (docs/design.md#role-floors): `min_prefill + min_decode` is at most the number of engines,
    except that a single engine with role `both` and both floors 1 is accepted: it serves aggregate
    inference. And enough engines can ever serve each phase: role `prefill` or `both` for prefill,
    `decode` or `both` for decode, or a `prefill` or `decode` engine the controller may move there.
    A configured split below a floor is otherwise the controller's to restore (floor recovery, one
    engine per pass), as after an ejection; where nothing can move (`controller.enabled` false,
    `controller.advisory`, or engines whose launch fixes their role, as SGLang's does) it could
    never be met."""
    if not cfg.engines:
        return []
    ctl = cfg.controller
    moves = ctl.enabled and not ctl.advisory

    def capable(phase: str) -> int:
        return sum(
            spec.role in (phase, "both")
            or (moves and spec.role in ("prefill", "decode") and not _fixed_role(spec))
            for spec in cfg.engines
        )

    out: list[str] = []
    for phase, floor in (("prefill", ctl.min_prefill), ("decode", ctl.min_decode)):
        able = capable(phase)
        if floor > able:
            movable = " or that the controller can move there" if moves else ""
            out.append(
                f"controller.min_{phase}: {floor} exceeds the {able} engine(s) with role "
                f"'{phase}' or 'both'{movable}"
            )
    aggregate = (
        len(cfg.engines) == 1
        and cfg.engines[0].role == "both"
        and ctl.min_prefill == ctl.min_decode == 1
    )
    total = ctl.min_prefill + ctl.min_decode
    if total > len(cfg.engines) and not aggregate:
        out.append(
            f"controller: min_prefill + min_decode = {total} exceeds the "
            f"{len(cfg.engines)} configured engine(s)"
        )
    return out


def _fixed_role(spec: EngineSpec) -> bool:
    """Whether the engine keeps its launch role (an SGLang server's is its launch mode, a
    vLLM engine's an explicit kv_role): the controller never moves one."""
    return dialect_for(spec.dialect).fixed_role is not None or spec.launch_fixes_role is not None


def _open_connections(cfg: Config) -> list[str]:
    """`listen.max_open_connections` exceeds `serving.max_connections +
    serving.queue_capacity`: every retained request holds a connection, and one more is
    needed to answer the ceiling's 429 (and `/health`) rather than leave clients waiting
    unanswered in the listen backlog."""
    limit = cfg.listen.max_open_connections
    ceiling = cfg.serving.max_connections + cfg.serving.queue_capacity
    if limit <= ceiling:
        return [
            f"listen.max_open_connections: {limit} must exceed serving.max_connections + "
            f"serving.queue_capacity = {ceiling}, the retained-request ceiling"
        ]
    return []


def _admin_token(cfg: Config) -> list[str]:
    """At most one of `admin.token` and `admin.token_file` is set."""
    if cfg.admin.token is not None and cfg.admin.token_file is not None:
        return [
            "admin.token_file: set, and so is admin.token; the admin listener takes one "
            "token: keep the file and drop admin.token"
        ]
    return []


_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def _admin_port(cfg: Config) -> list[str]:
    """The admin listener does not take the client listener's port (`admin.port` differs
    from `listen.port` unless one of them is `0`, or both hosts are other, specific
    addresses)."""
    listen, admin = cfg.listen, cfg.admin
    if admin.port == 0 or admin.port != listen.port:
        return []
    hosts = {listen.host.strip(), admin.host.strip()}
    if len(hosts) == 2 and hosts.isdisjoint(_WILDCARDS):
        return []
    return [
        f"admin.port: {admin.port} is listen.port too, on {admin.host}; the admin listener "
        "needs a port of its own"
    ]


def _cluster_endpoints(cfg: Config) -> list[str]:
    """No etcd member is listed twice: it would count as two tries of one request."""
    out: list[str] = []
    seen: dict[tuple[str, str, int], int] = {}
    for index, url in enumerate(cfg.cluster.endpoints):
        _, identity = url_problem(url)
        if identity is None:
            continue  # the field rule names it
        if identity in seen:
            out.append(
                f"cluster.endpoints[{index}]: {url!r} is the same member as "
                f"cluster.endpoints[{seen[identity]}]"
            )
        seen[identity] = index
    return out


def _cluster_timeout(cfg: Config) -> list[str]:
    """`cluster.request_timeout_s` is at most a third of `cluster.lease_ttl_s`: a renewal
    that times out must leave time for another before the lease lapses."""
    c = cfg.cluster
    if c.request_timeout_s > c.lease_ttl_s / 3:
        return [
            f"cluster.request_timeout_s: {c.request_timeout_s!r} exceeds a third of "
            f"cluster.lease_ttl_s={c.lease_ttl_s!r}"
        ]
    return []


def _retry_cap(cfg: Config) -> list[str]:
    """`serving.retry_cap_s` is at least `serving.retry_base_s`."""
    s = cfg.serving
    if s.retry_cap_s < s.retry_base_s:
        return [
            f"serving.retry_cap_s: {s.retry_cap_s!r} must be at least the base value "
            f"serving.retry_base_s={s.retry_base_s!r}"
        ]
    return []


def _effective(override: int | None, inherited: int) -> int:
    return inherited if override is None else override


def _queueing(cfg: Config) -> list[str]:
    """Queueing (`serving.queue_capacity > 0`) requires a positive `serving.queue_timeout_s`
    and a positive prefill and decode concurrency for every engine, after per-engine
    overrides."""
    s = cfg.serving
    if s.queue_capacity <= 0:
        return []
    because = f"when queueing is enabled (serving.queue_capacity={s.queue_capacity})"
    out: list[str] = []
    if s.queue_timeout_s <= 0:
        out.append(f"serving.queue_timeout_s: {s.queue_timeout_s!r} must be positive {because}")
    for phase in ("prefill", "decode"):
        inherited: int = getattr(s, f"{phase}_concurrency")
        overrides: list[int | None] = [
            getattr(spec, f"{phase}_concurrency") for spec in cfg.engines
        ]
        if inherited <= 0 and (not overrides or None in overrides):
            out.append(f"serving.{phase}_concurrency: {inherited} must be positive {because}")
        out.extend(
            f"engines[{index}].{phase}_concurrency: {value} must be positive {because}"
            for index, value in enumerate(overrides)
            if value is not None and value <= 0
        )
    return out


def _handoff_cap(cfg: Config) -> list[str]:
    """Queueing or retries (`serving.max_attempts > 1`) require a positive
    `serving.handoff_timeout_s`; a positive cap is below `serving.request_timeout_s`,
    since a cap the request deadline always reaches first never applies."""
    s = cfg.serving
    reasons: list[tuple[str, str]] = []
    if s.queue_capacity > 0:
        reasons.append(("queueing", f"serving.queue_capacity={s.queue_capacity}"))
    if s.max_attempts > 1:
        reasons.append(("retries", f"serving.max_attempts={s.max_attempts}"))
    if s.handoff_timeout_s <= 0 and reasons:
        features = " and ".join(name for name, _ in reasons)
        verb = "is" if features == "queueing" else "are"
        settings = ", ".join(setting for _, setting in reasons)
        return [
            f"serving.handoff_timeout_s: {s.handoff_timeout_s!r} must be positive when "
            f"{features} {verb} enabled ({settings})"
        ]
    if s.handoff_timeout_s >= s.request_timeout_s:
        return [
            f"serving.handoff_timeout_s: {s.handoff_timeout_s!r} must be below "
            f"serving.request_timeout_s={s.request_timeout_s!r}"
        ]
    return []


def _admission_overrides(cfg: Config) -> list[str]:
    """Admission overrides (`serving.prefill_concurrency`, `serving.decode_concurrency`
    and each engine's overrides) are at most `serving.max_connections`, keeping admission
    within the dispatch pool (docs/design.md#admission)."""
    limit = cfg.serving.max_connections
    named: list[tuple[str, int | None]] = [
        ("serving.prefill_concurrency", cfg.serving.prefill_concurrency),
        ("serving.decode_concurrency", cfg.serving.decode_concurrency),
    ]
    for index, spec in enumerate(cfg.engines):
        named.append((f"engines[{index}].prefill_concurrency", spec.prefill_concurrency))
        named.append((f"engines[{index}].decode_concurrency", spec.decode_concurrency))
    return [
        f"{path}: {value} exceeds serving.max_connections={limit}"
        for path, value in named
        if value is not None and value > limit
    ]


def _thresholds(cfg: Config) -> list[str]:
    """`controller.thresholds.shrink` is lower than `controller.thresholds.expand`."""
    t = cfg.controller.thresholds
    if t.shrink >= t.expand:
        return [
            f"controller.thresholds.shrink: {t.shrink!r} must be lower than "
            f"controller.thresholds.expand={t.expand!r}"
        ]
    return []


def _evidence_spans(cfg: Config) -> list[str]:
    """`evidence_span_s <= evidence_max_span_s <= window_s` in `controller.reactive`."""
    r = cfg.controller.reactive
    out: list[str] = []
    if r.evidence_span_s > r.evidence_max_span_s:
        out.append(
            f"controller.reactive.evidence_span_s: {r.evidence_span_s!r} must be at most "
            f"controller.reactive.evidence_max_span_s={r.evidence_max_span_s!r}"
        )
    if r.evidence_max_span_s > r.window_s:
        out.append(
            f"controller.reactive.evidence_max_span_s: {r.evidence_max_span_s!r} must be at "
            f"most controller.reactive.window_s={r.window_s!r}"
        )
    return out


def _decode_correction(cfg: Config) -> list[str]:
    """`controller.reactive.decode_correction_max` is at least `decode_correction_min`."""
    r = cfg.controller.reactive
    if r.decode_correction_max < r.decode_correction_min:
        return [
            f"controller.reactive.decode_correction_max: {r.decode_correction_max!r} must be "
            f"at least controller.reactive.decode_correction_min={r.decode_correction_min!r}"
        ]
    return []


def _health_samples(cfg: Config) -> list[str]:
    """`recovery.health.min_samples` is at most
    floor(`recovery.health.window_s` / `controller.monitor_interval_s`): each monitor
    pass contributes at most one residual per engine (docs/design.md#role-control)."""
    health = cfg.recovery.health
    interval = cfg.controller.monitor_interval_s
    # Operators write decimals: 0.3 / 0.1 must floor to 3, which binary floats get wrong
    # (2.9999999999999996), so divide the shortest decimal forms exactly.
    bound = math.floor(Fraction(repr(health.window_s)) / Fraction(repr(interval)))
    if health.min_samples > bound:
        return [
            f"recovery.health.min_samples: {health.min_samples} exceeds "
            "floor(recovery.health.window_s / controller.monitor_interval_s) = "
            f"floor({health.window_s!r} / {interval!r}) = {bound}"
        ]
    return []
