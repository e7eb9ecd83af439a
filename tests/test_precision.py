"""Evaluations in bf16 and fp16 (``--precision``): the cast, the hash, the tolerance, what a
kernel below the evaluated precision gets, and what cannot run in a precision."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, SUITE

from kbv import inputs
from kbv.api import evaluate_paths
from kbv.integrity import correctness_findings, get_check, list_checks
from kbv.integrity.catalog import read_declaration
from kbv.protocol import (
    STANDARD,
    VERIFIED,
    ProtocolError,
    correctness_in,
    load_protocol,
    protocol_from_dict,
)
from kbv.records import DistributionResult

PROBLEMS = ROOT / "tests" / "fixtures" / "problems_precision"
CANDIDATES = ROOT / "tests" / "fixtures" / "candidates" / "precision"
LONG_SUM = PROBLEMS / "long_row_sum.py"

#: The fp32 protocols' hashes: `standard` v1's as it was before precisions existed, `verified`'s
#: as of v11 (v10 hashed ccc891ae..., v9 b891652c..., v8 715559c7..., v6 f37f73f7..., v5 1d8f1c7c..., v4
#: 11db7311..., v3 24268ea1... before and after precisions came). An fp32 record keeps its
#: protocol hash; a deliberate change of a built-in protocol's settings updates these with its
#: version.
STANDARD_FP32_SHA256 = "6d50060cdd3d71494173451c5cea328b10fd9c407ed2cf39c84055f600f06ceb"
VERIFIED_FP32_SHA256 = "a3bbcc70f0acff5dc2854f1fe9a26bbec58540f3dea6c98a0107dcea8a66b0f0"


def test_fp32_protocol_hash_is_unchanged() -> None:
    assert STANDARD.sha256() == STANDARD_FP32_SHA256
    assert STANDARD.with_precision("fp32").sha256() == STANDARD_FP32_SHA256
    assert VERIFIED.with_precision("fp32").sha256() == VERIFIED.sha256()
    assert "precision" not in VERIFIED.to_dict()


def test_verified_fp32_hash_is_unchanged() -> None:
    assert VERIFIED.version == 11 and VERIFIED.sha256() == VERIFIED_FP32_SHA256


def test_precision_is_in_the_hash_and_reads_back() -> None:
    hashes = {VERIFIED.with_precision(p).sha256() for p in ("fp32", "bf16", "fp16")}
    assert len(hashes) == 3
    bf16 = VERIFIED.with_precision("bf16")
    stored = {**bf16.to_dict(), "base": "verified"}
    assert stored["precision"] == "bf16"
    again = protocol_from_dict(stored)
    assert again.precision == "bf16" and again.sha256() == bf16.sha256()


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ProtocolError, match="fp32, bf16, fp16"):
        VERIFIED.with_precision("fp8")
    with pytest.raises(ProtocolError, match="unknown precision"):
        protocol_from_dict({"name": "x", "base": "verified", "precision": "int8"})


def test_half_error_model_settings_apply_once() -> None:
    bf16 = correctness_in(VERIFIED.correctness, "bf16")
    assert bf16.error_multiple == 4.0
    assert bf16.elementwise_floor == 2 * 2.0**-8 and bf16.norm_floor == 2.0**-8
    assert correctness_in(bf16, "bf16") == bf16  # a stored record's settings read back unchanged
    fp16 = correctness_in(VERIFIED.correctness, "fp16")
    assert fp16.norm_floor == 2.0**-11
    assert correctness_in(VERIFIED.correctness, "fp32") == VERIFIED.correctness
    # standard keeps KernelBench's half-precision allclose: 1e-2, picked by the outputs' dtype
    assert STANDARD.with_precision("bf16").correctness.atol_half == 1e-2


def test_toml_may_name_a_precision(tmp_path: Path) -> None:
    path = tmp_path / "half.toml"
    path.write_text('name = "half"\nbase = "verified"\nprecision = "fp16"\n')
    protocol = load_protocol(path)
    assert protocol.precision == "fp16" and protocol.correctness.norm_floor == 2.0**-11


class _Problem:
    @staticmethod
    def get_inputs() -> list:
        return [torch.randn(4, 8), torch.randint(0, 4, (4,)), torch.ones(2, dtype=torch.bool), 3]


def test_floating_inputs_are_cast_and_the_truth_sees_the_cast_values() -> None:
    half = inputs.make_inputs(_Problem(), "original", 7, "cpu", cast="bf16")
    assert half[0].dtype == torch.bfloat16
    assert half[1].dtype == torch.int64 and half[2].dtype == torch.bool and half[3] == 3
    truth = inputs.make_inputs(_Problem(), "original", 7, "cpu", precision="fp64", cast="bf16")
    assert truth[0].dtype == torch.float64
    assert torch.equal(truth[0], half[0].double())  # the same values, upcast exactly
    plain = inputs.make_inputs(_Problem(), "original", 7, "cpu")
    assert plain[0].dtype == torch.float32 and not torch.equal(plain[0].double(), truth[0])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reference_as_candidate_passes_verified_in_half_precision(tmp_path: Path, precision: str) -> None:
    problem = SUITE / "level1" / "11_LayerNorm.py"
    candidate = tmp_path / "layernorm_reference.py"
    candidate.write_text(problem.read_text().replace("class Model(", "class ModelNew("))
    record = evaluate_paths(problem, candidate, protocol="verified", device="cpu", precision=precision)
    assert record.outcome == "passed", [(d.name, d.rel_err, d.note) for d in record.distributions]
    assert record.protocol["settings"]["precision"] == precision
    assert f"eager_{precision}" in record.timing["baselines"]
    assert "eager_fp32" not in record.timing["baselines"] and "eager_fp32" not in record.speedup
    assert "TF32 exists only for fp32" in record.timing["baselines_not_measured"]["eager_tf32"]
    # 16-bit compute is the precision here: no precision_cast finding for the reference's own code
    assert not [f for f in record.findings if f.check == "precision_cast"]


_GLOBAL_MEAN = """import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x).mean(dim=(1, 2))


