"""The gate in front of /v1/*: drain, API key, body limit and body deadline.

A plain ASGI middleware (not BaseHTTPMiddleware) so that the in-flight count
covers a streaming body until its last byte. For a POST it reads the whole
body before the app sees it:

- over ``request_body_limit`` bytes it answers 413 at once: from the
  Content-Length header before reading anything, else as soon as the bytes
  read pass the limit (uvicorn buffers at most 64 KiB ahead of the reader);
- a body that is not complete within ``body_timeout_seconds`` gets 408,
  or 503 at once when a drain starts meanwhile.

Every answer the gate gives closes the connection: the body is unread.
The caller (which key, what priority it may use) goes into the scope for
the routes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specpair_runtime.server.auth import ANONYMOUS_CALLER, Caller
from specpair_runtime.server.errors import error_response
from specpair_runtime.server.state import ServerState

log = logging.getLogger("specpair.server")

CALLER_SCOPE_KEY = "specpair.caller"


class BodyTooLarge(Exception):
    pass


def caller_of(scope: Scope) -> Caller:
    caller = scope.get(CALLER_SCOPE_KEY)
    return caller if isinstance(caller, Caller) else ANONYMOUS_CALLER


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses such a request before it gets here
    return None


async def read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The whole body (raises BodyTooLarge past ``limit``) and whether the client left."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts), False


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that gives the buffered body once, then defers to the real one."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class GateMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str
    ) -> None:
        """An error answer before the body was read: the connection closes after it,
        or a client still sending the body would keep it open for nothing."""
        self.state.metrics.error(code)
        response = error_response(status, message, code=code, close=True)
        if status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope["path"]).startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        state = self.state
        if state.draining:
            await self._refuse(
                scope, receive, send, 503, "server is shutting down", "shutting_down"
            )
            return
        caller = self._caller(scope)
        if caller is None:
            await self._refuse(
                scope, receive, send, 401, "missing or invalid API key", "invalid_api_key"
            )
            return
        scope[CALLER_SCOPE_KEY] = caller
        state.metrics.request_by_key(caller.name)
        state.in_flight += 1
        try:
            if scope["method"] == "POST":
                body = await self._read_body(scope, receive, send)
                if body is None:
                    return
                receive = replay(body, receive)
            await self.app(scope, receive, send)
        finally:
            state.in_flight -= 1
            if state.in_flight == 0 and state.idle is not None:
                state.idle.set()

    def _caller(self, scope: Scope) -> Caller | None:
        keys = self.state.api_keys
        if keys is None:
            return ANONYMOUS_CALLER
        header: Any = dict(scope["headers"]).get(b"authorization")
        return keys.caller(header.decode("latin-1") if header else None)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The body, or None when an answer (413, 408, 503) went out instead."""
        serving = self.state.config.serving
        limit = serving.request_body_limit
        too_large = f"request body is larger than the limit of {limit} bytes"
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(scope, receive, send, 413, too_large, "request_too_large")
            return None
        reader = asyncio.ensure_future(read_body(receive, limit))
        # A drain does not wait for uploads: work that has not arrived is not in flight.
        drain = asyncio.ensure_future(self.state.drain_started.wait())
        try:
            await asyncio.wait(
                {reader, drain},
                timeout=serving.body_timeout_seconds,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            drain.cancel()
            if not reader.done():
                reader.cancel()
        if reader.done() and not reader.cancelled():
            if isinstance(reader.exception(), BodyTooLarge):
                await self._refuse(scope, receive, send, 413, too_large, "request_too_large")
                return None
            body, gone = reader.result()
            return None if gone else body
        if self.state.draining:
            message = "server is shutting down"
            await self._refuse(scope, receive, send, 503, message, "shutting_down")
            return None
        log.warning("request body not complete within %.1fs", serving.body_timeout_seconds)
        message = f"request body not received within {serving.body_timeout_seconds:g}s"
        await self._refuse(scope, receive, send, 408, message, "request_timeout")
        return None
