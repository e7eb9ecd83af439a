"""Loading KernelBench-format problem files, single, by directory, or as a KernelBench tree.

Problem files are benchmark code, trusted like kbv itself: the parent may import them. Candidate
files are never imported here.

A problem's file is read once, by :func:`load_problem`; every later import (the parent's checks, the
workers) runs that text (:func:`load_source`), never the file again. So an evaluation judges the
bytes whose hash its record carries, whatever happens to the file meanwhile, and no worker, the
candidate's above all, is told where the file lives.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import linecache
import re
import sys
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the child imports this module: records stay out of its closure
    from kbv.records import ProblemSection

REQUIRED_NAMES = ("Model", "get_inputs", "get_init_inputs")
_LEVEL_DIR = re.compile(r"^level[_-]?(\d+)$", re.IGNORECASE)
_ID_PREFIX = re.compile(r"^(\d+)_")


class ProblemError(ValueError):
    """A problem file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Problem:
    """A problem's identity and the text read from its file once. Its module is made from that text
    where it runs (:meth:`load`, :func:`load_source`), never from the file again."""

    name: str
    path: Path
    source: str
    source_sha256: str
    level: int | None = None
    problem_id: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def ref(self) -> ProblemSection:
        """The record's ``problem`` field."""
        return {
            "name": self.name,
            "level": self.level,
            "id": self.problem_id,
            "path": str(self.path),
            "source_sha256": self.source_sha256,
        }

    def ref_checked(self) -> ProblemSection:
        """The record's ``problem`` field at the end of an evaluation: ``changed_on_disk`` is set
        when the file no longer holds the text that was evaluated (whose hash ``source_sha256`` is)."""
        section = self.ref()
        if self.changed_on_disk():
            section["changed_on_disk"] = True
        return section

    def sizes_for(self, device_type: str) -> dict[str, Any]:
        """Size constants to override for a device: the bundled suite runs small on the CPU.

        KernelBench files have no ``KBV`` dict and keep their own sizes.
        """
        if device_type == "cpu":
            return dict(self.extras.get("cpu_sizes", {}))
        return dict(self.extras.get("gpu_sizes", {}))

    def changed_on_disk(self) -> bool:
        """Whether the file now holds other bytes than the text read (or is gone): the evaluation
        goes on with the text read, and the record says so."""
        try:
            now = self.path.read_text()  # decoded as load_problem decodes it, so the hashes compare
        except (OSError, UnicodeDecodeError):
            return True
        return hashlib.sha256(now.encode()).hexdigest() != self.source_sha256

    def load(self, sizes: dict[str, Any] | None = None) -> ModuleType:
        """The problem's module, made from the text read (never the file on disk)."""
        return load_source(self.source, sizes=sizes, label=self.name)


def load_problem(path: str | Path) -> Problem:
    """Read and validate one problem file. Raises ProblemError with an actionable message."""
    path = Path(path)
    if not path.is_file():
        raise ProblemError(f"problem file {path} does not exist")
    source = path.read_text()
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise ProblemError(f"problem file {path} has a syntax error on line {exc.lineno}: {exc.msg}") from exc
    missing = [n for n in REQUIRED_NAMES if n not in _top_level_names(tree)]
    if missing:
        raise ProblemError(
            f"problem file {path} does not define {', '.join(missing)}; a KernelBench problem needs "
            "class Model(nn.Module), get_inputs() and get_init_inputs()"
        )
    extras = _literal_extras(tree, path)
    level = extras.get("level", _level_from_path(path))
    problem_id = extras.get("id", _id_from_name(path.stem))
    return Problem(
        name=path.stem,
        path=path.resolve(),
        source=source,
        source_sha256=hashlib.sha256(source.encode()).hexdigest(),
        level=level,
        problem_id=problem_id,
        extras=extras,
    )


def check_importable(problem: Problem) -> None:
    """Import the problem once so a broken file is reported before any worker starts."""
    problem.load()


