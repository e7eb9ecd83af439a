"""``kbv checks``: every registered integrity check with its kind, default severity, doc and the
fixtures that declare it (docs/integrity-checks.md, "Listing the checks")."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from kbv.cli import main
from kbv.integrity import static_scan
from kbv.integrity._registry import KINDS, SEVERITIES
from kbv.integrity.catalog import all_checks, catalog, declared_fixtures, read_declaration, unknown_names

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "tests" / "fixtures" / "candidates" / "static"
PROBLEM = (STATIC / "problem_linear_relu.py").read_text()


def _listed(capsys, *args: str) -> dict:
    assert main(["checks", "--json", *args]) == 0
    return {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}


def test_every_registered_check_is_listed_with_its_kind_severity_and_doc(capsys) -> None:
    listed = _listed(capsys)
    registered = {c.name: c for c in all_checks()}
    assert set(listed) == set(registered)
    assert {"side_stream", "caching", "timing_disagreement", "caching_probe"} <= set(listed)
    for name, entry in listed.items():
        check = registered[name]
        assert (entry["kind"], entry["default_severity"], entry["doc"]) == (
            check.kind,
            check.default_severity,
            check.doc,
        )
        assert entry["kind"] in KINDS and entry["default_severity"] in SEVERITIES and entry["doc"]
    assert {c["kind"] for c in _listed(capsys, "--kind", "dynamic").values()} == {"dynamic"}
    assert {n: c["kind"] for n, c in _listed(capsys, "--kind", "correctness").items()} == {
        "below_precision": "correctness"
    }


def test_each_check_lists_the_fixtures_it_must_reject_and_accept(capsys) -> None:
    listed = _listed(capsys)
    rejects = {name: set(entry["fixtures"]["rejects"]) for name, entry in listed.items()}
    assert "tests/fixtures/candidates/hacks/lying_clock.py" in rejects["timing_disagreement"]
    assert "tests/fixtures/candidates/static/hack_side_stream_cpp.py" in rejects["side_stream"]
    assert "src/kbv/suite/candidates/hacks_gpu/1_ReLU.py" in rejects["side_stream"]
    assert "tests/fixtures/candidates/hacks/lying_clock.py" not in rejects["side_stream"]
    evaluated_honest = "tests/fixtures/candidates/honest/relu_clamp.py"
    scanned_honest = "tests/fixtures/candidates/static/honest_relu_cpp.py"
    for entry in listed.values():
        accepts = set(entry["fixtures"]["accepts"])
        assert evaluated_honest in accepts
        assert (scanned_honest in accepts) == (entry["kind"] == "static")  # never run: static only
        assert not accepts & set(entry["fixtures"]["rejects"])
        assert "tests/fixtures/candidates/foundation/relu_cpp.py" not in accepts  # no test holds it
    precision = "tests/fixtures/candidates/precision/long_row_sum_fp{}_accumulation.py"
    assert listed["below_precision"]["fixtures"]["reports"] == [precision.format(16)]
    assert precision.format(32) in listed["below_precision"]["fixtures"]["accepts"]


def test_every_check_a_fixture_names_is_registered() -> None:
    assert unknown_names() == {}


def test_fixtures_are_read_from_their_declarations_without_importing_them(tmp_path) -> None:
    candidates = tmp_path / "tests" / "fixtures" / "candidates"
    for folder, name, declaration in (
        ("hacks", "hack.py", '{"expect_outcome": ["hack_detected"], "expect_checks": ["a", "b"]}'),
        ("hacks", "warned.py", '{"expect_outcome": ["passed"], "expect_warn": ["c"]}'),
        ("honest", "fine.py", '{"problem": "p.py"}'),
        ("gpu", "passes.py", '{"expect_outcome": ["passed"], "expect_checks": []}'),
        ("foundation", "helper.py", '{"problem": "p.py", "slow": True}'),
        ("static", "scanned.py", '{"scan": "static"}'),
    ):
        (candidates / folder).mkdir(parents=True, exist_ok=True)
        body = f"raise SystemExit('imported')\nKBV_FIXTURE = {declaration}\n"
        (candidates / folder / name).write_text(body)
    (candidates / "hacks" / "undeclared.py").write_text("x = 1\n")
    found = {Path(f.path).name: f for f in declared_fixtures(tmp_path)}
    assert set(found) == {"hack.py", "warned.py", "fine.py", "passes.py", "helper.py", "scanned.py"}
    assert found["hack.py"].must_fail == ("a", "b") and not found["hack.py"].honest
    assert found["warned.py"].must_report == ("c",) and not found["warned.py"].honest
    assert found["fine.py"].honest and found["passes.py"].honest
    assert not found["helper.py"].honest
    assert found["scanned.py"].honest and found["scanned.py"].scope == "static"
    assert read_declaration(candidates / "hacks" / "undeclared.py") is None


@pytest.mark.parametrize("path", sorted(STATIC.glob("*.py")), ids=lambda p: p.stem)
def test_static_fixtures_are_what_they_declare(path: Path) -> None:
    """The declarations kbv checks reads for the static-only fixtures hold: each named check fails
    (or reports) the hack, and no check fails an honest one."""
    spec = read_declaration(path)
    if spec is None:
        assert path.name == "problem_linear_relu.py"  # the problem the scans compare against
        return
    findings = static_scan(path.read_text(), problem_source=PROBLEM)
    fails = {f.check for f in findings if f.severity == "fail"}
    assert set(spec.get("expect_checks", [])) <= fails, findings
    assert set(spec.get("expect_warn", [])) <= {f.check for f in findings}, findings
    if path.name.startswith("honest_"):
        assert not fails and not spec.get("expect_checks"), findings


def test_the_text_listing_names_each_check_and_its_fixtures(capsys) -> None:
    assert main(["checks", "--kind", "static"]) == 0
    out = capsys.readouterr().out
    static = [e for e in catalog() if e.kind == "static"]
    for entry in static:
        assert f"{entry.name}  (static, default severity {entry.default_severity})" in out
    assert "timing_disagreement" not in out
    assert "    tests/fixtures/candidates/static/hack_token_pasting.py" in out
    assert "Every static check must accept these honest fixtures" in out


def _finding_calls(tree: ast.AST) -> list[ast.Call]:
    """Calls that make a finding: ``Finding(...)``, ``Finding.fail/warn/info(...)``, ``_finding(...)``."""
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        named = isinstance(func, ast.Name) and func.id in ("Finding", "_finding")
        helper = (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "Finding"
        )
        if named or helper:
            calls.append(node)
    return calls


def test_every_finding_is_made_inside_the_integrity_registry() -> None:
    """No second path: outside ``kbv.integrity`` a finding is only read back from a stored record
    (``kbv.records``); every check name a finding is made under is a registered check."""
    src = ROOT / "src" / "kbv"
    registered = {c.name for c in all_checks()}
    outside, unregistered = [], []
    for path in sorted(src.rglob("*.py")):
        relative = path.relative_to(src).as_posix()
        if relative.startswith("suite/"):
            continue
        for call in _finding_calls(ast.parse(path.read_text())):
            if not relative.startswith("integrity/") and relative != "records.py":
                outside.append(f"{relative}:{call.lineno}")
            first = call.args[0] if call.args else None
            if (
                isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and first.value not in registered
            ):
                unregistered.append(f"{relative}:{call.lineno} {first.value}")
    assert outside == [] and unregistered == []
    # the test can fail: a module outside the registry that makes a finding is named
    sample = ast.parse('from kbv.records import Finding\nx = Finding("below_precision", "info", "d")\n')
    assert [c.lineno for c in _finding_calls(sample)] == [2]
