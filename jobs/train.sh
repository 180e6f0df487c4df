#!/usr/bin/env bash
# The main job: hpcdl.train on N local ranks with the venv's mpiexec (default: the digits CNN
# on 2 ranks, about 18 s on a 2-core machine). Usage: jobs/train.sh [ranks] [hpcdl.train options]
#   jobs/train.sh 4 --model gpt --epochs 2 --precision bf16
source "$(dirname "$0")/env.sh"
export OMP_NUM_THREADS=1
RANKS="${1:-2}"
shift || true
exec mpiexec -n "$RANKS" python -m hpcdl.train "$@"
