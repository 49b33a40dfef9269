"""The request path's admission and placement inputs, read from the live fleet
(docs/design.md#admission, #placement).

Owns
  `admit_predictively`, which prices the fleet now (`priced`) and raises the refusal
  `admission.judge` decides; `placement_for`, the policy placement ranks engines by;
  `offered`, the demand event the role controller counts for every admitted or
  refused request.

Invariants
  The decisions are `admission`'s and `placement`'s pure functions; this module only
  gathers their inputs (profiles, backlog, decode-side load, the projection errors)
  at one clock reading. A request only one engine can serve well (`one_engine`) is
  priced and placed on aggregate engines alone while the fleet has one.

Errors
  `Unavailable` (`no_profile`, `no_priced_path`) and `Refused` (`ttft_budget` and the
  other verdicts) from `admit_predictively`.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import trio

from .._codes import ErrorCode
from .._errors import Refused, Unavailable
from ..admission import (
    PathQuote,
    Priced,
    ProfileSource,
    judge,
    placement_policy,
    price_fleet,
    quote_paths,
    ttft_budget_s,
)
from ..config import Config
from ..placement import Policy, cached_load_policy
from ._context import DemandEvent, ServingContext
from ._context_check import widest_context
from ._legs import leg_output_bound
from ._request import ClientRequest
from ._tokens import available_engines


def has_aggregate(ctx: ServingContext) -> bool:
    """Whether the fleet has an engine in the `both` role now (in placement or not)."""
    return any(engine.role == "both" for engine in ctx.fleet)


def aggregate_only(ctx: ServingContext, request: ClientRequest) -> bool:
    """Whether the request goes to an aggregate engine alone (`one_engine`)."""
    return request.one_engine is not None and has_aggregate(ctx)


def offered(
    ctx: ServingContext,
    request: ClientRequest,
    tokens: int,
    *,
    admitted: bool,
    reason: str | None = None,
    cached: Mapping[str, int],
) -> None:
    """The demand event of a request, priced for the role controller without the most of
    its prompt an engine holds cached, as far as cache.affinity credits it."""
    bound = leg_output_bound(request, tokens, widest_context(available_engines(ctx)))
    held = max(cached.values(), default=0) if ctx.config.cache.affinity > 0 else 0
    ctx.demand_events.append(
        DemandEvent(trio.current_time(), tokens, bound, admitted, reason, cached_tokens=held)
    )


def admit_predictively(
    ctx: ServingContext,
    request: ClientRequest,
    tokens: int,
    config: Config,
    cached: Mapping[str, int],
) -> list[PathQuote]:
    """Refuse with 429 when the cheapest prefill path misses the budget.

    `cached`: the leading tokens of the prompt each engine holds, credited as
    cache.affinity allows (at most as they are worth). Returns every path's quote, so
    the projection of the path placement picks can be recorded and compared with the
    TTFT the client saw.
    """
    if ctx.profiles is None:
        raise Unavailable(
            "serving.admission is predictive but no usable engine profile is loaded "
            f"(profiles.path={config.profiles.path}); run narwhal-profile, or set "
            "serving.admission to open",
            code=ErrorCode.NO_PROFILE,
            public="serving.admission is predictive but no usable engine profile is "
            "loaded; run narwhal-profile, or set serving.admission to open",
        )
    quotes = quote_paths(
        priced(ctx, ctx.profiles, cached).values(),
        prompt_tokens=tokens,
        handoff_s=ctx.profiles.handoff_s(tokens),
        credit=min(1.0, config.cache.affinity),
    )
    if aggregate_only(ctx, request):
        quotes = [quote for quote in quotes if quote.mode == "aggregate"]
    verdict = judge(
        quotes,
        prompt_tokens=tokens,
        ttft_target_s=config.slo.ttft_s,
        margin=config.serving.admission_margin,
        allowance=ctx.projection_errors.allowance(tokens, trio.current_time()),
    )
    if verdict.admitted:
        return quotes
    assert verdict.code is not None
    offered(ctx, request, tokens, admitted=False, reason=verdict.code, cached=cached)
    if verdict.code == ErrorCode.TTFT_BUDGET:
        # docs/design.md#reactive-parameters: a projected TTFT breach allows one guarded
        # D-to-P evaluation.
        ctx.signals.ttft_breach()
    if verdict.code == ErrorCode.NO_PRICED_PATH:
        raise Unavailable(verdict.message, code=verdict.code)
    refusal = Refused(
        verdict.message,
        code=verdict.code,
        retry_after_s=verdict.retry_after_s,
        final=verdict.final,
    )
    refusal.quote = verdict.quote
    raise refusal


def priced(
    ctx: ServingContext, profiles: ProfileSource, cached: Mapping[str, int]
) -> dict[str, Priced]:
    """Every engine as pricing sees it now: profile, backlog, decode-side load and the
    prompt's cached prefix on it."""
    now = trio.current_time()
    signals = ctx.load_signals(now)
    return price_fleet(
        ctx.fleet.views(now),
        profiles,
        backlog_s=signals.backlog_s,
        first_token_lag_s=signals.first_token_lag_s,
        kv_release_per_s=signals.kv_release_per_s,
        cached_tokens=cached,
    )


