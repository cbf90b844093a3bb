"""Output filters: run on verified text only, after the stop-string hold-back.

A filter sees the whole verified text released so far each time a chunk is
about to go out; a match withholds that chunk and ends the response with
``finish_reason: "content_filter"``.
"""

from __future__ import annotations

import re
from typing import Protocol

from specpair_runtime.config import ConfigError
from specpair_runtime.config import OutputFilter as OutputFilterConfig


class OutputFilter(Protocol):
    def check(self, verified_text: str) -> str | None:
        """Return why the text is refused, or None to release it."""


class DenyListFilter:
    """Refuse text that matches any of the configured regexes."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = [re.compile(pattern) for pattern in patterns]

    def check(self, verified_text: str) -> str | None:
        for pattern in self.patterns:
            if pattern.search(verified_text):
                return f"output matched deny pattern {pattern.pattern!r}"
        return None


class NoFilter:
    def check(self, verified_text: str) -> str | None:
        return None


def build_filter(config: OutputFilterConfig | None) -> OutputFilter:
    """The filter for ``serving.outputFilter``; bad regexes raise naming the field."""
    if config is None or not config.deny_patterns:
        return NoFilter()
    for index, pattern in enumerate(config.deny_patterns):
        try:
            re.compile(pattern)
        except re.error as error:
            raise ConfigError(
                f"serving.outputFilter.denyPatterns[{index}]: not a valid regex: {error}"
            ) from None
    return DenyListFilter(config.deny_patterns)
