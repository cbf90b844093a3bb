"""The loaded heap is frozen for the garbage collector while serving, and thawed after."""

from __future__ import annotations

import gc

from specpair_runtime.config import parse_runtime_config
from specpair_runtime.server.startup import freeze_long_lived_objects, stop_serving
from specpair_runtime.server.state import ServerState


def test_freezing_takes_live_objects_out_of_collections_until_serving_stops() -> None:
    state = ServerState(
        parse_runtime_config(
            {
                "pair": {"name": "p", "version": "1"},
                "target": {"source": "/models/target"},
                "draft": {"source": "/models/draft"},
            }
        )
    )
    try:
        freeze_long_lived_objects()
        assert gc.get_freeze_count() > 10_000  # the imported modules alone
        stop_serving(state)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
