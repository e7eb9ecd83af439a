"""What a user reads first must be true: the leaderboard's order, the comparison's words and
shares, one record per sample, a missing toolchain blamed on the machine, error summaries, host
memory, the README, and the smaller points (one missing-database wording, numeric drill-down)."""

from __future__ import annotations

import io
import math
import os
import re
import sqlite3
import stat
from pathlib import Path

import pytest
from conftest import FOUNDATION, RELU, ROOT
from rich.console import Console
from test_metrics import HACK, make_record

from kbv import metrics
from kbv.candidates import load_candidate
from kbv.cli import main
from kbv.problems import load_problem
from kbv.records import DistributionResult, Finding, host_memory_section, with_summary
from kbv.report.comparison import _shares, change, compare_protocols
from kbv.report.terminal import leaderboard_rows, render_comparison, render_summary
from kbv.store import DEFAULT_DB, DEMO_DB, Store, default_db_to_read, missing_database
from kbv.toolchain import ToolchainError, check_toolchain, toolchain_problems

# ----------------------------------------------------------------------------- 1. headline numbers


def _demo_like(protocol: str) -> list:
    """The CPU demo's shape: honest kernels all pass but are slower than PyTorch (0.58x), the
    broken set fails everything, the hacks pass once (0.99x) and are caught otherwise."""
    honest = [
        make_record(f"p{i}", f"h{i}", label="honest_cpu", protocol=protocol, speedup=0.58) for i in range(5)
    ]
    broken = [
        make_record(
            f"p{i}", f"b{i}", label="broken", protocol=protocol, outcome="compile_error", speedup=None
        )
        for i in range(4)
    ]
    hacks = [make_record("p0", "k0", label="hacks", protocol=protocol, speedup=0.99)] + [
        make_record(
            f"p{i}", f"k{i}", label="hacks", protocol=protocol, outcome="hack_detected", findings=[HACK]
        )
        for i in range(1, 13)
    ]
    return honest + broken + hacks


def test_the_leaderboard_ranks_correctness_first_and_a_set_that_failed_everything_last() -> None:
    records = _demo_like("verified")
    rows = {row["label"]: row for row in leaderboard_rows(records)}
    # The fixture the old order (speed if deployed, failures counting 1.0x) got wrong:
    assert rows["broken"]["comparable_geomean"] > rows["honest_cpu"]["comparable_geomean"]
    assert rows["hacks"]["comparable_geomean"] > rows["honest_cpu"]["comparable_geomean"]
    assert [row["label"] for row in leaderboard_rows(records)] == ["honest_cpu", "hacks", "broken"]
    assert [row["rank"] for row in leaderboard_rows(records)] == [1, 2, 3]
    # Within a protocol only: each protocol is its own board, ranked from 1.
    both = leaderboard_rows(_demo_like("standard") + records)
    assert [(r["protocol"], r["rank"]) for r in both][:4] == [
        ("standard", 1),
        ("standard", 2),
        ("standard", 3),
        ("verified", 1),
    ]
    # The accepted side: a set that passes more ranks higher even when it is slower.
    slow_good = [make_record(f"p{i}", f"s{i}", label="slow", speedup=0.5) for i in range(4)]
    fast_bad = [make_record("p0", "f0", label="fast", speedup=9.0)] + [
        make_record(f"p{i}", f"f{i}", label="fast", outcome="incorrect", speedup=None) for i in range(1, 4)
    ]
    assert [r["label"] for r in leaderboard_rows(slow_good + fast_bad)] == ["slow", "fast"]
    assert metrics.rank_key({"correct_rate": None, "fast_p": {}, "comparable_geomean": None}) == (0, 0, 0)


def test_the_terminal_leaderboard_leads_with_correctness_and_names_the_deployed_speed() -> None:
    console = Console(record=True, width=120)
    render_summary(_demo_like("verified"), console)
    text = console.export_text()
    order = [text.index(f"\n{label} ") for label in ("honest_cpu", "hacks", "broken")]
    assert order == sorted(order)
    header = next(line for line in text.splitlines() if line.startswith("label"))
    assert header.split()[3:6] == ["correct", "fast_1", "deployed"]
    assert "deploy each kernel where it passed and keep PyTorch elsewhere" in " ".join(text.split())
    assert "cmp" not in header


