"""The loaded heap is frozen for the garbage collector while serving, and thawed after."""

from __future__ import annotations

import gc

from specpair_runtime.server.startup import freeze_long_lived_objects, stop_serving
from tests.support.server_harness import bare_server_state


def test_freezing_takes_live_objects_out_of_collections_until_serving_stops() -> None:
    state = bare_server_state()
    try:
        freeze_long_lived_objects()
        assert gc.get_freeze_count() > 10_000  # the imported modules alone
        stop_serving(state)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
