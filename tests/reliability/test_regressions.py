"""Regression tests for bugs the reliability campaigns found (one per fix)."""

from __future__ import annotations

import json
import socket
import struct
from functools import partial

import h11
import pytest
import trio

from narwhal.ctl import CtlError
from narwhal.ctl._protocol import parse_request
from narwhal.sim import Fleet, serve_fleet
from narwhal.sim._http import request
from narwhal.sim._vllm import VLLMProtocol

from . import hostile
from .campaign import StartCampaign, start_beside_hostile
from .client import exchange


async def resetting_peer(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Accepts, reads the request, then resets the connection (an engine restarting
    or going down mid-exchange)."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listener:
        task_status.started(listener.socket.getsockname()[1])
        while True:
            stream = await listener.accept()
            await stream.receive_some(65536)
            linger = struct.pack("ii", 1, 0)
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            stream.socket.close()


async def test_sim_side_channel_reports_a_reset_as_a_protocol_error(
    nursery: trio.Nursery,
) -> None:
    """The simulator's engine-to-engine client raised trio.BrokenResourceError on a
    connection reset, which its callers (KV pull, heartbeats, release) did not expect:
    a heartbeat to a producer that was restarting crashed the whole simulated fleet.
    Found by test_faults.py::test_engine_restarts_under_load[long]."""
    port = await nursery.start(resetting_peer)
    with pytest.raises(h11.RemoteProtocolError):
        await request("127.0.0.1", port, "POST", "/_sim/nixl/heartbeat", {"x": 1})
    fleet: Fleet = await nursery.start(partial(serve_fleet, engines=1))
    engine = fleet[0].engine
    assert isinstance(engine.protocol, VLLMProtocol)
    await engine.protocol.send_heartbeat("127.0.0.1", port, "producer", ["r1"])
    assert engine.counters.heartbeats_failed == 1


async def test_a_non_json_200_from_a_decode_engine_is_not_relayed_as_json(
    start: StartCampaign, nursery: trio.Nursery
) -> None:
    """A non-streaming decode answer was relayed verbatim with 200 and
    content-type application/json, whatever it was: an HTML page from a proxy in front
    of the engine reached the client as a successful completion. Found by
    test_hostile.py::test_hostile_engine[decode-not_json_body-json]."""
    c, _ = await start_beside_hostile(
        start,
        nursery,
        "nonjson",
        "decode",
        hostile.not_json_body,
        sim={"lease_s": 4.0},
        serving={"max_attempts": 1},
    )
    ex = await c.send(0, c.body(stream=False, max_tokens=4))
    assert ex.status == 502
    error = json.loads(ex.body)["error"]
    # The leg is asked as a stream (manual 6); a JSON answer is named for what it is.
    assert error["code"] == "engine_bad_response"
    assert error["message"] == (
        "decode engine: answered a streaming request with application/json, not an event stream"
    )


async def test_a_deeply_nested_body_is_a_bad_request(start: StartCampaign) -> None:
    """A body of nested arrays (400 KB, well under serving.max_request_bytes) made
    json.loads raise RecursionError, which the parser did not catch: the client got a
    500 internal_error and the router logged a traceback per request. Found by
    test_bad_input.py::test_malformed_and_wrongly_typed_bodies."""
    c = await start("nested", ["prefill", "decode"])
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 50_000 + b"]}"):
        ex = await exchange(c.stack.url, raw, request_id=c.request_id(0))
        assert ex.status == 400
        assert json.loads(ex.body)["error"] == {
            "message": "request body is nested too deeply",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_json",
        }


async def test_an_unpaired_surrogate_escape_is_a_bad_request(start: StartCampaign) -> None:
    """`"\\ud800"` is valid JSON but decodes to a lone surrogate, which cannot be
    encoded again as UTF-8: building the engine request raised UnicodeEncodeError and
    the client got a 500 internal_error. Found by
    test_bad_input.py::test_malformed_and_wrongly_typed_bodies."""
    c = await start("surrogate", ["prefill", "decode"])
    raw = b'{"prompt": "abc \\ud800 def", "max_tokens": 2}'
    ex = await exchange(c.stack.url, raw, request_id=c.request_id(0))
    assert ex.status == 400
    error = json.loads(ex.body)["error"]
    assert error["code"] == "invalid_json"
    assert error["message"].startswith("request body contains an unpaired surrogate escape")
    # A proper pair (an emoji, escaped) is fine.
    ex = await exchange(
        c.stack.url, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}', request_id="pair"
    )
    assert ex.status == 200


def test_a_deeply_nested_control_request_is_a_bad_request() -> None:
    """A control line of nested arrays (well under the 64 KiB line limit) made the
    protocol parser raise RecursionError: the daemon answered internal_error and
    logged a traceback. Found by test_ctl_security.py::test_malformed_lines_never_crash_the_handler."""
    with pytest.raises(CtlError) as caught:
        parse_request(b"[" * 30_000 + b"]" * 30_000)
    assert (caught.value.code, caught.value.message) == (
        "bad_request",
        "request is not JSON: nested too deeply",
    )


@pytest.mark.parametrize(
    ("behaviour", "stream", "status", "code"),
    [
        # A non-streaming request's decode leg is a stream: a JSON body is refused unread.
        (hostile.nested_json_body, False, 502, "engine_bad_response"),
        (hostile.nested_event, True, 200, None),
        (hostile.nested_error_status, False, 503, "engine_http_503"),
    ],
)
async def test_deeply_nested_json_from_an_engine_is_not_an_internal_error(
    start: StartCampaign,
    nursery: trio.Nursery,
    behaviour: hostile.Behaviour,
    stream: bool,
    status: int,
    code: str | None,
) -> None:
    """Every place that parses an engine's JSON (the response body, an SSE event
    checked for a token or an error, an error body) caught only ValueError, so deeply
    nested JSON from an engine raised RecursionError through the request path: the
    client got internal_error and the router logged a traceback. Found by
    test_hostile.py (the nested_* behaviours)."""
    c, _ = await start_beside_hostile(
        start,
        nursery,
        "nested-engine",
        "decode",
        behaviour,
        sim={"lease_s": 4.0},
        serving={"max_attempts": 1},
    )
    ex = await c.send(0, c.body(stream=stream, max_tokens=4))
    assert ex.status == status
    if code is None:
        assert ex.events()[-1] == "[DONE]"
    else:
        assert json.loads(ex.body)["error"]["code"] == code
