"""Bearer API key check (OpenAI style: ``Authorization: Bearer KEY``)."""

from __future__ import annotations

import hmac
from pathlib import Path

from specpair_runtime.config import ConfigError


def load_api_key(path: Path) -> str:
    """The key is the file's content without surrounding whitespace."""
    try:
        key = path.read_text().strip()
    except OSError as error:
        raise ConfigError(f"serving.apiKeyFile: cannot read {path}: {error.strerror}") from None
    if not key:
        raise ConfigError(f"serving.apiKeyFile: {path} is empty")
    return key


def authorized(header: str | None, api_key: str | None) -> bool:
    """True when no key is configured or the header carries it."""
    if api_key is None:
        return True
    if header is None:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Constant-time compare so the key cannot be guessed byte by byte.
    return hmac.compare_digest(token.strip().encode(), api_key.encode())
