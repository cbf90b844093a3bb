"""uvicorn's h11 HTTP protocol with a deadline on request headers.

uvicorn 0.54 has no setting for it (its only timer is the keep-alive one,
which the first byte of a request cancels, so a client that trickles or
stalls its headers holds a connection forever). hypercorn's ``read_timeout``
is an idle timer on every read, which would also cut long streamed answers
to clients that send nothing meanwhile; granian's header timeout would mean
replacing the server and its drain. So the app keeps uvicorn and hands it
this protocol class through uvicorn's own ``http`` setting: the stock h11
protocol plus one timer, armed when a connection opens or a request's first
byte arrives and cleared once h11 has the whole header block. The body's
deadline is the app's (``gate.py``), where the body is read.

It also answers malformed HTTP with an OpenAI-shaped 400 instead of
uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specpair_runtime.server.errors import error_body

log = logging.getLogger("specpair.server")


def _raw_response(status: int, reason: bytes, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} ".encode()
        + reason
        + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
    )
    return head + body


def deadline_protocol(
    header_timeout: float, count_error: Callable[[str], None]
) -> type[asyncio.Protocol]:
    """An H11Protocol subclass that enforces ``header_timeout`` seconds per request head.

    ``count_error`` gets the error code of each answer it gives (for the metrics).
    """

    class HeaderDeadlineProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "unknown client"
            log.warning("request headers from %s not complete within %.1fs", client, header_timeout)
            count_error("request_timeout")
            if self.conn.our_state is h11.IDLE:
                message = f"request headers not received within {header_timeout:g}s"
                body = error_body(408, message, None, "request_timeout")
                self.transport.write(_raw_response(408, b"Request Timeout", body))
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            count_error("invalid_request")
            body = error_body(400, f"malformed HTTP request: {msg}", None, None)
            self.transport.write(_raw_response(400, b"Bad Request", body))
            self.transport.close()

    return HeaderDeadlineProtocol
