"""API keys: Bearer auth, a priority class and a name per key, and live rotation.

The key file is either one key (the whole content, whitespace stripped) or a
YAML document that lists several::

    keys:
      - name: interactive      # the metrics label; never the key itself
        key: sk-...
        priority: 10           # the highest priority its requests may ask for
      - name: batch
        key: sk-...
        priority: -5

A request runs at its key's priority unless it asks for a lower one; asking
for a higher one is refused. In a cluster the file is a Secret volume, which
the kubelet updates by swapping a symlink, so ``KeyFileWatcher`` polls its
content hash (as ``reload.ConfigWatcher`` does for the config file).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specpair_runtime.config import ConfigError, describe_validation_error

log = logging.getLogger("specpair.auth")

# The key of a one-key file, and of everyone when no key file is configured.
DEFAULT_KEY_NAME = "default"
ANONYMOUS = "anonymous"
# Names become metric labels: keep them short and tame.
NAME_PATTERN = r"^[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?$"


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    key: str = Field(min_length=8, repr=False)
    priority: int = Field(default=0, ge=-1000, le=1000)


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[KeyEntry] = Field(min_length=1)


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the key's name and the highest priority it may use."""

    name: str
    max_priority: int


ANONYMOUS_CALLER = Caller(ANONYMOUS, 0)


def parse_key_file(text: str, source: str = "serving.apiKeyFile") -> tuple[KeyEntry, ...]:
    """The keys in a key file's text; ConfigError naming the field when unusable."""
    stripped = text.strip()
    if not stripped:
        raise ConfigError(f"{source}: the file is empty")
    try:
        data = yaml.safe_load(stripped)
    except yaml.YAMLError:
        data = None
    if not isinstance(data, dict):
        # A plain key: one line, no whitespace inside.
        if len(stripped.split()) != 1:
            raise ConfigError(f"{source}: expected one key, or a YAML mapping with `keys`")
        return (KeyEntry(name=DEFAULT_KEY_NAME, key=stripped, priority=0),)
    try:
        entries = KeyFile.model_validate(data).keys
    except ValidationError as error:
        # Paths and messages only: pydantic's input (a key) is never echoed.
        raise ConfigError(describe_validation_error(error, prefix=f"{source}: ")) from None
    names = [entry.name for entry in entries]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"{source}: key names must be unique; repeated: {', '.join(duplicates)}")
    if len({entry.key for entry in entries}) != len(entries):
        raise ConfigError(f"{source}: two entries hold the same key")
    return tuple(entries)


def load_key_file(path: Path) -> tuple[KeyEntry, ...]:
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"serving.apiKeyFile: cannot read {path}: {error.strerror}") from None
    return parse_key_file(text, f"serving.apiKeyFile {path}")


def bearer_token(header: str | None) -> str | None:
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class KeyRing:
    """The keys in force; thread-safe swap on rotation."""

    def __init__(self, entries: tuple[KeyEntry, ...]) -> None:
        self._lock = threading.Lock()
        self._entries = entries

    @property
    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(entry.name for entry in self._entries)

    def replace(self, entries: tuple[KeyEntry, ...]) -> None:
        with self._lock:
            self._entries = entries

    def caller(self, header: str | None) -> Caller | None:
        """The caller the header's key belongs to, or None when it matches no key."""
        token = bearer_token(header)
        if token is None:
            return None
        with self._lock:
            entries = self._entries
        found: KeyEntry | None = None
        for entry in entries:
            # Constant-time compare, over every key, so timing reveals nothing.
            if hmac.compare_digest(token.encode(), entry.key.encode()):
                found = entry
        return None if found is None else Caller(found.name, found.priority)


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class KeyFileWatcher:
    """Polls the key file and swaps the keys in ``ring`` when its content changes."""

    def __init__(self, path: Path, ring: KeyRing, interval_seconds: float = 2.0) -> None:
        self.path = path
        self.ring = ring
        self.interval_seconds = interval_seconds
        self._digest = _digest(path)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> bool:
        """Check once; True when new keys came into force."""
        digest = _digest(self.path)
        if digest is None or digest == self._digest:
            return False
        self._digest = digest
        try:
            entries = load_key_file(self.path)
        except ConfigError as error:
            log.error("API key file rotation rejected, keeping the current keys: %s", error)
            return False
        self.ring.replace(entries)
        names = ", ".join(entry.name for entry in entries)
        log.warning("API keys rotated: %d key(s) now in force (%s)", len(entries), names)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                self.poll_once()
            except Exception:  # a watcher bug must not kill the server
                log.exception("API key file watcher failed; will retry")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="key-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
