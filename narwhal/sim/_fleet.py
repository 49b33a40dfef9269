"""A fleet of simulated engines in one trio process, and the handles tests use."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import trio

from ._engine import SimEngine
from ._events import KvEventsConfig
from ._faults import FaultSpec, parse_faults
from ._spec import Dialect, DisaggregationMode, SimEngineSpec
from ._timing import SimTiming


class EngineHandle:
    """One engine of a fleet. Survives restarts: `engine` is the current instance."""

    def __init__(self, fleet: Fleet, index: int, engine: SimEngine) -> None:
        self._fleet = fleet
        self.index = index
        self.engine = engine
        self._restart_lock = trio.Lock()

    def __repr__(self) -> str:
        e = self.engine
        return (
            f"<EngineHandle {self.index} {self.url} {e.spec.dialect} "
            f"{'up' if e.up else 'down'} gen={e.generation}>"
        )

    @property
    def url(self) -> str:
        return self.engine.url

    @property
    def port(self) -> int:
        return self.engine.port

    @property
    def host(self) -> str:
        return self.engine.advertised_host

    @property
    def instance_id(self) -> str:
        return self.engine.instance_id

    def set_faults(self, spec: FaultSpec | dict[str, Any] | None = None, **fields: Any) -> None:
        """Replace the engine's faults: a FaultSpec, a dict, or keyword fields (see _faults)."""
        if isinstance(spec, FaultSpec):
            if fields:
                spec = attrs.evolve(spec, **fields)
        else:
            spec = parse_faults({**(spec or {}), **fields})
        self.engine.set_faults(spec)

    def set_api_key(self, api_key: str | None) -> None:
        """Restart-free key change (an engine relaunched with another --api-key, without
        the wait); it lasts across `restart()`."""
        self._fleet.api_keys[self.index] = api_key
        self.engine.api_key = api_key

    def set_model(self, model: str) -> None:
        """Serve under another name (an engine relaunched with another
        --served-model-name, without the wait); `restart()` brings back the fleet's."""
        self.engine.spec = attrs.evolve(self.engine.spec, model=model)

    def clear_faults(self) -> None:
        self.engine.set_faults(None)

    def state(self, *, outcomes: int | None = None) -> dict[str, Any]:
        """The same document as GET /_sim/state."""
        return self.engine.state(outcomes=outcomes)

    async def go_down(self) -> None:
        """Close the listener and drop open connections (new connections are refused)."""
        await self.engine.go_down()

    async def come_up(self) -> None:
        await self.engine.come_up()

    async def restart(self) -> None:
        """Down, drop everything in flight and all KV, new instance id, up on the same port."""
        async with self._restart_lock:
            await self._fleet._restart(self)


class Fleet:
    """The engines served by `serve_fleet`; index it or iterate it."""

    def __init__(
        self,
        spec: SimEngineSpec,
        host: str,
        modes: Sequence[DisaggregationMode] | None = None,
        kv_connectors: Sequence[bool] | None = None,
    ) -> None:
        self.spec = spec
        self.host = host
        self.modes = tuple(modes) if modes is not None else None
        self.kv_connectors = tuple(kv_connectors) if kv_connectors is not None else None
        self.engines: list[EngineHandle] = []
        # Per-engine keys set by EngineHandle.set_api_key, over the spec's.
        self.api_keys: dict[int, str | None] = {}
        # Each engine's KV event endpoints as first bound: a restart binds them again.
        self.kv_events: dict[int, KvEventsConfig] = {}
        self._nursery: trio.Nursery | None = None
        self._scopes: dict[int, trio.CancelScope] = {}
        self._stopped: dict[int, trio.Event] = {}

    def __len__(self) -> int:
        return len(self.engines)

    def __getitem__(self, index: int) -> EngineHandle:
        return self.engines[index]

    def __iter__(self) -> Iterator[EngineHandle]:
        return iter(self.engines)

    @property
    def urls(self) -> list[str]:
        return [h.url for h in self.engines]

    def _new_engine(self, index: int, port: int, generation: int) -> SimEngine:
        spec = attrs.evolve(self.spec, seed=self.spec.seed + index)
        if self.modes is not None:
            # A restart relaunches the engine in the same mode, as a supervisor would.
            spec = attrs.evolve(spec, disaggregation_mode=self.modes[index])
        if self.kv_connectors is not None:
            spec = attrs.evolve(spec, kv_connector=self.kv_connectors[index])
        if index in self.api_keys:
            spec = attrs.evolve(spec, api_key=self.api_keys[index])
        if spec.kv_events is not None:
            spec = attrs.evolve(
                spec, kv_events=self.kv_events.get(index, spec.kv_events.for_engine(index))
            )
        return SimEngine(
            spec,
            index=index,
            host=self.host,
            port=port,
            generation=generation,
            on_restart=lambda: self._request_restart(index),
        )

    async def _run_engine(
        self, engine: SimEngine, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        stopped = self._stopped[engine.index] = trio.Event()
        try:
            with trio.CancelScope() as scope:
                self._scopes[engine.index] = scope
                await engine.run(task_status=task_status)
        finally:
            stopped.set()

    async def _start(self, engine: SimEngine) -> None:
        assert self._nursery is not None
        await self._nursery.start(self._run_engine, engine)

    async def _restart(self, handle: EngineHandle) -> None:
        old = handle.engine
        publisher = old.publisher
        if publisher is not None:
            # A port 0 was resolved when bound: the new instance takes the same one.
            self.kv_events[handle.index] = attrs.evolve(
                publisher.config,
                endpoint=publisher.endpoint,
                replay_endpoint=publisher.replay_endpoint,
            )
        await old.go_down()
        self._scopes[handle.index].cancel()
        await self._stopped[handle.index].wait()
        new = self._new_engine(handle.index, old.port, old.generation + 1)
        handle.engine = new
        await self._start(new)

    def _request_restart(self, index: int) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self.engines[index].restart)


