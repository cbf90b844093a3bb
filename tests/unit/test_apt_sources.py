"""The deb-src line for the control-plane build comes from the machine's apt config."""

from __future__ import annotations

from pathlib import Path

import pytest
from tools.apt_sources import (
    AptSource,
    deb_src_line,
    debian_mirror,
    machine_apt_sources,
    parse_deb822_sources,
    parse_one_line_sources,
)

DEB822 = """\
Types: deb
# a snapshot comment
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Enabled: no
Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Components: main
"""

INLINE_KEY = """\
Types: deb
URIs: http://inline.example/debian/
Suites: trixie
Components: main
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 abc
 -----END PGP PUBLIC KEY BLOCK-----
"""

ONE_LINE = """\
# comment
deb [arch=amd64 signed-by=/etc/apt/keyrings/x.gpg] http://one.example/debian/ bookworm main
deb-src http://one.example/debian bookworm main
deb http://security.example/debian-security bookworm-security main # trailing
deb http://short.example/debian
"""


def test_deb822_keeps_enabled_deb_entries_with_their_key() -> None:
    entries = parse_deb822_sources(DEB822)
    assert entries == [
        AptSource(
            "http://mirror.example/debian",
            ("bookworm", "bookworm-updates"),
            ("main", "contrib"),
            "/usr/share/keyrings/debian-archive-keyring.gpg",
        ),
        AptSource(
            "http://mirror.example/debian-security",
            ("bookworm-security",),
            ("main",),
            "/usr/share/keyrings/debian-archive-keyring.gpg",
        ),
    ]


def test_deb822_inline_key_falls_back_to_default_keyring() -> None:
    (entry,) = parse_deb822_sources(INLINE_KEY)
    assert entry.uri == "http://inline.example/debian"
    assert entry.signed_by is None


def test_one_line_entries_with_options() -> None:
    entries = parse_one_line_sources(ONE_LINE)
    assert entries == [
        AptSource("http://one.example/debian", ("bookworm",), ("main",), "/etc/apt/keyrings/x.gpg"),
        AptSource(
            "http://security.example/debian-security", ("bookworm-security",), ("main",), None
        ),
    ]


def test_mirror_prefers_the_suite_and_skips_security() -> None:
    entries = parse_deb822_sources(DEB822)
    assert debian_mirror(list(reversed(entries)), "bookworm").uri == "http://mirror.example/debian"


def test_mirror_of_another_release_serves_bookworm() -> None:
    (trixie,) = parse_deb822_sources(INLINE_KEY)
    chosen = debian_mirror([trixie], "bookworm")
    assert (
        deb_src_line(chosen, "bookworm") == "deb-src http://inline.example/debian bookworm main\n"
    )


def test_no_debian_archive_is_a_clear_error() -> None:
    ubuntu = AptSource("http://archive.ubuntu.com/ubuntu", ("noble",), ("main",), None)
    with pytest.raises(LookupError, match="no Debian archive"):
        debian_mirror([ubuntu], "bookworm")


def test_deb_src_line_carries_signed_by() -> None:
    source = AptSource("http://m.example/debian", ("bookworm",), ("main",), "/k.gpg")
    assert deb_src_line(source, "bookworm") == (
        "deb-src [signed-by=/k.gpg] http://m.example/debian bookworm main\n"
    )


def test_machine_sources_reads_list_and_sources_files(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(ONE_LINE)
    (tmp_path / "sources.list.d" / "debian.sources").write_text(DEB822)
    (tmp_path / "sources.list.d" / "off.list.disabled").write_text(ONE_LINE)
    uris = [s.uri for s in machine_apt_sources(tmp_path)]
    assert uris == [
        "http://one.example/debian",
        "http://security.example/debian-security",
        "http://mirror.example/debian",
        "http://mirror.example/debian-security",
    ]
