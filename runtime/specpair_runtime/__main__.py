"""``python -m specpair_runtime``: the same CLI as the ``specpair-runtime`` script."""

import sys

from specpair_runtime.cli import main

sys.exit(main())
