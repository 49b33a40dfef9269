"""narwhal-profile's cached-prefill step: does the engine keep a prefix cache, and does
its prefill of a partly cached prompt follow the law admission prices it with?

Owns `measure_cached_prefill` (after an engine's prefill fit, on the idle engine) and
`cached_law_warning` (what narwhal-profile and narwhal-check say of the result).

The law is `narwhal.admission.cached_prefill_s`: a prompt of n tokens whose first k the
engine holds costs the fitted curve at n less its token-dependent part at k. Measured:

* Whether the engine caches: one prompt of the largest measured size, sent once and
  then `_WARM_REPEATS` times more. The cache is seen when the engine's
  ``usage.prompt_tokens_details.cached_tokens`` says the fastest repeat hit, or, where
  it reports none, when that repeat is nearer the law's cached price than the first's
  time (a cache that served it would be that much faster). An
  engine without one records ``seen`` False and no points: pricing it by cached tokens
  would undercharge every prompt the router believes cached there.
* Points: for each of `_SHAPES` (n, k as fractions of the largest measured prompt), a
  prefix of about k tokens, then `SweepPlan.cached_repeats` prompts of that prefix
  followed by new text to about n tokens, each timed; the median is the point, as the
  prefill fit takes its repeats' median (a cached prefill of 20 ms is as exposed to a
  busy host's hiccups as a short cold one). The cached tokens of a point are
  the engine's ``cached_tokens`` when reported, else the common prefix of the two
  prompts' ``/tokenize`` ids cut to whole blocks (vllm:cache_config_info block_size), as
  vLLM's cache hits whole blocks and never the prompt's last token.

Errors: `ProbeError` (a request failed); the caller bounds the time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import attrs

from ..admission import cached_prefill_s
from ..profiles import (
    POOR_FIT_RESIDUAL_P90,
    CachedPoint,
    CachedPrefill,
    PrefillModel,
    cached_prefill as cached_record,
)
from ._client import Completion, EngineClient, Identity, ProbeError
from ._texts import TextMaker

# Repeats of the probe prompt once cached; the fastest is the warm time.
_WARM_REPEATS = 3
# (prompt, cached prefix) as fractions of the largest measured prompt: a half and nearly
# all of a mid-size and of the largest prompt, where the law's two terms both count.
_SHAPES = ((0.5, 0.25), (0.5, 0.44), (1.0, 0.5), (1.0, 0.875))
FROM_USAGE = "usage.prompt_tokens_details.cached_tokens"
FROM_TOKENIZE = "/tokenize common prefix, whole blocks"


async def measure_cached_prefill(
    client: EngineClient,
    texts: TextMaker,
    cpt: float,
    identity: Identity,
    model: PrefillModel,
    repeats: int,
) -> tuple[CachedPrefill, PrefillModel]:
    """The engine's `CachedPrefill` record, measured as the module docstring says, and
    `model` with the per-cached-token cost its points show (`with_kept_cost`)."""
    block = identity.block_size or 1
    # Inside the measured domain: generated text lands a few percent either side of its
    # target, and the largest measured prompt sits near max_model_len.
    top = max(1, int(model.max_tokens * 0.95))
    text = texts.text(max(1, round(top * cpt)))
    cold = await _complete(client, text, "a repeated prompt")
    # The fastest of a few: a busy host's hiccup only ever slows a sample, and one slow
    # warm sample read as no cache at all (seen in the real tier at load 14).
    warms = [await _complete(client, text, "a repeated prompt") for _ in range(_WARM_REPEATS)]
    warm = min(warms, key=lambda c: c.seconds)
    n = cold.prompt_tokens or top
    if warm.cached_tokens is not None:
        seen = warm.cached_tokens > 0
    else:
        hit = (max(0, n - 1) // block) * block
        seen = warm.seconds < (cold.seconds + cached_prefill_s(model, n, hit)) / 2
    if not seen:
        record = CachedPrefill(
            seen=False, block_size=block, probe_tokens=n, cold_s=cold.seconds, warm_s=warm.seconds
        )
        return record, model
    points: list[CachedPoint] = []
    sources: set[str] = set()
    for n_share, k_share in _SHAPES:
        samples: list[tuple[int, int, float]] = []
        prefix = texts.text(max(1, round(top * k_share * cpt)))
        await _complete(client, prefix, "a prefix")
        sent: list[list[int]] = []
        for _ in range(repeats):
            rest = texts.text(max(1, round(top * (n_share - k_share) * cpt)))
            sample, source = await _timed(client, prefix, f"{prefix} {rest}", block, sent)
            samples.append(sample)
            sources.add(source)
        # Repeats land a few tokens apart; a sample's own counts keep cached whole blocks.
        tokens = statistics.median_low(s[0] for s in samples)
        cached = statistics.median_low(s[1] for s in samples)
        points.append(
            CachedPoint(
                tokens=tokens,
                cached=cached,
                seconds=statistics.median(s[2] for s in samples),
                predicted_s=0.0,
            )
        )
    model = with_kept_cost(model, points)
    record = cached_record(
        block_size=block,
        cached_source=" and ".join(sorted(sources)),
        probe_tokens=n,
        cold_s=cold.seconds,
        warm_s=warm.seconds,
        points=[
            attrs.evolve(p, predicted_s=cached_prefill_s(model, p.tokens, p.cached)) for p in points
        ],
    )
    return record, model


def with_kept_cost(model: PrefillModel, points: Sequence[CachedPoint]) -> PrefillModel:
    """`model` with `cached_token_s`, the seconds per cached token that the points'
    prefills took beyond the law: least squares through the origin, never negative.

    The cold fit puts every per-token cost in its linear term, and a cached prefix does
    not save all of it: the engine still tokenises, hashes and carries the whole prompt
    (on narwhal-sim about 3 % of the per-token cost; the law alone then under-prices a
    mostly cached prompt by 10-15 %)."""
    law = attrs.evolve(model, cached_token_s=0.0)
    over = sum(p.cached * (p.seconds - cached_prefill_s(law, p.tokens, p.cached)) for p in points)
    weight = sum(p.cached * p.cached for p in points)
    return attrs.evolve(law, cached_token_s=max(0.0, over / weight) if weight else 0.0)


def requests(repeats: int) -> int:
    """The most requests `measure_cached_prefill` sends (completions and /tokenize), for
    the caller's time bound."""
    return 2 + len(_SHAPES) * (2 + 2 * repeats)


