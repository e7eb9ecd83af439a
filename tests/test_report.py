"""Reports: the protocol comparison, terminal tables, the self-contained HTML file, and the CLI."""

from __future__ import annotations

import argparse
import base64
import io
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from test_metrics import HACK, make_record

from kbv import _store_cli
from kbv.records import DistributionResult, Finding, Record
from kbv.report import compare_protocols, render_comparison, render_summary, verdict_reason
from kbv.store import Store

WIDE_FAIL = DistributionResult("wide", True, False, max_abs_err=3.5, note="overflow")


def pair(problem: str, candidate: str, label: str = "m", **verified: object) -> list[Record]:
    """A standard record (passed, 4x vs eager_fp32) and a verified record of the same pair."""
    std = make_record(
        problem, candidate, label=label, protocol="standard", speedup=4.0, speedups={"eager_fp32": 4.0}
    )
    ver = make_record(problem, candidate, label=label, **verified)  # type: ignore[arg-type]
    return [std, ver]


def corpus() -> tuple[list[Record], list[Record]]:
    records = (
        pair("p1", "honest", speedup=2.0, speedups={"eager_fp32": 3.0})  # survives, baseline + timing effect
        + pair("p2", "hack", outcome="hack_detected", findings=[HACK], speedup=50.0)
        + pair("p3", "narrow", outcome="incorrect", speedup=None, distributions=[WIDE_FAIL])
        + pair("p4", "crash", outcome="crashed", speedup=None)
    )
    return records[0::2], records[1::2]


def test_compare_protocols_decomposition() -> None:
    standard, verified = corpus()
    result = compare_protocols(standard, verified)
    assert result["pairs"] == 4 and result["unmatched_standard"] == result["unmatched_verified"] == 0
    summary = result["labels"]["m"]
    assert summary["standard"]["comparable_geomean"] == pytest.approx(4.0)
    assert summary["verified"]["comparable_geomean"] == pytest.approx(2.0**0.25)
    assert summary["drop"] == pytest.approx(4.0 / 2.0**0.25)
    effects = summary["effects"]
    # stages of geomeans: (4,4,4,4) -> (4,1,4,4) -> (4,1,1,4) -> (3,1,1,1) -> (2,1,1,1)
    assert effects["integrity"] == pytest.approx(4.0**0.25)
    assert effects["distribution"] == pytest.approx(4.0**0.25)
    assert effects["timing_other"] == pytest.approx((4.0 / 3.0) ** 0.25 * 4.0**0.25)
    assert effects["baseline"] == pytest.approx(1.5**0.25)
    assert math.prod(effects.values()) == pytest.approx(summary["drop"])
    assert sum(summary["effect_shares"].values()) == pytest.approx(1.0)
    assert summary["counts"] == {
        "integrity": 1,
        "distribution": 1,
        "other_failures": 1,
        "only_verified_passed": 0,
    }
    assert summary["verified"]["correct_speedup_vs_reference"] == pytest.approx(3.0)
    reasons = {c["problem"]: c["reason"] for c in result["changed"]}
    assert set(reasons) == {"p2", "p3", "p4"}
    assert reasons["p2"].startswith("timing_tamper:")
    assert reasons["p3"].startswith("distribution wide failed")
    assert reasons["p4"] == "crashed"


def test_compare_protocols_edge_cases() -> None:
    empty = compare_protocols([], [])
    assert (
        empty["pairs"] == 0 and empty["overall"] is None and empty["labels"] == {} and empty["changed"] == []
    )
    std = [make_record("p1", "a", protocol="standard", outcome="incorrect")]
    ver = [make_record("p1", "a", speedup=2.0), make_record("p2", "b")]
    result = compare_protocols(std, ver)
    assert result["unmatched_verified"] == 1
    (changed,) = result["changed"]
    assert changed["reason"].startswith("passes under verified")
    assert result["labels"]["model-a"]["counts"]["only_verified_passed"] == 1
    assert result["labels"]["model-a"]["drop"] == pytest.approx(0.5)  # a gain is a drop below 1


def test_compare_protocols_pairs_records_of_one_device_only() -> None:
    std_cpu = make_record("p1", "a", protocol="standard", device="x86_64", speedup=3.0)
    ver_gpu = make_record("p1", "a", device="NVIDIA H200", speedup=1.5)
    apart = compare_protocols([std_cpu], [ver_gpu])
    assert apart["pairs"] == 0 and apart["unmatched_standard"] == apart["unmatched_verified"] == 1
    std_gpu = make_record("p1", "a", protocol="standard", device="NVIDIA H200", speedup=4.0)
    ver_cpu = make_record("p1", "a", device="x86_64", speedup=1.0)
    both = compare_protocols([std_cpu, std_gpu], [ver_gpu, ver_cpu])
    assert both["pairs"] == 2 and both["unmatched_standard"] == both["unmatched_verified"] == 0
    # each device's drop is its own: 4/1.5 on the GPU, 3/1 on the CPU, geomean over the two pairs
    assert both["labels"]["model-a"]["drop"] == pytest.approx(math.sqrt(4.0 / 1.5 * 3.0 / 1.0))


