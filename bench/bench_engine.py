"""``make bench``: target-only vs specpair vs HF assisted generation on the real pair.

A thin wrapper over ``specpair-runtime bench`` that points it at the Qwen2.5-Coder
0.5B (draft) -> 1.5B (target) pair in the cache. All modes run in one process on
the same loaded models and prompts, so the printed ratios compare like with
like; three rounds by default, ratios are medians over rounds with their
spread. The draft is int4-weight on the CPU (the target stays fp32, so the
output is unchanged); pass extra ``specpair-runtime bench`` flags through
(``--draft-quantization int8-dynamic`` for the earlier draft).

``--shaped-pair`` runs it on a pair of the real pair's architecture with random
weights instead (``tools/shaped_pair.py``; for a GPU machine that cannot fetch
the pair): its step costs and the engine's overhead per step are real, while
its acceptance, and so every speedup, means nothing.

    .venv/bin/python bench/bench_engine.py [--depths 2,4,6] [--runs 3] [--plot FILE.png]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from specpair_runtime.openmp import openmp_defaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads sleep when idle but spin briefly between ops (before torch loads).
os.environ.update(openmp_defaults(os.environ))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


if TYPE_CHECKING:
    from tools.fetch_models import Role

SHAPED_PAIR_FLAG = "--shaped-pair"


def main(extra: list[str]) -> int:
    from tools.shaped_pair import bench_pair

    shaped = SHAPED_PAIR_FLAG in extra
    with bench_pair(shaped=shaped) as dirs:
        if dirs is None:
            return 2
        if shaped:
            print(
                "shaped pair (random weights): step costs are real; "
                "acceptance and speedups are not",
                flush=True,
            )
        return bench(dirs, [flag for flag in extra if flag != SHAPED_PAIR_FLAG])


def bench(dirs: Mapping[Role, Path], extra: list[str]) -> int:
    """``specpair-runtime bench`` on the pair in ``dirs``, with make bench's defaults."""
    import torch

    from specpair_runtime.cli import main as cli_main
    from specpair_runtime.config import recommended_draft_quantization
    from specpair_runtime.cpu_threads import apply_cpu_threads

    quantization = recommended_draft_quantization("cuda" if torch.cuda.is_available() else "cpu")
    defaults = ["--depths", "2,4,6", "--max-new-tokens", "32"]
    # Medians over 3 rounds, with their spread.
    rounds = [] if any(a.startswith("--runs") for a in extra) else ["--runs", "3"]
    argv = [
        "bench",
        "--target",
        str(dirs["target"]),
        "--draft",
        str(dirs["draft"]),
        "--draft-quantization",
        quantization,
        *(defaults if not any(a.startswith("--depths") for a in extra) else []),
        *rounds,
        *extra,
    ]
    threads, why = apply_cpu_threads(None)  # as the bench command will: a quota caps them
    print(
        f"torch threads: {threads} ({why}), "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '')}"
    )
    print("command: specpair-runtime " + " ".join(argv), flush=True)
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
