"""Run the app under uvicorn with a graceful SIGTERM drain and a forced stop.

uvicorn's own SIGTERM handling closes the listening socket at once, so new
clients would see a refused connection rather than a clear answer. Here the
first SIGTERM (or SIGINT) only starts a drain: new /v1 requests get a 503,
/readyz turns unready, in-flight requests get ``drainTimeoutSeconds`` to
finish, and then uvicorn exits normally (status 0).

A second signal forces the stop: the engine thread stops, which fails every
queued and running request, so each open stream gets an error chunk and
``[DONE]`` (non-streamed ones a 503); after a short flush the process exits
with a non-zero status (``ServerState.forced_stop``). A third signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn

from specpair_runtime.server.app import create_app
from specpair_runtime.server.protocol import deadline_protocol
from specpair_runtime.server.startup import stop_serving
from specpair_runtime.server.state import ServerState

log = logging.getLogger("specpair.server")

# After a forced stop, how long the failed responses get to reach their clients.
FORCED_FLUSH_SECONDS = 3.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future[None] | None = None
        self._forced_task: asyncio.Future[None] | None = None
        # Counted in the handler itself: the tasks start only when the loop next
        # runs, so two quick signals would otherwise both look like the first.
        self.signals_received = 0

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after
        # shutdown and the default action would replace our exit status.
        if self._loop is None:
            self.should_exit = True
            return
        self.signals_received += 1
        if self.signals_received == 1:
            log.info("received signal %d: draining", sig)
            self._loop.call_soon_threadsafe(self._begin_drain)
        elif self.signals_received == 2:
            log.warning("received signal %d again: forced stop, failing open requests", sig)
            self.state.forced_stop = True
            self._loop.call_soon_threadsafe(self._begin_forced_stop)
        else:
            self.force_exit = True
            self.should_exit = True

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    def _begin_forced_stop(self) -> None:
        if self._forced_task is None:
            self._forced_task = asyncio.ensure_future(self.forced_stop())

    async def forced_stop(self) -> None:
        """Fail what is open (error chunk + [DONE] per stream), let it flush, exit."""
        state = self.state
        state.draining = True
        state.drain_started.set()
        await asyncio.to_thread(stop_serving, state)
        if state.idle is not None:
            try:
                await asyncio.wait_for(state.idle.wait(), timeout=FORCED_FLUSH_SECONDS)
            except TimeoutError:
                log.warning("%d responses still open after the forced stop", state.in_flight)
        self.should_exit = True

    async def drain(self) -> None:
        """Refuse new work, let in-flight requests finish, then exit."""
        state = self.state
        timeout = state.config.serving.drain_timeout_seconds
        state.draining = True
        state.drain_started.set()
        state.readiness.set("draining", "shutting down: in-flight requests are finishing")
        state.idle = asyncio.Event()
        if state.in_flight == 0:
            state.idle.set()
        try:
            await asyncio.wait_for(state.idle.wait(), timeout=timeout)
            log.info("drained: no requests in flight")
        except TimeoutError:
            log.warning(
                "drain deadline of %.1fs passed with %d requests in flight; aborting them",
                timeout,
                state.in_flight,
            )
            # Stopping the engine thread fails what is still running, which
            # ends those responses (an error chunk for streams, 500 otherwise).
            await asyncio.to_thread(stop_serving, state)
        self.should_exit = True


def build_server(
    state: ServerState, host: str, port: int, log_level: str = "info"
) -> DrainingServer:
    serving = state.config.serving
    config = uvicorn.Config(
        create_app(state),
        host=host,
        port=port,
        # uvicorn's h11 protocol plus a deadline on request headers (protocol.py).
        http=deadline_protocol(serving.header_timeout_seconds, state.metrics.error),
        lifespan="off",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return DrainingServer(config, state)
