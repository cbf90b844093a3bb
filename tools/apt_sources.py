"""The machine's apt configuration, parsed (pure functions).

The control-plane build needs a `deb-src` line for Debian's archive. It is
derived from the `deb` entries that apt already uses, so no mirror host is
written into the repository.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AptSource:
    """One `deb` entry from the machine's apt configuration."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str | None


def parse_deb822_sources(text: str) -> list[AptSource]:
    """The enabled `deb` entries of a deb822 `.sources` file."""
    entries: list[AptSource] = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = ""
        for raw in stanza.splitlines():
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            if raw[0] in " \t" and key:
                fields[key] += "\n" + raw.strip()
                continue
            if ":" not in raw:
                continue
            key, _, value = raw.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        signed_by = fields.get("signed-by")
        # An inline key block is not a path; apt's default keyring serves then.
        if signed_by is not None and ("\n" in signed_by or not signed_by.startswith("/")):
            signed_by = None
        for uri in fields.get("uris", "").split():
            entries.append(
                AptSource(
                    uri=uri.rstrip("/"),
                    suites=tuple(fields.get("suites", "").split()),
                    components=tuple(fields.get("components", "").split()),
                    signed_by=signed_by,
                )
            )
    return entries


def parse_one_line_sources(text: str) -> list[AptSource]:
    """The `deb` entries of a one-line-style `sources.list` file."""
    entries: list[AptSource] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        signed_by = None
        options = re.match(r"deb\s+\[([^\]]*)\]\s*", line)
        if options:
            for opt in options.group(1).split():
                name, _, value = opt.partition("=")
                if name == "signed-by" and value.startswith("/"):
                    signed_by = value
            rest = line[options.end() :].split()
        else:
            rest = line.split()[1:]
        if len(rest) < 3:
            continue
        entries.append(
            AptSource(
                uri=rest[0].rstrip("/"),
                suites=(rest[1],),
                components=tuple(rest[2:]),
                signed_by=signed_by,
            )
        )
    return entries


# Debian's release suites (not -security, -updates or -backports, which
# carry only some packages); any mirror serving one serves all of them.
DEBIAN_RELEASE_SUITES = frozenset(
    {"buster", "bullseye", "bookworm", "trixie", "forky", "duke", "sid"}
    | {"oldoldstable", "oldstable", "stable", "testing", "unstable"}
)


def debian_mirror(sources: Sequence[AptSource], suite: str) -> AptSource:
    """The machine's Debian archive entry to fetch `suite` main from.

    Prefers an entry that already serves `suite` main; otherwise takes the
    first entry serving another Debian release's main, since a Debian mirror
    serves every release. Raises LookupError when there is none (e.g. Ubuntu).
    """
    archives = [
        s
        for s in sources
        if "main" in s.components and DEBIAN_RELEASE_SUITES.intersection(s.suites)
    ]
    for s in archives:
        if suite in s.suites:
            return s
    if archives:
        return archives[0]
    raise LookupError(
        "no Debian archive serving 'main' in /etc/apt/sources.list or /etc/apt/sources.list.d/"
    )


def deb_src_line(source: AptSource, suite: str, kind: str = "deb-src") -> str:
    """A one-line `deb-src` (or, with `kind`, `deb`) entry for `suite` main from that mirror."""
    options = f"[signed-by={source.signed_by}] " if source.signed_by else ""
    return f"{kind} {options}{source.uri} {suite} main\n"


def machine_apt_sources(etc_apt: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every `deb` entry the machine's apt configuration holds."""
    entries: list[AptSource] = []
    main_list = etc_apt / "sources.list"
    if main_list.is_file():
        entries += parse_one_line_sources(main_list.read_text())
    parts = etc_apt / "sources.list.d"
    if parts.is_dir():
        for path in sorted(parts.iterdir()):
            if path.suffix == ".list":
                entries += parse_one_line_sources(path.read_text())
            elif path.suffix == ".sources":
                entries += parse_deb822_sources(path.read_text())
    return entries
