# Sourced by the other job scripts: make sure .venv exists with hpcdl installed, then use it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# the pin keeps pip on the CPU build of torch; the stamp skips the install when nothing changed
# (the install also compiles collectives/node/cslots.c, so a newer C source installs again)
STAMP="$VENV/.hpcdl-installed"
if [ ! -f "$STAMP" ] || [ -n "$(find "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/collectives" -maxdepth 2 \
    \( -name setup.cfg -o -name setup.py -o -name '*.c' \) -newer "$STAMP" 2>/dev/null)" ]; then
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0" -e "$ROOT[test]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$ROOT"
