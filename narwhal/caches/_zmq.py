"""ZeroMQ sockets on trio, without threads: receiving, and where to reach an engine.

Owns: `receive` (one multipart message, waiting on the socket's descriptor), `closing`
(a socket closed with trio told first), and the endpoint rules: `narwhal_binds` and
`reachable` (the address Narwhal uses for an endpoint an engine's --kv-events-config
names).
Invariants: a ZMQ socket's descriptor (zmq.FD) is edge-triggered and says only that its
state may have changed: it is waited on only while zmq.EVENTS shows no message, and
zmq.EVENTS is read again after every wake and every message. A wait while a message
sits unread would sleep until the next one arrives (the classic lost wakeup). As
vLLM's publisher: an endpoint with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound by
the engine (Narwhal connects), any other is connected to by the engine (Narwhal binds);
a replay endpoint is always bound by the engine.
Errors: `zmq.ZMQError` from bind and connect.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio
import zmq

Socket = zmq.Socket[bytes]


async def receive(sock: Socket) -> list[bytes]:
    """The next multipart message on `sock`."""
    while not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
        await trio.lowlevel.wait_readable(int(sock.getsockopt(zmq.FD)))
    return sock.recv_multipart(zmq.NOBLOCK)


@contextmanager
def closing(ctx: zmq.Context[Socket], kind: int) -> Iterator[Socket]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)
    try:
        yield sock
    finally:
        # A task may still wait on the descriptor (a cancelled one): trio must let go
        # of it before the number is reused.
        trio.lowlevel.notify_closing(int(sock.getsockopt(zmq.FD)))
        sock.close(linger=0)


def engine_binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def narwhal_binds(endpoint: str) -> bool:
    return not engine_binds(endpoint)


def reachable(endpoint: str, engine_host: str) -> str:
    """The address to connect to for an endpoint the engine binds: a wildcard host is
    the engine's own host (its url's)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in ("*", "[::]", "::", "0.0.0.0"):
        host = f"[{engine_host}]" if ":" in engine_host else engine_host
    return f"tcp://{host}:{port}"
