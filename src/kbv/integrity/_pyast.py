"""Alias-aware reading of a candidate's Python source, with constant strings folded.

Nothing here imports or runs candidate code: the source is parsed with :mod:`ast` only. Names are
resolved to dotted "qualified names" through imports and simple rebinding, so that
``import torch as T; T.cuda.Stream()``, ``from torch import cuda as c; c.Stream()`` and
``getattr(torch.cuda, "Str" + "eam")()`` all read as ``torch.cuda.Stream``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

_MAX_FOLDED = 1_000_000  # never build a string larger than this while folding
_ALIASABLE_BUILTINS = {
    "builtins",
    "exec",
    "eval",
    "compile",
    "getattr",
    "setattr",
    "delattr",
    "__import__",
    "open",
    "vars",
    "globals",
    "id",
}
_STR_METHODS = {"lower", "upper", "strip", "lstrip", "rstrip", "casefold", "title", "swapcase"}


class Analysis:
    """A parsed candidate: the tree, its lines, import aliases and constant strings."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.tree = ast.parse(source)
        self.lines = source.splitlines()
        self.aliases: dict[str, str] = {}
        self.consts: dict[str, str] = {}
        self.assigned: dict[str, ast.expr] = {}
        self.imports: list[tuple[str, ast.AST]] = []
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(self.tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self._collect_imports()
        self._collect_bindings()

    # ------------------------------------------------------------------ collection
    def _collect_imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.imports.append((alias.name, node))
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:
                        root = alias.name.split(".")[0]
                        self.aliases[root] = root
            elif isinstance(node, ast.ImportFrom):
                module = ("." * node.level) + (node.module or "")
                for alias in node.names:
                    full = f"{module}.{alias.name}" if module else alias.name
                    self.imports.append((full, node))
                    if alias.name != "*":
                        self.aliases[alias.asname or alias.name] = full

    def _collect_bindings(self) -> None:
        """Simple ``NAME = value`` bindings: constant strings and aliases of modules/attributes.

        Repeated a few times so that chains (``a = "cu"; b = a + "da"``) resolve in any order.
        """
        assigns: list[tuple[str, ast.expr]] = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assigns.append((target.id, node.value))
                    elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        for t, v in zip(target.elts, node.value.elts, strict=False):
                            if isinstance(t, ast.Name):
                                assigns.append((t.id, v))
            elif (
                isinstance(node, (ast.AnnAssign, ast.NamedExpr))
                and node.value is not None
                and isinstance(node.target, ast.Name)
            ):
                assigns.append((node.target.id, node.value))
        for name, value in assigns:
            self.assigned.setdefault(name, value)
        for _ in range(4):
            changed = False
            for name, value in assigns:
                folded = self.fold(value)
                if folded is not None:
                    if self.consts.get(name) != folded:
                        self.consts[name] = folded
                        changed = True
                    continue
                if isinstance(value, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
                    qual = self.qualname(value)
                    if (
                        qual
                        and self._is_import_rooted(qual)
                        and qual != name
                        and self.aliases.get(name) != qual
                    ):
                        self.aliases[name] = qual
                        changed = True
            if not changed:
                break

    def _is_import_rooted(self, qual: str) -> bool:
        root = qual.split(".")[0]
        return root in _ALIASABLE_BUILTINS or any(v.split(".")[0] == root for v in self.aliases.values())

    # ------------------------------------------------------------------ resolution
    def qualname(self, node: ast.AST | None) -> str | None:
        """Dotted name of an expression, through aliases, ``getattr`` and dynamic imports; else None."""
        if isinstance(node, ast.Name):
            if node.id == "__builtins__":
                return "builtins"
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            if node.attr == "__dict__":
                return self.qualname(node.value)
            base = self.qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            return self._call_qualname(node)
        if isinstance(node, ast.Subscript):
            key = self.fold(node.slice)
            if key is None:
                return None
            base = self.qualname(node.value)
            if base in ("sys.modules", "sys.modules.get"):
                return key
            if base in ("globals", "builtins.globals", "locals"):
                return self.aliases.get(key, key)
            if isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__" and base:
                return f"{base}.{key}"
            if isinstance(node.value, ast.Call) and self.is_builtin(self.qualname(node.value.func), "vars"):
                inner = self.qualname(node.value.args[0]) if node.value.args else None
                return f"{inner}.{key}" if inner else None
        return None

    def _call_qualname(self, node: ast.Call) -> str | None:
        func = self.qualname(node.func)
        args = node.args
        if self.is_builtin(func, "getattr") and len(args) >= 2:
            attr = self.fold(args[1])
            base = self.qualname(args[0])
            return f"{base}.{attr}" if base and attr else None
        if (self.is_builtin(func, "__import__") or func == "importlib.import_module") and args:
            return self.fold(args[0])
        if func == "sys.modules.get" and args:
            return self.fold(args[0])
        if self.is_builtin(func, "vars") and args:
            return self.qualname(args[0])
        return None

    @staticmethod
    def is_builtin(qual: str | None, name: str) -> bool:
        return qual == name or qual == f"builtins.{name}"

    def fold(self, node: ast.AST | None, depth: int = 0) -> str | None:
        """The constant string an expression always evaluates to, or None when it is not constant."""
        if node is None or depth > 40:
            return None
        d = depth + 1
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        if isinstance(node, ast.Name):
            return self.consts.get(node.id)
        if isinstance(node, ast.BinOp):
            return self._fold_binop(node, d)
        if isinstance(node, ast.JoinedStr):
            parts = [self.fold(v.value if isinstance(v, ast.FormattedValue) else v, d) for v in node.values]
            return None if any(p is None for p in parts) else _capped("".join(p for p in parts if p))
        if isinstance(node, ast.Subscript):
            return self._fold_subscript(node, d)
        if isinstance(node, ast.Call):
            return self._fold_call(node, d)
        return None

    def _fold_binop(self, node: ast.BinOp, d: int) -> str | None:
        if isinstance(node.op, ast.Add):
            left, right = self.fold(node.left, d), self.fold(node.right, d)
            return _capped(left + right) if left is not None and right is not None else None
        if isinstance(node.op, ast.Mult):
            text = self.fold(node.left, d)
            count = node.right
            if text is None:
                text, count = self.fold(node.right, d), node.left
            if (
                text is not None
                and isinstance(count, ast.Constant)
                and isinstance(count.value, int)
                and len(text) * max(count.value, 0) <= _MAX_FOLDED
            ):
                return text * count.value
        if isinstance(node.op, ast.Mod):
            fmt = self.fold(node.left, d)
            values = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
            parts = [self.fold(v, d) for v in values]
            if fmt is not None and all(p is not None for p in parts):
                try:
                    return _capped(fmt % tuple(parts))
                except (TypeError, ValueError):
                    return None
        return None

    def _fold_subscript(self, node: ast.Subscript, d: int) -> str | None:
        text = self.fold(node.value, d)
        if text is None:
            return None
        index = node.slice
        if isinstance(index, ast.Slice):
            bounds = [_const_int(b) for b in (index.lower, index.upper, index.step)]
            given = [b for b in (index.lower, index.upper, index.step) if b is not None]
            if len([b for b in bounds if b is not None]) != len(given):
                return None
            return text[slice(*bounds)]
        i = _const_int(index)
        return text[i] if i is not None and -len(text) <= i < len(text) else None

    def _fold_call(self, node: ast.Call, d: int) -> str | None:
        func = node.func
        qual = self.qualname(func)
        if self.is_builtin(qual, "str") and len(node.args) == 1:
            return self.fold(node.args[0], d)
        if self.is_builtin(qual, "chr") and len(node.args) == 1:
            code = _const_int(node.args[0])
            return chr(code) if code is not None and 0 <= code < 0x110000 else None
        if not isinstance(func, ast.Attribute):
            return None
        if (
            func.attr == "decode"
            and isinstance(func.value, ast.Constant)
            and isinstance(func.value.value, bytes)
        ):
            return func.value.value.decode("utf-8", "replace")
        if (
            func.attr == "decode"
            and isinstance(func.value, ast.Call)
            and self.qualname(func.value.func) == "bytes.fromhex"
        ):
            hex_text = self.fold(func.value.args[0], d) if func.value.args else None
            try:
                return bytes.fromhex(hex_text).decode("utf-8", "replace") if hex_text is not None else None
            except ValueError:
                return None
        receiver = self.fold(func.value, d)
        if receiver is None:
            return None
        if func.attr == "join" and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple)):
            parts = [self.fold(e, d) for e in node.args[0].elts]
            return (
                None
                if any(p is None for p in parts)
                else _capped(receiver.join(p for p in parts if p is not None))
            )
        if func.attr in _STR_METHODS and not node.args:
            return str(getattr(receiver, func.attr)())
        if func.attr == "replace" and len(node.args) == 2:
            old, new = self.fold(node.args[0], d), self.fold(node.args[1], d)
            return _capped(receiver.replace(old, new)) if old is not None and new is not None else None
        if func.attr == "format" and not node.keywords:
            parts = [self.fold(a, d) for a in node.args]
            if all(p is not None for p in parts):
                try:
                    return _capped(receiver.format(*parts))
                except (IndexError, KeyError, ValueError):
                    return None
        return None

    # ------------------------------------------------------------------ helpers
    def calls(self, root: ast.AST | None = None) -> Iterator[tuple[ast.Call, str | None]]:
        for node in ast.walk(root or self.tree):
            if isinstance(node, ast.Call):
                yield node, self.qualname(node.func)

    def quote(self, node: ast.AST | int) -> tuple[int, str]:
        lineno = node if isinstance(node, int) else getattr(node, "lineno", 0)
        text = self.lines[lineno - 1].strip() if 0 < lineno <= len(self.lines) else ""
        return lineno, text

    def enclosing(self, node: ast.AST, kinds: tuple[type, ...]) -> ast.AST | None:
        current = self.parents.get(node)
        while current is not None and not isinstance(current, kinds):
            current = self.parents.get(current)
        return current


def under(qual: str | None, *prefixes: str) -> bool:
    """True when ``qual`` is one of ``prefixes`` or an attribute below one of them."""
    if not qual:
        return False
    return any(qual == p or qual.startswith(p + ".") for p in prefixes)


def _const_int(node: ast.AST | None) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _const_int(node.operand)
        return -inner if inner is not None else None
    return None


def _capped(text: str) -> str | None:
    return text if len(text) <= _MAX_FOLDED else None