async def serve_fleet(
    *,
    engines: int,
    host: str = "127.0.0.1",
    port: int = 0,
    spec: SimEngineSpec | None = None,
    dialect: Dialect | None = None,
    speed: float | None = None,
    lease_s: float | None = None,
    model: str | None = None,
    seed: int | None = None,
    build: str | None = None,
    vllm_version: str | None = None,
    max_num_queued: int | None = None,
    timing: SimTiming | None = None,
    disaggregation_modes: Sequence[DisaggregationMode] | None = None,
    kv_connectors: Sequence[bool] | None = None,
    api_key: str | None = None,
    task_status: trio.TaskStatus[Fleet] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `engines` simulated engines until cancelled; `started()` gives the Fleet.

    ``port=0`` gives every engine its own free port below the kernel's ephemeral range
    (safe for parallel tests, and free to bind again after a simulated restart); a base
    port gives consecutive ports. Keyword options override fields of ``spec``; engine i runs
    with seed ``seed + i`` so their noise differs. ``disaggregation_modes`` gives each
    SGLang engine its launch mode (one per engine); without it every engine has the
    spec's ``disaggregation_mode``. ``kv_connectors`` says, one per engine, which vLLM
    engines have a KV connector (an aggregate-only engine has none); without it every
    engine has the spec's ``kv_connector`` (default: one).
    """
    if engines < 1:
        raise ValueError(f"engines is {engines}; must be >= 1")
    if disaggregation_modes is not None and len(disaggregation_modes) != engines:
        raise ValueError(
            f"{len(disaggregation_modes)} disaggregation modes for {engines} engines; "
            "give one per engine"
        )
    if kv_connectors is not None and len(kv_connectors) != engines:
        raise ValueError(
            f"{len(kv_connectors)} kv_connectors for {engines} engines; give one per engine"
        )
    base = spec or SimEngineSpec()
    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "dialect": dialect,
            "speed": speed,
            "lease_s": lease_s,
            "model": model,
            "seed": seed,
            "build": build,
            "vllm_version": vllm_version,
            "max_num_queued": max_num_queued,
            "timing": timing,
            "api_key": api_key,
        }.items()
        if v is not None
    }
    shared = attrs.evolve(base, **overrides)
    for mode in disaggregation_modes or ():
        # Raises here, not in the nursery, when a mode does not suit the dialect.
        attrs.evolve(shared, disaggregation_mode=mode)
    fleet = Fleet(shared, host, disaggregation_modes, kv_connectors)
    async with trio.open_nursery() as nursery:
        fleet._nursery = nursery
        for i in range(engines):
            engine = fleet._new_engine(i, port + i if port else 0, 0)
            fleet.engines.append(EngineHandle(fleet, i, engine))
            await fleet._start(engine)
        task_status.started(fleet)
        # Keep the nursery open while an engine is between instances (restart).
        await trio.sleep_forever()
