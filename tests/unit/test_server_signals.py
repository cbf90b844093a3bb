"""The signal handler's count: drain, then forced stop, then exit at once."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest

from specpair_runtime.server.runner import DrainingServer, build_server
from tests.support.server_harness import bare_server_state


@pytest.fixture
def server() -> Iterator[DrainingServer]:
    """A server whose event loop exists but is not running: signals land before it runs."""
    server = build_server(bare_server_state(), "127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    server._loop = loop
    try:
        yield server
    finally:
        loop.close()


def run_loop_for(server: DrainingServer, seconds: float) -> None:
    assert server._loop is not None
    server._loop.run_until_complete(asyncio.sleep(seconds))


def test_two_signals_before_the_loop_runs_still_force_the_stop(server: DrainingServer) -> None:
    # The second SIGTERM can arrive before the loop has started the drain task;
    # it must still count as the second one (this once let a drain run on).
    state = server.state
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(signal.SIGTERM, None)
    assert state.forced_stop and not server.force_exit
    run_loop_for(server, 0.2)
    assert server._drain_task is not None and server._forced_task is not None
    assert state.draining and server.should_exit
    server.handle_exit(signal.SIGTERM, None)
    assert server.force_exit


def test_one_signal_only_drains(server: DrainingServer) -> None:
    state = server.state
    server.handle_exit(signal.SIGINT, None)
    run_loop_for(server, 0.05)
    assert state.draining and not state.forced_stop
    assert server._forced_task is None and state.readiness.state.phase == "draining"
