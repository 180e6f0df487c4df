"""The source tree's layering, read with ``ast``: no import circle in ``collectives`` or
``hpcdl`` (function-level imports included), no module importing another module's
underscore names, the arrows ``hpcdl.train -> hpcdl.optim -> runtime -> collectives``
pointing down only, and inside ``collectives`` its subpackages layered by concern:
plumbing, then the node engine, the algorithms, the per-communicator context and the
registry, argument agreement, the one-step path and the device package, and the public
API on top."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("collectives", "hpcdl")


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, list[str], int]]:
    """(target module, imported names, line) of every import of ours in ``path``."""
    base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                parts = parts[: len(parts) - node.level + 1]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] in PACKAGES:
                out.append((target, [a.name for a in node.names], node.lineno))
    return out


def _edges() -> dict[str, set[str]]:
    """Module -> the modules it imports (``from pkg import mod`` names the module itself)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for target, names, _ in _imports(name, path):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            graph[name].update(subs or ([target] if target in MODULES else []))
    return graph


def test_no_import_circle():
    graph = _edges()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t) :] + [t]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_module_imports_another_modules_underscore_names():
    bad = []
    for name, path in MODULES.items():
        for target, names, line in _imports(name, path):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and f"{target}.{n}" not in MODULES:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {n} from {target}")
    assert not bad, "\n".join(bad)


def _layer(module: str) -> int:
    if module.startswith("collectives"):
        return 0
    if module.startswith(("hpcdl.train",)):
        return 3
    if module.startswith(("hpcdl.optim", "hpcdl.parallel")):
        return 2
    if module == "hpcdl":  # the package's front door re-exports every layer but the job
        return 2
    return 1  # the runtime


COLLECTIVES_LAYERS = (
    # lowest first; a module may import its own layer and those below
    (
        "collectives.errors",
        "collectives.config",
        "collectives.ops",
        "collectives.blocks",
        "collectives.transport",
        "collectives.fake",
        "collectives.cost",
        "collectives.link",
        "collectives.cli",
        "collectives.launcher",
    ),
    (
        "collectives.node.futex",
        "collectives.node.channel",
        "collectives.node.cslots",
        "collectives.node.arena",
        "collectives.node.slots",
        "collectives.node.staged",
        "collectives.node.inplace",
    ),
    ("collectives.algorithms",),
    ("collectives.context", "collectives.select"),
    ("collectives.agreement",),
    ("collectives.node.onestep", "collectives.device"),
    ("collectives.api", "collectives.buffers", "collectives.unchecked", "collectives.tune"),
)


def _collectives_layer(module: str) -> int | None:
    """The layer of a module of ``collectives`` (None: a package's front door, above all)."""
    for level, prefixes in enumerate(COLLECTIVES_LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


def test_every_collectives_module_has_a_layer():
    """A new module must be placed: the check below would miss one it does not know."""
    fronts = {"collectives", "collectives.node", "collectives.device", "collectives.algorithms"}
    unplaced = [m for m in MODULES if m.startswith("collectives") and m not in fronts and _collectives_layer(m) is None]
    assert not unplaced, f"add these to COLLECTIVES_LAYERS: {unplaced}"


def test_collectives_subpackages_point_down_only():
    """Plumbing knows no algorithm or engine, the node engine no algorithm, the algorithms
    no device memory and no public call, and nothing below the public API imports it."""
    bad = []
    for name, targets in _edges().items():
        mine = _collectives_layer(name)
        if not name.startswith("collectives") or mine is None:
            continue
        for t in targets:
            theirs = _collectives_layer(t)
            if theirs is None or theirs > mine:
                bad.append(f"{name} (layer {mine}) imports {t} (layer {theirs})")
    assert not bad, "\n".join(sorted(bad))


def test_layers_point_down_only():
    bad = []
    for name, targets in _edges().items():
        for t in targets:
            if _layer(t) > _layer(name):
                bad.append(f"{name} (layer {_layer(name)}) imports {t} (layer {_layer(t)})")
    assert not bad, "\n".join(sorted(bad))


def test_the_checks_see_a_circle_and_an_underscore_import(tmp_path, monkeypatch):
    """The walker resolves relative imports, so a planted circle is found."""
    pkg = tmp_path / "hpcdl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import _hidden\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    graph = {}
    for n in ("hpcdl.a", "hpcdl.b"):
        graph[n] = _imports(n, pkg / (n.split(".")[1] + ".py"))
    assert graph["hpcdl.a"] == [("hpcdl.b", ["_hidden"], 1)]
    assert graph["hpcdl.b"] == [("hpcdl", ["a"], 2)]
