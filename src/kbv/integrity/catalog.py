"""What ``kbv checks`` lists: every registered integrity check, static, correctness and dynamic,
with the fixtures that hold it to account.

The registry knows a check's name, kind, default severity and doc. It does not know fixtures: a
fixture declares them itself. Every candidate fixture that a test evaluates end to end carries
``KBV_FIXTURE = {...}`` (docs/integrity-dynamic.md, "Fixtures"), read here without importing it:

- ``expect_checks``: the checks of which at least one must fail it (``tests/test_hack_fixtures.py``,
  ``tests/gpu/test_gpu_hacks.py``): the fixture is one the check must reject (with
  ``incorrect_suffices``, a plain ``incorrect`` outcome rejects it too);
- ``expect_findings`` and ``expect_warn``: checks that must report it, at any severity;
- ``max_speedup`` (with ``passed`` among its outcomes): a shortcut ``verified`` takes away rather
  than names (results remembered from earlier calls, docs/timing.md); it declares no check;
- an honest fixture (``tests/fixtures/candidates/honest/``, or one whose only ``expect_outcome``
  is ``passed``) declares none of these: it must pass with no ``fail`` finding, so every check
  must accept it;
- ``"scan": "static"``: a fixture that the static scan alone reads (``tests/test_integrity_static.py``
  and ``tests/test_checks_command.py``); it holds static checks only.

Fixtures live in the checkout (``tests/fixtures/candidates``) and in the bundled suite
(``src/kbv/suite/candidates``); an installed kbv without its tests lists the bundled ones only.
A check exercised only by inline sources in the tests shows no fixture file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kbv.integrity._registry import KINDS, Check, list_checks

SCHEMA = "kbv.checks/1"
#: Where fixtures are declared, relative to the checkout's root.
FIXTURE_DIRS = ("tests/fixtures/candidates", "src/kbv/suite/candidates")


@dataclass(frozen=True)
class Fixture:
    """One candidate file's ``KBV_FIXTURE`` declaration, as far as the checks are concerned."""

    path: str
    must_fail: tuple[str, ...]
    must_report: tuple[str, ...]
    honest: bool
    #: ``static``: read by the static scan only, never evaluated; ``all``: evaluated end to end.
    scope: str = "all"


@dataclass(frozen=True)
class CheckEntry:
    """A registered check and the fixtures that name it (paths relative to the checkout)."""

    name: str
    kind: str
    default_severity: str
    doc: str
    rejects: tuple[str, ...]
    reports: tuple[str, ...]
    accepts: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "default_severity": self.default_severity,
            "doc": self.doc,
            "fixtures": {
                "rejects": list(self.rejects),
                "reports": list(self.reports),
                "accepts": list(self.accepts),
            },
        }


def checkout_root() -> Path:
    """The directory that holds ``src/kbv`` (the checkout, for an editable install)."""
    return Path(__file__).resolve().parents[3]


def all_checks() -> list[Check]:
    """Every registered check, the dynamic ones included (importing them registers them), by kind
    in the order kinds run (:data:`KINDS`), then by name."""
    import kbv.integrity.dynamic  # noqa: F401  (registers the dynamic checks; needs torch)

    return sorted(list_checks(), key=lambda c: (KINDS.index(c.kind), c.name))


def read_declaration(path: Path) -> dict[str, Any] | None:
    """The file's ``KBV_FIXTURE`` dict, parsed, never imported; None when it declares none."""
    text = path.read_text(errors="replace")
    if "KBV_FIXTURE" not in text:
        return None
    for node in ast.parse(text).body:
        names = [getattr(target, "id", None) for target in getattr(node, "targets", [])]
        if isinstance(node, ast.Assign) and "KBV_FIXTURE" in names:
            value = ast.literal_eval(node.value)
            return value if isinstance(value, dict) else None
    return None


def declared_fixtures(root: Path) -> list[Fixture]:
    """Every fixture declared under :data:`FIXTURE_DIRS` of ``root``, sorted by path."""
    fixtures = []
    for top in FIXTURE_DIRS:
        for path in sorted((root / top).rglob("*.py")):
            spec = read_declaration(path)
            if spec is None:
                continue
            fixtures.append(_fixture(path.relative_to(root).as_posix(), spec))
    return fixtures


def _fixture(path: str, spec: dict[str, Any]) -> Fixture:
    must_fail = tuple(spec.get("expect_checks", []))
    must_report = (*spec.get("expect_findings", []), *spec.get("expect_warn", []))
    scope = "static" if spec.get("scan") == "static" else "all"
    # Only fixtures a test holds to "passed, no fail finding" are honest: a helper that merely
    # declares its problem (a build shared with the tests) is not.
    declared_passing = spec.get("expect_outcome") == ["passed"] or "/honest/" in f"/{path}"
    honest = not must_fail and not must_report and (declared_passing or scope == "static")
    return Fixture(path, must_fail, must_report, honest, scope)


def catalog(root: Path | None = None) -> list[CheckEntry]:
    """Every registered check (static, correctness, then dynamic, each by name) with its fixtures."""
    fixtures = declared_fixtures(root or checkout_root())
    return [
        CheckEntry(
            name=check.name,
            kind=check.kind,
            default_severity=check.default_severity,
            doc=check.doc,
            rejects=tuple(f.path for f in fixtures if check.name in f.must_fail),
            reports=tuple(f.path for f in fixtures if check.name in f.must_report),
            # a static-only fixture was never run, so it vouches for the static checks alone
            accepts=tuple(f.path for f in fixtures if f.honest and f.scope in ("all", check.kind)),
        )
        for check in all_checks()
    ]


def unknown_names(root: Path | None = None) -> dict[str, list[str]]:
    """Check names that fixtures declare but no check is registered under: fixture path -> names."""
    known = {c.name for c in all_checks()}
    unknown: dict[str, list[str]] = {}
    for fixture in declared_fixtures(root or checkout_root()):
        missing = sorted(set(fixture.must_fail + fixture.must_report) - known)
        if missing:
            unknown[fixture.path] = missing
    return unknown
