"""OpenMP thread waiting on the CPU path: sleep when idle, spin briefly between ops.

torch's CPU wheel runs its kernels on GNU OpenMP (libgomp). How an idle
worker thread waits for the next parallel region decides two costs:

- Spinning for libgomp's default (about 3 ms, ``OMP_WAIT_POLICY`` unset) or for
  good (``ACTIVE``) starves every other thread on a shared machine: on 2 cores
  beside a server's event loop or a second process, matmuls ran 10-75x slower.
- Sleeping at once (``PASSIVE``) makes every op wake the worker with a futex,
  about 0.1 ms a parallel region on 2 cores (Xeon, AVX-512). A decode step is
  hundreds of small ops: the int8 0.5B draft's forward of one token took 58 ms
  under ``PASSIVE`` and 39 ms with a short spin; the fp32 1.5B target's 316 ms
  and 303 ms (2 threads, medians of 3 processes).

So the runtime sleeps as ``PASSIVE`` does, but first spins ``SPIN_COUNT``
rounds (``GOMP_SPINCOUNT``; libgomp's estimate is about 100,000 rounds a
millisecond, so about 0.1 ms): long enough to bridge the gap between two ops
of one forward, short enough that an idle worker gives the cores back at once.

libgomp reads these variables once, when torch loads it, so they must be set
before ``import torch``. A value the user set always wins, and a spin count
is only added to the ``PASSIVE`` policy (under ``ACTIVE`` it would cut the
spinning short).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

WAIT_POLICY = "PASSIVE"
SPIN_COUNT = 10_000


def openmp_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP variables to add to ``environ`` (none that it already sets)."""
    added: dict[str, str] = {}
    policy = environ.get("OMP_WAIT_POLICY")
    if policy is None:
        policy = added["OMP_WAIT_POLICY"] = WAIT_POLICY
    if "GOMP_SPINCOUNT" not in environ and policy.strip().upper() == "PASSIVE":
        added["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return added


def openmp_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the OpenMP defaults filled in (for a child process)."""
    return {**environ, **openmp_defaults(environ)}


def apply_openmp_defaults() -> None:
    """Fill in the defaults in ``os.environ``; call it before ``import torch``."""
    os.environ.update(openmp_defaults(os.environ))
