"""How each engine dialect runs a request on a prefill/decode pair, or on one engine
(docs/design.md#placement, #retries).

Owns
  `PairProtocol` and its two forms: `VllmPair`, sequential legs (a prefill whose
  answer carries `kv_transfer_params`, then the decode request that pulls the KV), and
  `SglangPair`, concurrent legs sent with the same body and paired by a bootstrap
  room. `aggregate`: one engine does both phases. `pair_protocol` picks the form by the
  prefill engine's dialect; each form owns its dialect's words for a failed handoff.

Invariants
  The prefill slot is taken before the decode slot on every path, so no two pairs can
  each hold the slot the other waits for. vLLM: the KV handoff's age counts from the
  prefill HTTP request (serving.handoff_timeout_s), and the producer's held KV is
  counted until the decode request is sent. SGLang: both slots are held before either
  leg is sent, and the first failing leg cancels the other.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Protocol

import trio

from .._errors import NarwhalError
from ..engines import SGLANG_DEFAULT_BOOTSTRAP_PORT
from ..engines._dialects import (
    Dialect,
    encode,
    new_bootstrap_room,
    sglang_pd_body,
    usage_cached_tokens,
    vllm_decode_body,
    vllm_kv_params,
    vllm_prefill_body,
)
from ..fleet import EngineState
from ._failure import FailureKind
from ._leg_failures import failed, loads
from ._legs import HandoffExpired, Leg, engine_cached, leg_body
from ._request import ClientRequest

if TYPE_CHECKING:
    from ._exchange import Exchange


class PairProtocol(Protocol):
    # Whether the dialect's decode engine can compute a prompt itself (no handoff).
    prefills_locally: bool

    def decode_alone(self, request: ClientRequest) -> bool:
        """Whether the decode engine serves `request` without a prefill leg."""
        ...

    async def run(self, x: Exchange, prefill: EngineState, decode: EngineState) -> None:
        """Run `x` on the pair (inside its decode placement's claim, `Decisions`)."""
        ...


class VllmPair:
    """Sequential legs: the prefill answers with the KV's transfer params, then the
    decode request pulls the KV (NixlConnector)."""

    prefills_locally = True  # a request without handoff params is an aggregate one

    def decode_alone(self, request: ClientRequest) -> bool:
        # The decode engine recomputes a prompt whose logprobs are asked for anyway
        # (`one_engine`), and takes a request without handoff params as an aggregate
        # one (vLLM's own proxies send it so).
        return request.one_engine == "prompt_logprobs"

    async def run(self, x: Exchange, prefill: EngineState, decode: EngineState) -> None:
        serving = x.config.serving
        x.record.stage = "prefill"
        handoff_cap = serving.handoff_timeout_s or math.inf  # 0: the deadline is the cap
        async with x.decisions.phase_slot(prefill, "prefill", x.tokens):
            # docs/design.md#retries: the handoff's age counts from the prefill HTTP
            # request, not from the wait for a prefill slot before it (no KV exists yet
            # during that wait).
            prefill_started = trio.current_time()
            raw = await Leg(x, prefill, "prefill").read_whole(
                encode(vllm_prefill_body(x.request.body)),
                timeout_s=serving.prefill_timeout_s,
                on_timeout=FailureKind.PREFILL_TIMEOUT,
                timeout_setting="serving.prefill_timeout_s",
                prompt_tokens=x.tokens,
            )
        answer = loads(raw, prefill, "prefill")
        engine_cached(x, prefill, usage_cached_tokens(answer))
        kv_params = vllm_kv_params(answer)
        x.record.prefilled_at = trio.current_time()
        x.record.stage = "handoff"
        # Until the decode request is sent, the producer holds KV blocks for us.
        handoff = x.decisions.handoff(prefill)
        try:
            async with x.decisions.phase_slot(
                decode, "decode", x.tokens, not_after=prefill_started + handoff_cap
            ):
                handoff.release()
                body, own_usage, unstreamed = leg_body(x.request, decode)
                await Leg(x, decode, "decode").produce(
                    encode(vllm_decode_body(body, kv_params)),
                    first_token_budget=x.config.engine.first_token_timeout_s,
                    own_usage=own_usage,
                    unstreamed=unstreamed,
                )
        except HandoffExpired:
            age = trio.current_time() - prefill_started
            limit = f"serving.handoff_timeout_s={serving.handoff_timeout_s}"
            raise failed(
                decode,
                "decode",
                FailureKind.HANDOFF_EXPIRED,
                f"kv handoff from {prefill.id} expired after {age:.3f}s ({limit}); "
                "the prefill must be redone",
                public=f"kv handoff expired after {age:.3f}s ({limit}); the prefill must be redone",
            ) from None
        finally:
            handoff.release()


class SglangPair:
    """Both legs at once with the same body; the engines pair by bootstrap room.

    Both phase slots are held before either leg is sent: a prefill sent while its decode
    waits for a slot would wait in the prefill engine's bootstrap queue, run into
    serving.prefill_timeout_s and be charged to a healthy prefill engine.

    Either leg failing cancels the other at once (peers hang here until a bootstrap
    timeout). The decode stream's output is held until the prefill leg succeeds, so a
    prefill failure, an error event in its stream included, is still an HTTP error the
    client can retry.
    """

    prefills_locally = False  # a decode server refuses a request without a bootstrap room

    def decode_alone(self, request: ClientRequest) -> bool:
        # An SGLang decode server refuses a request without a bootstrap room.
        return False

    async def run(self, x: Exchange, prefill: EngineState, decode: EngineState) -> None:
        serving = x.config.serving
        first_token_s = x.config.engine.first_token_timeout_s
        port = prefill.spec.bootstrap_port or SGLANG_DEFAULT_BOOTSTRAP_PORT
        # Both legs take the same body, so the prefill leg is asked for usage too; its
        # answer is not relayed.
        shared, own_usage, unstreamed = leg_body(x.request, decode)
        body = encode(
            sglang_pd_body(shared, host=prefill.host, port=port, room=new_bootstrap_room())
        )
        prefill_done = trio.Event()
        prefill_slot = trio.Event()
        both_slots = trio.Event()
        first_failure: list[BaseException] = []
        x.record.stage = "prefill"
        timer = trio.CancelScope()  # its deadline starts once both legs are sent

        async def run_prefill() -> None:
            async with x.decisions.phase_slot(prefill, "prefill", x.tokens):
                prefill_slot.set()
                await both_slots.wait()
                await Leg(x, prefill, "prefill").read_whole(
                    body,
                    timeout_s=serving.prefill_timeout_s,
                    on_timeout=FailureKind.PREFILL_TIMEOUT,
                    timeout_setting="serving.prefill_timeout_s",
                    prompt_tokens=x.tokens,
                    sse=unstreamed is None,
                )
            x.record.prefilled_at = trio.current_time()
            x.record.stage = "decode"
            timer.deadline = min(timer.deadline, trio.current_time() + first_token_s)
            if x.request.stream:
                await x.client.start_stream()
            prefill_done.set()

        async def run_decode() -> None:
            await prefill_slot.wait()
            async with x.decisions.phase_slot(decode, "decode", x.tokens):
                timer.deadline = trio.current_time() + serving.prefill_timeout_s + first_token_s
                both_slots.set()
                await Leg(x, decode, "decode").produce(
                    body,
                    first_token_budget=math.inf,
                    timer=timer,
                    hold_until=prefill_done,
                    own_usage=own_usage,
                    unstreamed=unstreamed,
                )

        async with trio.open_nursery() as legs:
            for leg in (run_prefill, run_decode):
                legs.start_soon(_first_failure_cancels, leg, first_failure, legs.cancel_scope)
        if first_failure:
            raise first_failure[0]


async def aggregate(x: Exchange, engine: EngineState, *, local_prefill: bool = False) -> None:
    """One engine does both phases: its first token includes the prefill.

    `local_prefill`: a decode engine computes the prompt itself (cache.local_prefill_share).
    Its prefill is booked on the engine's backlog until the first token, so the next
    local prefill and the first decode step of a handoff behind it are priced behind it
    (docs/design.md#prefix-caching)."""
    x.record.stage = "decode"
    body, own_usage, unstreamed = leg_body(x.request, engine)
    # A leg read whole shows no first token: booked until its answer, it would stand
    # overdue on the engine for its whole decode.
    booked = (
        x.decisions.local_prefill(engine, x.tokens, x.cached.get(engine.id, 0))
        if local_prefill and unstreamed is None
        else None
    )
    with booked if booked is not None else nullcontext():
        async with x.decisions.phase_slot(engine, "decode", x.tokens):
            await Leg(x, engine, "aggregate", booked).produce(
                encode(body),
                first_token_budget=x.config.serving.prefill_timeout_s
                + x.config.engine.first_token_timeout_s,
                own_usage=own_usage,
                unstreamed=unstreamed,
            )


_PROTOCOLS: dict[str, PairProtocol] = {"vllm": VllmPair(), "sglang": SglangPair()}


def pair_protocol(dialect: Dialect) -> PairProtocol:
    """The pair protocol of a prefill engine of `dialect`."""
    return _PROTOCOLS[dialect.name]


async def _first_failure_cancels(
    leg: object, failures: list[BaseException], scope: trio.CancelScope
) -> None:
    assert callable(leg)
    try:
        await leg()
    except NarwhalError as exc:
        failures.append(exc)
        scope.cancel()
