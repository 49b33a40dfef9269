"""A request's prompt length, before admission prices it (docs/design.md#tokenize).

Owns
  `count_tokens`: the exact count from `engine.tokenizer_path`'s tokenizer in the router
  (`narwhal.tokenizer`), else from an engine's /tokenize (the least busy available
  engine, by router-side accounting), the count of token ids sent as such, or the
  chars-per-token estimate with the reason there is no exact count; and the context
  check that refuses, before any leg, a prompt every available engine would refuse.

Invariants
  An estimate moves admission, placement and KV accounting, so each one is counted by
  its reason (`narwhal_token_count_fallbacks_total`) and kept on the request's record;
  so is each request the local tokenizer leaves to the engines
  (`narwhal_token_count_local_misses_total`): a local count is exact or not made.
  An SGLang build whose /tokenize has no chat form is not asked again for chat until
  it may have changed (`ChatTokenizeRefusals`). An engine's 401/403 or 404 naming the
  model takes it out of placement as its legs' would (`key_refused`, `model_refused`).

Errors
  `BadRequest` from the context check (`check_context`); nothing else: every failure to
  count is a fallback reason.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from .._errors import ENGINE_AUTH_STATUSES
from ..engines import (
    ConnectError,
    Json,
    PoolTimeout,
    RemoteProtocolError,
    Response,
    ResponseTooLarge,
    parse_error_body,
)
from ..engines._dialects import (
    TOKEN_ID_BYTES,
    EndpointKind,
    TokenizeScan,
    chat_tokenize_refused,
    encode,
    tokenize_body,
)
from ..fleet import EngineState, key_refused, model_refused, names_model
from ._context import ServingContext, log
from ._context_check import check_context
from ._legs import ERROR_BODY_LIMIT, json_headers
from ._request import ClientRequest, truncated_prompt

if TYPE_CHECKING:
    from ._exchange import Exchange

# Prompts up to this many chars are counted on the loop: ~0.5 ms at 2k chars, less than
# a thread hand-off costs the loop below that (tools/bench/dev/local_tokens.py).
LOCAL_COUNT_INLINE_CHARS = 8192


async def count_tokens(x: Exchange) -> tuple[int, str]:
    """The prompt's length and how it was had: `token_ids`, `local`, `exact` or
    `fallback`."""
    ctx, request, config, record = x.ctx, x.request, x.config, x.record
    if request.prompt_token_ids is not None:
        # The engines count token ids as sent: the count is exact without /tokenize.
        return _exact(x, request.prompt_token_ids), "token_ids"
    local = await _count_locally(x)
    if local is not None:
        ctx.token_methods["local"] += 1
        ctx.metrics.token_counts_by("local").inc()
        x.prompt_ids = local
        return _exact(x, len(local)), "local"
    ratio, _ = ctx.chars_per_token(config)
    estimate = max(1, math.ceil(request.prompt_chars / ratio))
    if not config.engine.tokenize:
        reason = "disabled"
    elif isinstance(engine := _tokenizer_engine(ctx, request.kind), str):
        reason = engine
    else:
        body = tokenize_body(engine.dialect, request.kind, request.body)
        answer = await _tokenize(x, engine, body)
        if not isinstance(answer, str):
            count, context = answer
            ctx.token_methods["exact"] += 1
            ctx.metrics.token_counts_by("exact").inc()
            if context is not None and context != engine.context_length:
                # vLLM's answer carries the context its completions are held to: the
                # freshest word on it, between recovery's reads.
                engine.set_context(context, "its /tokenize answer's max_model_len")
            return _exact(x, count), "exact"
        reason = answer
    ctx.token_methods["fallback"] += 1
    ctx.metrics.token_counts_by("fallback").inc()
    ctx.token_fallbacks[reason] += 1
    ctx.metrics.token_fallbacks_by(reason).inc()
    record.token_count_fallback = reason
    return _truncated(request, estimate, available_engines(ctx)), "fallback"


def _exact(x: Exchange, count: int) -> int:
    """An exact prompt length as the engines will run it (`_truncated`), checked
    against their contexts (`_check_context`)."""
    available = available_engines(x.ctx)
    count = _truncated(x.request, count, available)
    _check_context(x, count, available)
    return count


async def _count_locally(x: Exchange) -> list[int] | None:
    """The prompt's token ids by `engine.tokenizer_path`'s tokenizer, or None when none
    is configured or it cannot count this request as the engines do (the miss is
    counted by reason and kept on the record, and the engines are asked). A long
    prompt is counted in a worker thread (the tokenizer releases the GIL), so that it
    does not stall every stream the loop relays: 200k chars take ~70 ms."""
    tokenizer = x.config.engine.tokenizer
    if tokenizer is None:
        return None
    dialects = {spec.dialect for spec in x.config.engines}
    request = x.request
    if request.prompt_chars < LOCAL_COUNT_INLINE_CHARS:
        ids = tokenizer.ids(request.kind, request.body, dialects)
    else:
        ids = await trio.to_thread.run_sync(tokenizer.ids, request.kind, request.body, dialects)
    if isinstance(ids, str):
        x.ctx.token_local_misses[ids] += 1
        x.ctx.metrics.token_local_misses_by(ids).inc()
        x.record.token_count_local_miss = ids
        return None
    return ids


def available_engines(ctx: ServingContext) -> list[EngineState]:
    """The engines in placement now (availability changes only across an await)."""
    now = trio.current_time()
    return [e for e in ctx.fleet if e.unavailable_reason(now) is None]


def _truncated(request: ClientRequest, count: int, available: list[EngineState]) -> int:
    """The prompt length the engines will run (`truncated_prompt`), when every
    available engine honours `truncate_prompt_tokens` (vLLM); one that ignores it
    (SGLang) runs the prompt whole. -1 keeps up to the largest context an engine
    reports, the longer prompt placement may meet (none while one is unknown)."""
    if request.truncate_prompt_tokens is None:
        return count
    if not available or not all(e.dialect.request_truncation for e in available):
        return count
    contexts = [e.context_length for e in available]
    known = [c for c in contexts if c is not None]
    return truncated_prompt(request, count, max(known) if len(known) == len(contexts) else None)


def _check_context(x: Exchange, count: int, available: list[EngineState]) -> None:
    """Refuse, before any leg, a request whose exact prompt length `count` every
    available engine would refuse for its context, by its build's rule
    (`check_context`): placement may pick any of them, and one no engine would take
    is certain to be refused, by the prefill engine or the decode engine. A request
    only some would refuse is left to those. Where none reports its context
    (`EngineState.context_note` says why), nothing is checked and the engine refuses
    it itself: counted as `unknown` and kept on the record."""
    result, refusal = check_context(x.request, count, available)
    x.ctx.context_checks[result] += 1
    x.ctx.metrics.context_checks_by(result).inc()
    if result == "unknown":
        x.record.context_unchecked = "no available engine reports its context length"
    if refusal is not None:
        raise refusal


def _tokenizer_engine(ctx: ServingContext, kind: EndpointKind) -> EngineState | str:
    """The engine to ask, or why there is none: `no_engine`, or `unsupported` when
    every available engine is an SGLang build whose /tokenize refused the chat form
    (asking again would cost a round trip for a certain refusal)."""
    now = trio.current_time()
    refusals = ctx.chat_tokenize_refusals
    candidates = []
    for engine in ctx.fleet:
        if engine.unavailable_reason(now) is None:
            candidates.append(engine)
        else:
            # Out of placement (a restart hold, an ejection, a drain): it may come
            # back as another build, so it is asked again then.
            refusals.forget(engine)
    if kind == "chat":
        able = [e for e in candidates if not refusals.known(e, ctx.config, now)]
        if candidates and not able:
            return "unsupported"
        candidates = able
    if not candidates:
        return "no_engine"
    # The least busy engine by router-side accounting; ties by config order.
    return min(candidates, key=lambda e: e.serving_pool.in_use)


async def _tokenize(x: Exchange, engine: EngineState, body: Json) -> tuple[int, int | None] | str:
    """The engine's count and, where its answer gives it, its context length; or why
    there is no count."""
    request, config = x.request, x.config
    payload = encode(body)
    with trio.move_on_after(config.engine.tokenize_timeout_s):
        try:
            async with engine.serving_pool.request(
                b"POST", engine.dialect.tokenize_path, json_headers(request.id), payload
            ) as response:
                status = response.status
                if status == 200:
                    return await _read_tokenize(x.ctx, response, len(payload), engine, request)
                raw = await response.aread(ERROR_BODY_LIMIT)
                info = parse_error_body(status, raw)
                if status in ENGINE_AUTH_STATUSES:
                    # SGLang guards /tokenize with --api-key (vLLM leaves it open):
                    # the engine would refuse the request's legs too.
                    key_refused(engine, status, info.message, config)
                    return "engine_auth"
                if names_model(status, info):
                    # vLLM's /tokenize checks the model as its completions do.
                    model_refused(engine, info.message, config)
                    return "engine_model"
                if request.kind == "chat" and chat_tokenize_refused(
                    engine.dialect, status, info.message
                ):
                    _chat_refused(x.ctx, engine, status)
                    return "unsupported"
                return "engine_error"
        except (ConnectError, RemoteProtocolError, PoolTimeout):
            return "unreachable"
        except (
            ResponseTooLarge,
            ValueError,
            RecursionError,  # json.loads of deeply nested input
        ):
            return "bad_answer"
    return "timeout"


async def _read_tokenize(
    ctx: ServingContext, response: Response, sent: int, engine: EngineState, request: ClientRequest
) -> tuple[int, int | None] | str:
    """A 200 answer's count and the engine's context length, scanned as it arrives
    (`TokenizeScan`) and bounded by what the text sent can count to."""
    scan = TokenizeScan()
    limit = ERROR_BODY_LIMIT + TOKEN_ID_BYTES * sent
    size = 0
    while chunk := await response.receive_available():
        size += len(chunk)
        if size > limit:
            return "bad_answer"
        scan.feed(chunk)
    count = scan.count()
    if count is None:
        return "bad_answer"
    if request.kind == "chat" and ctx.chat_tokenize_refusals.forget(engine):
        log.info(
            "engine %s counts chat messages again: its /tokenize takes them now (an "
            "upgraded build)",
            engine.id,
            extra={"event": "tokenize_chat_accepted", "engine": engine.id},
        )
    return count, scan.context(engine.dialect)


def _chat_refused(ctx: ServingContext, engine: EngineState, status: int) -> None:
    """`engine`'s build has no chat form of /tokenize: its chat requests are estimated
    without asking until it may have changed (`ChatTokenizeRefusals`)."""
    refusals = ctx.chat_tokenize_refusals
    if refusals.refused(engine, trio.current_time()):
        log.warning(
            "engine %s counts no chat messages: its /tokenize refused them (HTTP %d), as "
            "an SGLang build without their form does; its chat requests are estimated "
            "at the chars ratio, and it is asked again after a reload, after it has been "
            "out of placement (as a restart takes it) or in %ss",
            engine.id,
            status,
            f"{refusals.recheck_s:g}",
            extra={"event": "tokenize_chat_refused", "engine": engine.id, "status": status},
        )