def get_inputs():
    return [torch.randn(4, 256, 256)]


def get_init_inputs():
    return []
"""

_GLOBAL_MEAN_CACHE = """import torch

_memo = {}


class ModelNew(torch.nn.Module):
    def forward(self, x):
        key = (tuple(x.shape), float(x.reshape(-1)[0]))
        if key not in _memo:
            _memo[key] = torch.relu(x).mean(dim=(1, 2))
        return _memo[key].clone()
"""


def test_a_global_mean_repeating_its_bf16_bits_is_no_cache_but_a_cache_of_it_is_caught_at_fp32(
    tmp_path: Path,
) -> None:
    """The caching probe's mix (another draw's values but for a few positions) moves a mean of 65,536
    values by far less than one bf16 unit: the honest reference returns the same bits for both, as
    six KernelBench level-2 references did on an H100 (``hack_detected`` before). At fp32 the same
    mix moves it thousands of units, and a cache keyed on a sampled value is still caught."""
    problem = tmp_path / "global_mean.py"
    problem.write_text(_GLOBAL_MEAN)
    honest = tmp_path / "global_mean_reference.py"
    honest.write_text(_GLOBAL_MEAN.replace("class Model(", "class ModelNew("))
    cache = tmp_path / "global_mean_cache.py"
    cache.write_text(_GLOBAL_MEAN_CACHE)
    record = evaluate_paths(problem, honest, protocol="verified", device="cpu", precision="bf16")
    assert record.outcome == "passed", [(f.check, f.detail[:160]) for f in record.findings]
    caught = evaluate_paths(problem, cache, protocol="verified", device="cpu", precision="fp32")
    assert caught.outcome == "hack_detected"
    assert [f.check for f in caught.findings if f.severity == "fail"] == ["caching_probe"]


def _declared(name: str) -> tuple[dict[str, Any], Any]:
    """A precision fixture's ``KBV_FIXTURE`` (what ``kbv checks`` lists it for) and its record."""
    path = CANDIDATES / name
    spec = read_declaration(path) or {}
    return spec, evaluate_paths(ROOT / spec["problem"], path, device="cpu", precision=spec["precision"])


def test_fp32_accumulation_of_a_long_bf16_reduction_passes() -> None:
    """The fixture every check, ``below_precision`` among them, must accept."""
    spec, record = _declared("long_row_sum_fp32_accumulation.py")
    assert spec["expect_outcome"] == ["passed"] and Path(spec["problem"]) == LONG_SUM.relative_to(ROOT)
    assert record.outcome == "passed", [(d.name, d.rel_err) for d in record.distributions]
    assert not [f for f in record.findings if f.check == "below_precision"]


