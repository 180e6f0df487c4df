"""Test set-up shared by the single-process and the mpiexec runs."""

from __future__ import annotations

import os

# one intra-op thread per rank: ranks already share two cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