def test_verdict_reason_prefers_fail_findings() -> None:
    record = make_record(
        outcome="hack_detected", distributions=[WIDE_FAIL], findings=[Finding.warn("pytorch_only", "x"), HACK]
    )
    assert verdict_reason(record) == f"timing_tamper: {HACK.detail}"
    error = make_record(outcome="runtime_error")
    error.error = {"type": "RuntimeError", "message": "CUDA error: illegal memory access"}
    assert verdict_reason(error) == "runtime_error: CUDA error: illegal memory access"
    assert verdict_reason(make_record()) == "passed"


def _console() -> Console:
    return Console(record=True, width=160, force_terminal=False, color_system=None)


def test_render_summary_and_comparison() -> None:
    standard, verified = corpus()
    console = _console()
    render_summary(standard + verified, console)
    render_comparison(standard, verified, console)
    text = console.export_text()
    assert "Leaderboard" in text and "timing_tamper" in text and "hack_detected" in text
    assert "standard vs verified" in text and "distribution wide failed" in text
    empty = _console()
    render_summary([], empty)
    render_comparison([], [], empty)
    text = empty.export_text()
    assert "No records" in text and "nothing to compare" in text


def test_rich_markup_in_data_is_not_interpreted() -> None:
    console = _console()
    record = make_record(
        label="[bold]evil[/bold]", outcome="hack_detected", findings=[Finding.fail("x", "[red]y")]
    )
    render_summary([record], console)
    assert "[bold]evil[/bold]" in console.export_text()


def html_records() -> list[Record]:
    standard, verified = corpus()
    timing = {
        "recipe": "events-median",
        "candidate": {
            "rounds": [{"device_ms": [1.0, 1.2, 1.1], "wall_ms": [1.3, 1.4, 1.2]}],
            "summary": {
                "n": 3,
                "median": 1.1,
                "min": 1.0,
                "max": 1.2,
                "cv": 0.09,
                "warnings": ["few_samples"],
            },
        },
        "baselines": {"eager_fp32": {"samples_ms": [3.0]}},
    }
    extra = [
        make_record("p5", "mem", label="other", speedup=1.5, memory=(1000, 500), timing=timing),
        make_record("p6", "nan", label="other", speedup=float("nan")),
    ]
    return standard + verified + extra


@pytest.fixture
def html_report(tmp_path: Path) -> Path:
    source = tmp_path / "cand.py"
    source.write_text("class ModelNew:\n    '<script>alert(1)</script>'\n")
    records = html_records()
    records.append(make_record("p7", source.read_text(), path=str(source), label="other"))
    from kbv.report import write_html_report

    return write_html_report(records, tmp_path / "out" / "report.html", title="Test <report>")


def test_html_is_self_contained(html_report: Path) -> None:
    html = html_report.read_text()
    assert 'id="leaderboard"' in html and 'id="scatter"' in html and 'id="comparison"' in html
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
    assert "http://" not in html and "https://" not in html
    assert "<link" not in html and "<script" not in html  # no external CSS, no JS at all
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # candidate source shown, escaped
    assert "Test &lt;report&gt;" in html
    assert html.count('<details class="pair">') == len(html_records()) + 1
    assert "data:image/png;base64," in html
    assert "timing_tamper" in html and "distribution wide failed" in html
    assert "<td>1.1000</td>" in html and "few_samples" in html  # timing summary of p5


def test_html_without_comparison_or_memory(tmp_path: Path) -> None:
    from kbv.report import write_html_report

    path = write_html_report([make_record(outcome="incorrect", speedup=None)], tmp_path / "r.html")
    html = path.read_text()
    assert 'id="leaderboard"' in html and 'id="scatter"' in html and 'id="comparison"' not in html
    assert "candidate source not available" in html


CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is required in CI for the HTML screenshot test (apt-get install chromium)")
        pytest.skip("chromium not installed: apt-get install chromium to run the HTML screenshot test")
    profile = tmp_path / "chromium-profile"
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _pixels(png: bytes) -> Any:
    """An (h, w, 3) uint8 array of a PNG, decoded by matplotlib's reader (Pillow underneath)."""
    import matplotlib.image

    image = matplotlib.image.imread(io.BytesIO(png), format="png")
    if image.dtype != np.uint8:
        image = np.round(image * 255).astype(np.uint8)
    return image[..., :3]


