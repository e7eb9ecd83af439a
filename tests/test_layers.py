"""The import graph of src/kbv, imports inside functions included (grimp): every module sits in one
layer, no import points from a lower layer to a higher one, there is no import cycle, and the trust
boundary holds (docs/architecture.md, "Layers")."""

from __future__ import annotations

from pathlib import Path

import pytest

import kbv

# The dev extra installs grimp (CI has it); the GPU image does not, and its GPU tests must still run.
grimp = pytest.importorskip("grimp", reason="grimp is not installed: pip install -e '.[dev]'")

SRC = Path(kbv.__file__).resolve().parents[1]  # the tree grimp analyses: the kbv that is imported

#: Highest first. A module may import its own layer or any layer below it, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # ``import kbv``: it names what every layer below offers (its imports of them run only under
    # TYPE_CHECKING or on first use), and no module of kbv imports it.
    ("public facade", ("kbv",)),
    (
        "command line",
        (
            "kbv.cli",
            "kbv._store_cli",
            "kbv.generate._cli",
            "kbv.protocol_audit._cli",
            "kbv.errors",
            "kbv.serve",
            "kbv.serve.*",
        ),
    ),
    (
        "commands",
        (
            "kbv.demo",
            "kbv.batch",
            "kbv._evaluator",
            "kbv.client",
            "kbv.rewards",
            "kbv.generate",
            "kbv.generate.*",
            "kbv.protocol_audit",
            "kbv.protocol_audit.*",
        ),
    ),
    ("executors", ("kbv.execute", "kbv.execute.*")),
    (
        "one evaluation",
        ("kbv.api", "kbv.evaluation", "kbv.evaluation.*", "kbv._shared_reference", "kbv.toolchain"),
    ),
    (
        "measurement and judgement",
        (
            "kbv.performance",
            "kbv.baseline_cache",
            "kbv.timed_sketches",
            "kbv.measure_context",
            "kbv.correctness",
            "kbv.integrity",
            "kbv.integrity.*",
            "kbv.problems_audit",
        ),
    ),
    ("results", ("kbv.store", "kbv.report", "kbv.report.*", "kbv.metrics")),
    ("parent side of the worker", ("kbv.worker", "kbv.worker.*", "kbv.statistics", "kbv.device_lock")),
    ("child side of the worker", ("kbv.child", "kbv.child.*")),
    (
        "shared by both sides",
        (
            "kbv.channel",
            "kbv.wire",
            "kbv.wire_replies",
            "kbv.handoff",
            "kbv._staged_handoff",
            "kbv._vmm",
            "kbv.processes",
            "kbv.samples",
            "kbv.sketch",
            "kbv._sketch_kernel",
            "kbv.error_stats",
            "kbv.inputs",
            "kbv.seeds",
            "kbv._input_fills",
            "kbv.telemetry",
            "kbv.problems",
            "kbv.problems._loader",
            "kbv.problems.structure",
            "kbv.candidates",
        ),
    ),
    ("foundation", ("kbv.protocol", "kbv.records", "kbv.devices", "kbv._version")),
]

#: What the worker process must never hold: verdicts, comparisons, statistics and the store.
TRUSTED_ONLY = (
    "kbv.evaluation",
    "kbv.api",
    "kbv.correctness",
    "kbv.integrity",
    "kbv.metrics",
    "kbv.statistics",
    "kbv.performance",
    "kbv.baseline_cache",
    "kbv.timed_sketches",
    "kbv.measure_context",
    "kbv.store",
    "kbv.report",
    "kbv.execute",
    "kbv.batch",
    "kbv.worker",
)


@pytest.fixture(scope="module")
def graph() -> object:
    return grimp.build_graph("kbv", include_external_packages=False, cache_dir=None)


def _modules(graph: object) -> list[str]:
    return sorted(m for m in graph.modules if not m.startswith("kbv.suite"))  # type: ignore[attr-defined]


def _layer(module: str) -> int | None:
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-1])):
                return index
    return None


