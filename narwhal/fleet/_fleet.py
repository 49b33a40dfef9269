"""The engines in config order, and the one watcher of their availability.

Owns
  `Fleet`: lookups by id, the engines a reload retired until their work is done.

Invariants
  An engine id is in the fleet once. A retired engine is marked removed, leaves
  placement at once and waits in `retiring` until its resident requests are done.

Errors
  ValueError from `add` (an id twice) and `watch` (a second watcher).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import trio

from ..config import Config
from ..engines import Connect
from ._engine import EngineState, EngineView
from ._share import Share


class Fleet:
    """The engines in config order; lookups by id.

    A reload adds engines with `add` and takes them out with `retire`: a retired engine
    is marked `removed`, leaves placement at once and waits in `retiring` until its
    resident requests are done and its pools are closed (`forget`).
    """

    def __init__(self, config: Config, *, connect: Connect = trio.open_tcp_stream) -> None:
        # How every engine's pools open connections, those a reload adds included: TCP,
        # or a test's memory-stream network.
        self.connect = connect
        self._engines: dict[str, EngineState] = {}
        self.retiring: list[EngineState] = []
        self._watcher: Callable[[EngineState], None] | None = None
        # This replica's part of the engines' phase limits (`apply_share`).
        self.share = Share()
        for spec in config.engines:
            self.add(EngineState(spec, config, connect=connect))

    def watch(self, watcher: Callable[[EngineState], None]) -> None:
        """Call `watcher(engine)` whenever an engine of the fleet (a retiring one
        included) changes role or is drained, undrained, removed, or found refusing
        Narwhal's API key or not serving its configured model, at once and synchronously,
        whoever made the change.

        Recovery's readmission shortcuts start when an engine becomes the last to take
        its role's work (`Recovery.placement_changed`); those changes are made by
        narwhalctl, a reload, the role controller and the request path, so the fleet,
        which every one of them goes through, reports them. There is one watcher."""
        if self._watcher is not None:
            raise ValueError("the fleet has a watcher already")
        self._watcher = watcher

    def _changed(self, engine: EngineState) -> None:
        if self._watcher is not None:
            self._watcher(engine)

    def __iter__(self) -> Iterator[EngineState]:
        return iter(self._engines.values())

    def __len__(self) -> int:
        return len(self._engines)

    def get(self, engine_id: str) -> EngineState | None:
        return self._engines.get(engine_id)

    def views(self, now: float) -> tuple[EngineView, ...]:
        return tuple(engine.view(now) for engine in self._engines.values())

    def add(self, engine: EngineState) -> None:
        if engine.id in self._engines:
            raise ValueError(f"engine {engine.id!r} is already in the fleet")
        self._engines[engine.id] = engine
        engine._on_change = self._changed

    def retire(self, engine_id: str) -> EngineState | None:
        engine = self._engines.pop(engine_id, None)
        if engine is not None:
            engine.reload_remove()
            self.retiring.append(engine)
        return engine

    def forget(self, engine: EngineState) -> None:
        self.retiring = [e for e in self.retiring if e is not engine]
        engine._on_change = None

    def reorder(self, engine_ids: list[str]) -> None:
        """Config order after a reload (placement breaks ties by id, state lists in order)."""
        order = {engine_id: i for i, engine_id in enumerate(engine_ids)}
        self._engines = dict(
            sorted(self._engines.items(), key=lambda item: order.get(item[0], len(order)))
        )

    def apply_share(self, config: Config, share: Share | None = None) -> None:
        """Give every engine this replica's part of its phase limits (`share`, else the
        one last given): after a membership change, and after a reload added or
        reordered engines (the split spreads remainders by config order)."""
        if share is not None:
            self.share = share
        for offset, engine in enumerate(self._engines.values()):
            engine.cluster_share(self.share, offset, config)

    async def aclose(self) -> None:
        for engine in [*self._engines.values(), *self.retiring]:
            await engine.aclose()
