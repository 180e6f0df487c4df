"""Algorithm selection: the algorithms each collective offers, the tuning table's lookup,
the shipped table, and what ``auto`` picks."""

from __future__ import annotations

import pytest

import collectives as C
from collectives.select import choose, rules


def test_algorithms_list_native_and_auto():
    for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"):
        names = C.algorithms(coll)
        assert "native" in names and names[-1] == "auto"
    assert {"ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical", "shm"} <= set(
        C.algorithms("allreduce")
    )
    with pytest.raises(ValueError):
        C.algorithms("scan")


def test_tuning_rules_lookup_exact_then_nearest_then_default():
    table = {
        "tables": [
            {"collective": "allreduce", "size": 2, "nodes": 1, "rules": [[100, "tree"], [None, "ring"]]},
            {"collective": "allreduce", "size": 8, "nodes": 1, "rules": [[None, "rabenseifner"]]},
        ]
    }
    assert rules(table, "allreduce", 2, 1)[0][1] == "tree"
    assert rules(table, "allreduce", 3, 1)[0][1] == "tree"
    assert rules(table, "allreduce", 7, 1)[0][1] == "rabenseifner"
    assert rules(table, "allreduce", 4, 2)[0][1] == "recursive_doubling"  # no multi-node table: defaults


def test_shipped_table_names_only_registered_algorithms():
    from collectives.select import REGISTRY, load_table

    table = load_table()
    assert table["tables"], "the package must ship a measured tuning table"
    for entry in table["tables"]:
        for _limit, name in entry["rules"]:
            assert name in REGISTRY[entry["collective"]], entry


def test_the_shipped_table_has_measured_rows_for_every_rank_count_it_was_run_at():
    """One node at 2, 3, 4, 8 and 16 ranks: each of the five collectives has its own row, so
    ``auto`` at those counts follows what was measured there, not the rows of another count;
    each row says on which machine it was measured."""
    import json

    from collectives.select import load_table

    table = load_table()
    have = {(e["collective"], e["size"]) for e in table["tables"] if e["nodes"] == 1}
    colls = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
    missing = [(c, n) for c in colls for n in (2, 3, 4, 8, 16) if (c, n) not in have]
    assert not missing, missing
    assert all(e.get("machine") for e in table["tables"])
    for n in (8, 16):  # the rows measured at one rank per core of a 16-core node
        got = {c: rules(table, c, n, 1) for c in colls}
        want = {e["collective"]: e["rules"] for e in table["tables"] if e["size"] == n and e["nodes"] == 1}
        assert got == want
        assert json.dumps(got) != json.dumps({c: rules(table, c, 4, 1) for c in colls})
    # a count between two measured ones takes the nearer row (the larger on a tie)
    assert rules(table, "allreduce", 12, 1) == rules(table, "allreduce", 16, 1)
    assert rules(table, "reduce", 6, 1) == rules(table, "reduce", 8, 1)
    assert rules(table, "reduce", 5, 1) == rules(table, "reduce", 4, 1)


def test_auto_never_picks_native_without_mpi():
    class Fake:
        comm = None
        size = 2

    class Ctx:
        transport = Fake()

        def __init__(self) -> None:
            self.picks: dict = {}

    for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"):
        for nbytes in (4, 1 << 30):
            assert choose(Ctx(), coll, nbytes) != "native"


def test_tuning_votes_for_the_algorithm_that_wins_most_sweeps():
    from collectives.tune import rules_from, vote

    # one slow spell (the second sweep) does not decide a size
    assert vote([{"shm": 1.0, "tree": 2.0}, {"shm": 9.0, "tree": 2.0}, {"shm": 1.1, "tree": 2.1}]) == "shm"
    # a tie goes to the lowest median over the sweeps: shm 5.0, tree 2.0
    assert vote([{"shm": 1.0, "tree": 2.0}, {"shm": 9.0, "tree": 2.0}]) == "tree"
    assert rules_from([(4, "shm"), (64, "shm"), (1024, "tree"), (16384, "shm")]) == [
        [256, "shm"],
        [4096, "tree"],
        [None, "shm"],
    ]
