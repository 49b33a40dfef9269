"""The configuration model: one frozen attrs class per section.

Every field of the product manual's tables is here with the manual's default. Ranges
are attached as metadata (see `_rules`) and cross-field rules live in `_load`; both
are enforced by `load_config`, which reports every problem at once.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import attrs

from ._rules import AtLeast, Between, NonNegative, Positive, Rule, ZeroOrAtLeast

Dialect = Literal["vllm", "sglang"]
Role = Literal["prefill", "decode", "both"]
Admission = Literal["predictive", "open"]
LogLevel = Literal["debug", "info", "warning", "error"]
T = TypeVar("T")


def _f(default: T, *rules: Rule, doc: str = "") -> T:
    # Typed as the default so the attrs mypy plugin sees a plain default value.
    field: T = attrs.field(default=default, metadata={"rules": rules, "doc": doc})
    return field


@attrs.frozen(kw_only=True)
class EngineSpec:
    id: str
    url: str
    dialect: Dialect = "vllm"
    role: Role = "both"
    model: str = "default"
    # SGLang only: the prefill engine's bootstrap server port (SGLang's default is 8998).
    bootstrap_port: int | None = _f(None, Between(1, 65535), doc="SGLang bootstrap port")
    # Per-engine admission overrides; None inherits serving.prefill/decode_concurrency.
    prefill_concurrency: int | None = _f(
        None, NonNegative(), doc="override of serving.prefill_concurrency"
    )
    decode_concurrency: int | None = _f(
        None, NonNegative(), doc="override of serving.decode_concurrency"
    )


@attrs.frozen(kw_only=True)
class Slo:
    ttft_s: float = _f(0.5, Positive(), doc="time-to-first-token target")
    tpot_s: float = _f(0.05, Positive(), doc="time-per-output-token target")
    percentile: float = _f(
        0.9, Between(0.0, 1.0, low_open=True), doc="attainment percentile reported"
    )


@attrs.frozen(kw_only=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = _f(8000, Between(0, 65535))


@attrs.frozen(kw_only=True)
class Ctl:
    socket: str = "runs/narwhal.sock"


@attrs.frozen(kw_only=True)
class Log:
    level: LogLevel = "info"


@attrs.frozen(kw_only=True)
class Serving:
    admission: Admission = "predictive"
    admission_margin: float = _f(0.0, NonNegative())
    max_connections: int = _f(512, AtLeast(1))
    queue_capacity: int = _f(0, NonNegative())
    queue_timeout_s: float = _f(0.0, NonNegative())
    prefill_concurrency: int = _f(0, NonNegative())
    decode_concurrency: int = _f(0, NonNegative())
    handoff_timeout_s: float = _f(0.0, NonNegative())
    max_attempts: int = _f(1, Between(1, 3))
    retry_base_s: float = _f(0.1, Positive())
    retry_cap_s: float = _f(1.0, Positive())
    retry_budget: int = _f(10, NonNegative())
    retry_replenish: float = _f(0.1, Between(0.0, 1.0))
    max_request_bytes: int = _f(4194304, AtLeast(1))
    max_response_bytes: int = _f(16777216, AtLeast(1))
    request_timeout_s: float = _f(600.0, Positive())
    prefill_timeout_s: float = _f(120.0, Positive())


@attrs.frozen(kw_only=True)
class Engine:
    control_connections: int = _f(0, NonNegative())
    decode_read_timeout_s: float = _f(60.0, NonNegative())
    first_token_timeout_s: float = _f(2.5, Positive())
    tokenize: bool = True
    tokenize_timeout_s: float = _f(2.0, Positive())
    chars_per_token: float = _f(3.8, Positive())
    pool_timeout_s: float = _f(5.0, Positive())
    connect_timeout_s: float = _f(10.0, Positive())
    health_timeout_s: float = _f(5.0, Positive())

    def control_pool_size(self, engine_count: int) -> int:
        """`0` derives two per engine with a minimum of four (manual 4.1)."""
        if self.control_connections:
            return self.control_connections
        return max(4, 2 * engine_count)


@attrs.frozen(kw_only=True)
class Profiles:
    path: str = "runs/profiles.json"


@attrs.frozen(kw_only=True)
class Health:
    interval_s: float = _f(2.0, Positive(), doc="health probe period per engine")
    window_s: float = _f(30.0, Positive(), doc="latency-residual window for ejection")
    min_samples: int = _f(5, AtLeast(1), doc="residuals required before ejection can fire")
    eject_ratio: float = _f(3.0, AtLeast(1.0), doc="median observed/predicted latency that ejects")
    failure_threshold: int = _f(3, AtLeast(1), doc="consecutive failed probes that eject")
    readmit_successes: int = _f(2, AtLeast(1), doc="consecutive good probes before verification")


@attrs.frozen(kw_only=True)
class Breaker:
    failure_threshold: int = _f(5, AtLeast(1), doc="counted failures within window_s that open")
    window_s: float = _f(30.0, Positive())
    open_s: float = _f(10.0, Positive(), doc="time open before a half-open verification")


@attrs.frozen(kw_only=True)
class Recovery:
    failure_quarantine_s: float = _f(0.0, NonNegative())
    restart_hold_s: float = _f(
        5.0, NonNegative(), doc="hold after an engine restart before placement"
    )
    shutdown_grace_s: float = _f(30.0, NonNegative(), doc="in-flight drain bound on SIGTERM")
    health: Health = attrs.field(factory=Health)
    breaker: Breaker = attrs.field(factory=Breaker)


@attrs.frozen(kw_only=True)
class Thresholds:
    expand: float = _f(1.0, Positive())
    shrink: float = _f(0.5, NonNegative())
    cooldown_s: float = _f(10.0, NonNegative())
    sustained_intervals: int = _f(3, AtLeast(1))
    dwell_s: float = _f(0.0, NonNegative())
    panic_ratio: float = _f(0.0, ZeroOrAtLeast(1))
    flip_resident_guard: int = _f(0, NonNegative())


@attrs.frozen(kw_only=True)
class Reactive:
    window_s: float = _f(120.0, Positive())
    confirmations: int = _f(2, AtLeast(1))
    utilization: float = _f(0.8, Between(0.0, 1.0, low_open=True))
    min_arrivals: int = _f(10, AtLeast(1))
    demand_floor: float = _f(0.5, Positive())
    movement_margin: float = _f(0.05, Between(0.0, 1.0, high_open=True))
    step_s: float = _f(5.0, Positive())
    evidence_span_s: float = _f(60.0, Positive())
    evidence_max_span_s: float = _f(120.0, Positive())
    evidence_min_arrivals: int = _f(10, AtLeast(1))
    demand_rise_tolerance: float = _f(0.25, NonNegative())
    decode_correction_min: float = _f(0.5, Positive())
    decode_correction_max: float = _f(2.0, Positive())
    decode_correction_alpha: float = _f(0.2, Between(0.0, 1.0, low_open=True))
    decode_correction_min_samples: int = _f(8, AtLeast(1))


@attrs.frozen(kw_only=True)
class Controller:
    enabled: bool = True
    advisory: bool = False
    monitor_interval_s: float = _f(1.0, Positive())
    monitor_failure_limit: int = _f(5, AtLeast(1))
    min_prefill: int = _f(1, AtLeast(1))
    min_decode: int = _f(1, AtLeast(1))
    flip_history: int = _f(1000, AtLeast(1))
    thresholds: Thresholds = attrs.field(factory=Thresholds)
    reactive: Reactive = attrs.field(factory=Reactive)


@attrs.frozen(kw_only=True)
class Config:
    engines: tuple[EngineSpec, ...] = ()
    slo: Slo = attrs.field(factory=Slo)
    listen: Listen = attrs.field(factory=Listen)
    ctl: Ctl = attrs.field(factory=Ctl)
    log: Log = attrs.field(factory=Log)
    serving: Serving = attrs.field(factory=Serving)
    engine: Engine = attrs.field(factory=Engine)
    controller: Controller = attrs.field(factory=Controller)
    recovery: Recovery = attrs.field(factory=Recovery)
    profiles: Profiles = attrs.field(factory=Profiles)

    def engine_by_id(self, engine_id: str) -> EngineSpec | None:
        for spec in self.engines:
            if spec.id == engine_id:
                return spec
        return None
