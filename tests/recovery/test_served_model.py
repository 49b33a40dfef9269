"""An engine launched under another name than its engines[].model."""

from __future__ import annotations

import logging

import pytest
import trio

from narwhal.recovery import HttpProber, ModelRefusal, VerifyPair, VerifyResult

from ..serving.conftest import MODEL, Stack
from ..serving.test_api_key import complete
from ..serving.test_retries import PD4, RETRYING, requests
from ..support import wait_for
from .conftest import StartStack
from .test_sim_faults import prober_pair

# vLLM 0.32's refusal by an engine launched as "another-model".
REFUSAL = f"The model `{MODEL}` does not exist. Valid aliases: another-model."
REFUSED = f"HTTP 404: {REFUSAL}"


def reason(stack: Stack, engine_id: str) -> str | None:
    engine = stack.ctx.fleet.get(engine_id)
    assert engine is not None
    return engine.unavailable_reason(trio.current_time())


async def test_an_engine_serving_another_model_leaves_placement_and_comes_back_when_it_serves_it(
    start_stack: StartStack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    stack = await start_stack()
    stack.fleet[0].set_model("another-model")  # relaunched with a mistyped name
    first = await complete(stack)
    # Refused at the prefill leg (502, not the engine's 404: the client's model is right)
    # or already at the /tokenize that counts the prompt, which leaves no prefill engine.
    code = first.json()["error"]["code"]
    assert code in ("engine_model_missing", "no_engine_available"), first.text
    assert reason(stack, "p0") == f"model not served: {REFUSED}"
    # Out of placement: nothing more is sent to it, however long it answers its probes.
    before = requests(stack, 0, "prefill")
    second = await complete(stack)
    assert second.status_code == 503, second.text
    # The client learns only that no engine could take it; the state says why.
    assert second.json()["error"]["message"] == "no prefill engine is available"
    await trio.sleep(0.3)  # several probe intervals (0.05 s)
    assert requests(stack, 0, "prefill") == before
    assert reason(stack, "p0") == f"model not served: {REFUSED}"
    state = await stack.state()
    p0 = next(e for e in state["engines"] if e["id"] == "p0")
    assert p0["unavailable_reason"] == f"model not served: {REFUSED}"

    stack.fleet[0].set_model(MODEL)  # relaunched with the right name
    await wait_for(lambda: reason(stack, "p0") is None)
    third = await complete(stack)
    assert third.status_code == 200, third.text
    missing = [r for r in caplog.records if r.__dict__.get("event") == "engine_model_missing"]
    served = [r for r in caplog.records if r.__dict__.get("event") == "engine_model_served"]
    assert len(missing) == 1  # once per episode, not per refused request
    assert "check the engine's --served-model-name" in missing[0].getMessage()
    assert [r.__dict__["engine"] for r in served] == ["p0"]
    assert stack.supervisor.reloads == []


async def test_a_leg_refused_for_the_model_is_retried_on_an_engine_that_serves_it(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(PD4, serving=RETRYING, engine={"tokenize": False})
    stack.fleet[0].set_model("another-model")
    p0 = stack.ctx.fleet.get("p0")
    assert p0 is not None
    # Until placement has tried p0 once (bounded: it is out after that). The engine
    # refuses before it runs anything, so only the router's count shows the attempt.
    for _ in range(20):
        response = await complete(stack, stream=True)
        assert response.status_code == 200, response.text
        if p0.model_refusals:
            break
    assert reason(stack, "p0") == f"model not served: {REFUSED}"
    for _ in range(4):
        assert (await complete(stack)).status_code == 200
    assert p0.model_refusals == 1
    assert requests(stack, 0, "prefill") == 0
    # Not the engine's fault as a breaker sees it: no failure counted against it.
    breakers = (await stack.state())["recovery"]["engines"]["p0"]["breakers"]
    assert all(b["state"] == "closed" for b in breakers.values()), breakers


async def test_a_verification_leg_refused_for_the_model_is_a_refusal_not_a_failure(
    nursery: trio.Nursery,
) -> None:
    fleet, config, p0, d0 = await prober_pair(nursery, "vllm")
    prober = HttpProber()
    pair = VerifyPair(d0, "decode", p0, d0, "narwhal-verify-model")
    fleet[1].set_model("another-model")
    assert await prober.verify(pair, config) == VerifyResult(
        "refused",
        f"prefill on p0, decode on d0: decode leg on d0 returned {REFUSED}",
        refusal=ModelRefusal(d0, REFUSAL),
    )
    for engine in (p0, d0):
        await engine.aclose()


async def test_an_engine_restarted_under_another_name_is_out_for_the_model_not_ejected(
    start_stack: StartStack,
) -> None:
    stack = await start_stack()
    d1 = stack.ctx.fleet.get("d1")
    assert d1 is not None
    await stack.fleet[1].restart()
    # Relaunched under another name; seen before its restart hold (0.2 s) ends.
    stack.fleet[1].set_model("another-model")
    # Held for the restart, then verified: its decode leg is refused for the model.
    await wait_for(lambda: d1.model_missing is not None)
    state = await stack.state()
    health = state["recovery"]["engines"]["d1"]["health"]
    assert health["verdict"] != "ejected", health
    assert reason(stack, "d1") == f"model not served: {REFUSED}"
