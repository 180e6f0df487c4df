#!/usr/bin/env bash
# The whole test suite: single-process tests, then the multi-rank tests under mpiexec -n 1, 2,
# 3 and 4 (at 3 and 4 less the collectives, ops, optimizer and device-array files, which run at
# 5 and 8); the collectives' tests again at 2 ranks with every wait sleeping at once, and at 4
# with every wait spinning first, as on a node with a core per rank; the collectives, ops,
# optimizer, Adasum, parameter-server, device-array and emulated-link tests at 5 ranks and the
# collectives, ops and optimizer tests at 8 (oversubscribed on a small machine).
# Every run has a hard time limit, so a deadlock fails, never hangs; a hung test prints every
# rank's stacks first. The ranks agree on each test's outcome (tests/conftest.py), and a
# collective left waiting by a rank that failed ends in a stall error within
# HPCDL_STALL_TIMEOUT, so one failing test never hangs the ones after it.
source "$(dirname "$0")/env.sh"
# the hundreds of processes the runs start read the package's bytecode, and pytest's
# rewritten test modules, from __pycache__ rather than each compiling them again (where the
# environment says not to write bytecode: 0.3 s of a process's start, 4 s of a rank's collection)
unset PYTHONDONTWRITEBYTECODE
echo "-- environment ready in ${SECONDS} s"
SECONDS=0
# SIGTERM (a CI runner or Slurm cancelling the job) and Ctrl-C end the running test job too: each
# runs in the background under `timeout`, which passes the signal on to its whole job
# (bash runs a trap only once the command it waits for ends, but `wait` it interrupts)
end_on_signal() {
    trap - TERM INT
    pkill -TERM -P $$ 2>/dev/null
    wait
    rm -f .pytest-rank*.log
    echo "stopped by signal: the test runs were ended" >&2
    exit "$1"
}
trap 'end_on_signal 143' TERM
trap 'end_on_signal 130' INT
# run COMMAND... in the background and wait for it: its status, and signals still reach the traps
in_bg() {
    "$@" &
    wait $!
}
PYTEST_OPTS=(-q -p no:cacheprovider --timeout=300)
# in the mpiexec runs: a collective, or an engine request, that waits a minute for another rank ends in an error
STALLS=(HPCDL_STALL_TIMEOUT="${HPCDL_STALL_TIMEOUT:-60}"
    HPCDL_STALL_SHUTDOWN_TIME_SECONDS="${HPCDL_STALL_SHUTDOWN_TIME_SECONDS:-60}")
status=0

echo "== single process"
# the slowest tests listed at the end, and each run's seconds: where the suite's time goes
in_bg timeout -k 10 1200 python -m pytest "${PYTEST_OPTS[@]}" --durations=15 tests || status=1
echo "-- single process: ${SECONDS} s"

# mpirun N [VAR=value ...] -- test files
mpirun() {
    local n="$1" envs=() files=()
    shift
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    files=("$@")
    echo "== mpiexec -n $n ${envs[*]} ${files[*]}"
    rm -f .pytest-rank*.log
    local start=$SECONDS
    # thread timeouts end the process, so mpiexec ends the other ranks too
    if ! in_bg env "${STALLS[@]}" "${envs[@]}" timeout -k 10 900 mpiexec -n "$n" python tests/mpi_pytest.py "${PYTEST_OPTS[@]}" \
            --timeout=120 --timeout-method=thread -m mpi "${files[@]}"; then
        status=1
        for f in .pytest-rank*.log; do
            [ -f "$f" ] && { echo "---- $f"; tail -n 80 "$f"; }
        done
    fi
    echo "-- mpiexec -n $n: $((SECONDS - start)) s"
}

# at 3 and 4 ranks, every file but those the 5-rank run covers too (the collectives, ops and
# optimizer tests also run at 8, a power of two as 4 is); Adasum (powers of two only) and the
# parameter servers keep their 3- and 4-rank runs
AT_5=(tests/test_collectives.py tests/test_collectives_errors.py tests/test_compiled_channel.py tests/test_memory_layouts.py
    tests/test_ops.py tests/test_optimizers.py tests/test_adasum.py tests/test_ps.py tests/test_device_arrays.py
    tests/test_front_door.py tests/test_link.py)
AT_8=(tests/test_collectives.py tests/test_ops.py tests/test_optimizers.py)
NOT_AT_3_4=(tests/test_collectives.py tests/test_collectives_errors.py tests/test_compiled_channel.py tests/test_memory_layouts.py
    tests/test_ops.py tests/test_optimizers.py tests/test_device_arrays.py)
for n in 1 2; do
    mpirun "$n" -- tests
done
for n in 3 4; do
    mpirun "$n" -- $(ls tests/test_*.py | grep -v -x -F "$(printf '%s\n' "${NOT_AT_3_4[@]}")")
done
mpirun 2 HPCDL_SHM_SPIN=0 -- tests/test_collectives.py tests/test_compiled_channel.py tests/test_window_buffers.py tests/test_pipeline.py
# ranks beyond the cores would sleep after a few polls; a node's ranks with a core each spin 2000
# (collectives.node.channel.SPIN) first: that path with more than two ranks waiting on one another
mpirun 4 HPCDL_SHM_SPIN=2000 -- tests/test_collectives.py tests/test_compiled_channel.py tests/test_window_buffers.py
mpirun 5 -- "${AT_5[@]}"
mpirun 8 -- "${AT_8[@]}"
rm -f .pytest-rank*.log
if [ "$status" -eq 0 ]; then echo "all test runs passed in ${SECONDS} s"; else echo "SOME TEST RUNS FAILED (${SECONDS} s)"; fi
exit "$status"
