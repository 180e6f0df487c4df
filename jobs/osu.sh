#!/usr/bin/env bash
# hpcdl's allreduce against MPI_Allreduce and torch gloo on 2 ranks,
# OSU-style, 4 B to 16 MiB, with bus bandwidth.
# Usage: jobs/osu.sh [ranks] [osu_allreduce options]
source "$(dirname "$0")/env.sh"
export OMP_NUM_THREADS=1
RANKS="${1:-2}"
shift || true
if [ "$#" -eq 0 ]; then
    set -- -T mpi_float -m 4:16M --compare mpi,auto,gloo --busbw -c
fi
exec mpiexec -n "$RANKS" python -m benchmarks.osu_allreduce "$@"
