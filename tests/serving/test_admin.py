"""Issue 29, item 5: the admin surface apart from the clients', client API keys, and client
errors that name no engine.

- `/narwhal/state` and `/metrics` are served on the admin listener (admin.host,
  admin.port), with admin.token when one is set; the client port answers them 404.
- listen.api_keys: every `/v1/` route asks for one of them (401 and `WWW-Authenticate:
  Bearer` otherwise, counted as a refusal); `/health` stays open. Keys and tokens, inline
  or from their files, apply at the next request after a reload.
- A client's error message names no engine id or url unless
  serving.expose_engine_details; the log keeps them.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from narwhal.config import load_config
from narwhal.sim import Fleet, serve_fleet
from narwhal.supervisor import ListenError, Supervisor

from ..support import FakeFileLimit, wait_for
from .conftest import MODEL, Stack, fleet_config

KEY = "sk-client-0123456789abcdef"
OTHER_KEY = "sk-client-fedcba9876543210"
TOKEN = "admin-token-0123456789"
BODY = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 3}
# Engine ids nothing else in a message could contain.
PREFILL_ID, DECODE_ID = "pf-secret-engine", "dc-secret-engine"


async def start(nursery: trio.Nursery, tmp_path: Path, **sections: Any) -> tuple[Stack, Path]:
    """A 1P1D simulated fleet with distinctive engine ids and a Narwhal in front of it,
    started from a config file (for reloads); returns the stack and the file."""
    fleet: Fleet = await nursery.start(partial(serve_fleet, engines=2, speed=20.0, model=MODEL))
    document = fleet_config(fleet, ["prefill", "decode"], **sections)
    document["engines"][0]["id"], document["engines"][1]["id"] = PREFILL_ID, DECODE_ID
    path = tmp_path / "narwhal.json"
    path.write_text(json.dumps(document))
    config = load_config(document)
    supervisor: Supervisor = await nursery.start(
        Supervisor(config, config_path=str(path), open_files=FakeFileLimit().limit()).run
    )
    return Stack(fleet, supervisor, config), path


def rewrite(path: Path, **sections: Any) -> None:
    document = json.loads(path.read_text())
    for key, value in sections.items():
        document[key] = {**document.get(key, {}), **value}
    path.write_text(json.dumps(document))


async def get(url: str, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.get(url, **kw)


async def complete(stack: Stack, key: str | None = None, **body: Any) -> httpx.Response:
    headers = {} if key is None else {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{stack.url}/v1/completions", json={**BODY, **body}, headers=headers
        )


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


# ------------------------------------------------------------------ the admin surface


async def test_state_and_metrics_are_on_the_admin_listener_only(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack, _ = await start(nursery, tmp_path)
    assert stack.supervisor.admin_bound != stack.supervisor.bound
    for path in ("/narwhal/state", "/metrics"):
        refused = await get(f"{stack.url}{path}")
        assert refused.status_code == 404, path
        assert refused.json()["error"] == {
            "message": f"no route for GET {path}: narwhal serves it on its admin listener "
            "(admin.host, admin.port), not to clients",
            "type": "invalid_request_error",
            "param": None,
            "code": "not_found",
        }
        assert PREFILL_ID not in refused.text
    state = await get(f"{stack.admin_url}/narwhal/state")
    assert state.status_code == 200
    assert stack.fleet[0].url in state.text  # what the client port no longer shows
    assert state.json()["supervisor"]["admin"] == [stack.admin_url]
    metrics = await get(f"{stack.admin_url}/metrics")
    assert metrics.status_code == 200
    assert "narwhal_requests_total" in metrics.text
    # The admin listener serves nothing else: no completions, no health.
    assert (await get(f"{stack.admin_url}/health")).status_code == 404
    async with httpx.AsyncClient(timeout=10) as client:
        post = await client.post(f"{stack.admin_url}/metrics", json={})
    assert (post.status_code, post.headers["allow"]) == (405, "GET, HEAD")
    # And the client port still serves its own.
    assert (await get(f"{stack.url}/health")).status_code == 200
    assert (await complete(stack)).status_code == 200


async def test_the_admin_token_is_asked_for_and_reloads(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    stack, config_path = await start(nursery, tmp_path, admin={"token_file": str(token_file)})
    url = f"{stack.admin_url}/narwhal/state"
    missing = await get(url)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == 'Bearer realm="narwhal"'
    assert missing.json()["error"]["code"] == "missing_token"
    wrong = await get(url, headers=bearer("not-" + TOKEN))
    assert wrong.status_code == 401
    assert wrong.headers["www-authenticate"] == 'Bearer realm="narwhal", error="invalid_token"'
    assert wrong.json()["error"] == {
        "message": "incorrect admin token provided",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_token",
    }
    assert (await get(url, headers=bearer(TOKEN))).status_code == 200
    assert (await get(f"{stack.admin_url}/metrics", headers=bearer(TOKEN))).status_code == 200
    # The scheme is case-insensitive (RFC 9110 11.1); another scheme is no token.
    assert (await get(url, headers={"authorization": f"bearer {TOKEN}"})).status_code == 200
    basic = await get(url, headers={"authorization": f"Basic {TOKEN}"})
    assert basic.json()["error"]["code"] == "missing_token"
    # A rotated token applies at the reload; the old one is refused from then on.
    token_file.write_text("rotated-" + TOKEN)
    result = await stack.supervisor.reload()
    assert result.applied, result.errors
    assert result.plan is not None
    assert result.plan.summary() == ['admin.token_file: "<redacted>" -> "<redacted>"']
    assert (await get(url, headers=bearer(TOKEN))).status_code == 401
    assert (await get(url, headers=bearer("rotated-" + TOKEN))).status_code == 200
    # The token is nowhere in what the admin shows.
    state = await get(url, headers=bearer("rotated-" + TOKEN))
    assert TOKEN not in state.text
    # A move of the admin listener waits for a restart.
    rewrite(config_path, admin={"port": 1})
    result = await stack.supervisor.reload()
    assert result.plan is not None
    assert [c.path for c in result.plan.restart_required] == ["admin.port"]
    assert stack.ctx.config.admin.port == 0
    assert (await get(url, headers=bearer("rotated-" + TOKEN))).status_code == 200


# ------------------------------------------------------------------ client API keys


async def test_client_api_keys_guard_every_v1_route(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack, _ = await start(nursery, tmp_path, listen={"api_keys": [OTHER_KEY, KEY]})
    missing = await complete(stack)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == 'Bearer realm="narwhal"'
    assert missing.json()["error"] == {
        "message": "an API key is required: send it as `Authorization: Bearer KEY`",
        "type": "invalid_request_error",
        "param": None,
        "code": "missing_api_key",
    }
    wrong = await complete(stack, key=KEY[:-1])
    assert wrong.status_code == 401
    assert wrong.headers["www-authenticate"] == 'Bearer realm="narwhal", error="invalid_token"'
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert KEY[:-1] not in wrong.text
    assert (await complete(stack, key=KEY)).status_code == 200
    assert (await complete(stack, key=OTHER_KEY, stream=True)).status_code == 200
    # Two Authorization headers are not a key.
    async with httpx.AsyncClient(timeout=10) as client:
        twice = await client.post(
            f"{stack.url}/v1/completions",
            json=BODY,
            headers=[("authorization", f"Bearer {KEY}"), ("authorization", "Bearer x")],
        )
    assert twice.json()["error"]["code"] == "invalid_api_key"
    # Every /v1 route, even one that does not exist; /health stays open.
    assert (await get(f"{stack.url}/v1/models")).status_code == 401
    assert (await get(f"{stack.url}/v1/models", headers=bearer(KEY))).status_code == 200
    assert (await get(f"{stack.url}/v1/embeddings")).status_code == 401
    assert (await get(f"{stack.url}/v1/embeddings", headers=bearer(KEY))).status_code == 404
    assert (await get(f"{stack.url}/health")).status_code == 200
    # Counted as refusals, and as the client's own outcome (not an SLO miss).
    await wait_for(lambda: stack.ctx.retained == 0)
    assert stack.ctx.outcomes["missing_api_key"] == 1
    assert stack.ctx.outcomes["invalid_api_key"] == 2
    registry = stack.ctx.metrics.registry
    refusals = "narwhal_refusals_total"
    assert registry.get_sample_value(refusals, {"reason": "invalid_api_key"}) == 2
    assert registry.get_sample_value(refusals, {"reason": "missing_api_key"}) == 3
    assert registry.get_sample_value("narwhal_slo_requests_total", {"result": "refused"}) is None
    # The simulated engines saw only the two requests with a key.
    assert sum(stack.fleet[1].state()["counters"]["requests"].values()) == 2


async def test_the_openai_sdk_sends_its_key_and_reads_the_refusal(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack, _ = await start(nursery, tmp_path, listen={"api_keys": [KEY]})

    def ask(key: str) -> str:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, timeout=10)
        try:
            done = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
            return done.choices[0].finish_reason
        finally:
            client.close()

    assert await trio.to_thread.run_sync(ask, KEY) == "length"
    with pytest.raises(openai.AuthenticationError) as refused:
        await trio.to_thread.run_sync(ask, OTHER_KEY)
    assert refused.value.status_code == 401
    assert refused.value.code == "invalid_api_key"
    # The SDK does not retry a 401 (it would with a 5xx or 429).
    await wait_for(lambda: stack.ctx.retained == 0)
    assert stack.ctx.outcomes["invalid_api_key"] == 1


async def test_client_keys_from_a_file_reload(nursery: trio.Nursery, tmp_path: Path) -> None:
    keys = tmp_path / "client-keys"
    keys.write_text(f"# the clients\n{KEY}\n")
    stack, config_path = await start(nursery, tmp_path, listen={"api_keys_file": str(keys)})
    assert (await complete(stack, key=KEY)).status_code == 200
    assert (await complete(stack, key=OTHER_KEY)).status_code == 401
    keys.write_text(f"{OTHER_KEY}\n")
    result = await stack.supervisor.reload()
    assert result.applied, result.errors
    assert (await complete(stack, key=KEY)).status_code == 401
    assert (await complete(stack, key=OTHER_KEY)).status_code == 200
    # A file that cannot be used rejects the reload; the running keys stay.
    keys.write_text("two words\n")
    result = await stack.supervisor.reload()
    assert not result.applied
    assert result.errors == (
        f"listen.api_keys_file: {json.dumps(str(keys))}: line 1: the key holds a character "
        "that cannot be sent in an HTTP header (space, line break, control or non-ASCII "
        "character); expected printable ASCII",
    )
    assert (await complete(stack, key=OTHER_KEY)).status_code == 200
    # Without keys, no key is asked.
    keys.write_text(f"{OTHER_KEY}\n")
    rewrite(config_path, listen={"api_keys_file": None})
    assert (await stack.supervisor.reload()).applied
    assert (await complete(stack)).status_code == 200


# ------------------------------------------------------------------ engine details


def _no_engine_named(stack: Stack, text: str) -> None:
    assert PREFILL_ID not in text, text
    assert DECODE_ID not in text, text
    for handle in stack.fleet:
        assert f":{handle.port}" not in text, text


async def _representative_errors(stack: Stack) -> dict[str, str]:
    """A client's error message for each kind of failure that names an engine in the log:
    by code (a stream's terminal event for `engine_stream_error`)."""
    seen: dict[str, str] = {}
    failing = {"on": False}

    async def fail_the_pass(result: object) -> None:
        if failing["on"]:
            raise RuntimeError(f"engine {DECODE_ID}: GET {decode.url}/metrics failed")

    async def record(**body: Any) -> None:
        response = await complete(stack, **body)
        if response.status_code == 200:
            last = response.text.rstrip("\n").rsplit("\n\n", 1)[-1].removeprefix("data: ")
            error = json.loads(last)["error"]
        else:
            error = response.json()["error"]
        seen[error["code"]] = error["message"]

    prefill, decode = stack.fleet
    assert stack.supervisor.monitor is not None
    stack.supervisor.monitor.add_handler("test", fail_the_pass)
    engine = stack.ctx.fleet.get(PREFILL_ID)
    assert engine is not None
    await wait_for(lambda: engine.unavailable_reason(trio.current_time()) is None)
    prefill.set_faults(error_status=500, leg="prefill", count=1)
    await record()
    decode.set_faults(sse_error_after_tokens=1, leg="decode", count=1)
    await record(stream=True, max_tokens=8)
    engine.operator_drain()  # the only prefill engine: nothing to place on
    await record()
    engine.operator_undrain()
    # A monitor pass handler failing, naming an engine and its url, degrades the router.
    failing["on"] = True
    await wait_for(lambda: stack.ctx.degraded_reason is not None)
    await record()
    health = (await get(f"{stack.url}/health")).json()
    seen["health"] = health["reason"]
    failing["on"] = False
    await wait_for(lambda: stack.ctx.degraded_reason is None)
    await prefill.go_down()
    await record()
    await prefill.come_up()
    await wait_for(lambda: engine.unavailable_reason(trio.current_time()) is None)
    await wait_for(lambda: stack.ctx.degraded_reason is None)
    # Last: the engine is out until its key check passes, a probe interval later.
    prefill.set_api_key("a-key-narwhal-does-not-send")
    await record()
    prefill.set_api_key(None)
    return seen


async def test_client_errors_name_no_engine_unless_the_setting_allows_it(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    stack, config_path = await start(
        nursery,
        tmp_path,
        # Keep the failing prefill engine in placement, so that every case reaches it.
        recovery={"breaker": {"failure_threshold": 1000}, "health": {"interval_s": 0.1}},
        # Degraded after 3 failed passes: the engine down a moment below stays short of it.
        controller={"monitor_interval_s": 0.1, "monitor_failure_limit": 3},
    )
    hidden = await _representative_errors(stack)
    assert hidden == {
        "engine_http_500": "prefill engine returned HTTP 500: Internal server error",
        "engine_stream_error": "decode engine: engine reported an error mid-stream: Internal "
        "server error",
        "engine_auth_failed": "prefill engine refused narwhal's API key (HTTP 401): the "
        "router's configuration is at fault, not the request",
        "no_engine_available": "no prefill engine is available",
        "degraded": "narwhal is degraded: its monitor passes keep failing "
        "(controller.monitor_failure_limit)",
        "health": "degraded: its monitor passes keep failing (controller.monitor_failure_limit)",
        "engine_unreachable": "prefill engine: could not connect to the engine",
    }
    for message in hidden.values():
        _no_engine_named(stack, message)
    # The operator's log has the whole of each.
    logged = " ".join(record.getMessage() for record in caplog.records)
    assert f"prefill engine {PREFILL_ID} returned HTTP 500" in logged
    assert f"connect to 127.0.0.1:{stack.fleet[0].port} failed" in logged

    # serving.expose_engine_details, applied by a reload, names them again.
    rewrite(config_path, serving={"expose_engine_details": True})
    assert (await stack.supervisor.reload()).applied
    shown = await _representative_errors(stack)
    assert shown["engine_http_500"].startswith(f"prefill engine {PREFILL_ID} returned HTTP 500")
    assert shown["no_engine_available"] == f"no prefill engine is available ({PREFILL_ID}: drained)"
    failure = f"engine {DECODE_ID}: GET {stack.fleet[1].url}/metrics failed"
    assert shown["degraded"].endswith(failure)
    assert shown["health"].endswith(failure)
    assert f"127.0.0.1:{stack.fleet[0].port}" in shown["engine_unreachable"]


@pytest.mark.parametrize(
    ("admin", "warned"),
    [
        ({"host": "10.0.0.1"}, True),
        ({"host": "10.0.0.1", "token": TOKEN}, False),
        ({"host": "127.0.0.1"}, False),
        ({"host": "::1"}, False),
    ],
)
def test_an_admin_listener_off_loopback_without_a_token_is_warned_of(
    caplog: pytest.LogCaptureFixture, admin: dict[str, str], warned: bool
) -> None:
    section: dict[str, object] = {**admin, "port": 9}
    config = load_config({"engines": [{"id": "a", "url": "http://127.0.0.1:9"}], "admin": section})
    Supervisor._warn_open_admin(config)
    events = [r for r in caplog.records if getattr(r, "event", None) == "admin_open"]
    assert [r.getMessage() for r in events] == (
        [
            "the admin listener on 10.0.0.1:9 asks no token: whoever reaches it reads every "
            "engine's url and the requests in flight; set admin.token_file"
        ]
        if warned
        else []
    )


async def test_an_admin_port_in_use_stops_startup_naming_its_settings(
    nursery: trio.Nursery,
) -> None:
    (taken,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = taken.socket.getsockname()[1]
    fleet: Fleet = await nursery.start(partial(serve_fleet, engines=2, speed=20.0, model=MODEL))
    document = fleet_config(fleet, ["prefill", "decode"], admin={"port": port})
    supervisor = Supervisor(load_config(document), open_files=FakeFileLimit().limit())
    try:
        with pytest.RaisesGroup(
            pytest.RaisesExc(
                ListenError,
                match=rf"^cannot listen on admin\.host:admin\.port = 127\.0\.0\.1:{port}: "
                "address already in use$",
            ),
            flatten_subgroups=True,
        ):
            await supervisor.run()
    finally:
        await taken.aclose()
