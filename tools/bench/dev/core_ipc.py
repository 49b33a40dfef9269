"""What asking a decision core in another process costs: the all-cores data plane's
per-request round trip, measured before it is built.

    .venv/bin/python tools/bench/dev/core_ipc.py [--messages 20000] [--reps 3]

A worker process sends small msgpack requests (msgspec, as an admit/place/retry question
would be: an id, a few ints and a short string) over a unix socketpair to a core process,
which answers each with a small reply, both on trio. Length-prefixed frames; a reader
takes every whole frame a receive brought, and a writer sends what its queue holds in
one write (so concurrent questions coalesce). At 1 question in flight this is the
latency a request pays per decision; at 64 it is the core's throughput and the CPU per
round trip on each side. Writes runs/bench/core-ipc.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchkit, one folder up
from benchkit import RUNS, Json, write_json
from benchkit._facts import git_revision, load_average, machine


class Ask(msgspec.Struct, array_like=True):
    id: int
    kind: str
    tokens: int
    bound: int
    engine: str


class Answer(msgspec.Struct, array_like=True):
    id: int
    ok: bool
    prefill: str
    decode: str
    backoff_s: float


_ENCODE = msgspec.msgpack.Encoder().encode
_ASK = msgspec.msgpack.Decoder(Ask)
_ANSWER = msgspec.msgpack.Decoder(Answer)


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


class Frames:
    """Whole frames out of a byte stream."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.buffer += data
        out = []
        at = 0
        while len(self.buffer) - at >= 4:
            size = int.from_bytes(self.buffer[at : at + 4], "big")
            if len(self.buffer) - at - 4 < size:
                break
            out.append(bytes(self.buffer[at + 4 : at + 4 + size]))
            at += 4 + size
        del self.buffer[:at]
        return out


class Writer:
    """Coalesces what concurrent tasks send into one write per wake-up."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.pending: list[bytes] = []
        self.wake = trio.Event()

    def send(self, payload: bytes) -> None:
        self.pending.append(frame(payload))
        self.wake.set()

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake = trio.Event()
            data, self.pending = b"".join(self.pending), []
            await self.stream.send_all(data)


async def core(fd: int) -> None:
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))
    frames = Frames()
    writer = Writer(stream)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)
        while data := await stream.receive_some(65536):
            for payload in frames.feed(data):
                ask = _ASK.decode(payload)
                writer.send(_ENCODE(Answer(ask.id, True, "p0", "d0", 0.0)))
        nursery.cancel_scope.cancel()


async def worker(stream: trio.SocketStream, messages: int, inflight: int) -> dict[str, float]:
    frames = Frames()
    writer = Writer(stream)
    waiting: dict[int, trio.Event] = {}
    latencies: list[float] = []

    async def reader() -> None:
        while data := await stream.receive_some(65536):
            for payload in frames.feed(data):
                waiting.pop(_ANSWER.decode(payload).id).set()

    async def asker(first: int) -> None:
        for i in range(first, messages, inflight):
            done = waiting[i] = trio.Event()
            start = time.perf_counter()
            writer.send(_ENCODE(Ask(i, "completions", 1000, 256, "d0")))
            await done.wait()
            latencies.append(time.perf_counter() - start)

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)
        nursery.start_soon(reader)
        async with trio.open_nursery() as askers:
            for first in range(inflight):
                askers.start_soon(asker, first)
        nursery.cancel_scope.cancel()
    wall = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {
        "round_trips_per_s": messages / wall,
        "latency_p50_us": statistics.median(latencies) * 1e6,
        "worker_cpu_us_per_round_trip": cpu / messages * 1e6,
    }


def cell(messages: int, inflight: int) -> Json:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen(
        [sys.executable, __file__, "--core-fd", str(theirs.fileno())], pass_fds=[theirs.fileno()]
    )
    theirs.close()
    try:
        pid = child.pid
        core_cpu0 = _cpu(pid)
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(mine))
        result = trio.run(worker, stream, messages, inflight)
        result["core_cpu_us_per_round_trip"] = (_cpu(pid) - core_cpu0) / messages * 1e6
    finally:
        mine.close()
        child.wait(timeout=30)
    return {k: round(v, 2) for k, v in result.items()}


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=RUNS / "core-ipc.json")
    p.add_argument("--core-fd", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.core_fd is not None:
        trio.run(core, args.core_fd)
        return
    cells: dict[str, list[Json]] = {}
    for _ in range(args.reps):
        for inflight in (1, 64):
            cells.setdefault(str(inflight), []).append(cell(args.messages, inflight))
    document = {
        "benchmark": "core-ipc",
        "machine": machine(),
        "git": git_revision(),
        "load_average": load_average(),
        "config": {"messages": args.messages, "reps": args.reps},
        "results": cells,
    }
    write_json(args.out, document)
    for key, runs in cells.items():
        for run in runs:
            print(f"inflight {key}: {run}")
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
