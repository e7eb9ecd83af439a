"""What every static check shares: the parsed candidate (:class:`StaticContext`), the
finding collector and the helpers that name what a line calls."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

from kbv.integrity import _cpp
from kbv.integrity._cpp import CppSource
from kbv.integrity._pyast import Analysis, under
from kbv.integrity._registry import get_check
from kbv.records import Finding


@dataclass
class StaticContext:
    """What a static check may read. Build one with :meth:`StaticContext.build`."""

    source: str
    path: str = "<candidate>"
    cpp_sources: dict[str, str] = field(default_factory=dict)
    problem_source: str | None = None
    problem_dtype_fp32: bool = True
    analysis: Analysis | None = None
    parse_error: str | None = None
    cpp: list[CppSource] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        source: str,
        *,
        path: str = "<candidate>",
        problem_source: str | None = None,
        problem_dtype_fp32: bool = True,
    ) -> StaticContext:
        try:
            analysis: Analysis | None = Analysis(source)
            error = None
        except (SyntaxError, ValueError, RecursionError) as exc:
            analysis, error = None, f"line {getattr(exc, 'lineno', 0) or 0}: {exc.__class__.__name__}: {exc}"
        if analysis is not None:
            cpp = _cpp.extract(analysis)
        else:  # unparsable Python: scan the whole file as if it were C++, so nothing hides behind it
            cpp = [CppSource("whole_file@line1", source, 1, True)]
        return cls(
            source=source,
            path=path,
            cpp_sources={s.key: s.text for s in cpp},
            problem_source=problem_source,
            problem_dtype_fp32=problem_dtype_fp32,
            analysis=analysis,
            parse_error=error,
            cpp=cpp,
        )

    @cached_property
    def problem(self) -> Analysis | None:
        if not self.problem_source:
            return None
        try:
            return Analysis(self.problem_source)
        except (SyntaxError, ValueError, RecursionError):
            return None

    @cached_property
    def references(self) -> list[tuple[ast.AST, str]]:
        """Every name-like expression with its resolved dotted name (imports, getattr, __dict__...)."""
        a = self.analysis
        if a is None:
            return []
        out: list[tuple[ast.AST, str]] = []
        for node in ast.walk(a.tree):
            if isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
                qual = a.qualname(node)
                if qual:
                    out.append((node, qual))
        return out

    @cached_property
    def imports(self) -> list[tuple[str, ast.AST]]:
        """Imported module names, including ``__import__``/``import_module`` of folded strings."""
        a = self.analysis
        if a is None:
            return []
        found = list(a.imports)
        for call, func in a.calls():
            if (a.is_builtin(func, "__import__") or func == "importlib.import_module") and call.args:
                name = a.fold(call.args[0])
                if name:
                    found.append((name, call))
        return found

    @cached_property
    def strings(self) -> list[tuple[ast.AST, str]]:
        """Maximal constant-string expressions (``"a" + "b"`` is one string, not two)."""
        a = self.analysis
        if a is None:
            return []
        out: list[tuple[ast.AST, str]] = []
        for node in ast.walk(a.tree):
            if isinstance(node, (ast.Constant, ast.BinOp, ast.JoinedStr, ast.Call, ast.Name, ast.Subscript)):
                text = a.fold(node)
                parent = a.parents.get(node)
                if text is not None and (parent is None or a.fold(parent) is None):
                    out.append((node, text))
        return out


class _Report:
    """Collects one check's findings: one per (line, severity), each quoting its line."""

    def __init__(self, check: str, ctx: StaticContext) -> None:
        self.check = check
        self.default = get_check(check).default_severity
        self.ctx = ctx
        self._found: list[tuple[int, Finding]] = []
        self._seen: set[tuple[int, str]] = set()

    @property
    def findings(self) -> list[Finding]:
        """The findings in line order."""
        return [f for _, f in sorted(self._found, key=lambda item: item[0])]

    def py(self, node: ast.AST | int, reason: str, severity: str | None = None) -> None:
        assert self.ctx.analysis is not None
        line, text = self.ctx.analysis.quote(node)
        self._add(line, f"line {line}: {_short(text)} -- {reason}", severity)

    def cpp(self, source: CppSource, line: int, text: str, reason: str, severity: str | None = None) -> None:
        self._add(line, f"line {line}: {_short(text)} -- {reason} (C++/CUDA source {source.key})", severity)

    def cpp_pattern(self, pattern: re.Pattern[str], reason: str, severity: str | None = None) -> None:
        for source in self.ctx.cpp:
            for line, text, match in _cpp.search(source, pattern):
                self.cpp(source, line, text, reason.format(match=match.group(0)), severity)

    def _add(self, line: int, detail: str, severity: str | None) -> None:
        sev = severity or self.default
        if (line, sev) in self._seen:
            return
        self._seen.add((line, sev))
        self._found.append((line, Finding(self.check, sev, detail)))


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _last(qual: str) -> str:
    return qual.rsplit(".", 1)[-1]


def _module_hits(
    ctx: StaticContext, modules: tuple[str, ...], allowed: tuple[str, ...] = ()
) -> Iterator[tuple[ast.AST, str]]:
    """Imports and uses of anything under ``modules``, except the ``allowed`` dotted names.

    A module with allowed attributes (``gc`` for ``gc.collect``) is judged by the attributes used,
    not by its import.
    """

    def flagged(name: str) -> bool:
        if not under(name, *modules) or (allowed and under(name, *allowed)):
            return False
        return not any(ok.startswith(name + ".") for ok in allowed)

    for name, node in ctx.imports:
        if flagged(name):
            yield node, name
    for node, qual in ctx.references:
        if flagged(qual):
            yield node, qual
