# Sourced by the other job scripts: make sure .venv exists with hpcdl installed, then use it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# the pin keeps pip on the CPU build of torch; the stamp skips the install when nothing changed
STAMP="$VENV/.hpcdl-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/setup.cfg" -nt "$STAMP" ]; then
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0" -e "$ROOT[test]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$ROOT"
