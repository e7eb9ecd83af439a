"""C++/CUDA sources embedded in a candidate: extraction from the Python AST and line-wise scanning."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass

from kbv.integrity._pyast import Analysis

# Keyword arguments (and positional slots) of the loaders that take C++/CUDA source text.
_SOURCE_KEYWORDS = {"cpp_sources", "cuda_sources", "sources", "code", "src", "source"}
_LOADER_POSITIONS = {"load_inline": (1, 2), "RawKernel": (0,), "RawModule": (0,), "ElementwiseKernel": (2,)}

_STRONG = re.compile(r"#\s*include\b|__global__|PYBIND11_MODULE|\bcuda[A-Z]\w*\s*\(|TORCH_LIBRARY")
_WEAK = re.compile(
    r"#\s*define\b|__device__|\btorch::|\bat::|\bblockIdx\b|\bthreadIdx\b|extern\s+\"C\"|\bstd::"
    r"|\bvoid\s+\w+\s*\(|\b(?:int|float|double|auto)\s+\w+\s*=[^=]|;\s*$",
    re.MULTILINE,
)
_COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.DOTALL)


@dataclass(frozen=True)
class CppSource:
    """One C++/CUDA text and where it sits in the candidate (``exact``: line ``k`` of the text is
    Python line ``pyline + k - 1``; otherwise the text was assembled and only ``pyline`` is known)."""

    key: str
    text: str
    pyline: int
    exact: bool

    def python_line(self, cpp_line: int) -> int:
        return self.pyline + cpp_line - 1 if self.exact else self.pyline


def looks_like_cpp(text: str) -> bool:
    if len(text) < 20 or "\n" not in text.strip() and len(text) < 60:
        return bool(_STRONG.search(text)) and len(text) >= 20
    return bool(_STRONG.search(text)) or len(set(m.group(0)[:6] for m in _WEAK.finditer(text))) >= 3


def strip_comments(text: str) -> str:
    """Blank out comments (keeping line breaks) so that prose never triggers a finding."""

    def blank(match: re.Match[str]) -> str:
        token = match.group(0)
        if token.startswith(("//", "/*")):
            return re.sub(r"[^\n]", " ", token)
        return token

    return _COMMENT_OR_STRING.sub(blank, text)


def extract(analysis: Analysis) -> list[CppSource]:
    """Every string the candidate hands to a C++/CUDA loader, plus any other C++-looking string."""
    found: dict[str, CppSource] = {}
    for call, qual in analysis.calls():
        loader = (qual or "").rsplit(".", 1)[-1]
        if loader not in _LOADER_POSITIONS and loader != "load":
            continue
        exprs: list[tuple[str, ast.expr]] = [
            (kw.arg, kw.value) for kw in call.keywords if kw.arg is not None and kw.arg in _SOURCE_KEYWORDS
        ]
        for pos in _LOADER_POSITIONS.get(loader, ()):
            if pos < len(call.args):
                exprs.append((loader, call.args[pos]))
        for label, expr in exprs:
            for text, node in _strings_in(analysis, expr):
                _add(found, label, text, node)
    for node in ast.walk(analysis.tree):
        if isinstance(node, (ast.Constant, ast.BinOp, ast.JoinedStr, ast.Call)) and not _inside_fold(
            analysis, node
        ):
            folded = analysis.fold(node)
            if folded is not None and folded not in found and looks_like_cpp(folded):
                _add(found, "string", folded, node)
    return sorted(found.values(), key=lambda s: s.pyline)


def _strings_in(analysis: Analysis, expr: ast.expr, depth: int = 0) -> Iterator[tuple[str, ast.AST]]:
    """Strings an argument evaluates to: a folded constant, a list of them, or a name bound to one."""
    if depth > 5:
        return
    text = analysis.fold(expr)
    if text is not None:
        origin: ast.AST = expr
        if isinstance(expr, ast.Name) and expr.id in analysis.assigned:
            origin = analysis.assigned[expr.id]
        yield text, origin
    elif isinstance(expr, (ast.List, ast.Tuple)):
        for element in expr.elts:
            yield from _strings_in(analysis, element, depth + 1)
    elif isinstance(expr, ast.Name) and expr.id in analysis.assigned:
        yield from _strings_in(analysis, analysis.assigned[expr.id], depth + 1)


def _inside_fold(analysis: Analysis, node: ast.AST) -> bool:
    parent = analysis.parents.get(node)
    return parent is not None and analysis.fold(parent) is not None


def _add(found: dict[str, CppSource], label: str, text: str, node: ast.AST) -> None:
    exact = isinstance(node, ast.Constant)
    line = getattr(node, "lineno", 0)
    previous = found.get(text)
    if previous is not None and (previous.exact or not exact):
        return
    found[text] = CppSource(f"{label}@line{line}", text, line, exact)


def search(source: CppSource, pattern: re.Pattern[str]) -> Iterator[tuple[int, str, re.Match[str]]]:
    """Matches of ``pattern`` in the comment-free text: (Python line, quoted C++ line, match)."""
    clean = strip_comments(source.text)
    original = source.text.splitlines()
    for match in pattern.finditer(clean):
        cpp_line = clean.count("\n", 0, match.start()) + 1
        text = original[cpp_line - 1].strip() if cpp_line <= len(original) else match.group(0)
        yield source.python_line(cpp_line), text, match
