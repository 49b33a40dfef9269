"""The flood client of the memory benchmark, run as its own process by memory.py.

    .venv/bin/python tools/bench/memory_flood.py '<spec JSON>'   # prints one JSON line

`concurrency` workers share `requests` non-streaming completions and send the next one as
soon as their previous one is answered, each on its own keep-alive connection (reopened
when the router closes it), so the router sees as many open sockets as workers and an
offered rate bounded only by how fast it answers. Refusals come back at once and the
worker moves on: that is how a flood much faster than the fleet looks. Raw h11 on trio
sockets (`h11load.exchange`), so the client stays cheap.

Spec: {"url", "requests", "concurrency", "prompt_tokens", "max_tokens", "model",
"request_timeout_s", "deadline_s"}. Result: outcome counts ("ok", "<status> <error code>",
"timeout", "broken", "connect_error"), answer latency per outcome class, wall time, CPU.
"""

from __future__ import annotations

import json
import resource
import sys
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import h11load
import trio
from benchkit import Json, summarize

_CODE_LIMIT = 64


def outcome_of(status: int, body: bytes) -> str:
    """ "ok" for 200, else the status and the error envelope's code ("429 queue_full")."""
    if status == 200:
        return "ok"
    code = "unparsed"
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("error"), dict):
        code = str(document["error"].get("code") or "none")[:_CODE_LIMIT]
    return f"{status} {code}"


class Flood:
    def __init__(self, spec: dict[str, Any]) -> None:
        parts = urlsplit(spec["url"])
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.total = int(spec["requests"])
        self.concurrency = int(spec["concurrency"])
        self.timeout_s = float(spec["request_timeout_s"])
        self.deadline_s = float(spec["deadline_s"])
        ids = ",".join(["791"] * int(spec["prompt_tokens"]))
        self.body = (
            f'{{"model":{json.dumps(spec["model"])},"prompt":[{ids}],'
            f'"max_tokens":{int(spec["max_tokens"])},"stream":false}}'
        ).encode()
        self.issued = 0
        self.outcomes: Counter[str] = Counter()
        self.latency: dict[str, list[float]] = {}
        self.connections = 0

    def _done(self, outcome: str, seconds: float, *, connecting: bool = False) -> None:
        self.outcomes[outcome] += 1
        kind = outcome if outcome == "ok" else outcome.split(" ", 1)[0]
        # A connection's first request includes its connect and the router's accept: kept
        # apart, so a slow accept does not pass for a slow answer.
        if connecting:
            kind += " (with connect)"
        self.latency.setdefault(kind, []).append(seconds)

    async def worker(self) -> None:
        conn: h11load._Conn | None = None
        while self.issued < self.total:
            self.issued += 1
            started = trio.current_time()
            connecting = conn is None
            try:
                if conn is None:
                    conn = await h11load._connect(self.host, self.port)
                    self.connections += 1
                with trio.move_on_after(self.timeout_s) as timer:
                    result = await h11load.exchange(
                        conn, b"/v1/completions", self.body, stream=False
                    )
            except OSError:
                self._done("connect_error", trio.current_time() - started)
                conn = None
                continue
            except h11load._Broken:
                self._done("broken", trio.current_time() - started)
                if conn is not None:
                    conn.stream.socket.close()
                conn = None
                continue
            if timer.cancelled_caught:
                self._done("timeout", trio.current_time() - started)
                conn.stream.socket.close()
                conn = None
                continue
            self._done(
                outcome_of(result.status, bytes(result.body)),
                trio.current_time() - started,
                connecting=connecting,
            )
        if conn is not None:
            conn.stream.socket.close()

    async def run(self) -> dict[str, Json]:
        started = trio.current_time()
        with trio.move_on_after(self.deadline_s) as limit:
            async with trio.open_nursery() as nursery:
                for _ in range(self.concurrency):
                    nursery.start_soon(self.worker)
        wall = trio.current_time() - started
        usage = resource.getrusage(resource.RUSAGE_SELF)
        answered = sum(self.outcomes.values())
        return {
            "requests": self.total,
            "answered": answered,
            "unanswered_at_deadline": self.total - answered if limit.cancelled_caught else 0,
            "hit_deadline": limit.cancelled_caught,
            "wall_s": round(wall, 2),
            "offered_per_s": round(answered / wall, 1) if wall > 0 else None,
            "connections_opened": self.connections,
            "outcomes": dict(sorted(self.outcomes.items())),
            "latency_s": {k: summarize(v, digits=4) for k, v in sorted(self.latency.items())},
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        }


def main() -> None:
    spec = json.loads(sys.argv[1])
    print(json.dumps(trio.run(Flood(spec).run)), flush=True)


if __name__ == "__main__":
    main()