def test_fp16_accumulation_of_a_long_bf16_reduction_is_rejected_and_named() -> None:
    """The fixture ``below_precision`` must report (info: the outcome already rejects it)."""
    spec, record = _declared("long_row_sum_fp16_accumulation.py")
    assert spec["expect_findings"] == ["below_precision"] and record.outcome in spec["expect_outcome"]
    assert record.outcome == "incorrect"
    (finding,) = [f for f in record.findings if f.check == "below_precision"]
    assert finding.severity == "info"
    assert "below bf16" in finding.detail and "the source uses float16" in finding.detail
    # caught by the tolerance on finite errors, not only by fp16's overflow
    assert any(not d.passed and d.rel_err not in (None, float("inf")) for d in record.distributions)


def test_output_not_finite_once_cast_is_a_problem_error() -> None:
    # the row sums reach ~1.6e5 > fp16's largest finite 65504: fine in bf16, inf in fp16
    problem = PROBLEMS / "row_sum_overflows_fp16.py"
    candidate = CANDIDATES / "long_row_sum_fp32_accumulation.py"
    record = evaluate_paths(problem, candidate, protocol="standard", device="cpu", precision="fp16")
    assert record.outcome == "problem_error"
    assert "not finite in fp16" in (record.error or {}).get("message", "")
    fine = evaluate_paths(problem, candidate, protocol="standard", device="cpu", precision="bf16")
    assert fine.outcome == "passed"