def test_a_rise_is_labelled_a_rise_and_a_drop_a_drop() -> None:
    assert change(1 / 0.58) == "drop ÷1.72"
    assert change(0.58) == "rise ×1.72"
    assert change(1.001) == "no change"
    # A set whose score rose under verified: the old table printed "÷0.58" as its drop.
    standard = [make_record("p1", "c1", protocol="standard", outcome="incorrect", speedup=None)]
    verified = [make_record("p1", "c1", protocol="verified", speedup=2.0)]
    console = Console(record=True, width=100)
    result = render_comparison(standard, verified, console)
    text = console.export_text()
    assert result["labels"]["model-a"]["change"] == "rise"
    assert "rise ×2.00" in text and "÷0.50" not in text


def test_decomposition_shares_stay_within_0_and_100_percent() -> None:
    # One factor drops (integrity), another rises (timing): a share of the net change is unbounded.
    effects = {"integrity": 2.0, "distribution": 1.0, "timing_other": 0.4, "baseline": 1.0}
    net = math.log(2.0) / (math.log(2.0) + math.log(0.4))
    assert not 0.0 <= net <= 1.0  # the rule the old report used: -310% here
    shares = _shares(effects)
    assert all(0.0 <= share <= 1.0 for share in shares.values() if share is not None)
    assert sum(s for s in shares.values() if s is not None) == pytest.approx(1.0)
    assert _shares({"integrity": 1.0, "distribution": 1.0}) == {"integrity": None, "distribution": None}
    # Through the whole comparison: a hack caught (a drop) next to a kernel that only verified passes.
    standard = [
        make_record("p1", "a", protocol="standard", speedup=8.0),
        make_record("p2", "b", protocol="standard", outcome="incorrect", speedup=None),
    ]
    verified = [
        make_record("p1", "a", protocol="verified", outcome="hack_detected", findings=[HACK]),
        make_record("p2", "b", protocol="verified", speedup=30.0),
    ]
    summary = compare_protocols(standard, verified)["labels"]["model-a"]
    assert summary["effect_directions"]["integrity"] == "drop"
    assert summary["effect_directions"]["timing_other"] == "rise"
    assert all(0.0 <= s <= 1.0 for s in summary["effect_shares"].values() if s is not None)


