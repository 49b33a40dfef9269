"""An engine started with --api-key: the routes each real engine guards, and its 401."""

from __future__ import annotations

import httpx
import pytest

from narwhal.cli import sim as sim_cli
from narwhal.sim import DEFAULT_MODEL

from ..support import StartFleet

KEY = "sim-key-42"
FAST = {"speed": 50.0}
COMPLETION = {"model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 2}
UNAUTHORIZED = {"error": "Unauthorized"}


async def _call(
    client: httpx.AsyncClient, method: str, url: str, headers: dict[str, str]
) -> httpx.Response:
    if method == "POST":
        return await client.post(url, json=COMPLETION, headers=headers)
    return await client.get(url, headers=headers)


# (method, path, guarded): vLLM's AuthenticationMiddleware guards /v1 only.
VLLM_ROUTES = [
    ("POST", "/v1/completions", True),
    ("POST", "/v1/chat/completions", True),
    ("GET", "/v1/models", True),
    ("GET", "/v1/no-such-route", True),
    ("POST", "/tokenize", False),
    ("GET", "/health", False),
    ("GET", "/metrics", False),
    ("GET", "/version", False),
]
# SGLang's guards everything but /health* and /metrics*.
SGLANG_ROUTES = [
    ("POST", "/v1/completions", True),
    ("GET", "/v1/models", True),
    ("POST", "/tokenize", True),
    ("POST", "/v1/tokenize", True),
    ("GET", "/version", True),
    ("GET", "/get_server_info", True),
    ("GET", "/get_model_info", True),
    ("GET", "/no-such-route", True),
    ("GET", "/health", False),
    ("GET", "/health_generate", False),
    ("GET", "/metrics", False),
]


@pytest.mark.parametrize(
    ("dialect", "method", "path", "guarded"),
    [("vllm", *route) for route in VLLM_ROUTES] + [("sglang", *route) for route in SGLANG_ROUTES],
)
async def test_guarded_routes_want_the_key(
    start_fleet: StartFleet,
    client: httpx.AsyncClient,
    dialect: str,
    method: str,
    path: str,
    guarded: bool,
) -> None:
    fleet = await start_fleet(engines=1, dialect=dialect, api_key=KEY, **FAST)
    url = fleet[0].url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = await _call(client, method, url, headers)
        if guarded:
            assert (response.status_code, response.json()) == (401, UNAUTHORIZED), headers
        else:
            assert response.status_code != 401, headers
    for scheme in ("Bearer", "bearer"):
        response = await _call(client, method, url, {"Authorization": f"{scheme} {KEY}"})
        assert response.status_code != 401


async def test_without_a_key_nothing_is_guarded(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=1, **FAST)
    response = await client.post(f"{fleet[0].url}/v1/completions", json=COMPLETION)
    assert response.status_code == 200


async def test_a_changed_key_applies_at_once_and_survives_a_restart(
    start_fleet: StartFleet, client: httpx.AsyncClient
) -> None:
    fleet = await start_fleet(engines=2, api_key=KEY, **FAST)
    fleet[0].set_api_key("rotated")
    url = f"{fleet[0].url}/v1/models"
    assert (await client.get(url, headers={"Authorization": f"Bearer {KEY}"})).status_code == 401
    await fleet[0].restart()
    assert (await client.get(url, headers={"Authorization": "Bearer rotated"})).status_code == 200
    other = f"{fleet[1].url}/v1/models"
    assert (await client.get(other, headers={"Authorization": f"Bearer {KEY}"})).status_code == 200


def test_cli_api_key_reaches_the_spec() -> None:
    args = sim_cli.parser().parse_args(["--api-key", KEY])
    assert sim_cli.spec_from_args(args).api_key == KEY
    assert sim_cli.spec_from_args(sim_cli.parser().parse_args([])).api_key is None