#: The file name a problem's code runs under in a worker: its tracebacks and ``inspect`` read the
#: text through ``linecache``; the path on disk is never part of it.
SOURCE_FILENAME = "<kbv problem>"


def load_source(source: str, sizes: dict[str, Any] | None = None, label: str = "problem") -> ModuleType:
    """A problem's module made from its text, under a private module name, with size overrides.

    ``label`` names the problem in error messages only. The module has no ``__file__`` and its code
    the file name :data:`SOURCE_FILENAME`: nothing in it tells where the problem lives on disk."""
    name = f"kbv_problem_{uuid.uuid4().hex}"
    filename = f"{SOURCE_FILENAME[:-1]} {name}>"
    try:
        code = compile(source, filename, "exec")
    except SyntaxError as exc:
        raise ProblemError(f"problem {label} has a syntax error on line {exc.lineno}: {exc.msg}") from exc
    # mtime None: linecache.checkcache keeps the entry (there is no file to compare it with).
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = ModuleType(name)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)  # noqa: S102 - problems are trusted benchmark code
    except Exception as exc:
        sys.modules.pop(name, None)
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise ProblemError(f"problem {label} failed to import: {last}") from exc
    _apply_sizes(module, sizes, label)
    return module


def load_module(path: str | Path, sizes: dict[str, Any] | None = None) -> ModuleType:
    """Import a problem file under a private module name and apply size overrides (tools that hold
    only a path; an evaluation loads the text it read, :meth:`Problem.load`).

    Size constants are module globals read by ``get_inputs``/``get_init_inputs`` at call time, so
    overriding the globals resizes the problem without editing the file.
    """
    path = Path(path)
    name = f"kbv_problem_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ProblemError(f"problem file {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise ProblemError(f"problem file {path} failed to import: {last}") from exc
    _apply_sizes(module, sizes, f"file {path}")
    return module


def _apply_sizes(module: ModuleType, sizes: dict[str, Any] | None, label: str) -> None:
    for key, value in (sizes or {}).items():
        if not hasattr(module, key):
            raise ProblemError(f"problem {label}: size override {key!r} names no module constant")
        setattr(module, key, value)


def discover(path: str | Path) -> list[Path]:
    """Problem files under a file, a directory, or a KernelBench tree, in a stable order."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ProblemError(f"{root} is neither a problem file nor a directory")
    files = [p for p in root.rglob("*.py") if not p.name.startswith("_") and "__pycache__" not in p.parts]
    return sorted(files, key=_sort_key)


def load_problems(path: str | Path) -> tuple[list[Problem], list[tuple[Path, str]]]:
    """All loadable problems under ``path`` plus (file, error) for those that are not."""
    problems: list[Problem] = []
    errors: list[tuple[Path, str]] = []
    for file in discover(path):
        try:
            problems.append(load_problem(file))
        except ProblemError as exc:
            errors.append((file, str(exc)))
    return problems, errors


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _literal_extras(tree: ast.Module, path: Path) -> dict[str, Any]:
    """The optional module-level ``KBV = {...}`` dict, read without running the file."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "KBV" for t in node.targets
        ):
            try:
                value = ast.literal_eval(node.value)
            except ValueError as exc:
                raise ProblemError(f"problem file {path}: KBV must be a literal dict ({exc})") from exc
            if not isinstance(value, dict):
                raise ProblemError(f"problem file {path}: KBV must be a dict")
            return value
    return {}


def _level_from_path(path: Path) -> int | None:
    for part in reversed(path.parent.parts):
        match = _LEVEL_DIR.match(part)
        if match:
            return int(match.group(1))
    return None


def _id_from_name(stem: str) -> int | None:
    match = _ID_PREFIX.match(stem)
    return int(match.group(1)) if match else None


def _sort_key(path: Path) -> tuple[int, int, str]:
    return (_level_from_path(path) or 0, _id_from_name(path.stem) or 0, str(path))
