"""Run the app under uvicorn with a graceful SIGTERM drain.

uvicorn's own SIGTERM handling closes the listening socket at once, so new
clients would see a refused connection rather than a clear answer. Here the
first SIGTERM (or SIGINT) only starts a drain: new /v1 requests get a 503,
/readyz turns unready, in-flight requests get ``drainTimeoutSeconds`` to
finish, and then uvicorn exits normally (status 0). A second SIGINT forces.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from specpair_runtime.server.app import create_app
from specpair_runtime.server.startup import stop_serving
from specpair_runtime.server.state import ServerState

log = logging.getLogger("specpair.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after
        # shutdown and the default SIGTERM action would make the exit status non-zero.
        if self._drain_task is not None or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        log.info("received signal %d: draining", sig)
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Refuse new work, let in-flight requests finish, then exit."""
        state = self.state
        timeout = state.config.serving.drain_timeout_seconds
        state.draining = True
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
    config = uvicorn.Config(
        create_app(state),
        host=host,
        port=port,
        lifespan="off",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return DrainingServer(config, state)
