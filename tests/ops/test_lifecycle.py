"""Shutdown and reload in process: what happens to requests in flight."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import Config, load_config
from narwhal.profiles import FleetProfiles, save_profiles
from narwhal.serving import ServingContext, state_document
from narwhal.supervisor import Notifier, Supervisor, _supervisor

from ..profiles.helpers import config_document, store_for
from ..recovery.conftest import FAST, StartStack, start_stack as start_stack
from ..recovery.fakes import merge
from ..serving.conftest import MODEL, Stack
from ..support import FakeFileLimit, open_sse, wait_for

BODY = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 8, "stream": True}


@asynccontextmanager
async def systemd(directory: Path) -> AsyncIterator[Notifier]:
    """A Notifier whose NOTIFY_SOCKET is a datagram socket bound in `directory`, as
    systemd's would be (what it sent stays in `Notifier.sent`)."""
    address = str(directory / "notify.sock")
    with trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM) as sink:
        await sink.bind(address)
        yield Notifier(address)


def pair_document(stack: Stack) -> dict[str, Any]:
    """A config for a second daemon in front of the stack's 1P1D fleet, open admission."""
    fleet = stack.fleet
    return merge(
        {
            "engines": [
                {"id": "p0", "url": fleet[0].url, "role": "prefill", "model": MODEL},
                {"id": "d1", "url": fleet[1].url, "role": "decode", "model": MODEL},
            ],
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
            "serving": {"admission": "open"},
        },
        FAST,
    )


async def refused(stack: Stack) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(f"{stack.url}/v1/completions", json={**BODY, "stream": False})


async def read_all(reader: Any) -> list[str]:
    events = []
    while (event := await reader.event()) is not None:
        events.append(event)
    return events


