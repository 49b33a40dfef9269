"""A minimal etcd v3 client over etcd's JSON gateway (etcd >= 3.4), on trio with httpx.

Owns
  `Etcd`: leases (grant, keepalive, revoke), keys (put, get, get_prefix, delete), two
  transactions (`create`: put if absent; `delete_if_lease`: delete if held by a lease)
  and `watch_prefix`, each a POST of JSON to /v3/<service>/<method> on one of the
  endpoints. Keys and values are bytes (base64 on the wire); int64 fields arrive as
  JSON strings, and an absent field is zero or empty.

Invariants
  A call tries the endpoint that answered last first, then the others in order: a
  connect error, a timeout, a broken connection or an HTTP 5xx (etcd without quorum
  answers 503, or 500 on its own deadline) moves on, anything else etcd says is final.
  Each endpoint gets `timeout_s`; so a call never takes longer than
  len(endpoints) * timeout_s. A call that moves on after a lost reply may have been
  applied: `create` then says False for the key it made (its holder's lease tells).
  A watch holds its own connection from a second pool for as long as it is read, so
  watches never starve the unary calls of theirs; only its start (until etcd confirms
  the watch) is bounded, never its reads. No background tasks: nothing runs between
  calls.

Errors
  `EtcdError` naming the operation, the endpoint and etcd's text; `EtcdUnavailable`
  when no endpoint answered (each one's failure listed); `LeaseLost` for a lease etcd
  no longer has (keepalive, and a put or create under it); `Compacted` for a watch
  starting before etcd's compaction.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Literal

import attrs
import httpx
import trio

# Small on purpose: a handful of calls are ever in flight (httpx's pool also gets slow
# past ~32 connections).
MAX_CONNECTIONS = 4
MAX_WATCHES = 16
# Bound on closing a watch's stream.
CLEANUP_S = 1.0

# gRPC status codes etcd reports (in "code", or "grpc_code" on a stream).
_NOT_FOUND = 5
_UNAVAILABLE = 14
_DEADLINE_EXCEEDED = 4

_JSON = {"content-type": "application/json"}
# Makes etcd end a watch when its member loses the raft leader (for longer than an
# election), instead of keeping a stream that will never carry another event (the gateway
# turns Grpc-Metadata-* headers into gRPC metadata; clientv3.WithRequireLeader).
_REQUIRE_LEADER = {**_JSON, "grpc-metadata-hasleader": "true"}


class EtcdError(Exception):
    pass


class EtcdUnavailable(EtcdError):
    pass


class LeaseLost(EtcdError):
    pass


class Compacted(EtcdError):
    pass


@attrs.frozen
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@attrs.frozen
class WatchEvent:
    kind: Literal["put", "delete"]
    key: bytes
    value: bytes  # empty for a delete
    mod_revision: int


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes a range of `prefix` cover every key starting with it:
    the prefix with its last byte below 0xff incremented and what follows dropped; a
    prefix of only 0xff bytes (or none) has no end, which etcd spells b"\\0"."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


class _NextEndpoint(Exception):
    """This endpoint failed in a way another may not: try the next one."""


class Etcd:
    def __init__(self, endpoints: Sequence[str], *, timeout_s: float) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        for endpoint in endpoints:
            if not endpoint.startswith(("http://", "https://")):
                raise ValueError(f"etcd endpoint {endpoint!r} must start with http:// or https://")
        if timeout_s <= 0:
            raise ValueError(f"etcd timeout_s={timeout_s}; must be > 0")
        self._endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self._timeout_s = timeout_s
        self._preferred = 0
        # trust_env=False: etcd is on the cluster's own network; an http_proxy meant for
        # the engines' model downloads must not carry it.
        self._unary = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS),
            timeout=timeout_s,
            trust_env=False,
        )
        self._streams = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=MAX_WATCHES, max_keepalive_connections=0),
            timeout=httpx.Timeout(timeout_s, read=None),
            trust_env=False,
        )

    def __repr__(self) -> str:
        return f"<Etcd [{', '.join(self._endpoints)}] preferred {self._preferred}>"

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._endpoints)

    async def aclose(self) -> None:
        try:
            await self._unary.aclose()
        finally:
            await self._streams.aclose()

    # ------------------------------------------------------------------ leases

    async def grant(self, ttl_s: int) -> int:
        """A new lease's id. etcd may grant more than `ttl_s` (never less): its
        minimum is 1.5 election timeouts; keepalive tells the TTL it keeps."""
        reply = await self._call("grant", "/v3/lease/grant", {"TTL": ttl_s})
        return _int(reply, "ID")

    async def keepalive(self, lease: int) -> int:
        """Renew `lease` once; its TTL from now, as etcd keeps it."""
        reply = await self._call(
            "keepalive", "/v3/lease/keepalive", {"ID": str(lease)}, streamed=True
        )
        ttl = _int(reply, "TTL")
        if ttl <= 0:
            raise LeaseLost(f"etcd keepalive: lease {lease:x} is gone (expired or revoked)")
        return ttl

    async def revoke(self, lease: int) -> None:
        """Revoke `lease`, deleting its keys at once; a lease already gone is fine."""
        try:
            await self._call("revoke", "/v3/lease/revoke", {"ID": str(lease)})
        except LeaseLost:
            pass

    # ------------------------------------------------------------------ keys

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Set `key`; the revision that made the change."""
        reply = await self._call(
            "put", "/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(lease)}
        )
        return _int(_header(reply), "revision")

    async def get(self, key: bytes) -> KeyValue | None:
        reply = await self._call("get", "/v3/kv/range", {"key": _b64(key)})
        found = [_kv(item) for item in _list(reply, "kvs")]
        return found[0] if found else None

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key starting with `prefix`, sorted by key, and the revision they are
        read at (a watch from revision + 1 misses nothing after them)."""
        reply = await self._call(
            "get_prefix",
            "/v3/kv/range",
            {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))},
        )
        found = sorted((_kv(item) for item in _list(reply, "kvs")), key=lambda kv: kv.key)
        return found, _int(_header(reply), "revision")

    async def delete(self, key: bytes) -> int:
        """Delete `key`; how many keys went (0 or 1)."""
        reply = await self._call("delete", "/v3/kv/deleterange", {"key": _b64(key)})
        return _int(reply, "deleted")

    async def create(self, key: bytes, value: bytes, *, lease: int) -> bool:
        """Put `key` only if it does not exist; True if this call created it."""
        reply = await self._txn(
            "create",
            {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"},
            {"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}},
        )
        return reply.get("succeeded") is True

    async def delete_if_lease(self, key: bytes, lease: int) -> bool:
        """Delete `key` only if `lease` holds it (a leader resigning its own key and no
        successor's); True if it was deleted."""
        reply = await self._txn(
            "delete_if_lease",
            {"key": _b64(key), "target": "LEASE", "result": "EQUAL", "lease": str(lease)},
            {"request_delete_range": {"key": _b64(key)}},
        )
        if reply.get("succeeded") is not True:
            return False
        deleted = [
            _int(_obj(item.get("response_delete_range")), "deleted")
            for item in map(_obj, _list(reply, "responses"))
        ]
        return sum(deleted) > 0

    async def _txn(
        self, op: str, compare: Mapping[str, object], success: Mapping[str, object]
    ) -> dict[str, object]:
        return await self._call(op, "/v3/kv/txn", {"compare": [compare], "success": [success]})

    # ------------------------------------------------------------------ watch

    async def watch_prefix(
        self, prefix: bytes, *, start_revision: int
    ) -> AsyncGenerator[list[WatchEvent], None]:
        """The changes to keys starting with `prefix` from `start_revision` on (0: from
        now), one list per watch response, in revision order, for as long as it is read.

        An async generator holding a connection: read it inside
        `async with contextlib.aclosing(etcd.watch_prefix(...)) as batches:` so the
        connection closes when the reader stops. Raises `Compacted` if etcd no longer
        has `start_revision`, and `EtcdUnavailable` if no endpoint starts the watch or
        the stream breaks (its member lost the raft leader included): the reader reads
        again and watches from after what it read."""
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        async with AsyncExitStack() as stack:
            endpoint, lines = await self._open_watch(stack, json.dumps(body).encode())
            while True:
                try:
                    line = await anext(lines)
                except StopAsyncIteration:
                    raise EtcdUnavailable(f"etcd watch at {endpoint}: the stream ended") from None
                except httpx.TransportError as exc:
                    raise EtcdUnavailable(
                        f"etcd watch at {endpoint}: the stream broke: {_describe(exc)}"
                    ) from None
                if not line.strip():
                    continue
                result = _watch_result("watch", endpoint, line)
                if result.get("canceled") is True:
                    compacted = _int(result, "compact_revision")
                    if compacted:
                        raise Compacted(
                            f"etcd watch at {endpoint}: revision {start_revision} is "
                            f"compacted (etcd keeps from {compacted})"
                        )
                    reason = result.get("cancel_reason") or "no reason given"
                    raise EtcdError(f"etcd watch at {endpoint}: cancelled by etcd: {reason}")
                events = [_event(_obj(item)) for item in _list(result, "events")]
                # The created confirmation and progress notifications carry no events.
                if events:
                    yield events

    async def _open_watch(
        self, stack: AsyncExitStack, body: bytes
    ) -> tuple[str, AsyncIterator[str]]:
        """Start the watch on the first endpoint that confirms it (each within
        timeout_s); the endpoint and the stream's remaining lines, both kept open by
        `stack`."""
        failures: list[str] = []
        for index in self._order():
            endpoint = self._endpoints[index]
            async with AsyncExitStack() as attempt:
                try:
                    with trio.fail_after(self._timeout_s):
                        request = _Body.request(
                            self._streams, f"{endpoint}/v3/watch", body, _REQUIRE_LEADER
                        )
                        response = await self._streams.send(request, stream=True)
                        attempt.push_async_callback(response.aclose)
                        if response.status_code != 200:
                            await response.aread()
                            _check_status("watch", endpoint, response)
                        lines = response.aiter_lines()
                        attempt.push_async_callback(_finish, response, lines)
                        first = ""
                        while not first.strip():
                            first = await anext(lines)
                        result = _stream_result(
                            "watch", endpoint, _reply("watch", endpoint, first.encode())
                        )
                except trio.TooSlowError:
                    failures.append(f"{endpoint}: no answer within {self._timeout_s}s")
                    continue
                except (httpx.TransportError, StopAsyncIteration) as exc:
                    failures.append(f"{endpoint}: {_describe(exc)}")
                    continue
                except _NextEndpoint as exc:
                    failures.append(str(exc))
                    continue
                if result.get("created") is not True:
                    raise EtcdError(f"etcd watch at {endpoint}: expected its confirmation: {first}")
                self._preferred = index
                stack.push_async_exit(attempt.pop_all())
                return endpoint, lines
        raise EtcdUnavailable(f"etcd watch: no endpoint answered: {'; '.join(failures)}")

    # ------------------------------------------------------------------ transport

    def _order(self) -> Iterator[int]:
        count = len(self._endpoints)
        start = self._preferred
        return ((start + step) % count for step in range(count))

    async def _call(
        self, op: str, path: str, body: Mapping[str, object], *, streamed: bool = False
    ) -> dict[str, object]:
        """POST `body` to `path` on the endpoints in turn; etcd's reply (for a
        `streamed` method, its one result)."""
        content = json.dumps(body).encode()
        failures: list[str] = []
        for index in self._order():
            endpoint = self._endpoints[index]
            try:
                with trio.fail_after(self._timeout_s):
                    request = _Body.request(self._unary, f"{endpoint}{path}", content, _JSON)
                    response = await self._unary.send(request)
                _check_status(op, endpoint, response)
                reply = _reply(op, endpoint, response.content)
                if streamed:
                    reply = _stream_result(op, endpoint, reply)
            except trio.TooSlowError:
                failures.append(f"{endpoint}: no answer within {self._timeout_s}s")
                continue
            except httpx.TransportError as exc:
                failures.append(f"{endpoint}: {_describe(exc)}")
                continue
            except _NextEndpoint as exc:
                failures.append(str(exc))
                continue
            self._preferred = index
            return reply
        raise EtcdUnavailable(f"etcd {op}: no endpoint answered: {'; '.join(failures)}")


# ---------------------------------------------------------------------- the wire


class _Body(httpx.AsyncByteStream):
    """A request body httpx sends without an async generator of its own (it wraps bytes
    in one): a request cancelled mid-send, as a replica stopping during a keepalive
    cancels it, would leave that generator to the garbage collector, and trio warns of
    each one."""

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    @classmethod
    def request(
        cls, client: httpx.AsyncClient, url: str, data: bytes, headers: Mapping[str, str]
    ) -> httpx.Request:
        """A POST of `data` with the client's settings (its timeouts) and this body."""
        request = client.build_request(
            "POST", url, headers={**headers, "content-length": str(len(data))}
        )
        request.stream = cls(data)
        return request

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        if self._data is None:
            raise StopAsyncIteration
        data, self._data = self._data, None
        return data


def _check_status(op: str, endpoint: str, response: httpx.Response) -> None:
    """Nothing for a 200; otherwise raise what etcd's error means."""
    if response.status_code == 200:
        return
    text, code = _error_text(response.content)
    if response.status_code >= 500:
        raise _NextEndpoint(f"{endpoint}: HTTP {response.status_code}: {text}")
    if code == _NOT_FOUND and "lease not found" in text:
        raise LeaseLost(f"etcd {op} at {endpoint}: {text}")
    raise EtcdError(f"etcd {op} at {endpoint}: HTTP {response.status_code}: {text}")


def _error_text(content: bytes) -> tuple[str, int]:
    """etcd's message and gRPC code in an error body (unary: {"error", "message",
    "code"}; a stream's: {"error": {"grpc_code", "http_code", "message", ...}})."""
    try:
        body = json.loads(content)
    except ValueError:
        return content.decode(errors="replace").strip()[:200], 0
    if not isinstance(body, dict):
        return str(body)[:200], 0
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message", error)), _int(error, "grpc_code")
    return str(body.get("message") or error or body), _int(body, "code")


def _reply(op: str, endpoint: str, content: bytes) -> dict[str, object]:
    try:
        body = json.loads(content)
    except ValueError:
        raise EtcdError(f"etcd {op} at {endpoint}: not JSON: {content[:200]!r}") from None
    if not isinstance(body, dict):
        raise EtcdError(f"etcd {op} at {endpoint}: not a JSON object: {content[:200]!r}")
    return body


def _stream_result(op: str, endpoint: str, message: dict[str, object]) -> dict[str, object]:
    """The "result" of one message of a streamed method, or what its "error" means."""
    if message.get("error") is not None:
        error = _obj(message.get("error"))
        text = str(error.get("message", error))
        code = _int(error, "grpc_code")
        if code in (_UNAVAILABLE, _DEADLINE_EXCEEDED) or _int(error, "http_code") >= 500:
            raise _NextEndpoint(f"{endpoint}: {text}")
        raise EtcdError(f"etcd {op} at {endpoint}: {text}")
    return _obj(message.get("result"))


def _watch_result(op: str, endpoint: str, line: str) -> dict[str, object]:
    try:
        return _stream_result(op, endpoint, _reply(op, endpoint, line.encode()))
    except _NextEndpoint as exc:
        # Mid-stream there is no next endpoint to try: the reader watches again.
        raise EtcdUnavailable(f"etcd {op} at {exc}") from None


async def _finish(response: httpx.Response, lines: AsyncIterator[str]) -> None:
    """Close a watch's response and end its line iterator.

    httpx's line iterator is a chain of async generators that closing the response does
    not finish, and trio warns of each one left to the garbage collector: read on after
    the close, which fails at once and ends them all."""
    with trio.move_on_after(CLEANUP_S, shield=True):
        await response.aclose()
        try:
            async for _ in lines:
                pass
        except (httpx.HTTPError, httpx.StreamError):
            pass


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _obj(value: object) -> dict[str, object]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise EtcdError(f"etcd answered {value!r} where an object belongs")
    return value


def _list(body: Mapping[str, object], field: str) -> list[object]:
    value = body.get(field)
    if value is None:
        return []
    if not isinstance(value, list):
        raise EtcdError(f"etcd answered {field}={value!r}; expected a list")
    return value


def _int(body: Mapping[str, object], field: str) -> int:
    """An int64 field: a JSON string (or number), absent when zero."""
    value = body.get(field)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise EtcdError(f"etcd answered {field}={value!r}; expected an integer")
    try:
        return int(value)
    except ValueError:
        raise EtcdError(f"etcd answered {field}={value!r}; expected an integer") from None


def _bytes(body: Mapping[str, object], field: str) -> bytes:
    value = body.get(field)
    if value is None:
        return b""
    if not isinstance(value, str):
        raise EtcdError(f"etcd answered {field}={value!r}; expected base64")
    return base64.b64decode(value)


def _header(reply: Mapping[str, object]) -> dict[str, object]:
    return _obj(reply.get("header"))


def _kv(item: object) -> KeyValue:
    body = _obj(item)
    return KeyValue(
        key=_bytes(body, "key"),
        value=_bytes(body, "value"),
        create_revision=_int(body, "create_revision"),
        mod_revision=_int(body, "mod_revision"),
        lease=_int(body, "lease"),
    )


def _event(body: Mapping[str, object]) -> WatchEvent:
    kv = _kv(body.get("kv"))
    # The type is an enum whose zero value, PUT, is left out.
    kind: Literal["put", "delete"] = "delete" if body.get("type") == "DELETE" else "put"
    return WatchEvent(kind=kind, key=kv.key, value=kv.value, mod_revision=kv.mod_revision)