def _distinct_colours(pixels: Any) -> int:
    return len(np.unique(pixels.reshape(-1, 3), axis=0))


def _has_colour(pixels: Any, rgb: tuple[int, int, int], tolerance: int = 12, at_least: int = 10) -> bool:
    close = np.all(np.abs(pixels.astype(int) - np.array(rgb)) <= tolerance, axis=-1)
    return int(close.sum()) >= at_least


def _embedded_png(dom: str, figure_id: str) -> bytes:
    # The figure's counting rule (a figcaption) comes first, then its image.
    match = re.search(
        rf'<figure id="{figure_id}">(?:<figcaption[^>]*>[^<]*</figcaption>\s*)?'
        r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"',
        dom,
    )
    assert match is not None, f"no embedded PNG in figure {figure_id}"
    data = base64.b64decode(match.group(1), validate=True)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return data


def test_pixel_checks_tell_a_blank_image_from_a_plot() -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    blank = io.BytesIO()
    fig = plt.figure(figsize=(2, 2))
    fig.savefig(blank, format="png")
    plt.close(fig)
    pixels = _pixels(blank.getvalue())
    assert _distinct_colours(pixels) == 1 and not _has_colour(pixels, (31, 119, 180))


def test_chromium_renders_report(html_report: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    result = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", html_report.as_uri())
    assert shot.is_file(), result.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000  # a blank page is a few KB
    page = _pixels(data)
    assert page.shape[:2] == (2000, 1400)
    assert _distinct_colours(page) > 200  # text, tables and figures, not an empty page
    assert _has_colour(page, (13, 27, 42), tolerance=2, at_least=1000)  # the header bar was styled

    dom = _chromium(tmp_path, "--enable-logging=stderr", "--v=0", "--dump-dom", html_report.as_uri())
    rows = re.findall(r'<tr class="leaderboard-row">', dom.stdout)
    assert len(rows) == 3  # m/standard, m/verified, other/verified
    assert 'id="scatter"' in dom.stdout
    # the scatter image the browser loaded is a real plot: many colours, and one point per label drawn
    # in that label's colour (tab10: "m" blue, "other" orange)
    scatter = _pixels(_embedded_png(dom.stdout, "label-scatter"))
    assert _distinct_colours(scatter) > 50
    assert _has_colour(scatter, (31, 119, 180)) and _has_colour(scatter, (255, 127, 14))
    problem_scatter = _pixels(_embedded_png(dom.stdout, "problem-scatter"))
    assert _distinct_colours(problem_scatter) > 50
    # the leaderboard is an HTML table (no image): its cells rendered with the computed numbers
    assert re.search(r'<tr class="leaderboard-row">\s*<td class="l">other</td>', dom.stdout)
    console_errors = [
        line for line in dom.stderr.splitlines() if "CONSOLE" in line and "ERROR" in line.upper()
    ]
    assert not console_errors, console_errors
    # nothing tried to reach the network
    assert "net::ERR" not in dom.stderr


# ----------------------------------------------------------------------------- CLI


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kbv")
    _store_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return int(args.handler(args))


def test_cli_export_import_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "kbv.sqlite"
    with Store(db) as store:
        run = store.start_run("run")
        for record in html_records():
            store.add_record(record, run)
        store.finish_run(run)

    jsonl, csv_path, html = tmp_path / "r.jsonl", tmp_path / "r.csv", tmp_path / "r.html"
    assert _cli("export", "--db", str(db), "--jsonl", str(jsonl)) == 0
    assert f"to {jsonl}" in capsys.readouterr().out
    assert len(jsonl.read_text().splitlines()) == len(html_records())
    assert _cli("export", "--db", str(db), "--csv", str(csv_path), "--run", str(run)) == 0
    header, first = csv_path.read_text().splitlines()[:2]
    assert header.startswith("record_id,label,")  # the id kbv explain ID takes
    assert first.split(",")[0] == "1"

    other = tmp_path / "other.sqlite"
    assert _cli("import", "--db", str(other), str(jsonl)) == 0
    assert f"into {other}" in capsys.readouterr().out
    assert _cli("import", "--db", str(other), str(jsonl)) == 0
    assert "skipped" in capsys.readouterr().out

    assert _cli("report", "--db", str(other), "--html", str(html)) == 0
    out = capsys.readouterr().out
    assert "Leaderboard" in out and "standard vs verified" in out and f"to {html}" in out
    assert 'id="leaderboard"' in html.read_text()


def test_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.sqlite"
    assert _cli("report", "--db", str(missing)) == 2
    assert "no results database" in capsys.readouterr().err
    assert not missing.exists()  # reading never creates a database
    assert _cli("export", "--db", str(missing), "--csv", str(tmp_path / "x.csv")) == 2
    assert _cli("import", "--db", str(missing), str(tmp_path / "nope.jsonl")) == 2
    with Store(tmp_path / "empty.sqlite"):
        pass
    assert _cli("report", "--db", str(tmp_path / "empty.sqlite")) == 2
    assert "no records" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli("export", "--db", str(missing))  # needs --jsonl or --csv


def test_default_db_path() -> None:
    assert str(_store_cli.DEFAULT_DB) == os.path.join("kbv-results", "kbv.sqlite")


# ----------------------------------------------------------------------------- pass@k, per-level labels, CI


def _samples(label: str, problem: str, level: int, speedups: list[float | None]) -> list[Record]:
    """One record per sample; a None speedup is an incorrect sample."""
    return [
        make_record(
            problem,
            f"{label}-{problem}-{i}",
            label=label,
            level=level,
            outcome="passed" if s is not None else "incorrect",
            speedup=s,
            path=f"/r/{label}/level_{level}_problem_{problem}_sample_{i}_kernel.py",
        )
        for i, s in enumerate(speedups)
    ]


def _row(html: str, table_id: str, first_cell: str) -> str:
    table = re.search(rf'<table id="{table_id}">(.*?)</table>', html, re.S)
    assert table is not None, table_id
    rows = [
        r
        for r in re.findall(r"<tr[^>]*>(.*?)</tr>", table.group(1), re.S)
        if f'<td class="l">{first_cell}</td>' in r
    ]
    assert len(rows) == 1, rows
    return rows[0]


def test_html_shows_pass_at_k_per_label_levels_and_speedup_interval(tmp_path: Path) -> None:
    from kbv.report import write_html_report

    records = (
        _samples("m1", "1", 1, [2.0, None, None, None])
        + _samples("m1", "2", 1, [None] * 4)
        + _samples("m2", "1", 1, [3.0] * 4)
        + _samples("m2", "2", 1, [1.5] * 4)
    )
    html = write_html_report(records, tmp_path / "r.html").read_text()
    head = re.search(r'<table id="leaderboard">\s*<thead>(.*?)</thead>', html, re.S)
    assert head is not None
    # four samples per problem: pass@1 and pass@2 (pass@5 needs five)
    assert "<th>pass@1</th>" in head.group(1) and "<th>pass@2</th>" in head.group(1)
    assert "pass@5" not in html
    m1, m2 = _row(html, "leaderboard", "m1"), _row(html, "leaderboard", "m2")
    # m1: problem 1 has 1 of 4 passing, problem 2 none: pass@1 = (1/4 + 0)/2, pass@2 = (1 - C(3,2)/C(4,2))/2
    assert re.findall(r'<td class="pass-at-k">(.*?)</td>', m1) == ["12.5%", "25.0%"]
    assert re.findall(r'<td class="pass-at-k">(.*?)</td>', m2) == ["100.0%", "100.0%"]
    # correct speedup with its bootstrap interval over problems
    assert '<td class="correct-speedup">2.00x<br><span class="ci">[2.00x, 2.00x]</span></td>' in m1
    assert '<td class="correct-speedup">2.12x<br><span class="ci">[1.50x, 3.00x]</span></td>' in m2
    # per-level table: one row per label at the same level, never mixed
    level_m1, level_m2 = _row(html, "level-table", "m1"), _row(html, "level-table", "m2")
    assert "<td>1</td><td>8</td><td>12.5%</td>" in level_m1
    assert "<td>1</td><td>8</td><td>100.0%</td>" in level_m2
    assert re.findall(r"<td>([\d.]+%)</td>", level_m1)[-2:] == ["12.5%", "25.0%"]


def test_html_without_samples_shows_no_pass_at_k(html_report: Path) -> None:
    assert "pass@" not in html_report.read_text()


def test_changed_verdicts_name_the_candidate_file_with_its_path_on_hover(tmp_path: Path) -> None:
    """A table cell names the file; the whole recorded path (long, machine-specific) is its title."""
    from kbv.report import write_html_report

    path = "/a/long/checkout/path/src/kbv/suite/candidates/hacks/7_Tanh.py"
    records = [
        make_record("7_Tanh", "c7", protocol="standard", outcome="passed", path=path),
        make_record("7_Tanh", "c7", protocol="verified", outcome="hack_detected", speedup=None, path=path),
    ]
    html = write_html_report(records, tmp_path / "r.html").read_text()
    changed = html[html.index('<table id="changed">') :]
    changed = changed[: changed.index("</table>")]
    assert f'title="{path}">7_Tanh.py</td>' in changed
    assert ">/a/long/checkout" not in changed
