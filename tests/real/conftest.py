"""The real-engine tier: Narwhal against real vLLM engines (see `engines.py`).

Every test under tests/real is marked `real`; `bash tools/test.sh --no-real` deselects them
for a quick local run, CI always runs them. The engines are started once per session, after
the rest of the suite has run (the root conftest orders real tests last), and reaped at the
end. When a test fails, its report gets a section per engine with what that engine logged
during the test (and the log's path); when the engines cannot be installed or started,
every test of the tier errors with the reason, never skips.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Generator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import trio

from narwhal.config import Config, load_config
from narwhal.supervisor import Supervisor

from ..support import FakeFileLimit, InFront
from .engines import MODEL_NAME, Engine, RealFleet, real_fleet

MODEL = MODEL_NAME
# Where each engine's log stood when the running test took the fleet (name -> byte offset).
LOG_OFFSETS = pytest.StashKey[dict[str, int]]()
FLEET = pytest.StashKey[RealFleet]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.real)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    offsets = item.stash.get(LOG_OFFSETS, None)
    if report.passed or offsets is None:
        return report
    fleet = item.stash[FLEET]
    for name, offset in offsets.items():
        engine = fleet[name]
        report.sections.append(
            (f"engine {name} ({engine.url}) log {engine.log}", engine.log_since(offset))
        )
    return report


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    """Two aggregate vLLM engines and one NixlConnector P/D pair, up for the session
    (their logs stay in the session's temporary folder)."""
    with real_fleet(tmp_path_factory.mktemp("vllm-fleet")) as fleet:
        yield fleet


@pytest.fixture
def vllm(request: pytest.FixtureRequest, vllm_fleet: RealFleet) -> RealFleet:
    """The session's fleet, every engine healthy: one a test before left dead (killed,
    then failed before relaunching it) is relaunched first."""
    relaunched = vllm_fleet.heal()
    if relaunched:
        print(f"relaunched engine(s) {relaunched} that an earlier test left dead")
    request.node.stash[FLEET] = vllm_fleet
    request.node.stash[LOG_OFFSETS] = {
        name: engine.log_size() for name, engine in vllm_fleet.engines.items()
    }
    return vllm_fleet


def engine_entry(engine: Engine, role: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": engine.name,
        "url": engine.url,
        "role": role,
        "model": MODEL,
        "dialect": "vllm",
        **extra,
    }


WORKERS_ENV = "NARWHAL_REAL_WORKERS"


def real_config(entries: list[dict[str, Any]], **sections: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "engines": entries,
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        # NARWHAL_REAL_WORKERS: the tier run with serving.workers at that value.
        "serving": {"admission": "open", "workers": int(os.environ.get(WORKERS_ENV, "1"))},
        "controller": {"enabled": False},
        # CPU engines on a two-core box shared with the test process: a first token or a
        # probe answer can take seconds (a NIXL transfer starved of CPU took 40 s once,
        # and in CI the whole box once stood still for 33 s under a pair's first token,
        # which then missed 60 s; a stall of 54 s once outlasted a loopback connect's
        # 10 s). The tier asserts behaviour, not latency, and a leg cut at the default
        # 2.5 s would count against a healthy engine; tests of a timer set their own.
        # Below the clients' 120 s, so a stall still ends in Narwhal's answer.
        "engine": {
            "first_token_timeout_s": 90.0,
            "health_timeout_s": 20.0,
            "connect_timeout_s": 60.0,
        },
    }
    for key, value in sections.items():
        document[key] = {**document.get(key, {}), **value}
    return document


def aggregate_config(fleet: RealFleet, **sections: Any) -> dict[str, Any]:
    sections.setdefault("profiles", {"path": str(fleet.directory / "no-profiles.json")})
    return real_config([engine_entry(e, "both") for e in fleet.aggregate], **sections)


def pair_config(fleet: RealFleet, **sections: Any) -> dict[str, Any]:
    prefill, decode = fleet.pair
    # Not the repository's runs/profiles.json, which profiles the simulated demo fleet.
    sections.setdefault("profiles", {"path": str(fleet.directory / "no-profiles.json")})
    return real_config(
        [engine_entry(prefill, "prefill"), engine_entry(decode, "decode")], **sections
    )


@attrs.define
class RealStack(InFront):
    supervisor: Supervisor
    config: Config
    # A CPU engine's probe can hold the router's loop a moment on a busy two-core box.
    state_timeout_s: ClassVar[float] = 10.0


@asynccontextmanager
async def narwhal_in_front(
    document: dict[str, Any], profiles: Any = None
) -> AsyncIterator[RealStack]:
    """An in-process Narwhal serving `document`'s engines, cancelled on exit."""
    config = load_config(document)
    async with trio.open_nursery() as nursery:
        supervisor: Supervisor = await nursery.start(
            Supervisor(config, profiles=profiles, open_files=FakeFileLimit().limit()).run
        )
        try:
            yield RealStack(supervisor, config)
        finally:
            nursery.cancel_scope.cancel()


class RequestLog:
    """Narwhal's `request` log lines (one per finished request), as their fields: the
    daemon's own records and, with worker processes (NARWHAL_REAL_WORKERS), the JSON
    lines the workers write to the stderr they share with it."""

    def __init__(self, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]):
        self._caplog = caplog
        self._capfd = capfd
        self._from_workers: list[dict[str, Any]] = []
        caplog.set_level(logging.INFO, logger="narwhal.request")

    def lines(self) -> list[dict[str, Any]]:
        """Every request line so far, in the order each process wrote them."""
        _, err = self._capfd.readouterr()
        for text in err.splitlines():
            if text.startswith("{") and '"event": "request"' in text:
                self._from_workers.append(json.loads(text))
        own = [
            dict(record.__dict__)
            for record in self._caplog.records
            if getattr(record, "event", None) == "request"
        ]
        return own + self._from_workers


@pytest.fixture
def request_log(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> RequestLog:
    return RequestLog(caplog, capfd)