async def _timed(
    client: EngineClient, prefix: str, prompt: str, block: int, sent: list[list[int]]
) -> tuple[tuple[int, int, float], str]:
    """((prompt tokens, cached tokens, seconds), how the cached tokens were known) of
    `prompt`, which starts with `prefix`, sent after it and after the prompts whose
    token ids are in `sent` (appended to)."""
    timed = await _complete(client, prompt, "a prompt that repeats a prefix")
    tokens = timed.prompt_tokens
    if tokens is None:
        raise ProbeError(f"engine {client.id!r}: no usage.prompt_tokens for a cached prefill")
    if timed.cached_tokens is not None:
        return (tokens, timed.cached_tokens, timed.seconds), FROM_USAGE
    if not sent:
        sent.append(await _ids(client, prefix))
    ids = await _ids(client, prompt)
    # The new text of two repeats may start alike too: the hit is the longest match.
    common = max(_common_prefix(earlier, ids) for earlier in sent)
    sent.append(ids)
    cached = (min(common, tokens - 1) // block) * block
    return (tokens, cached, timed.seconds), FROM_TOKENIZE


async def _complete(client: EngineClient, prompt: str, what: str) -> Completion:
    result = await client.complete(client.completion_body(prompt, 1, stream=False))
    if result.error is not None:
        raise ProbeError(f"engine {client.id!r}: cached prefill, {what}: {result.error}")
    return result


async def _ids(client: EngineClient, text: str) -> list[int]:
    _, answer = await client.tokenize(text)
    ids = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(ids, list):
        raise ProbeError(
            f"engine {client.id!r}: /tokenize gave no token ids and completions no "
            "usage.prompt_tokens_details.cached_tokens: cached prefill cannot be measured"
        )
    return ids


def _common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def cached_law_warning(engine_id: str, record: CachedPrefill | None) -> str | None:
    """A warning naming the engine and the numbers when the law misses the engine's
    cached prefills by more than `POOR_FIT_RESIDUAL_P90` at the p90 (the bound a prefill
    fit is held to, for the same reason: a projection at 80 % of a TTFT target can then
    be a breach); None otherwise, and for an engine without a cache or a record."""
    if record is None or not record.seen or record.residual_p90 <= POOR_FIT_RESIDUAL_P90:
        return None
    return (
        f"engine {engine_id!r}: cached-prefill law residual p90 "
        f"{100 * record.residual_p90:.1f}% (max {100 * record.residual_max:.1f}% over "
        f"{len(record.points)} measured points) is above {100 * POOR_FIT_RESIDUAL_P90:.0f}%: "
        "prefills of prompts with a cached prefix on this engine are that far from their "
        "price, so cache-aware pricing misleads admission there; re-run narwhal-profile on "
        "a quiet host"
    )


def cached_summary(record: CachedPrefill | None) -> str:
    """One line on the record for progress and check rows."""
    if record is None:
        return "not measured"
    if not record.seen:
        return (
            f"no prefix cache: a repeated {record.probe_tokens}-token prompt took "
            f"{1000 * record.warm_s:.1f} ms after {1000 * record.cold_s:.1f} ms"
        )
    return (
        f"law residual p50 {100 * record.residual_p50:.1f}% p90 "
        f"{100 * record.residual_p90:.1f}% max {100 * record.residual_max:.1f}% over "
        f"{len(record.points)} (n, cached) points; a repeated {record.probe_tokens}-token "
        f"prompt took {1000 * record.warm_s:.1f} ms after {1000 * record.cold_s:.1f} ms"
    )
