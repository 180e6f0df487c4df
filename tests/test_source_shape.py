"""The source tree's shape, read with ``ast``: no function or method of the product
(``collectives``, ``hpcdl``, ``benchmarks``) runs over 80 lines, unless its docstring says
why it must (a sentence starting "Long because")."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 80


def long_functions(root: pathlib.Path, limit: int = LIMIT) -> list[str]:
    """``path:line name (n lines)`` of every function over ``limit`` lines under ``root``
    whose docstring does not say why it is long."""
    out = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit and "Long because" not in (ast.get_docstring(node) or ""):
                    out.append(f"{f}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_runs_over_80_lines():
    found = [line for pkg in ("collectives", "hpcdl", "benchmarks") for line in long_functions(ROOT / pkg)]
    assert not found, "split these into named steps:\n" + "\n".join(found)


def test_the_check_sees_a_long_function_and_its_reason(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "a.py").write_text(f"def long():\n{body}\n\n\ndef said():\n    '''Long because it is.'''\n{body}\n")
    found = long_functions(tmp_path)
    assert len(found) == 1 and "long (81 lines)" in found[0], found