async def test_shutdown_lets_a_stream_finish_and_refuses_new_requests(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(recovery={"shutdown_grace_s": 10.0})
    stack.fleet[1].set_faults(stall_after_tokens=2, stall_s=1.0, leg="decode", count=1)
    async with open_sse(stack.url, "/v1/completions", BODY) as reader:
        assert reader.status == 200
        assert await reader.event() is not None
        stack.supervisor.request_shutdown()
        await wait_for(lambda: stack.supervisor.stopping)
        response = await refused(stack)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "shutting_down"
        events = await read_all(reader)
    assert events[-1] == "[DONE]"
    assert not any('"error"' in e for e in events)
    await wait_for(lambda: stack.ctx.outcomes["ok"] == 1)


async def test_past_the_grace_streams_end_with_a_terminal_error_event(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(recovery={"shutdown_grace_s": 0.3})
    stack.fleet[1].set_faults(stall_after_tokens=2, leg="decode")  # stalls for good
    async with open_sse(stack.url, "/v1/completions", BODY) as reader:
        assert await reader.event() is not None
        started = trio.current_time()
        stack.supervisor.request_shutdown()
        with trio.fail_after(5):
            events = await read_all(reader)
        waited = trio.current_time() - started
    assert 0.3 <= waited < 2.0
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["code"] == "shutting_down"
    assert error["message"] == (
        "narwhal shut down before the request finished (recovery.shutdown_grace_s=0.3)"
    )
    await wait_for(lambda: stack.ctx.outcomes["shutting_down"] == 1)
    with trio.fail_after(5):
        while True:  # the listener closes once the drain is over
            try:
                stream = await trio.open_tcp_stream(*stack.supervisor.bound[0])
            except OSError:
                break
            await stream.aclose()
            await trio.sleep(0.05)


def write(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document))


async def test_reload_adds_and_retires_engines_while_resident_work_finishes(
    start_stack: StartStack, tmp_path: Path
) -> None:
    stack = await start_stack(["prefill", "decode", "decode"])
    fleet = stack.fleet
    # The running daemon only knows p0 and d1 (d2 exists, unconfigured).
    base = pair_document(stack)
    path = tmp_path / "narwhal.json"
    write(path, base)
    config = load_config(base)
    # A supervisor of our own: the fixture's has no config file to re-read.
    async with trio.open_nursery() as nursery:
        supervisor: Supervisor = await nursery.start(Supervisor(config, config_path=str(path)).run)
        ctx = supervisor.ctx
        assert isinstance(ctx, ServingContext)
        fleet[1].set_faults(stall_after_tokens=2, stall_s=1.0, leg="decode", count=1)
        async with open_sse(supervisor.url, "/v1/completions", BODY) as reader:
            assert await reader.event() is not None  # resident on d1
            new = merge(
                base,
                {
                    "serving": {
                        "max_connections": 32,
                        "request_timeout_s": 30.0,
                        "max_pending_bodies_per_client": 5,
                    },
                    "slo": {"ttft_s": 0.75},
                },
            )
            new["engines"] = [
                base["engines"][0],
                {"id": "d2", "url": fleet[2].url, "role": "decode", "model": MODEL},
            ]
            new["listen"] = {"host": "127.0.0.1", "port": 1, "max_open_connections": 100}
            write(path, new)
            result = await supervisor.reload()
            assert result.applied
            assert result.plan is not None
            assert result.plan.engines_added == ("d2",)
            assert result.plan.engines_removed == ("d1",)
            assert [c.path for c in result.plan.restart_required] == ["listen.port"]
            assert [e.id for e in ctx.fleet] == ["p0", "d2"]
            assert [e.id for e in ctx.fleet.retiring] == ["d1"]
            assert ctx.gate.statistics().max_admitted == 32
            assert ctx.connections.limit == 100  # applied in place, unlike the port
            # Per client: as set, and derived from the new ceiling (twice 32).
            assert (ctx.pending_bodies.limit, ctx.connections.per_client.limit) == (5, 64)
            assert ctx.config.serving.request_timeout_s == 30.0
            # Decode-side load signals average over the new TTFT target's timescale.
            assert ctx.first_token_lags.tau_s == ctx.kv_turnover.tau_s == 0.75
            assert ctx.config.listen.port == 0  # kept: it needs a restart
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.post(
                    f"{supervisor.url}/v1/completions", json={**BODY, "stream": False}
                )
            assert response.status_code == 200
            assert fleet[2].state()["counters"]["requests"]["decode"] >= 1
            events = await read_all(reader)
        assert events[-1] == "[DONE]"
        await wait_for(lambda: not ctx.fleet.retiring)
        # The KV the stream freed on d1 after the reload was not learnt (d1 had left the
        # fleet), and what admission learnt about d1 before went once it retired: nothing
        # is kept or shown for it.
        live = list(ctx.fleet)
        assert all(e in live for e in [*ctx.kv_turnover.value, *ctx.first_token_lags.value])
        admission = state_document(ctx)["admission"]
        assert isinstance(admission, dict)
        assert "d1" not in admission["decode_kv_release_tokens_per_s"]
        assert "d1" not in admission["decode_first_token_lag_s"]

        write(path, {**new, "serving": {"max_connections": 0}, "bogus": 1})
        rejected = await supervisor.reload()
        assert not rejected.applied
        assert rejected.errors == (
            "serving.max_connections: 0 must be at least 1",
            "bogus: unknown key",
        )
        assert ctx.gate.statistics().max_admitted == 32
        assert [e.id for e in ctx.fleet] == ["p0", "d2"]
        supervisor.request_shutdown()


async def test_a_leg_failing_on_a_replaced_engine_counts_against_neither_instance(
    start_stack: StartStack, tmp_path: Path
) -> None:
    # The request path told recovery of a failed leg by engine id; after a reload that
    # replaced the engine, that id names the replacement, whose breakers then counted
    # the failures of the old server (likely as it is taken down).
    stack = await start_stack(["prefill", "decode", "decode"])
    fleet = stack.fleet
    base = merge(pair_document(stack), {"engine": {"decode_read_timeout_s": 1.0}})
    path = tmp_path / "narwhal.json"
    write(path, base)
    async with trio.open_nursery() as nursery:
        supervisor: Supervisor = await nursery.start(
            Supervisor(load_config(base), config_path=str(path)).run
        )
        ctx, recovery = supervisor.ctx, supervisor.recovery
        assert ctx is not None
        assert recovery is not None
        fleet[1].set_faults(stall_after_tokens=2, stall_s=5.0, leg="decode", count=1)
        async with open_sse(supervisor.url, "/v1/completions", BODY) as reader:
            assert await reader.event() is not None  # resident on d1, then silent
            d1 = {**base["engines"][1], "url": fleet[2].url}  # d1 is another server now
            write(path, {**base, "engines": [base["engines"][0], d1]})
            assert (await supervisor.reload()).applied
            events = await read_all(reader)
        assert "decode_stalled" in events[-1]  # the old d1 went silent past 1 s
        record = recovery.record("d1")
        assert record is not None
        assert record.engine is ctx.fleet.get("d1")
        now = trio.current_time()
        assert {n: b.failures_in_window(now) for n, b in record.breakers.items()} == {
            "prefill": 0,
            "decode": 0,
        }
        supervisor.request_shutdown()


async def test_a_second_shutdown_request_skips_the_rest_of_the_grace(
    start_stack: StartStack,
) -> None:
    stack = await start_stack(recovery={"shutdown_grace_s": 30.0})
    stack.fleet[1].set_faults(stall_after_tokens=2, leg="decode")
    async with open_sse(stack.url, "/v1/completions", BODY) as reader:
        assert await reader.event() is not None
        stack.supervisor.request_shutdown()
        await wait_for(lambda: stack.supervisor.stopping)
        stack.supervisor.request_shutdown()  # the operator insists (a second SIGTERM)
        with trio.fail_after(5):
            events = await read_all(reader)
    assert json.loads(events[-1])["error"]["code"] == "shutting_down"


async def test_a_reload_that_turns_the_controller_off_leaves_it_running(
    start_stack: StartStack, tmp_path: Path
) -> None:
    stack = await start_stack()
    base = pair_document(stack)
    path = tmp_path / "narwhal.json"
    write(path, merge(base, {"controller": {"enabled": False}}))
    async with trio.open_nursery() as nursery:
        supervisor: Supervisor = await nursery.start(
            Supervisor(load_config(base), config_path=str(path)).run
        )
        ctx = supervisor.ctx
        assert ctx is not None
        assert supervisor.link is not None
        controller = supervisor.link.controller
        assert controller is not None
        result = await supervisor.reload()
        assert result.applied
        assert result.plan is not None
        assert [c.path for c in result.plan.restart_required] == ["controller.enabled"]
        # "the running value stays in force": the controller still decides, and the
        # state document says it is on.
        assert ctx.config.controller.enabled
        assert controller.step(trio.current_time()) is not None
        state = state_document(ctx)["controller"]
        assert isinstance(state, dict)
        assert state["enabled"] is True
        supervisor.request_shutdown()


async def test_a_reload_during_the_shutdown_drain_is_refused_and_sends_no_ready(
    start_stack: StartStack, short_tmp: Path
) -> None:
    stack = await start_stack()
    fleet = stack.fleet
    document = merge(pair_document(stack), {"recovery": {"shutdown_grace_s": 30.0}})
    path = short_tmp / "narwhal.json"
    write(path, document)
    fleet[1].set_faults(stall_after_tokens=2, leg="decode")  # holds the drain open
    async with systemd(short_tmp) as notifier, trio.open_nursery() as nursery:
        supervisor: Supervisor = await nursery.start(
            Supervisor(load_config(document), config_path=str(path), notifier=notifier).run
        )
        async with open_sse(supervisor.url, "/v1/completions", BODY) as reader:
            assert await reader.event() is not None
            supervisor.request_shutdown()
            await wait_for(lambda: supervisor.stopping)
            # Say a SIGHUP that waited behind startup, with engines added meanwhile.
            write(path, merge(document, {"serving": {"max_connections": 7}}))
            result = await supervisor.reload(trigger="SIGHUP")
            assert not result.applied
            assert result.errors == ("narwhal is shutting down; the configuration is not re-read",)
            assert supervisor.ctx is not None
            assert supervisor.ctx.config.serving.max_connections == 512
            supervisor.request_shutdown()  # skip the rest of the grace
            await read_all(reader)
    sent = [message.split("\n")[0] for message in notifier.sent]
    # It used to be READY, STOPPING, RELOADING, READY: "up again" while stopping.
    assert sent == ["READY=1", "STOPPING=1"]


async def test_shutdown_does_not_wait_for_a_reload_stuck_reading_a_file(
    start_stack: StartStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read that does not return (a file of a stalled network filesystem: read_file
    # gives up on it in time, but its thread stays until the filesystem answers). The
    # cancelled reload waited for its thread, and the daemon did not stop.
    stack = await start_stack()
    document = pair_document(stack)
    path = tmp_path / "narwhal.json"
    write(path, document)
    reading = threading.Event()
    release = threading.Event()

    def stuck(config_path: str) -> Config:
        reading.set()
        release.wait()
        return load_config(document)

    monkeypatch.setattr(_supervisor, "load_config_file", stuck)
    # Without the fix nothing else would end the wait, and the test with it.
    watchdog = threading.Timer(30, release.set)
    watchdog.start()
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                supervisor: Supervisor = await nursery.start(
                    Supervisor(load_config(document), config_path=str(path)).run
                )
                # As `narwhal serve` runs a SIGHUP's reload, and cancels it once stopped.
                async with trio.open_nursery() as signals:
                    signals.start_soon(supervisor.reload, "SIGHUP")
                    await trio.to_thread.run_sync(reading.wait)
                    supervisor.request_shutdown()
                    signals.cancel_scope.cancel()
        assert not release.is_set()
    finally:
        release.set()
        watchdog.cancel()


async def test_a_rejected_reload_shows_in_the_systemd_status_until_one_applies(
    start_stack: StartStack, short_tmp: Path
) -> None:
    # A SIGHUP reports nothing back to whoever sent it, so `systemctl status` must say
    # when a reload was rejected.
    stack = await start_stack()
    document = pair_document(stack)
    path = short_tmp / "narwhal.json"
    write(path, document)

    async with systemd(short_tmp) as notifier, trio.open_nursery() as nursery:

        def status() -> str:
            return notifier.sent[-1].split("\n")[-1]

        supervisor: Supervisor = await nursery.start(
            Supervisor(load_config(document), config_path=str(path), notifier=notifier).run
        )
        write(path, merge(document, {"serving": {"max_attempts": 9, "retry_budget": -1}}))
        assert not (await supervisor.reload(trigger="SIGHUP")).applied
        assert status().endswith("; last reload rejected (2 problem(s), see the journal)")
        write(path, document)
        assert (await supervisor.reload(trigger="SIGHUP")).applied
        assert status().startswith("STATUS=listening on ")
        assert "rejected" not in status()
        supervisor.request_shutdown()


async def test_a_reload_of_the_client_stall_limit_applies_to_the_http_server(
    start_stack: StartStack, tmp_path: Path
) -> None:
    """serving.client_stall_s bounds each blocked write to a client (manual 4.3). The
    HTTP server read it once at start, so a reload that lowered it said it was applied
    while a client that stopped reading still held its stream for the old limit."""
    stack = await start_stack(speed=1000.0, sim={"timing": None, "lease_s": 30_000.0})
    base = merge(pair_document(stack), {"serving": {"client_stall_s": 60.0}})
    path = tmp_path / "narwhal.json"
    write(path, merge(base, {"serving": {"client_stall_s": 0.2}}))
    async with trio.open_nursery() as nursery:
        supervisor: Supervisor = await nursery.start(
            Supervisor(load_config(base), config_path=str(path)).run
        )
        ctx = supervisor.ctx
        assert ctx is not None
        result = await supervisor.reload()
        assert result.applied
        assert result.plan is not None
        assert not result.plan.restart_required
        # A client that asks for a long stream and reads none of it, with a small window.
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
        host, port = supervisor.url.removeprefix("http://").rsplit(":", 1)
        await sock.connect((host, int(port)))
        body = json.dumps({**BODY, "prompt": "a", "max_tokens": 8000}).encode()
        await sock.send(
            b"POST /v1/completions HTTP/1.1\r\nhost: narwhal\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        # Well inside the old 60 s limit.
        await wait_for(lambda: ctx.outcomes["client_disconnected"] == 1, within_s=10.0)
        sock.close()
        supervisor.request_shutdown()


async def test_a_reload_keeps_the_decode_corrections_of_the_engines_it_left_alone(
    tmp_path: Path,
) -> None:
    # Every reload re-reads the profiles, and each engine's learnt decode correction
    # started again from 1.0: a reload that only rotated a key reset TPOT pricing.
    urls = {"p0": "http://127.0.0.1:1", "d0": "http://127.0.0.1:2", "d1": "http://127.0.0.1:3"}
    store = tmp_path / "profiles.json"
    save_profiles(store_for(urls), store)
    document = merge(
        config_document(
            urls,
            profiles=str(store),
            listen={"host": "127.0.0.1", "port": 0},
            admin={"host": "127.0.0.1", "port": 0},
        ),
        FAST,
    )
    path = tmp_path / "narwhal.json"
    write(path, document)
    async with trio.open_nursery() as nursery:
        supervisor: Supervisor = await nursery.start(
            Supervisor(load_config(document), config_path=str(path)).run
        )
        assert supervisor.ctx is not None
        before = supervisor.ctx.profiles
        assert isinstance(before, FleetProfiles)
        for engine_id in ("d0", "d1"):
            before.observe_decode(engine_id, 0.03, 20, 0.02)
        learnt = before.decode_correction("d0")
        assert learnt > 1.0
        # d1 moves to another server; the rest of the change applies in place.
        moved = merge(document, {"serving": {"max_connections": 64}})
        moved["engines"][2]["url"] = "http://127.0.0.1:4"
        write(path, moved)
        assert (await supervisor.reload(trigger="SIGHUP")).applied
        after = supervisor.ctx.profiles
        assert isinstance(after, FleetProfiles)
        assert after is not before
        assert after.decode_correction("d0") == learnt
        assert after.decode_correction("d1") == 1.0  # another engine now
        supervisor.request_shutdown()


async def test_start_and_reload_fit_the_open_file_limit_to_the_connection_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal")
    document = merge(
        {
            "engines": [
                {"id": "p0", "url": "http://127.0.0.1:1", "role": "prefill", "model": MODEL},
                {"id": "d0", "url": "http://127.0.0.1:2", "role": "decode", "model": MODEL},
            ],
            "listen": {"host": "127.0.0.1", "port": 0, "max_open_connections": 600},
            "admin": {"host": "127.0.0.1", "port": 0},
            "serving": {"admission": "open", "max_connections": 16},
        },
        FAST,
    )
    reserve = 2 * (16 + 4) + 200  # two engines' serving and control pools, and the rest
    path = tmp_path / "narwhal.json"
    write(path, document)
    files = FakeFileLimit(soft=256, hard=2000)
    async with trio.open_nursery() as nursery:
        supervisor: Supervisor = await nursery.start(
            Supervisor(load_config(document), config_path=str(path), open_files=files.limit()).run
        )
        ctx = supervisor.ctx
        assert ctx is not None
        assert files.set_to == [(600 + reserve, 2000)]
        assert (ctx.connections.limit, ctx.connections.configured_limit) == (600, 600)

        # More than the hard limit has room for: served with what it leaves.
        write(path, merge(document, {"listen": {"max_open_connections": 1900}}))
        assert (await supervisor.reload()).applied
        assert files.set_to[-1] == (2000, 2000)
        assert (ctx.connections.limit, ctx.connections.configured_limit) == (2000 - reserve, 1900)
        section = state_document(ctx)["connections"]
        assert isinstance(section, dict)
        assert (section["limit"], section["configured_limit"]) == (1760, 1900)
        assert section["open_files"] == {
            "soft": 2000,
            "hard": 2000,
            "needed": 1900 + reserve,
            "reserve": reserve,
            "raised_from": 600 + reserve,
            "note": None,
        }
        metrics = ctx.metrics.render().decode()
        assert "narwhal_client_connection_limit 1760.0" in metrics
        assert "narwhal_client_connection_limit_configured 1900.0" in metrics

        # Too little left for the retained requests' connections: rejected, as a
        # configuration the loader refuses would be; nothing changes.
        write(
            path,
            merge(
                document,
                {"listen": {"max_open_connections": 1900}, "serving": {"max_connections": 800}},
            ),
        )
        result = await supervisor.reload()
        assert not result.applied
        assert result.errors == (
            "the hard open-file limit (RLIMIT_NOFILE) is 2000: with 1808 descriptors for "
            "engine pools, sockets and files, it leaves room for 192 client connections, "
            "which must exceed serving.max_connections + serving.queue_capacity = 800; "
            "listen.max_open_connections=1900 needs 3708 in all: raise the hard limit "
            "(LimitNOFILE= in the unit, ulimit -Hn) to at least that",
        )
        assert ctx.config.serving.max_connections == 16
        assert (ctx.connections.limit, files.set_to[-1]) == (1760, (2000, 2000))
        supervisor.request_shutdown()
    assert [
        (r.levelname, getattr(r, "outcome", None))
        for r in caplog.records
        if getattr(r, "event", None) == "open_file_limit"
    ] == [("INFO", "raised"), ("INFO", "raised"), ("WARNING", "capped")]
