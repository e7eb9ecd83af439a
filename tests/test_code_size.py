"""Rooms a newcomer can read: no module of src/kbv over 700 lines and no function over 80, counted
from its ``def`` line to its last line. The bundled problem suite (src/kbv/suite) is data, not
kbv's code, and is left out."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kbv"
EXCLUDED = PACKAGE / "suite"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function or method in ``source`` longer than ``limit``
    lines; nested functions count on their own and inside the function that holds them."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                found.append((node.name, node.lineno, length))
    return found


def _modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if EXCLUDED not in p.parents]


def _function_of(lines: int) -> str:
    """A function of exactly ``lines`` lines, its ``def`` included."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 2))
    return f"def f():\n{body}    return 0\n"


def test_the_scan_rejects_81_lines_and_accepts_80() -> None:
    assert long_functions(_function_of(81)) == [("f", 1, 81)]
    assert long_functions(_function_of(80)) == []
    method = "class C:\n" + "".join("    " + line + "\n" for line in _function_of(81).splitlines())
    assert long_functions(method) == [("f", 2, 81)]


def test_the_scan_sees_the_package() -> None:
    modules = _modules()
    assert PACKAGE / "store.py" in modules and PACKAGE / "serve" / "_app.py" in modules
    assert not any(EXCLUDED in p.parents for p in modules)


def test_no_module_over_700_lines() -> None:
    over = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by topic): {over}"


def test_no_function_over_80_lines() -> None:
    over = [
        f"{p.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for p in _modules()
        for name, line, length in long_functions(p.read_text())
    ]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named helpers): {over}"
