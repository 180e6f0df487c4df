#!/usr/bin/env bash
# The whole test suite: single-process tests, then the multi-rank tests under
# mpiexec -n 1, 2, 3 and 4. Every run has a hard time limit, so a deadlock fails, never hangs.
source "$(dirname "$0")/env.sh"
PYTEST_OPTS=(-q -p no:cacheprovider --timeout=300)
status=0

echo "== single process"
timeout -k 10 1200 python -m pytest "${PYTEST_OPTS[@]}" tests || status=1

for n in 1 2 3 4; do
    echo "== mpiexec -n $n"
    rm -f .pytest-rank*.log
    # thread timeouts end the process, so mpiexec ends the other ranks too
    if ! timeout -k 10 900 mpiexec -n "$n" python tests/mpi_pytest.py "${PYTEST_OPTS[@]}" \
            --timeout=120 --timeout-method=thread -m mpi tests; then
        status=1
        for f in .pytest-rank*.log; do
            [ -f "$f" ] && { echo "---- $f"; tail -n 60 "$f"; }
        done
    fi
done
rm -f .pytest-rank*.log
if [ "$status" -eq 0 ]; then echo "all test runs passed"; else echo "SOME TEST RUNS FAILED"; fi
exit "$status"
