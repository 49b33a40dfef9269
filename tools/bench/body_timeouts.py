"""The event loop when hundreds of body timeouts fire at once (issue 29, item 4).

    .venv/bin/python tools/bench/body_timeouts.py              # 512 and 2,048 POSTs, 3 runs each
    .venv/bin/python tools/bench/body_timeouts.py --slow 2048 --repeat 1 --out /tmp/x.json

A slowloris holds a retained request per slow POST until serving.body_timeout_s, and
POSTs that arrived together time out together: Narwhal then answers every one of them
408 and closes it, in one burst of work on its one event loop, and every other client
waits meanwhile. This measures that wait from outside.

Each run, everything on loopback: 2 simulated engines and Narwhal (its own process,
serving.max_connections = the number of slow POSTs, `log.level` info as in production,
its log going to a file), then:

- the storm (this script with --storm, its own process) connects `--slow` times from
  `--addresses` loopback source addresses (127.0.1.x, few enough per address that no
  per-client limit refuses them) and sends the first line of a POST on each; once all
  are connected it sends the rest of every head at once, announcing a 1,000-byte body,
  and 10 bytes of it, so the body deadlines fall within a few ms of each other. Each
  then trickles a byte a second, each at its own random phase, and records when its
  408 arrives (`--reconnect`: and opens one more slow POST then, as an attacker would);
- the probe (this script with --probe, its own process, so that the storm's own burst
  of 408s does not delay it) sends GET /health on one keep-alive connection every
  `--probe-every-ms` from before the deadline to after it, and records each latency.

Reported per run: the probe's latency before the deadline (the baseline) and from just
before the deadline to the last 408 (p50, p99, max), the longest gap between two probe
answers in that window (the stall another client sees), when the first and the last
408 arrived after the deadline, Narwhal's CPU and its loop lag histogram
(narwhal_event_loop_lag_seconds); per size, the medians over `--repeat` runs. Writes
runs/bench/body_timeouts.json (or --out; `--label` says what code ran); logs go to
runs/tmp/body_timeouts/<timestamp>/ (git-ignored). To measure older code, run this
script from a checkout of it (the router is started from the script's repository).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import benchkit
import httpx
import trio
from benchkit import Json, harness

OUT = benchkit.RUNS / "body_timeouts.json"
_DECLARED = 1000
_SENT = 10


# ------------------------------------------------------------------------- the storm


class _Storm:
    """The slow POSTs: each connects and sends the first line of its head; once all are
    connected (`go`), each sends the rest of its head and 10 bytes of its body at once,
    so their body deadlines fall within a few ms of each other."""

    def __init__(self, spec: Json) -> None:
        self.host = spec["host"]
        self.port = spec["port"]
        self.slow = spec["slow"]
        self.reconnect = spec["reconnect"]
        self.connected = 0
        self.all_connected = trio.Event()
        self.go = trio.Event()
        self.records: list[Json] = []
        self.phases = random.Random(spec["seed"])

    async def connect(self, source: str) -> trio.SocketStream:
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        await sock.bind((source, 0))
        await sock.connect((self.host, self.port))
        return trio.SocketStream(sock)

    async def slow_post(self, source: str) -> None:
        stream = await self.connect(source)
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\n")
        self.connected += 1
        if self.connected == self.slow:
            self.all_connected.set()
        await self.go.wait()
        for round_ in range(2 if self.reconnect else 1):
            if round_:
                stream = await self.connect(source)
                await stream.send_all(b"POST /v1/completions HTTP/1.1\r\n")
            await self._hold(stream, source, round_)

    async def _hold(self, stream: trio.SocketStream, source: str, round_: int) -> None:
        rest = (
            f"host: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
            f"content-length: {_DECLARED}\r\n\r\n"
        ).encode() + b" " * _SENT
        record: Json = {"source": source, "round": round_, "sent": time.time()}
        record.update(status=None, answered=None)
        self.records.append(record)
        reply = b""
        async with stream, trio.open_nursery() as nursery:

            async def trickle() -> None:
                try:
                    await stream.send_all(rest)
                    # Each at its own phase, as the connections of a real slowloris
                    # are: bytes arriving together are another burst, not this one.
                    await trio.sleep(self.phases.random())
                    for _ in range(_DECLARED - _SENT - 1):
                        await stream.send_all(b" ")
                        await trio.sleep(1.0)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            nursery.start_soon(trickle)
            try:
                while b"\r\n" not in reply:
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    reply += data
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            record["answered"] = time.time()
            if reply.startswith(b"HTTP/1.1 "):
                record["status"] = int(reply[9:12])
            nursery.cancel_scope.cancel()


async def storm(spec: Json) -> None:
    sources = [f"127.0.1.{1 + i}" for i in range(spec["addresses"])]
    run = _Storm(spec)
    async with trio.open_nursery() as nursery:
        for i in range(spec["slow"]):
            nursery.start_soon(run.slow_post, sources[i % len(sources)])
            if i % 32 == 31:
                await trio.lowlevel.checkpoint()
        with trio.fail_after(30):
            await run.all_connected.wait()
        run.go.set()
        with trio.fail_after(30):
            while len(run.records) < spec["slow"]:  # noqa: ASYNC110 - this process's own tasks
                await trio.sleep(0.001)
        print(json.dumps({"sent": max(r["sent"] for r in run.records)}), flush=True)
    print(json.dumps({"records": run.records}), flush=True)


# ------------------------------------------------------------------------- the probe


async def probe(spec: Json) -> None:
    host, port = spec["host"], spec["port"]
    every = spec["every_ms"] / 1000
    stop = spec["until"]
    samples: list[tuple[float, float]] = []
    request = f"GET /health HTTP/1.1\r\nhost: {host}:{port}\r\n\r\n".encode()
    stream: trio.SocketStream | None = None
    while time.time() < stop:
        if stream is None:
            stream = await trio.open_tcp_stream(host, port)
        sent = time.perf_counter()
        at = time.time()
        try:
            await stream.send_all(request)
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
                data = await stream.receive_some(65536)
                if not data:
                    raise trio.BrokenResourceError
                reply += data
        except trio.BrokenResourceError:
            stream = None
            continue
        samples.append((at, time.perf_counter() - sent))
        await trio.sleep(every)
    print(json.dumps({"samples": samples}), flush=True)


# ------------------------------------------------------------------------- the driver


def _stats(values: Sequence[float]) -> Json:
    summary = benchkit.summarize(values, scale=1000.0, digits=2, with_max=True)
    if not values:
        return summary
    return {"n": summary["n"], **{f"{k}_ms": summary[k] for k in ("p50", "p99", "max")}}


def _lag_histogram(metrics: str) -> Json:
    buckets = {}
    for line in metrics.splitlines():
        if line.startswith("narwhal_event_loop_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[le] = int(float(line.rsplit(" ", 1)[1]))
    return buckets


async def one_run(args: argparse.Namespace, slow: int) -> Json:
    run_dir = benchkit.TMP / "body_timeouts" / time.strftime("%Y%m%d-%H%M%S")
    await trio.Path(run_dir).mkdir(parents=True, exist_ok=True)
    async with harness.Procs(run_dir, args.niceness) as procs:
        groups = await harness.start_fleet(procs, engines=2, speed=1.0, model=harness.MODEL, seed=1)
        urls, roles = harness.assign_roles(groups, 1)
        port = harness.free_port()
        config = harness.narwhal_config(
            urls,
            roles,
            port=port,
            speed=1.0,
            admission="open",
            controller=False,
            ttft_slo_s=0.5,
            tpot_slo_s=0.05,
            socket_path=str(run_dir / "narwhal.sock"),
            extra={
                "serving": {"max_connections": slow, "body_timeout_s": args.body_timeout_s},
                "log": {"level": args.log_level},
            },
        )
        url = await harness.start_narwhal(procs, config, run_dir)
        narwhal = procs.find("narwhal")
        await harness.warm_up(url, count=1)
        cpu0 = benchkit.cpu_seconds(narwhal.pid)
        me = [sys.executable, __file__]
        storm_spec = {"host": "127.0.0.1", "port": port, "slow": slow}
        storm_spec.update(addresses=args.addresses, reconnect=args.reconnect, seed=args.seed)
        storm_proc = await procs.start(
            "storm", [*me, "--storm", json.dumps(storm_spec)], stdout_pipe=True
        )
        (line,) = await harness.read_lines(storm_proc, 1, 60.0)
        deadline = json.loads(line)["sent"] + args.body_timeout_s
        probe_spec = {
            "host": "127.0.0.1",
            "port": port,
            "every_ms": args.probe_every_ms,
            "until": deadline + args.after_s,
        }
        probe_proc = await procs.start(
            "probe", [*me, "--probe", json.dumps(probe_spec)], stdout_pipe=True
        )
        (line,) = await harness.read_lines(storm_proc, 1, args.body_timeout_s + 60.0)
        records = json.loads(line)["records"]
        (line,) = await harness.read_lines(probe_proc, 1, args.body_timeout_s + args.after_s + 30)
        samples = json.loads(line)["samples"]
        cpu1 = benchkit.cpu_seconds(narwhal.pid)
        async with httpx.AsyncClient(timeout=10.0) as client:
            metrics = (await client.get(harness.admin_url(config) + "/metrics")).text
    first_round = [r for r in records if r["round"] == 0]
    answered = sorted(r["answered"] - deadline for r in first_round if r["answered"] is not None)
    statuses: dict[str, int] = {}
    for r in records:
        key = f"round {r['round']}: {r['status']}"
        statuses[key] = statuses.get(key, 0) + 1
    last = deadline + (answered[-1] if answered else 0.0)
    before = [lat for at, lat in samples if at < deadline - 0.2]
    # The storm window: from just before the deadline (the body deadlines are the
    # router's clock, a few ms off ours) to the last 408 and a little after.
    window = [lat for at, lat in samples if deadline - 0.2 <= at <= last + 0.2]
    times = [at + lat for at, lat in samples]
    window_gaps = [b - a for a, b in itertools.pairwise(times) if deadline - 0.2 <= b <= last + 1.0]
    return {
        "statuses": statuses,
        "answers_after_deadline_s": {
            "first": round(answered[0], 3) if answered else None,
            "last": round(answered[-1], 3) if answered else None,
        },
        "probe_before": _stats(before),
        "probe_during": _stats(window),
        "probe_longest_gap_ms": round(max(window_gaps, default=0.0) * 1000, 1),
        "narwhal_cpu_s": round(cpu1 - cpu0, 2),
        "narwhal_loop_lag_buckets": _lag_histogram(metrics),
        "load_average": benchkit.load_average(),
    }


def _summary(runs: Sequence[Json]) -> Json:
    def median(key: str, field: str | None = None) -> float | None:
        values = [r[key] if field is None else r[key][field] for r in runs]
        return benchkit.median([v for v in values if v is not None])

    return {
        "probe_during_max_ms": median("probe_during", "max_ms"),
        "probe_during_p99_ms": median("probe_during", "p99_ms"),
        "probe_longest_gap_ms": median("probe_longest_gap_ms"),
        "last_408_after_deadline_s": median("answers_after_deadline_s", "last"),
        "probe_before_max_ms": median("probe_before", "max_ms"),
    }


async def run(args: argparse.Namespace) -> Json:
    cells = []
    for slow in (int(n) for n in args.slow.split(",")):
        runs = [await one_run(args, slow) for _ in range(args.repeat)]
        cells.append({"slow_posts": slow, "summary": _summary(runs), "runs": runs})
    return {
        "label": args.label,
        "config": {
            "source_addresses": args.addresses,
            "body_timeout_s": args.body_timeout_s,
            "log_level": args.log_level,
            "probe_every_ms": args.probe_every_ms,
            "reconnect": args.reconnect,
            "repeat": args.repeat,
            "seed": args.seed,
        },
        "cells": cells,
        "machine": benchkit.machine(),
        "git": benchkit.git_revision(),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--slow", default="512,2048", help="slow POSTs per run (and max_connections), a list"
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per size")
    p.add_argument("--label", default="", help="what code ran, for the result file")
    p.add_argument("--addresses", type=int, default=16, help="loopback source addresses")
    p.add_argument("--body-timeout-s", type=float, default=5.0)
    p.add_argument("--log-level", default="info")
    p.add_argument("--probe-every-ms", type=float, default=5.0)
    p.add_argument("--after-s", type=float, default=3.0, help="probing after the deadline")
    p.add_argument(
        "--reconnect", action="store_true", help="each slow POST opens another at its 408"
    )
    p.add_argument("--seed", type=int, default=1, help="the trickles' phases")
    p.add_argument("--niceness", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--storm", help=argparse.SUPPRESS)
    p.add_argument("--probe", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.storm:
        trio.run(storm, json.loads(args.storm))
        return 0
    if args.probe:
        trio.run(probe, json.loads(args.probe))
        return 0

    async def guarded() -> int:
        document = await run(args)
        benchkit.write_json(args.out, document)
        for cell in document["cells"]:
            print(cell["slow_posts"], json.dumps(cell["summary"]))
        return 0

    return trio.run(harness.run_guarded, guarded)


if __name__ == "__main__":
    sys.exit(main())
