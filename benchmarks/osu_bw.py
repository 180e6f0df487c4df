"""OSU-style point-to-point bandwidth (64 sends in flight, rank 0 to 1); see :mod:`benchmarks.osu`.

Run: ``mpiexec -n 2 python benchmarks/osu_bw.py [options]`` (``--help`` lists them).
"""

import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.osu import main  # noqa: E402
from collectives.cli import run_main  # noqa: E402

if __name__ == "__main__":
    run_main(lambda: main("bw"))
