#!/usr/bin/env bash
# The main job (for now): our allreduce against MPI_Allreduce on 2 ranks, 4 B to 64 MiB.
# Usage: jobs/quickstart.sh [ranks] [benchmark options]
source "$(dirname "$0")/env.sh"
RANKS="${1:-2}"
shift || true
exec mpiexec -n "$RANKS" python -m benchmarks.allreduce_vs_native "$@"
