"""Copy crds/*.yaml into the Helm chart's crds/ byte for byte (run by `make crds`).

Helm installs what is in a chart's crds/ directory; the chart must carry the
very same CRD that `kubectl apply -f crds/` installs.

    python -m tools.sync_chart_crds           # copy
    python -m tools.sync_chart_crds --check   # exit 1 when they differ
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "crds"
CHART_CRDS = ROOT / "charts" / "specpair-operator" / "crds"


def crd_files(source: Path = SOURCE) -> list[Path]:
    """The generated CRDs: the YAML files directly in crds/ (not the samples)."""
    return sorted(p for p in source.glob("*.yaml") if p.is_file())


def out_of_sync(source: Path = SOURCE, chart_crds: Path = CHART_CRDS) -> list[str]:
    """Names of the files that are missing, stale or extra in the chart."""
    wanted = {p.name: p.read_bytes() for p in crd_files(source)}
    present = {p.name: p.read_bytes() for p in crd_files(chart_crds)} if chart_crds.is_dir() else {}
    return sorted(
        name for name in wanted.keys() | present.keys() if wanted.get(name) != present.get(name)
    )


def sync(source: Path = SOURCE, chart_crds: Path = CHART_CRDS) -> list[str]:
    """Make the chart's crds/ equal to crds/*.yaml; return the names it changed."""
    changed = out_of_sync(source, chart_crds)
    chart_crds.mkdir(parents=True, exist_ok=True)
    wanted = {p.name for p in crd_files(source)}
    for name in changed:
        if name in wanted:
            shutil.copyfile(source / name, chart_crds / name)
        else:
            (chart_crds / name).unlink()
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="Only compare; exit 1 on a difference."
    )
    args = parser.parse_args(argv)
    if not crd_files():
        print(f"error: no CRD YAML in {SOURCE}; run `make crds`", file=sys.stderr)
        return 2
    if args.check:
        stale = out_of_sync()
        if stale:
            print(f"out of sync with crds/: {', '.join(stale)}; run `make crds`", file=sys.stderr)
            return 1
        print("chart CRDs match crds/")
        return 0
    changed = sync()
    print(f"synced {CHART_CRDS.relative_to(ROOT)}: {', '.join(changed) or 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