def placement_for(
    ctx: ServingContext, tokens: int, config: Config, cached: Mapping[str, int]
) -> Policy:
    """The policy placement ranks engines by: predicted costs under predictive
    admission with a profile, else the load order; either with each engine's cached
    prefix of the prompt weighed by cache.affinity."""
    affinity = config.cache.affinity
    if config.serving.admission != "predictive" or ctx.profiles is None:
        return cached_load_policy(cached, affinity)
    return placement_policy(
        priced(ctx, ctx.profiles, cached),
        prompt_tokens=tokens,
        handoff_s=ctx.profiles.handoff_s(tokens),
        ttft_budget_s=ttft_budget_s(config.slo.ttft_s, config.serving.admission_margin),
        tpot_target_s=config.slo.tpot_s,
        affinity=affinity,
    )


@attrs.frozen
class LocalPrices:
    """A pair request's two ways to its first token on the decode engine, in seconds;
    None where no profile prices it.

    `local_s`: the decode engine prefills the uncached rest itself once it can take
    the prompt in (`DecodeSide.delay_s`: its recent lag to a first token, KV room, the
    local prefills booked before it), in a step of its decode batch that makes the
    first token (so it pays what the batch adds to a step, `Priced.batch_step_s`).
    `remote_s`: the prefill engine's path to the handoff (backlog, prefill, handoff),
    the same delay less what the path overlaps of it, and the decode engine's first
    step. `local_wait_s`: the delay, `local_s`'s wait."""

    local_s: float | None = None
    remote_s: float | None = None
    local_wait_s: float = 0.0


def local_prefill_prices(
    ctx: ServingContext, prefill: str, decode: str, tokens: int, cached: Mapping[str, int]
) -> LocalPrices:
    if ctx.profiles is None:
        return LocalPrices()
    prices = priced(ctx, ctx.profiles, cached)
    local = prices.get(decode)
    if local is None:
        return LocalPrices()
    return local_path_prices(local, prices.get(prefill), tokens, ctx.profiles.handoff_s(tokens))


def local_path_prices(
    local: Priced, remote: Priced | None, tokens: int, handoff_s: float
) -> LocalPrices:
    """`LocalPrices` of a prompt of `tokens` on decode engine `local` and prefill engine
    `remote`, as priced now."""
    step_s = local.first_step_s(tokens)
    side = local.decode_side(tokens, handoff_s, step_s)
    local_wait_s = side.delay_s()
    local_s = None
    if local.prefill is not None:
        local_s = local_wait_s + local.prefill_s(tokens) + local.batch_step_s(tokens)
    remote_s = None
    if remote is not None and remote.prefill is not None:
        path_s = remote.backlog_s + remote.prefill_s(tokens) + handoff_s
        remote_s = path_s + side.delay_s(path_s) + step_s
    return LocalPrices(local_s, remote_s, local_wait_s)
