#!/usr/bin/env bash
# The byte-level GPT trained by hpcdl.train on one rank and on each 4-rank DP x TP x PP grid,
# with the same global batch and learning rate (a grid with dp = 2 takes half the batch per
# replica and no learning-rate scaling): the held-out perplexities side by side.
#   benchmarks/grid_perplexity.sh [extra hpcdl.train flags, e.g. --epochs 3]
set -euo pipefail
cd "$(dirname "$0")/.."
source jobs/env.sh
out=$(mktemp -d)
common=(-m hpcdl.train --model gpt --no-progress --checkpoint-every 0 --epochs 1 "$@")
run() {  # name, ranks, flags...
    local name=$1 n=$2; shift 2
    local t0=$SECONDS
    mpiexec -n "$n" python "${common[@]}" --run-dir "$out/$name" "$@" > "$out/$name.log" 2>&1 \
        || { echo "$name failed:"; tail -5 "$out/$name.log"; exit 1; }
    python - "$out/$name/summary.json" "$name" "$n" "$((SECONDS - t0))" "$*" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
g = s["grid"]
print(f"{sys.argv[2]:<10} {sys.argv[3]:>5}  {g['dp']}x{g['tp']}x{g['pp']:<4} {s['steps']:>5} {s['final']['perplexity']:>10.4f} "
      f"{sys.argv[4]:>6}  {sys.argv[5]}", flush=True)
PY
}
echo "# $(date -u +%Y-%m-%d) $(uname -n), $(nproc --all) cores; hpcdl.train ${common[*]:2}"
printf "%-10s %5s  %-9s %5s %10s %6s  %s\n" run ranks grid steps perplexity wall_s flags
run one-rank 1
run 1x2x2 4 --tp 2 --pp 2 --chunks 4
run 1x1x4 4 --pp 4 --chunks 8 --pp-schedule gpipe
run 1x4x1 4 --tp 4 --sequence-parallel
run 2x2x1 4 --tp 2 --batch-size 16 --lr-scaling none
run 2x1x2 4 --pp 2 --chunks 4 --batch-size 16 --lr-scaling none
rm -rf "$out"