def test_html_charts_say_how_they_count_and_never_draw_a_failed_set_as_best(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from kbv.report import write_html_report
    from kbv.report.html import _comparison_figure, _speed_memory_figure

    records = _demo_like("standard") + _demo_like("verified")
    html = write_html_report(records, tmp_path / "r.html").read_text()
    assert 'class="rule">Ranked by <b>correct</b>' in html
    assert html.count('<figcaption class="rule">') >= 4  # every chart, above its image
    board = html[
        html.index('<table id="leaderboard">') : html.index("</table>", html.index('id="leaderboard"'))
    ]
    labels = re.findall(r'<tr class="leaderboard-row">\s*<td class="l">([^<]+)</td>', board)
    assert labels == ["honest_cpu", "hacks", "broken"] * 2

    comparison = compare_protocols(*(_demo_like(p) for p in ("standard", "verified")))
    figure = _comparison_figure(comparison, plt)
    left, right = figure.axes
    assert "every other outcome counts as failed" in left.get_title()
    assert "a failed pair counts 1.0x" in right.get_title()
    assert [t.get_text() for t in left.get_xticklabels()] == ["honest_cpu", "hacks", "broken"]
    # broken: no speed bar, a "none passed" mark instead; the others a bar each per protocol
    assert [t.get_text() for t in right.texts].count("none\npassed") == 2
    assert len(right.patches) == 4
    plt.close(figure)
    # the speed-versus-memory chart leaves out a set with no passed pair (it would sit at 1.0x)
    rows = [
        {
            "label": "ok",
            "protocol": "verified",
            "comparable_geomean": 0.6,
            "memory_efficiency": 1.0,
            "correct_rate": 1.0,
        },
        {
            "label": "none",
            "protocol": "verified",
            "comparable_geomean": 1.0,
            "memory_efficiency": 1.0,
            "correct_rate": 0.0,
        },
    ]
    colours = {"ok": "blue", "none": "red"}
    scatter = _speed_memory_figure(rows, colours, plt)
    assert [t.get_text() for t in scatter.axes[0].get_legend().get_texts()] == ["ok (verified)"]
    plt.close(scatter)


# ----------------------------------------------------------------------------- 2. one record per sample


def _samples_dir(root: Path, copies: int = 8) -> Path:
    """32 KernelBench-named samples of problem 1 (ReLU) from 4 distinct sources, 8 copies each."""
    root.mkdir(parents=True)
    sources = ["relu_plain.py", "relu_wrong.py", "relu_plain.py", "relu_wrong.py"]
    for i, name in enumerate(sources):
        text = (FOUNDATION / name).read_text() + f"\n# source {i}\n"
        for j in range(copies):
            (root / f"level_1_problem_1_sample_{i * copies + j}_kernel.py").write_text(text)
    return root


def _fake_evaluate(problem, candidate, protocol, device, *, timeout_s=None):
    """A verdict from the source alone (sources 0 and 2 pass), recorded as the pipeline would."""
    import platform

    from kbv._version import __version__
    from kbv.execute import crashed_record

    device_name = platform.processor() or platform.machine()  # what the batch's probe calls this CPU
    protocol = protocol.with_timeout(timeout_s)
    record = crashed_record(problem, candidate, protocol, {"type": "cpu", "name": device_name}, "", [])
    passed = "# source 0" in candidate.source or "# source 2" in candidate.source
    record.outcome, record.correct, record.error = (
        ("passed", True, None) if passed else ("incorrect", False, None)
    )
    record.versions = {"kbv": __version__, "torch": "fake-torch"}
    return record


def test_identical_samples_each_keep_their_own_record_and_pass_at_k_counts_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kbv.execute._sequential
    from kbv.batch import plan_batch, run_batch
    from kbv.protocol import STANDARD

    monkeypatch.setattr(
        kbv.execute._sequential, "probe_hello", lambda device, visible=None: {"torch": "fake-torch"}
    )
    plan = plan_batch(RELU, _samples_dir(tmp_path / "samples"), label="m")
    assert len(plan.pairs) == 32 and len({c.source_sha256 for _, c in plan.pairs}) == 4
    with Store(tmp_path / "s.sqlite") as store:
        first = run_batch(plan.pairs, STANDARD, device="cpu", store=store, evaluate_fn=_fake_evaluate)
        again = run_batch(plan.pairs, STANDARD, device="cpu", store=store, evaluate_fn=_fake_evaluate)
        records = store.records()
    # The rejected behaviour was "8 evaluated, 24 already stored".
    assert (len(first.records), first.skipped) == (32, 0)
    assert (len(again.records), again.skipped) == (0, 32)  # --resume still skips what is stored
    assert len(records) == 32
    summary = metrics.aggregate(records)
    assert summary["n"] == 32 and summary["correct_rate"] == 0.5
    # pass@k over n = 32 samples with c = 16 passed: 1 - C(16, k) / C(32, k)
    assert summary["pass_at_k"][2] == pytest.approx(1 - math.comb(16, 2) / math.comb(32, 2))
    # Duplicates share one build: the compile stage hands identical sources the same future.
    from kbv.worker.builds import CompileStage

    stage = CompileStage(1)
    try:
        futures = {id(stage.submit(c)) for _, c in plan.pairs}
    finally:
        stage.close()
    assert len(futures) == 4


def test_an_older_store_gains_the_sample_key_and_keeps_resuming(tmp_path: Path) -> None:
    """A version-2 store (key without the candidate's file) migrates: its records keep their key, so
    a resumed batch skips them and evaluates only the duplicates the old key had merged."""
    from kbv.store import record_key

    path = tmp_path / "v2.sqlite"
    with Store(path) as store:
        store.add_record(make_record("p1", "c1", path="/runs/level_1_problem_1_sample_0_kernel.py"))
    conn = sqlite3.connect(path)  # what a version-2 file looks like: no candidate_path column
    conn.executescript(
        "DROP INDEX records_key; ALTER TABLE records DROP COLUMN candidate_path;"
        " CREATE INDEX records_key ON records(problem_sha, candidate_sha, protocol_sha, device_name,"
        " kbv_version, torch_version); PRAGMA user_version = 2;"
    )
    conn.close()
    with Store(path) as store:
        assert store.schema_version == 3
        first = make_record("p1", "c1", path="/runs/level_1_problem_1_sample_0_kernel.py")
        duplicate = make_record("p1", "c1", path="/runs/level_1_problem_1_sample_1_kernel.py")
        assert store.has_record(record_key(first))
        assert not store.has_record(record_key(duplicate))


def test_the_batch_says_that_every_file_is_a_sample() -> None:
    from kbv.batch import samples_note

    candidate = load_candidate(FOUNDATION / "relu_plain.py")
    problem = load_problem(RELU)
    assert samples_note([(problem, candidate)] * 3) == (
        "3 samples of 1 distinct source (every candidate file is a sample, identical files included; "
        "they share one compiled extension)"
    )
    assert samples_note([(problem, candidate)]) == ""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert "identical" in doc and "n = 32" in doc


# ----------------------------------------------------------------------------- 3. the toolchain


_ORIGINAL_PATH = os.environ.get("PATH", os.defpath)


def _path_with(tmp_path: Path, *tools: str) -> str:
    """A PATH holding only the named tools (links to the real ones)."""
    import shutil

    directory = tmp_path / ("bin-" + "-".join(tools))
    directory.mkdir(exist_ok=True)
    for tool in tools:
        real = shutil.which(tool, path=_ORIGINAL_PATH)
        if real is None:
            pytest.skip(f"{tool} is not installed here")
        (directory / tool).symlink_to(real)
    return str(directory)


def test_a_missing_ninja_is_a_harness_error_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpp = load_candidate(FOUNDATION / "relu_cpp.py")
    plain = load_candidate(FOUNDATION / "relu_plain.py")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", _path_with(tmp_path, "c++"))
    problems = toolchain_problems([cpp, plain], "cpu")
    assert problems == [
        "ninja is not on the PATH, and 1 C++/CUDA candidate needs it to build: pip install ninja "
        "(or apt-get install ninja-build)"
    ]
    with pytest.raises(ToolchainError, match="pip install ninja"):
        check_toolchain([cpp], "cpu")
    check_toolchain([plain], "cpu")  # accepted: a plain PyTorch candidate builds nothing
    monkeypatch.setenv("PATH", _path_with(tmp_path, "ninja"))
    assert "no C++ compiler (c++) on the PATH" in toolchain_problems([cpp], "cpu")[0]


def test_an_unusable_cuda_toolkit_is_reported_for_cuda_candidates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = load_candidate(ROOT / "src" / "kbv" / "suite" / "candidates" / "honest_cuda" / "1_ReLU.py")
    cpp = load_candidate(FOUNDATION / "relu_cpp.py")
    monkeypatch.setenv("PATH", _path_with(tmp_path, "c++", "ninja"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    problems = toolchain_problems([cuda], "cuda")
    assert len(problems) == 1 and "no usable CUDA toolkit" in problems[0] and "CUDA_HOME" in problems[0]
    assert toolchain_problems([cpp], "cuda") == []  # C++ for the CPU needs no toolkit
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert toolchain_problems([cuda], "cuda") == []


def test_kbv_eval_without_ninja_exits_2_and_writes_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    out = tmp_path / "records.jsonl"
    monkeypatch.setenv("PATH", _path_with(tmp_path, "c++") + os.pathsep + str(Path(sys.executable).parent))
    if Path(sys.executable).parent.joinpath("ninja").exists():
        pytest.skip("ninja lives beside the interpreter here")
    code = main(["eval", str(RELU), str(FOUNDATION / "relu_cpp.py"), "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "ninja is not on the PATH" in err and "pip install ninja" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_batch_without_ninja_stops_before_any_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kbv.batch import run_batch
    from kbv.protocol import STANDARD

    calls: list[str] = []

    def evaluate(*args, **kwargs):  # pragma: no cover - must never run
        calls.append("evaluated")
        raise AssertionError("evaluated")

    pairs = [(load_problem(RELU), load_candidate(FOUNDATION / "relu_cpp.py"))]
    monkeypatch.setenv("PATH", _path_with(tmp_path, "c++"))
    with Store(tmp_path / "s.sqlite") as store, pytest.raises(ToolchainError):
        run_batch(pairs, STANDARD, device="cpu", store=store, evaluate_fn=evaluate)
    with Store(tmp_path / "s.sqlite") as store:
        assert store.records() == [] and not calls


def test_build_progress_is_printed_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import kbv.worker.builds as builds
    from kbv.batch import prebuild_extensions
    from kbv.worker.builds import CompileResult

    def fake_prebuild(candidates, *, device="cpu", workers=None, on_result=None):
        results = [CompileResult(c.source_sha256, "built", 12.0) for c in candidates]
        for candidate, result in zip(candidates, results, strict=True):
            on_result(candidate, result)
        return results

    monkeypatch.setattr(builds, "prebuild", fake_prebuild)
    problem = load_problem(RELU)
    pairs = [(problem, load_candidate(FOUNDATION / name)) for name in ("relu_cpp.py", "relu_plain.py")]
    stream = io.StringIO()
    console = Console(file=stream, width=100)
    assert not console.is_terminal
    prebuild_extensions(pairs, "cpu", console)
    text = stream.getvalue()
    assert "building 1 C++/CUDA extension(s) for 1 candidate(s)" in text
    assert "[1/1] built " in text and "relu_cpp.py (12 s;" in text
    assert "extensions: 1 built, 0 cached, 0 failed" in text
    # A build that failed before is cached as a failure: said so, never counted as a success.
    monkeypatch.setattr(
        builds,
        "prebuild",
        lambda candidates, **kw: [
            kw["on_result"](c, CompileResult(c.source_sha256, "cached")) for c in candidates
        ],
    )
    monkeypatch.setattr(builds, "known_build_failure", lambda sha: "error: expected ';'")
    stream.truncate(0)
    prebuild_extensions(pairs, "cpu", console)
    text = stream.getvalue()
    assert "[1/1] failed (cached) " in text and "0 cached, 1 failed" in text


def test_prebuild_reports_each_result_as_it_finishes() -> None:
    from kbv.worker.builds import prebuild

    seen: list[str] = []
    plain = load_candidate(FOUNDATION / "relu_plain.py")  # builds nothing: answered at once
    results = prebuild([plain], device="cpu", on_result=lambda c, r: seen.append(f"{c.path.name} {r.status}"))
    assert [r.status for r in results] == ["skipped"] and seen == ["relu_plain.py skipped"]


# ----------------------------------------------------------------------------- 4. records say why


def test_every_outcome_but_passed_has_a_summary_and_a_hack_names_its_checks() -> None:
    findings = [
        Finding.fail("output_aliases_input", "output 0 shares storage with input 0"),
        Finding.warn("transient_mismatch", "1 draw failed once"),
        Finding.fail("timer_tampering", "line 3: time.perf_counter = fake"),
    ]
    error = with_summary("hack_detected", findings, [], None)
    assert error is not None
    assert error["summary"] == (
        "hack detected by 2 checks: output_aliases_input: output 0 shares storage with input 0; "
        "timer_tampering: line 3: time.perf_counter = fake"
    )
    assert [c["check"] for c in error["checks"]] == ["output_aliases_input", "timer_tampering"]
    wrong = DistributionResult("signed", applicable=True, passed=False, max_abs_err=0.5, note="x" * 400)
    incorrect = with_summary("incorrect", [], [DistributionResult("original", True, True), wrong], None)
    assert incorrect is not None and incorrect["summary"].startswith(
        "wrong output on the signed inputs (max_abs_err 0.5): x"
    )
    assert len(incorrect["summary"]) < 250
    crashed = with_summary(
        "runtime_error", [], [], {"kind": "runtime_error", "message": "Traceback\n  f\nValueError: bad"}
    )
    assert crashed is not None and crashed["summary"] == "ValueError: bad"
    assert with_summary("passed", [], [], None) is None  # accepted: a pass has nothing to explain


# ----------------------------------------------------------------------------- 5. host memory


def test_host_memory_ratio_in_the_record_the_metrics_and_the_report(tmp_path: Path) -> None:
    assert host_memory_section(1_550, 350)["host_ratio"] == pytest.approx(1_550 / 350)
    assert host_memory_section(None, 350)["host_ratio"] is None
    records = [make_record("p1", "a"), make_record("p2", "b"), make_record("p3", "c", outcome="incorrect")]
    for record, (cand, ref) in zip(records, ((400, 100), (100, 100), (900, 100)), strict=True):
        record.memory.update(host_memory_section(cand, ref))
    assert metrics.host_memory_ratio(records) == pytest.approx(2.0)  # passed pairs only: sqrt(4 * 1)
    assert metrics.aggregate(records)["host_memory_ratio"] == pytest.approx(2.0)
    del records[0].memory["host_ratio"]  # an older record: from its two peaks
    assert metrics.host_memory_ratio(records) == pytest.approx(2.0)
    console = Console(record=True, width=120)
    render_summary(records, console)
    text = console.export_text()
    assert (
        "host mem" in text
        and "2.00x" in text
        and "host memory, candidate process peak" in " ".join(text.split())
    )
    from kbv.report import write_html_report

    html = write_html_report(records, tmp_path / "r.html").read_text()
    assert '<td class="host-memory">2.00x</td>' in html and "host memory" in html


# ----------------------------------------------------------------------------- 6. README


README = ROOT / "README.md"


def test_readme_first_screen_requirements_api_exit_codes_and_links() -> None:
    text = README.read_text()
    first_screen = "\n".join(text.splitlines()[:25])
    assert "https://github.com/ScalingIntelligence/KernelBench" in first_screen
    for needed in (
        "## Requirements",
        "## Python API",
        "kbv.evaluate_paths",
        "Linux",
        "Python >= 3.10",
        "ninja",
    ):
        assert needed in text, needed
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    for code in ("`0`", "`1`", "`2`", "`130`"):
        assert code in text, code
    # Every link stays inside the repository (the KernelBench link and PyTorch's index excepted).
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith("http"):
            assert "KernelBench" in target or "pytorch.org" in target, target
            continue
        assert (ROOT / target.split("#")[0]).exists(), target
    for path in re.findall(r"`(docs/[\w./-]+\.md)`", text):
        assert (ROOT / path).exists(), path


def test_the_quick_start_is_what_ci_runs() -> None:
    commands = re.search(r"## Quick start\s+```bash\n(.*?)```", README.read_text(), re.S)
    assert commands is not None
    first, second = commands.group(1).strip().splitlines()[:2]
    assert first.endswith("kbv demo")
    assert second in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_contract_lives_in_the_repository() -> None:
    contract = (ROOT / "docs" / "contract.md").read_text()
    assert "## The evaluation record" in contract and "hack_detected" in contract


def test_kbv_report_after_kbv_demo_needs_no_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_db_to_read() == DEFAULT_DB  # nothing yet: kbv run's store
    with Store(DEMO_DB) as store:
        store.add_record(make_record(label="honest_cpu"))
    assert default_db_to_read() == DEMO_DB
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    assert "honest_cpu" in out and f"--db {DEMO_DB}" in out
    with Store(DEFAULT_DB) as store:  # a later kbv run: now the latest
        store.add_record(make_record(label="later"))
    os.utime(DEMO_DB, (1, 1))
    for wal in DEMO_DB.parent.glob("demo.sqlite-*"):
        os.utime(wal, (1, 1))
    assert default_db_to_read() == DEFAULT_DB


# ----------------------------------------------------------------------------- 7. smaller points


def test_one_wording_for_a_missing_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "none.sqlite"
    expected = missing_database(missing)
    for argv in (
        ["report", "--db", str(missing)],
        ["export", "--db", str(missing), "--jsonl", "x.jsonl"],
        ["explain", "1", "--db", str(missing)],
        ["compare", "--db", str(missing)],
        ["run", "--resume", "--db", str(missing)],
    ):
        assert main(argv) == 2, argv
        assert expected in capsys.readouterr().err, argv


def test_the_drill_down_sorts_problems_numerically(tmp_path: Path) -> None:
    from kbv.report import write_html_report
    from kbv.report.html import problem_order

    names = ["11_LayerNorm", "2_LeakyReLU", "1_ReLU", "12_X", "Custom"]
    assert sorted(names, key=lambda n: problem_order(1, n)) == [
        "1_ReLU",
        "2_LeakyReLU",
        "11_LayerNorm",
        "12_X",
        "Custom",
    ]
    html = write_html_report([make_record(n, f"c{n}") for n in names], tmp_path / "r.html").read_text()
    drill = html[html.index('id="drilldown"') :]
    assert re.findall(r"<h3>Level 1 &middot; ([^<]+)</h3>", drill) == [
        "1_ReLU",
        "2_LeakyReLU",
        "11_LayerNorm",
        "12_X",
        "Custom",
    ]


def test_explain_at_80_columns_keeps_notes_on_whole_lines() -> None:
    from kbv.report.explain import print_record

    note = "failed again on a re-run of the same inputs (original draw 0); only 1 of 2 draws ran"
    dists = [
        DistributionResult(
            name, True, False, max_abs_err=2.4e-5, rel_err=1.0, tolerance={"error_multiple": 8}, note=note
        )
        for name in ("original", "signed", "blockwise")
    ]
    record = make_record(outcome="incorrect", speedup=None, distributions=dists)
    narrow = Console(record=True, width=80)
    print_record(record, narrow)
    text = narrow.export_text()
    assert text.count("failed again on a re-run of the same inputs") == 3  # a sentence, not a word a line
    assert max(len(line) for line in text.splitlines()) <= 80
    wide = Console(record=True, width=160)
    print_record(record, wide)
    assert "┃ note" in wide.export_text()  # wide enough: the notes stay in their column


def test_the_racing_thread_hack_says_its_standard_verdict_varies() -> None:
    hack = (ROOT / "src" / "kbv" / "suite" / "candidates" / "hacks" / "7_Tanh.py").read_text()
    assert "nondeterministic" in hack and "standard" in hack
    assert "7_Tanh" in (ROOT / "docs" / "integrity-dynamic.md").read_text()


def test_the_local_executor_announces_each_build_as_it_finishes(capsys: pytest.CaptureFixture[str]) -> None:
    from concurrent.futures import Future

    from kbv.execute._local import _announce_builds, _Job
    from kbv.worker.builds import CompileResult

    problem = load_problem(RELU)
    cpp, plain = load_candidate(FOUNDATION / "relu_cpp.py"), load_candidate(FOUNDATION / "relu_plain.py")
    shared: Future[CompileResult] = Future()  # two samples with one source share one build
    skipped: Future[CompileResult] = Future()
    jobs = [_Job(problem, cpp, shared), _Job(problem, cpp, shared), _Job(problem, plain, skipped)]
    _announce_builds(jobs)
    assert "building 1 C++/CUDA extension(s)" in capsys.readouterr().err
    shared.set_result(CompileResult(cpp.source_sha256, "built", 31.0))
    skipped.set_result(CompileResult(plain.source_sha256, "skipped"))
    assert capsys.readouterr().err.splitlines() == [f"  [1/1] built {cpp.label}/relu_cpp.py (31 s)"]
