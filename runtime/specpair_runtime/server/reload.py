"""Live knob reload: watch the config file and apply speculation knob changes.

In a cluster the file is a ConfigMap volume, which the kubelet updates by
swapping a symlink, so inotify on the file itself misses changes. Polling
the content hash through the path catches both symlink swaps and edits.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specpair_runtime.config import (
    ConfigError,
    RuntimeConfig,
    SpeculationKnobs,
    load_runtime_config,
)

log = logging.getLogger("specpair.reload")

# Sections of the file that only take effect on a restart.
RESTART_SECTIONS = ("pair", "target", "draft", "serving")


@dataclass(frozen=True)
class ReloadPlan:
    knobs: SpeculationKnobs | None  # the new knobs, when they changed
    restart_required: tuple[str, ...]  # sections that changed but need a restart


def plan_reload(old: RuntimeConfig, new: RuntimeConfig) -> ReloadPlan:
    """What a new file changes: live knobs, and the sections that need a restart."""
    knobs = new.speculation if new.speculation != old.speculation else None
    restart = tuple(name for name in RESTART_SECTIONS if getattr(old, name) != getattr(new, name))
    return ReloadPlan(knobs=knobs, restart_required=restart)


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class ConfigWatcher:
    """Polls ``path``; applies knob changes through ``apply_knobs``."""

    def __init__(
        self,
        path: Path,
        current: RuntimeConfig,
        apply_knobs: Callable[[SpeculationKnobs], None],
        interval_seconds: float = 2.0,
    ) -> None:
        self.path = path
        self.current = current
        self.apply_knobs = apply_knobs
        self.interval_seconds = interval_seconds
        self._digest = _digest(path)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> ReloadPlan | None:
        """Check the file once; return the plan applied, None when nothing applied."""
        digest = _digest(self.path)
        if digest is None or digest == self._digest:
            return None
        self._digest = digest
        try:
            new = load_runtime_config(self.path)
        except ConfigError as error:
            log.error("config reload rejected, keeping the current knobs: %s", error)
            return None
        plan = plan_reload(self.current, new)
        if plan.restart_required:
            log.warning(
                "config change in %s: restart required to apply it",
                ", ".join(plan.restart_required),
            )
        if plan.knobs is not None:
            self.apply_knobs(plan.knobs)
            log.info("speculation knobs reloaded: %s", plan.knobs.to_wire())
            # Only the knobs are in force; models and serving keep their old values.
            self.current = self.current.model_copy(update={"speculation": plan.knobs})
        return plan

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                self.poll_once()
            except Exception:  # a watcher bug must not kill the server
                log.exception("config watcher failed; will retry")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="config-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
