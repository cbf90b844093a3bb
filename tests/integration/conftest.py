"""Fixtures shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.server_harness import save_tiny_pair


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny Llama pair (target, draft) in Hugging Face layout; tests only read it."""
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))
