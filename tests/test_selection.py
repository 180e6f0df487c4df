"""Algorithm selection: the algorithms each collective offers, the tuning table's lookup,
the shipped table, and what ``auto`` picks."""

from __future__ import annotations

import pytest

import collectives as C
from collectives.cost import AlphaBeta
from collectives.select import choose, ps_own, rules


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


def test_rows_measured_oversubscribed_are_passed_over_where_ranks_have_a_core_each():
    over = {"oversubscribed": True}
    table = {
        "tables": [
            {"collective": "allreduce", "size": 2, "nodes": 1, "rules": [[None, "tree"]]},
            {"collective": "allreduce", "size": 4, "nodes": 1, "rules": [[None, "ring"]], **over},
            {"collective": "allreduce", "size": 8, "nodes": 1, "rules": [[None, "rabenseifner"]]},
            {"collective": "reduce", "size": 4, "nodes": 1, "rules": [[None, "shm"]], **over},
        ]
    }
    # a core per rank: the nearest row measured so (the larger on a tie), not the exact one
    assert rules(table, "allreduce", 4, 1, False) == [[None, "tree"]]
    assert rules(table, "allreduce", 5, 1, False) == [[None, "rabenseifner"]]
    assert rules(table, "allreduce", 3, 1, False) == [[None, "tree"]]
    # oversubscribed, or not known: every row, the exact one first
    assert rules(table, "allreduce", 4, 1, True) == rules(table, "allreduce", 4, 1) == [[None, "ring"]]
    assert rules(table, "allreduce", 3, 1, True) == [[None, "ring"]]
    # only oversubscribed rows of the kind: they are still better than no measurement
    assert rules(table, "reduce", 8, 1, False) == [[None, "shm"]]
    assert rules(table, "allreduce", 4, 2, False)[0][1] == "recursive_doubling"  # several nodes: defaults


def test_the_tuning_file_check_names_a_bad_oversubscribed_word(tmp_path):
    import json

    from collectives.config import ConfigError, read_tuning_file

    path = tmp_path / "t.json"
    row = {"collective": "allreduce", "size": 4, "nodes": 1, "rules": [[None, "ring"]], "oversubscribed": "yes"}
    path.write_text(json.dumps({"tables": [row]}))
    with pytest.raises(ConfigError, match=r'tables\[0\]: "oversubscribed" is true or false, not \'yes\''):
        read_tuning_file(str(path))
    row["oversubscribed"] = True
    path.write_text(json.dumps({"tables": [row]}))
    assert read_tuning_file(str(path))["tables"][0]["oversubscribed"] is True


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
    # the 3- and 4-rank rows were measured on 2 cores: a node with a core per rank at 3-5
    # ranks follows the rows measured so (2 ranks on 2 cores; 8 on a 16-core node)
    over = {(e["collective"], e["size"]) for e in table["tables"] if e.get("oversubscribed")}
    assert over == {(c, n) for c in colls for n in (3, 4)}
    assert all(isinstance(e.get("oversubscribed"), bool) for e in table["tables"] if e["nodes"] == 1)
    for c in colls:
        assert rules(table, c, 3, 1, False) == rules(table, c, 4, 1, False) == rules(table, c, 2, 1)
        assert rules(table, c, 5, 1, False) == rules(table, c, 8, 1)
        assert rules(table, c, 4, 1, True) == rules(table, c, 4, 1)


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


def test_merging_tables_replaces_rows_of_the_same_kind_and_keeps_the_rest():
    from collectives.tune import merge

    def row(coll: str, size: int, algo: str, nodes: int = 1) -> dict:
        return {"collective": coll, "size": size, "nodes": nodes, "rules": [[None, algo]]}

    base = {
        "machine": "per entry",
        "tables": [row("allreduce", 2, "shm"), row("allreduce", 8, "ring"), row("allreduce", 8, "tree", 2)],
        "node_paths": [{"size": 2, "alpha": 1e-6, "beta": 1e9}, {"size": 8, "alpha": 2e-6, "beta": 2e9}],
        "runs": ["first"],
    }
    frozen = repr(base)
    new = {"tables": [row("allreduce", 8, "shm"), row("bcast", 8, "shm")], "runs": ["second"]}
    new["node_paths"] = [{"size": 8, "alpha": 3e-6, "beta": 3e9}]
    out = merge(base, new, "node X")
    assert repr(base) == frozen  # the base is not changed
    got = {(e["collective"], e["size"], e["nodes"]): (e["rules"][0][1], e.get("machine")) for e in out["tables"]}
    assert got == {
        ("allreduce", 2, 1): ("shm", None),
        ("allreduce", 8, 1): ("shm", "node X"),  # the same collective, ranks and nodes: replaced, labelled
        ("allreduce", 8, 2): ("tree", None),  # another node count: kept
        ("bcast", 8, 1): ("shm", "node X"),
    }
    assert [(p["size"], p["alpha"]) for p in out["node_paths"]] == [(2, 1e-6), (8, 3e-6)]
    # the parameter servers' own work: the new table's, where it has one, else the base's
    assert ps_own(out) is None and "ps_own" not in out
    owned = merge(out, {"ps_own": {"alpha": 1e-4, "beta": 2e9}})
    assert ps_own(owned) == AlphaBeta(1e-4, 2e9) and ps_own(merge(owned, new)) == AlphaBeta(1e-4, 2e9)
    assert ps_own(merge(owned, {"ps_own": {"alpha": 0, "beta": 3e9}})) == AlphaBeta(0.0, 3e9)
    assert ps_own(owned, "ps_phases") is None  # the hybrid's phases inside a node: a key of their own
    phased = merge(owned, {"ps_phases": {"alpha": 2e-3, "beta": 1e9}})
    assert ps_own(phased, "ps_phases") == AlphaBeta(2e-3, 1e9) and ps_own(phased) == AlphaBeta(1e-4, 2e9)
    assert out["runs"] == ["first", "second"] and out["machine"] == "per entry"
    # what auto reads from it: the merged row
    assert rules(out, "allreduce", 8, 1) == [[None, "shm"]] and rules(out, "allreduce", 8, 2) == [[None, "tree"]]
    assert "machine" not in merge(base, new)["tables"][1]
