"""The ASGI applications of Narwhal's two HTTP listeners.

`App` (listen.host:listen.port) serves clients: the OpenAI-compatible completions,
`/v1/models` and `/health`. `AdminApp` (admin.host:admin.port) serves the operator:
`/narwhal/state` and `/metrics`, which name engines, their urls and the requests in
flight with their placement, so the client listener answers them 404 like any path it
does not serve.

Each listener asks for its own bearer credential when the configuration sets one
(`_auth`): listen.api_keys on every `/v1/` route (`/health` stays open for load
balancers), admin.token on every admin route. The check comes before routing, so a
client without it learns nothing (not even which paths exist), and a completion
request refused for it is counted with the other refusals before the body.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from .._codes import ErrorCode
from .._errors import MalformedRequest, NarwhalError, NotFound
from ..metrics._merge import merged
from ._auth import ADMIN_TOKEN, CLIENT_KEYS, BearerCheck
from ._client import ClientChannel, Receive, Send, eager, has_body, json_bytes
from ._context import DEGRADED_PUBLIC, ServingContext
from ._exchange import Exchange
from ._request import request_id_from_header
from ._state import full_state_document, live_gauges

log = logging.getLogger("narwhal.app")

_METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
# The methods each route answers. HEAD is GET without the body, which hypercorn leaves
# out of the response (RFC 9110 9.3.2: a server answering GET answers HEAD too).
_READ = ("GET", "HEAD")
_CLIENT_ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    **dict.fromkeys(("/health", "/v1/models"), _READ),
}
_ADMIN_ROUTES: dict[str, tuple[str, ...]] = dict.fromkeys(("/narwhal/state", "/metrics"), _READ)


class MethodNotAllowed(NarwhalError):
    """A route that exists, asked with a method it does not answer (RFC 9110 15.5.6:
    the answer names the methods it does answer in `Allow`)."""

    status = 405
    type = "invalid_request_error"
    default_code = ErrorCode.METHOD_NOT_ALLOWED

    def __init__(self, message: str, *, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.allowed = allowed

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"allow", ", ".join(self.allowed).encode())]


def _refusal(routes: dict[str, tuple[str, ...]], method: str, path: str) -> NarwhalError:
    allowed = routes.get(path)
    if allowed is None:
        return NotFound(f"no route for {method} {path}")
    return MethodNotAllowed(
        f"{path} answers {' and '.join(allowed)}, not {method}", allowed=allowed
    )


def _framing_conflicts(headers: list[tuple[bytes, bytes]]) -> bool:
    """Both a Transfer-Encoding and a Content-Length. h11 reads the body by the first;
    a proxy in front that read it by the second would take the rest for another request
    (request smuggling), so RFC 9112 6.3 has the server close the connection after
    answering."""
    chunked = length = False
    for name, _ in headers:
        chunked = chunked or name == b"transfer-encoding"
        length = length or name == b"content-length"
    return chunked and length


def _closing(send: Send) -> Send:
    """`send`, with every response saying `connection: close` (hypercorn then closes)."""

    async def send_closing(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
            message = {**message, "headers": [*kept, (b"connection", b"close")]}
        await send(message)

    return send_closing


class _Listener:
    """What both listeners do with a request before and after their routes."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._refuse_upgrade(scope, receive, send)
            return
        if scope["type"] != "http":
            # No lifespan protocol: hypercorn continues without it when the app raises.
            raise RuntimeError(f"narwhal serves http only, not {scope['type']}")
        headers = scope.get("headers", [])
        request_id = request_id_from_header(
            next((v for k, v in headers if k == b"x-request-id"), None)
        )
        receive = eager(receive)
        if _framing_conflicts(headers):
            send = _closing(send)
        try:
            await self._route(scope, headers, request_id, receive, send)
        except NarwhalError as exc:
            # Only routes that never read a body get here (the flow answers its own errors).
            channel = ClientChannel(send, request_id, close_connection=has_body(headers))
            await channel.send_error(exc)

    async def _route(
        self,
        scope: MutableMapping[str, Any],
        headers: list[tuple[bytes, bytes]],
        request_id: str,
        receive: Receive,
        send: Send,
    ) -> None:
        raise NotImplementedError

    def _counted(self, refusal: NarwhalError) -> NarwhalError:
        self.ctx.metrics.refusals.labels(refusal.code).inc()
        return refusal

    async def _refuse_upgrade(
        self, scope: MutableMapping[str, Any], receive: Receive, send: Send
    ) -> None:
        """A websocket upgrade, answered with the error envelope through ASGI's websocket
        denial response and counted with the client protocol errors. The app used to
        raise, and hypercorn then answered a bare 500, as if Narwhal had failed."""
        if "websocket.http.response" not in scope.get("extensions", {}):
            raise RuntimeError("narwhal serves http only, and cannot refuse a websocket here")
        await receive()  # websocket.connect
        error = MalformedRequest(
            "narwhal serves HTTP only; a websocket upgrade is not supported",
            status=400,
            code=ErrorCode.UPGRADE_UNSUPPORTED,
        )
        self.ctx.client_protocol_error(error)
        body = json_bytes(error.envelope())
        await send(
            {
                "type": "websocket.http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})


class App(_Listener):
    """The client listener."""

    def __init__(self, ctx: ServingContext) -> None:
        super().__init__(ctx)
        self.keys = BearerCheck(lambda config: config.listen.client_keys(), CLIENT_KEYS)

    async def _route(
        self,
        scope: MutableMapping[str, Any],
        headers: list[tuple[bytes, bytes]],
        request_id: str,
        receive: Receive,
        send: Send,
    ) -> None:
        method = scope["method"]
        path = scope["path"]
        refusal = None
        if path.startswith("/v1/"):
            refusal = self.keys.refusal(self.ctx.config, headers)
        if method == "POST" and path == "/v1/completions":
            await Exchange(self.ctx, "completions", dict(scope), send).run(receive, refusal=refusal)
        elif method == "POST" and path == "/v1/chat/completions":
            await Exchange(self.ctx, "chat", dict(scope), send).run(receive, refusal=refusal)
        elif refusal is not None:
            raise self._counted(refusal)
        elif method not in _READ:
            raise _refusal(_CLIENT_ROUTES, method, path)
        elif path == "/health":
            await self._health(send, request_id)
        elif path == "/v1/models":
            await self._models(send, request_id)
        elif path in _ADMIN_ROUTES:
            raise NotFound(
                f"no route for {method} {path}: narwhal serves it on its admin listener "
                "(admin.host, admin.port), not to clients"
            )
        else:
            raise _refusal(_CLIENT_ROUTES, method, path)

    async def _health(self, send: Send, request_id: str) -> None:
        ctx = self.ctx
        reason = ctx.degraded_reason
        if reason is not None and not ctx.config.serving.expose_engine_details:
            reason = f"degraded: {DEGRADED_PUBLIC}"
        if reason is None and not ctx.accepting:
            reason = "shutting down"
        status = 200 if reason is None else 503
        body = {"status": "ok" if reason is None else "unavailable", "reason": reason}
        await ClientChannel(send, request_id).send_json(status, json_bytes(body))

    async def _models(self, send: Send, request_id: str) -> None:
        data = [
            {
                "id": model,
                "object": "model",
                "created": 0,
                "owned_by": "narwhal",
                "max_model_len": self._model_context(model),
            }
            for model in self.ctx.models
        ]
        body = json_bytes({"object": "list", "data": data})
        await ClientChannel(send, request_id).send_json(200, body)

    def _model_context(self, model: str) -> int | None:
        """The context a request for `model` fits whichever engine serves it: the least
        `max_model_len` its engines' cards report (vLLM's card carries its own); None
        while none has reported one."""
        lengths = [
            engine.context_length
            for engine in self.ctx.fleet
            if engine.spec.model == model and engine.context_length is not None
        ]
        return min(lengths) if lengths else None


class AdminApp(_Listener):
    """The admin listener: the state document and the Prometheus metrics."""

    def __init__(self, ctx: ServingContext) -> None:
        super().__init__(ctx)
        self.token = BearerCheck(
            lambda config: [] if (token := config.admin.bearer_token()) is None else [token],
            ADMIN_TOKEN,
        )
        ctx.metrics.add_live_gauges(lambda: live_gauges(ctx))

    async def _route(
        self,
        scope: MutableMapping[str, Any],
        headers: list[tuple[bytes, bytes]],
        request_id: str,
        receive: Receive,
        send: Send,
    ) -> None:
        method = scope["method"]
        path = scope["path"]
        refusal = self.token.refusal(self.ctx.config, headers)
        if refusal is not None:
            raise self._counted(refusal)
        if method not in _READ or path not in _ADMIN_ROUTES:
            raise _refusal(_ADMIN_ROUTES, method, path)
        ctx = self.ctx
        if path == "/narwhal/state":
            document = await full_state_document(ctx)
            await ClientChannel(send, request_id).send_json(200, json_bytes(document))
            return
        body = ctx.metrics.render()
        if ctx.worker_metrics is not None:
            body = merged(body, await ctx.worker_metrics())
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", _METRICS_TYPE),
                    (b"content-length", b"%d" % len(body)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})
