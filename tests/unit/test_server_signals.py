"""The signal handler's count: drain, then forced stop, then exit at once."""

from __future__ import annotations

import asyncio
import signal

from specpair_runtime.config import parse_runtime_config
from specpair_runtime.server.runner import build_server
from specpair_runtime.server.state import ServerState


def server_state() -> ServerState:
    config = parse_runtime_config(
        {
            "pair": {"name": "p", "version": "1"},
            "target": {"source": "/models/target"},
            "draft": {"source": "/models/draft"},
        }
    )
    return ServerState(config)


def test_two_signals_before_the_loop_runs_still_force_the_stop() -> None:
    # The second SIGTERM can arrive before the loop has started the drain task;
    # it must still count as the second one (this once let a drain run on).
    state = server_state()
    server = build_server(state, "127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    try:
        server._loop = loop
        server.handle_exit(signal.SIGTERM, None)
        server.handle_exit(signal.SIGTERM, None)
        assert state.forced_stop and not server.force_exit
        loop.run_until_complete(asyncio.sleep(0.2))
        assert server._drain_task is not None and server._forced_task is not None
        assert state.draining and server.should_exit
        server.handle_exit(signal.SIGTERM, None)
        assert server.force_exit
    finally:
        loop.close()


def test_one_signal_only_drains() -> None:
    state = server_state()
    server = build_server(state, "127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    try:
        server._loop = loop
        server.handle_exit(signal.SIGINT, None)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert state.draining and not state.forced_stop
        assert server._forced_task is None and state.readiness.state.phase == "draining"
    finally:
        loop.close()
