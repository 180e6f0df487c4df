#!/usr/bin/env bash
# Characterise this node in one command (about 8 minutes): the collectives against MPI and
# the tuner at 2, 4, 8 ... ranks up to one per core, training-step ratios, the pipeline
# bubble, the planner against the GPT's measured steps, the parameter servers against allreduce across emulated
# Ethernet, and the GPU paths where there is a GPU. Writes DIR (default node_report/): summary.md first,
# report.json, ratios.png, tuning.json (for HPCDL_TUNING_FILE), ps_links.{md,svg,json}, raw/. Extra arguments go to the report
# (--budget SECONDS, --max-ranks N, --quick, --bind none: ranks unbound instead of a core each).
source "$(dirname "$0")/env.sh"
out="${1:-node_report}"
shift || true
exec python -m benchmarks.node_report --out "$out" "$@"
