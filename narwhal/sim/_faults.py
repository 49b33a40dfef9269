"""Fault injection: one flat JSON object, per engine (runtime) or per request (header).

Keys (all optional; durations are wall-clock seconds, *not* divided by the speed factor):

  leg                          "prefill" | "decode" | "aggregate" | "any" (default): which legs
                               the request faults below apply to
  count                        engine faults only: apply to the first N matching requests, then
                               expire (default: every matching request)
  error_status                 answer at once with this HTTP status (e.g. 503, 500, 429, 400)
  error_message                message for error_status (default: a generic one per status)
  stall_before_first_token_s   hold the response's first token this long (headers go out first)
  stall_after_tokens           after this many tokens, stall for stall_s (default: forever)
  stall_s                      length of that stall
  crash_after_tokens           after this many tokens, drop the TCP connection (no terminator)
  sse_error_after_tokens       after this many tokens, send an SSE error event and [DONE]
                               (non-streaming: answer 500 when the tokens are done)
  slow_first_token_s           delay the request's admission to the scheduler (TTFT + this)
  kv_pull_fail                 this decode's KV pull fails (as if the producer were gone)
  lease_s                      lease of KV this engine produces (instead of the configured one)
  down_s                       engine only: close the listener for this long (connection refused)
  health_flap_period_s         engine only: /health alternates 200/503 every period
  unhealthy                    engine only: /health answers 503
  metrics_stall_s              engine only: GET /metrics answers only after this long (the
                               connection is accepted at once; a large value plays a
                               /metrics that never answers)
  decode_slowdown              engine only: every step that decodes takes this many times
                               as long (>= 1; a mixed step, prefill chunks included, as a
                               whole): a gray failure, slower than the profile but healthy
                               to every probe. `leg` and `count` do not apply
"""

from __future__ import annotations

from typing import Any, Literal, cast

import attrs

Leg = Literal["prefill", "decode", "aggregate", "any"]
_LEGS = ("prefill", "decode", "aggregate", "any")
ENGINE_ONLY = (
    "count",
    "down_s",
    "health_flap_period_s",
    "unhealthy",
    "metrics_stall_s",
    "decode_slowdown",
)


class FaultSpecError(ValueError):
    pass


@attrs.frozen(kw_only=True)
class FaultSpec:
    leg: Leg = "any"
    count: int | None = None
    error_status: int | None = None
    error_message: str | None = None
    stall_before_first_token_s: float | None = None
    stall_after_tokens: int | None = None
    stall_s: float | None = None
    crash_after_tokens: int | None = None
    sse_error_after_tokens: int | None = None
    slow_first_token_s: float | None = None
    kv_pull_fail: bool = False
    lease_s: float | None = None
    down_s: float | None = None
    health_flap_period_s: float | None = None
    unhealthy: bool = False
    metrics_stall_s: float | None = None
    decode_slowdown: float | None = None

    def applies_to(self, leg: str) -> bool:
        return self.leg == "any" or self.leg == leg

    @property
    def has_request_faults(self) -> bool:
        return any(
            (
                self.error_status is not None,
                self.stall_before_first_token_s is not None,
                self.stall_after_tokens is not None,
                self.crash_after_tokens is not None,
                self.sse_error_after_tokens is not None,
                self.slow_first_token_s is not None,
                self.kv_pull_fail,
            )
        )

    def to_json(self) -> dict[str, Any]:
        defaults = FaultSpec()
        return {
            f.name: getattr(self, f.name)
            for f in attrs.fields(FaultSpec)
            if getattr(self, f.name) != getattr(defaults, f.name)
        }


_INT_FIELDS = (
    "count",
    "error_status",
    "stall_after_tokens",
    "crash_after_tokens",
    "sse_error_after_tokens",
)
_FLOAT_FIELDS = (
    "stall_before_first_token_s",
    "stall_s",
    "slow_first_token_s",
    "lease_s",
    "down_s",
    "health_flap_period_s",
    "metrics_stall_s",
    "decode_slowdown",
)
_BOOL_FIELDS = ("kv_pull_fail", "unhealthy")


def parse_faults(obj: Any, *, per_request: bool = False) -> FaultSpec:
    """Validate a fault object; raise FaultSpecError naming the first bad key."""
    if not isinstance(obj, dict):
        raise FaultSpecError("faults must be a JSON object")
    known = {f.name for f in attrs.fields(FaultSpec)}
    kwargs: dict[str, Any] = {}
    for key, value in obj.items():
        if key not in known:
            raise FaultSpecError(f"unknown fault {key!r}")
        if per_request and key in ENGINE_ONLY:
            raise FaultSpecError(f"fault {key!r} applies to an engine, not to one request")
        if value is None:
            continue
        if key == "leg":
            if value not in _LEGS:
                raise FaultSpecError(f"leg is {value!r}; must be one of {', '.join(_LEGS)}")
        elif key == "error_message":
            if not isinstance(value, str):
                raise FaultSpecError("error_message must be a string")
        elif key in _INT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise FaultSpecError(f"{key} is {value!r}; must be an integer >= 0")
            if key == "error_status" and not 400 <= value <= 599:
                raise FaultSpecError(f"error_status is {value}; must be 400..599")
        elif key in _FLOAT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise FaultSpecError(f"{key} is {value!r}; must be a number >= 0")
            value = float(value)
            if key == "health_flap_period_s" and value <= 0:
                raise FaultSpecError("health_flap_period_s must be > 0")
            if key == "decode_slowdown" and value < 1:
                raise FaultSpecError(f"decode_slowdown is {value!r}; must be >= 1")
        elif key in _BOOL_FIELDS and not isinstance(value, bool):
            raise FaultSpecError(f"{key} must be true or false")
        kwargs[key] = value
    if "leg" in kwargs:
        kwargs["leg"] = cast(Leg, kwargs["leg"])
    return FaultSpec(**kwargs)