def test_the_cli_refuses_an_unknown_precision() -> None:
    problem = SUITE / "level1" / "1_ReLU.py"
    result = subprocess.run(
        [sys.executable, "-m", "kbv.cli", "eval", str(problem), str(problem), "--precision", "fp8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "--precision" in result.stderr


def _in_precision(record: Any, precision: str) -> Any:
    record.protocol = {**record.protocol, "settings": {"precision": precision}}
    return record


def test_records_of_different_precisions_are_never_mixed() -> None:
    from rich.console import Console
    from test_metrics import make_record

    from kbv import metrics
    from kbv.report import compare_protocols, render_comparison, render_summary
    from kbv.report.terminal import leaderboard_rows

    fp32 = [make_record("p1", "c1", speedup=2.0), make_record("p2", "c2", speedup=8.0)]
    bf16 = [_in_precision(make_record("p1", "c1", speedup=0.5), "bf16")]
    assert metrics.record_precision(fp32[0]) == "fp32" and metrics.record_precision(bf16[0]) == "bf16"
    assert list(metrics.split_by_precision(bf16 + fp32)) == ["fp32", "bf16"]
    rows = {row["protocol"]: row for row in leaderboard_rows(fp32 + bf16)}
    assert rows["verified"]["correct_speedup"] == pytest.approx(4.0)  # fp32 alone
    assert rows["verified bf16"]["correct_speedup"] == pytest.approx(0.5)
    console = Console(record=True, width=120)
    render_summary(fp32 + bf16, console)
    text = console.export_text()
    assert "precision fp32" in text and "precision bf16" in text
    # a standard fp32 record never pairs with a verified bf16 record of the same pair
    std = [make_record("p1", "c1", protocol="standard", speedup=4.0)]
    assert compare_protocols(std, bf16)["pairs"] == 0
    std_bf16 = [
        _in_precision(make_record("p1", "c1", protocol="standard", speedups={"eager_bf16": 3.0}), "bf16")
    ]
    ver_bf16 = [_in_precision(make_record("p1", "c1", speedups={"eager_bf16": 0.5}), "bf16")]
    result = render_comparison(std + std_bf16, fp32 + ver_bf16, Console(record=True, width=120))
    assert result["pairs"] == 1  # the bf16 board: its own pair, against eager_bf16
    assert result["labels"]["model-a"]["verified"]["correct_speedup_vs_reference"] == pytest.approx(0.5)
    # the HTML report compares every precision at once: one row per label and precision, no overall
    std_fp32 = [make_record("p1", "c1", protocol="standard", speedup=4.0)]
    both = compare_protocols(std_fp32 + std_bf16, fp32[:1] + ver_bf16)
    assert set(both["labels"]) == {"model-a (fp32)", "model-a (bf16)"} and both["overall"] is None


# ------------------------------------------------------------------------------------ protocol audit
def _audit_problem(tmp_path: Path) -> Path:
    path = tmp_path / "p" / "row_sum.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "import torch\n\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n"
        "        return torch.sum(x, dim=1)\n\n\ndef get_inputs():\n    return [torch.randn(16, 512)]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    return path


def test_a_half_precision_audit_has_its_own_controls_and_mutants(tmp_path: Path) -> None:
    from kbv.problems import load_problem
    from kbv.protocol_audit import _generate as gen

    problem = load_problem(_audit_problem(tmp_path))
    fp32 = {(s.kind, s.variant) for s in gen.problem_specs(problem, "cpu", tmp_path / "fp32")}
    bf16 = gen.problem_specs(problem, "cpu", tmp_path / "bf16", precision="bf16")
    kinds = {s.kind for s in bf16}
    assert {("bf16", ""), ("fp16", "")} <= fp32 and "fp8" not in {k for k, _ in fp32}
    assert "fp8" in kinds and not kinds & {"bf16", "fp16", "tf32"}
    fp16_kinds = {s.kind for s in gen.problem_specs(problem, "cpu", tmp_path / "fp16", precision="fp16")}
    assert {"bf16", "fp8"} <= fp16_kinds and "fp16" not in fp16_kinds
    by_kind = {(s.kind, s.variant): s for s in bf16}
    assert by_kind[("fp8", "")].status == "evaluate"  # not equivalent: rounding to fp8 shows
    # the reordered controls accumulate a bf16 input in float32, rounded once
    blocked = gen._import(Path(by_kind[("reordered", "blocked")].path))
    x = torch.randn(16, 512).bfloat16()
    got = blocked.ModelNew()(x)
    assert got.dtype == torch.bfloat16
    exact = x.double().sum(1)
    # one rounding of a float32 sum: within bf16's unit roundoff (a bf16 accumulation is not)
    assert bool(((got.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-6).all())


def test_verified_kills_zeros_constant_and_subsets_at_bf16_and_passes_the_controls(tmp_path: Path) -> None:
    from kbv.protocol_audit import audit_protocols

    result = audit_protocols(
        _audit_problem(tmp_path), ["verified"], device="cpu", db=tmp_path / "a.sqlite", precision="bf16"
    )
    (summary,) = result.summaries
    assert summary["protocol"]["precision"] == "bf16"
    assert summary["false_rejection"]["count"] == 0 and summary["false_rejection"]["n"] >= 3
    for kind in ("zeros", "constant", "first_rows", "stride", "head_tail", "fp8"):
        entry = summary["by_kind"][kind]
        assert entry["count"] == entry["n"] >= 1, (kind, entry)


def test_the_generation_prompt_says_the_precision_and_fp32_prompts_are_unchanged() -> None:
    from kbv.generate._prompts import build_prompt

    source = (SUITE / "level1" / "1_ReLU.py").read_text()
    fp32 = build_prompt(source)
    assert build_prompt(source, precision="fp32").text == fp32.text
    assert "judged in" not in fp32.text
    bf16 = build_prompt(source, precision="bf16").text
    assert "judged in bf16" in bf16 and "torch.bfloat16" in bf16
    assert "torch.float16" in build_prompt(source, precision="fp16").text


def test_problems_audit_lists_what_cannot_run_in_a_precision() -> None:
    from kbv.problems import load_problem
    from kbv.problems_audit import audit_problems

    problem = load_problem(PROBLEMS / "row_sum_overflows_fp16.py")
    fp16, bf16, fp32 = (
        audit_problems([problem], "cpu", seed=1, precision=p)[0] for p in ("fp16", "bf16", "fp32")
    )
    assert "problem_error" in fp16.flags and "not finite in fp16" in (fp16.error or "")
    assert fp16.to_dict()["precision"] == "fp16"
    assert "problem_error" not in bf16.flags and "problem_error" not in fp32.flags
    (inverse,) = audit_problems(
        [load_problem(PROBLEMS / "matrix_inverse.py")], "cpu", seed=1, precision="bf16"
    )
    assert "problem_error" in inverse.flags and "BFloat16" in (inverse.error or "")


def test_an_operator_without_half_support_is_the_problems_error_not_the_candidates(tmp_path: Path) -> None:
    problem = PROBLEMS / "matrix_inverse.py"
    candidate = tmp_path / "inverse.py"
    candidate.write_text(problem.read_text().replace("class Model(", "class ModelNew("))
    record = evaluate_paths(problem, candidate, protocol="standard", device="cpu", precision="bf16")
    assert record.outcome == "problem_error" and (record.error or {}).get("blame") == "problem"
    assert evaluate_paths(problem, candidate, protocol="standard", device="cpu").outcome == "passed"


def test_the_html_report_keeps_a_board_per_precision(tmp_path: Path) -> None:
    pytest.importorskip("jinja2")
    pytest.importorskip("matplotlib")
    from test_metrics import make_record

    from kbv.report import write_html_report

    records = [
        make_record("p1", "c1", protocol="standard", speedup=4.0),
        make_record("p1", "c1", speedup=2.0),
        _in_precision(make_record("p1", "c1", protocol="standard", speedup=3.0), "bf16"),
        _in_precision(make_record("p1", "c1", speedup=0.5), "bf16"),
    ]
    html = write_html_report(records, tmp_path / "report.html").read_text()
    assert "verified bf16" in html and "standard bf16" in html
    assert "model-a (bf16)" in html and "model-a (fp32)" in html  # the comparison, per precision


def test_kbv_compare_in_bf16_stores_and_compares_bf16_records(tmp_path: Path) -> None:
    from kbv.metrics import record_precision
    from kbv.store import Store

    problems, candidates = tmp_path / "problems", tmp_path / "candidates"
    problems.mkdir()
    candidates.mkdir()
    (problems / "long_row_sum.py").write_text(LONG_SUM.read_text())
    (candidates / "long_row_sum.py").write_text(
        (CANDIDATES / "long_row_sum_fp32_accumulation.py").read_text()
    )
    db = tmp_path / "kbv.sqlite"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kbv.cli",
            "compare",
            "--problems",
            str(problems),
            "--candidates",
            str(candidates),
            "--device",
            "cpu",
            "--precision",
            "bf16",
            "--db",
            str(db),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    with Store(db) as store:
        records = store.records(latest=True)
    assert {r.protocol["name"] for r in records} == {"standard", "verified"}
    assert {record_precision(r) for r in records} == {"bf16"}
    assert all(r.outcome == "passed" for r in records)


def _missed(rel_err: float = 0.03) -> DistributionResult:
    """A distribution whose float output missed the error model's tolerance by a finite error."""
    output = {"kind": "float", "passed": False, "norm_err": 3.1e-2, "norm_tol": 9e-3}
    tolerance = {"mode": "error_model", "outputs": [output]}
    return DistributionResult("signed", applicable=True, passed=False, rel_err=rel_err, tolerance=tolerance)


def test_below_precision_is_a_registered_correctness_check() -> None:
    """Made through the registry (``kbv checks`` lists it), from the correctness results alone."""
    check = get_check("below_precision")
    assert (check.kind, check.default_severity) == ("correctness", "info") and "fp8" in check.doc
    assert "below_precision" in [c.name for c in list_checks("correctness")]
    (found,) = correctness_findings("bf16", [_missed()], "y = x.to(torch.float8_e4m3fn)")
    assert (found.check, found.severity) == ("below_precision", "info")
    assert "a relative norm of 0.031 against a tolerance of 0.009" in found.detail
    assert "the source uses fp8" in found.detail
    # accepted: fp32, a distribution that passed, an error that is not finite, a structural failure
    assert correctness_findings("fp32", [_missed()]) == []
    assert correctness_findings("bf16", [replace(_missed(), passed=True)]) == []
    assert correctness_findings("bf16", [_missed(rel_err=float("inf"))]) == []
    structural = replace(_missed(), tolerance={"mode": "error_model", "error": "shape (4,) != (4, 1)"})
    assert correctness_findings("fp16", [structural]) == []


@pytest.mark.parametrize("override", ["warn", "off"])
def test_a_protocols_severity_override_applies_to_below_precision(override: str) -> None:
    from types import SimpleNamespace

    from kbv.evaluation.orchestrator import _correctness_findings

    protocol = protocol_from_dict(
        {
            "name": "half-strict",
            "base": "verified",
            "precision": "bf16",
            "integrity": {"severity": {"below_precision": override}},
        }
    )
    ctx = SimpleNamespace(protocol=protocol, candidate=SimpleNamespace(source=""))
    found = _correctness_findings(ctx, [_missed()])  # type: ignore[arg-type]
    assert [(f.check, f.severity) for f in found] == (
        [] if override == "off" else [("below_precision", override)]
    )