def test_every_module_is_in_a_layer(graph: object) -> None:
    assert [m for m in _modules(graph) if _layer(m) is None] == []


def test_no_import_goes_up_a_layer(graph: object) -> None:
    upward = []
    for module in _modules(graph):
        for imported in graph.find_modules_directly_imported_by(module):  # type: ignore[attr-defined]
            if imported.startswith("kbv.suite"):
                continue
            if (_layer(imported) or 0) < (_layer(module) or 0):
                upward.append(
                    f"{module} ({LAYERS[_layer(module) or 0][0]}) imports {imported} "
                    f"({LAYERS[_layer(imported) or 0][0]})"
                )
    assert upward == []


def test_there_is_no_import_cycle(graph: object) -> None:
    modules = set(_modules(graph))
    cycles = []
    for module in sorted(modules):
        for imported in graph.find_modules_directly_imported_by(module):  # type: ignore[attr-defined]
            if imported in modules and graph.chain_exists(imported, module):  # type: ignore[attr-defined]
                cycles.append(f"{module} -> {imported} -> ... -> {module}")
    assert cycles == []


def _runtime_closure(graph: object, roots: list[str]) -> set[str]:
    """What importing ``roots`` runs: their imports (inside functions too, not those under
    ``if TYPE_CHECKING:``) and every package above each module reached, whose ``__init__`` runs first."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(
            m for m in graph.find_modules_directly_imported_by(module) if not _only_type_checking(module, m)
        )  # type: ignore[attr-defined]
    return seen


def _only_type_checking(importer: str, imported: str) -> bool:
    """Whether every import of ``imported`` in ``importer`` sits under ``if TYPE_CHECKING:``."""
    import ast

    path = SRC.joinpath(*importer.split("."))
    source = (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
    guarded, anywhere = set(), set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
        ):
            guarded.update(id(n) for child in node.body for n in ast.walk(child))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            )
            if imported in names:
                anywhere.add(id(node))
    return bool(anywhere) and anywhere <= guarded


def test_the_worker_process_holds_no_verdict_store_or_comparison(graph: object) -> None:
    children = [m for m in _modules(graph) if m == "kbv.child" or m.startswith("kbv.child.")]
    closure = _runtime_closure(graph, children)
    assert sorted(m for m in closure if any(m == t or m.startswith(t + ".") for t in TRUSTED_ONLY)) == []


def test_no_trusted_module_imports_the_child_side(graph: object) -> None:
    """Candidate code is loaded only by the worker's own modules (kbv.child): no module outside that
    package imports any of it, so the parent never runs what a candidate worker runs."""
    importers = []
    for module in _modules(graph):
        if module == "kbv.child" or module.startswith("kbv.child."):
            continue
        importers += [
            f"{module} imports {m}"
            for m in graph.find_modules_directly_imported_by(module)
            if m.startswith("kbv.child")
        ]  # type: ignore[attr-defined]
    assert importers == []


def test_only_the_child_loads_candidate_code() -> None:
    """Candidate files are executed by kbv.child only (the worker's entry point and the build
    process). The parent executes problem files alone (kbv.problems' loader, on the text a
    ``Problem`` read from its file) and the protocol audit's controls and mutants, which kbv
    writes from a problem's own source only (as trusted as the problem)."""
    import re

    parent_may_execute = {"kbv/problems/_loader.py", "kbv/protocol_audit/_generate.py"}

    executes, loads = [], []
    for path in sorted((SRC / "kbv").rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        if relative.startswith(("kbv/suite/", "kbv/child/")):
            continue
        text = path.read_text()
        if (
            "spec_from_file_location" in text or "exec_module(" in text
        ) and relative not in parent_may_execute:
            executes.append(relative)
        loads += [
            f"{relative}: {m.group(0)}"
            for m in re.finditer(r"(?<!def )\b(?:load_module|load_source)\((?!problem\.path\b)[^)]*\)", text)
            if relative != "kbv/problems/_loader.py"  # ``Problem.load`` is the one caller
        ]
    assert (executes, loads) == ([], [])
