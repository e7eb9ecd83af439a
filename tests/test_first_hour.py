"""Issue 14, "the first hour as a user": replay, blame, devices, numbers, pictures and small things.

Most tests are pure functions or in-process CLI calls; the few that start workers use the standard
protocol on tiny problems.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FOUNDATION, RELU, ROOT

from kbv.api import evaluate_paths
from kbv.cli import build_parser, main
from kbv.records import Finding, Record, error_summary

BROKEN = ROOT / "tests" / "fixtures" / "problems_error"
IDENTITY = FOUNDATION / "identity.py"


def _record(
    outcome: str,
    protocol: str = "verified",
    label: str = "m",
    speedup: float | None = None,
    problem: str = "p",
    memory: dict | None = None,
) -> Record:
    return Record(
        problem={"name": problem, "level": 1, "id": 1, "path": f"/x/{problem}.py", "source_sha256": problem},
        candidate={"path": f"/c/{problem}.py", "source_sha256": f"c-{problem}-{label}", "label": label},
        protocol={"name": protocol, "version": 1, "sha256": protocol},
        device={"type": "cpu", "name": "cpu"},
        outcome=outcome,
        correct=outcome == "passed",
        speedup={"best": speedup, "eager_fp32": speedup},
        memory=memory or {"candidate_peak_bytes": None, "baseline_peak_bytes": None, "ratio": None},
        error={"kind": "runtime_error", "message": "the problem failed"}
        if outcome == "problem_error"
        else None,
    )


# ------------------------------------------------------------------------------------ 1. replay


def test_eval_replay_needs_no_problem_or_candidate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rec.jsonl"
    assert (
        main(
            [
                "eval",
                str(RELU),
                str(FOUNDATION / "relu_plain.py"),
                "--protocol",
                "standard",
                "--device",
                "cpu",
                "--json",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    first = json.loads(capsys.readouterr().out)
    assert main(["eval", "--replay", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["outcome"] == first["outcome"] == "passed" and again["seeds"] == first["seeds"]
    assert main(["eval", str(RELU), "--replay", str(out)]) == 2  # both forms at once: a usage error
    assert "takes the problem and candidate from the record" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 2. problem errors


@pytest.mark.parametrize(
    ("problem", "says"),
    [
        ("forward_raises.py", "forward is broken"),
        ("get_inputs_raises.py", "get_inputs is broken"),
        ("init_raises.py", "__init__ is broken"),
    ],
)
def test_a_problem_that_cannot_produce_its_reference_is_a_problem_error(problem: str, says: str) -> None:
    record = evaluate_paths(BROKEN / problem, IDENTITY, protocol="standard", device="cpu")
    assert record.outcome == "problem_error" and record.error is not None
    assert record.error["blame"] == "problem" and says in record.error["message"]


def test_problem_errors_count_in_no_metric_and_are_listed_apart(tmp_path: Path) -> None:
    from rich.console import Console

    from kbv import metrics
    from kbv.report.comparison import compare_protocols
    from kbv.report.terminal import render_summary

    records = [_record("passed", speedup=2.0, problem="a"), _record("problem_error", problem="b")]
    summary = metrics.aggregate(records)
    assert summary["n"] == 1 and summary["correct_rate"] == 1.0 and summary["problem_errors"] == 1
    assert summary["comparable_geomean"] == pytest.approx(2.0)  # not pulled to 1.0 by the broken problem
    assert (
        compare_protocols(
            [_record("problem_error", "standard", problem="b")], [_record("problem_error", problem="b")]
        )["pairs"]
        == 0
    )
    console = Console(width=100, record=True)
    render_summary(records, console)
    text = console.export_text()
    assert "Problem errors" in text and "the problem failed" in text
    from kbv.report import write_html_report

    html = write_html_report(records, tmp_path / "r.html").read_text()
    assert 'id="problem-error-table"' in html and "the problem failed" in html


def test_audit_flags_a_problem_whose_reference_raises_and_one_that_does_not_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(BROKEN / "forward_raises.py", tmp_path / "2_Forward.py")
    shutil.copy(RELU, tmp_path / "1_ReLU.py")
    (tmp_path / "3_Syntax.py").write_text("import torch\nclass Model(:\n")
    assert main(["problems", "audit", str(tmp_path), "--device", "cpu", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    flags = {line["problem"]: line["flags"] for line in lines}
    assert flags == {"3_Syntax": ["problem_error"], "1_ReLU": [], "2_Forward": ["problem_error"]}
    assert "forward is broken" in next(line for line in lines if line["problem"] == "2_Forward")["error"]


def test_a_candidate_whose_problem_file_does_not_load_is_not_said_to_match_no_problem(tmp_path: Path) -> None:
    from kbv.batch import plan_batch

    problems, candidates = tmp_path / "level1", tmp_path / "model"
    problems.mkdir()
    candidates.mkdir()
    shutil.copy(RELU, problems / "1_ReLU.py")
    (problems / "2_Syntax.py").write_text("import torch\nclass Model(:\n")
    for name in ("2_Syntax.py", "level_1_problem_2_sample_0_kernel.py", "9_Nothing.py"):
        shutil.copy(FOUNDATION / "relu_plain.py", candidates / name)
    why = {Path(f).name: w for f, w in plan_batch(problems, candidates).unmatched}
    assert (
        why["2_Syntax.py"]
        == why["level_1_problem_2_sample_0_kernel.py"]
        == "its problem 2_Syntax.py is not usable (error above)"
    )
    assert why["9_Nothing.py"] == "matches no problem"


# ------------------------------------------------------------------------------------ 3. devices


_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")


@pytest.mark.parametrize(
    "device", [pytest.param("cuda", marks=_NO_CUDA), pytest.param("cuda:0", marks=_NO_CUDA), "tpu", "cuda:x"]
)
@pytest.mark.parametrize(
    "command",
    [
        ["eval", str(RELU), str(FOUNDATION / "relu_plain.py")],
        ["run", "--problems", str(RELU.parent), "--candidates", str(FOUNDATION)],
        ["demo"],
        ["compare", "--problems", str(RELU.parent), "--candidates", str(FOUNDATION)],
        ["problems", "audit", str(RELU)],
    ],
    ids=["eval", "run", "demo", "compare", "audit"],
)
def test_a_device_that_is_not_there_is_a_one_line_usage_error(
    command: list[str],
    device: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may be written, but if it were, not into the repository
    assert main([*command, "--device", device]) == 2
    captured = capsys.readouterr()
    assert (
        captured.out == ""
        and len(captured.err.strip().splitlines()) == 1
        and captured.err.startswith("kbv: error:")
    )
    assert not (tmp_path / "kbv-results").exists()


# ------------------------------------------------------------------------------- 4. the charts


def _plt():
    from kbv.report.html import _require_extras

    return _require_extras()[1]


def test_the_comparison_chart_leads_with_passes_and_draws_no_speed_for_a_set_that_failed() -> None:
    from kbv.report.comparison import compare_protocols
    from kbv.report.html import _comparison_figure

    broken = [_record("incorrect", "standard", "broken", problem=p) for p in "ab"]
    broken += [_record("incorrect", "verified", "broken", problem=p) for p in "ab"]
    fig = _comparison_figure(
        compare_protocols(
            [r for r in broken if r.protocol["name"] == "standard"],
            [r for r in broken if r.protocol["name"] == "verified"],
        ),
        _plt(),
    )
    passed, speed = fig.axes
    assert passed.get_ylabel() == "pairs that passed (%)"
    assert "a failed pair counts 1.0x" in speed.get_title()
    # a set whose every pair failed gets no speed bar (it would stand at 1.0x): "none passed"
    assert [t.get_text() for t in speed.texts] == ["none\npassed", "none\npassed"]
    assert not speed.patches


def test_the_passed_pairs_chart_has_one_panel_per_protocol_and_never_mixes_them() -> None:
    from kbv.report.html import _problem_points, _problem_scatter_figure

    hack_passes_standard = _record("passed", "standard", "hacks", speedup=113.75, problem="a")
    caught = _record("hack_detected", "verified", "hacks", speedup=None, problem="a")
    honest = [_record("passed", p, "honest", speedup=1.2, problem="b") for p in ("standard", "verified")]
    records = [hack_passes_standard, caught, *honest]
    points = _problem_points(records)
    assert points["standard"]["hacks"] == [(113.75, None)] and "hacks" not in points["verified"]
    fig = _problem_scatter_figure(records, {"hacks": "red", "honest": "blue"}, _plt())
    assert [ax.get_title() for ax in fig.axes] == ["passed under standard", "passed under verified"]


def test_the_speed_memory_chart_needs_memory_figures_and_names_points_in_a_legend() -> None:
    from kbv.report.html import _speed_memory_figure
    from kbv.report.terminal import leaderboard_rows

    plt = _plt()
    no_memory = [
        _record("passed", p, lb, speedup=1.0 + i, problem=f"p{i}")
        for i, (p, lb) in enumerate([("standard", "a"), ("verified", "a"), ("verified", "b")])
    ]
    colours = {"a": "red", "b": "blue"}
    assert _speed_memory_figure(leaderboard_rows(no_memory), colours, plt) is None
    mem = {"candidate_peak_bytes": 100, "baseline_peak_bytes": 100}
    close = [
        _record("passed", p, lb, speedup=1.0, problem="p", memory=mem)
        for p, lb in [("standard", "a"), ("verified", "a"), ("verified", "b")]
    ]
    fig = _speed_memory_figure(leaderboard_rows(close), colours, plt)
    ax = fig.axes[0]
    assert not ax.texts  # no point labels to overlap: three rows on one spot stay readable
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == [
        "a (standard)",
        "a (verified)",
        "b (verified)",
    ]


def test_the_report_without_memory_draws_no_speed_memory_chart(tmp_path: Path) -> None:
    from kbv.report import write_html_report

    path = write_html_report([_record("passed", "verified", speedup=1.5)], tmp_path / "r.html")
    html = path.read_text()
    assert (
        "speed versus memory per label" not in html
        and "No memory figures were recorded for the device" in html
    )


def test_outcome_counts_are_per_protocol_in_terminal_and_html(tmp_path: Path) -> None:
    from rich.console import Console

    from kbv.report import write_html_report
    from kbv.report.terminal import outcome_columns, render_summary

    records = [
        _record("passed", "standard", problem="a"),
        _record("passed", "verified", problem="a"),
        _record("incorrect", "verified", problem="b"),
    ]
    assert outcome_columns(records) == {
        "protocols": ["standard", "verified"],
        "rows": {"passed": {"standard": 1, "verified": 1}, "incorrect": {"standard": 0, "verified": 1}},
    }
    console = Console(width=80, record=True)
    render_summary(records, console)
    text = console.export_text()
    assert re.search(r"passed\W+1\W+1", text) and re.search(r"incorrect\W+0\W+1", text)
    html = write_html_report(records, tmp_path / "r.html").read_text()
    assert "pairs (standard)" in html and "pairs (verified)" in html


# ------------------------------------------------------------------------------- 5. small things


def test_a_compile_errors_summary_is_the_compilers_error_line() -> None:
    message = (
        "Error building extension 'x': [1/2] c++ -MMD -c /tmp/b/main.cpp -o main.o\nFAILED: main.o\n"
        "/tmp/b/main.cpp: In function 'at::Tensor f(at::Tensor)':\n"
        "/tmp/b/main.cpp:10:43: error: 'zero_value' was not declared in this scope\n"
        "ninja: build stopped: subcommand failed.\n"
    )
    assert (
        error_summary("compile_error", message)
        == "main.cpp:10:43: error: 'zero_value' was not declared in this scope"
    )
    assert (
        error_summary("compile_error", 'kernel.cu(12): error: identifier "foo" is undefined')
        == 'kernel.cu(12): error: identifier "foo" is undefined'
    )
    assert (
        error_summary("runtime_error", "Traceback (most recent call last):\n  File 'x'\nValueError: bad")
        == "ValueError: bad"
    )
    assert error_summary("timeout", "") == "timeout"


def test_sys_exit_at_import_reads_clearly() -> None:
    record = evaluate_paths(
        RELU, FOUNDATION / "relu_exit_zero_at_import.py", protocol="standard", device="cpu"
    )
    assert record.outcome == "runtime_error" and record.error is not None
    assert "sys.exit(0)" in record.error["message"] and "imported" in record.error["summary"]


def test_record_ids_are_shown_compactly() -> None:
    from rich.console import Console

    from kbv.report.terminal import id_ranges, render_record_ids

    assert id_ranges([7, 1, 2, 3, 9, 10]) == "1-3, 7, 9-10" and id_ranges([]) == ""
    console = Console(width=80, record=True)
    render_record_ids(
        [(1, _record("passed")), (2, _record("incorrect")), (3, _record("passed"))], "db.sqlite", console
    )
    text = console.export_text()
    assert (
        "kbv explain ID --db db.sqlite" in text
        and "verified passed: 1, 3" in text
        and "verified incorrect: 2" in text
    )


def test_every_subcommand_has_a_description_and_every_timeout_a_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in ("report", "export", "import", "eval", "run", "demo", "compare", "explain"):
        assert sub.choices[name].description, name
    for name in ("demo", "compare", "eval", "run"):
        timeout = next(a for a in sub.choices[name]._actions if "--timeout" in a.option_strings)
        assert timeout.help, name


def test_the_demo_timeout_in_the_help_is_the_demos() -> None:
    from kbv import cli, demo

    assert cli._DEMO_CPU_TIMEOUT == demo.CPU_TIMEOUT_S
    assert cli._DEMO_GPU_TIMEOUT == demo.GPU_TIMEOUT_S


@pytest.mark.parametrize("device, expected", [("cpu", 20.0), ("cuda:0", 60.0)])
def test_the_demo_limits_each_candidate_on_either_device(
    device: str, expected: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the H200 the protocol's own 300 s let the bundled hanging candidate cost ten minutes."""
    from kbv import demo

    seen: dict = {}

    class Stop(Exception):
        pass

    def capture(*args: object, **kwargs: object) -> None:
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(demo, "demo_pairs", lambda device: [])
    monkeypatch.setattr(demo, "run_both_protocols", capture)
    with pytest.raises(Stop):
        demo.run_demo(device=device, db=str(tmp_path / "d.sqlite"), html=str(tmp_path / "d.html"))
    assert seen["timeout_s"] == expected


def test_usage_errors_are_found_before_torch_is_imported() -> None:
    script = (
        "import sys\nfrom kbv.cli import main\n"
        "codes = [main(['eval', '/no/such.py', '/no/such2.py']), main(['eval', '--replay', '/no/r.json']),"
        " main(['run', '--problems', '/no/dir', '--candidates', '/no/c']), main(['eval', 'a.py', "
        "'b.py', '--device', 'tpu'])]\n"
        "assert codes == [2, 2, 2, 2], codes\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[A-Za-z_][A-Za-z0-9_.\-]{5,}", text)}


def test_tables_at_80_columns_wrap_no_word(tmp_path: Path) -> None:
    """Every word of the cells (check names, outcomes, file names, notes) appears whole in the
    output, and no line is wider than the terminal."""
    from rich.console import Console

    from kbv.records import DistributionResult
    from kbv.report.explain import print_record
    from kbv.report.terminal import render_comparison, render_summary

    name = "8_Softmax_WideRow_WithALongName"
    std = [_record("passed", "standard", "honest_triton_and_more", speedup=2.0, problem=name)]
    hack = _record("hack_detected", "verified", "honest_triton_and_more", problem=name)
    evidence = (
        "call 2 (same buffers, new contents) returned exactly the output of call 1 (fresh buffers "
        "(control)) for different input values"
    )
    hack.findings = [Finding("caching_probe", "fail", evidence)]
    note = "failed again on a re-run of the same inputs (shifted draw 0); only 1 of 2 draws ran"
    hack.distributions = [
        DistributionResult(
            "shifted",
            True,
            False,
            0.884,
            0.0465,
            {"error_multiple": 8.0, "elementwise_floor": 1e-5, "norm_floor": 1e-6},
            note,
        )
    ]
    console = Console(width=80, record=True)
    render_summary(std + [hack], console)
    render_comparison(std, [hack], console)
    print_record(hack, console)
    text = console.export_text()
    for word in _words(
        " ".join(
            [name, "honest_triton_and_more", "caching_probe", "hack_detected", evidence, note, "elementwise"]
        )
    ) - {"elementwise"}:
        assert word in text, word
    assert re.search(r"hacks\s*\n", text)  # the leaderboard keeps every column at 80
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80


# ----------------------------------------------------------------------- 6. the audit's output


def _documented_audit_keys() -> set[str]:
    doc = (ROOT / "docs" / "problems-audit.md").read_text()
    section = doc.split("## The JSON object", 1)[1]
    return set(re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE))


def test_the_audit_object_has_exactly_the_documented_keys() -> None:
    from kbv.problems_audit import AuditResult, unloadable

    documented = _documented_audit_keys()
    assert {"schema", "flags", "notes", "error", "source_sha256"} <= documented
    assert set(AuditResult("p", "/p.py").to_dict()) == documented
    broken = unloadable("/p/3_Syntax.py", "syntax error").to_dict()
    assert (
        set(broken) == documented
        and broken["flags"] == ["problem_error"]
        and broken["error"] == "syntax error"
    )


def test_the_audit_yields_each_result_before_it_audits_the_next_problem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kbv import problems_audit as audit
    from kbv.problems import load_problem

    audited: list[str] = []

    class FakeWorker:
        def __init__(self, spec: object) -> None:
            self.remaining_s = 0.0

        def start(self) -> None: ...
        def alive(self) -> bool:
            return True

        def close(self) -> None: ...

    def fake_audit(
        worker: object, problem, device: str, master: int, precision: str = "fp32"
    ) -> audit.AuditResult:
        audited.append(problem.name)
        return audit.AuditResult(problem.name, str(problem.path))

    monkeypatch.setattr(audit, "Worker", FakeWorker)
    monkeypatch.setattr(audit, "_audit_in", fake_audit)
    results = audit.iter_audit([load_problem(RELU), load_problem(BROKEN / "forward_raises.py")])
    assert next(results).problem == "1_ReLU" and audited == ["1_ReLU"]
    assert next(results).problem == "forward_raises" and audited == ["1_ReLU", "forward_raises"]


# -------------------------------------------------------------- 4. the CPU baseline's fault


def test_a_cpu_worker_runs_one_intra_op_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads on a loaded two-core machine made a 0.006 ms eager reduction take 16-24 ms per
    call in bursts (a helper thread waiting for its time slice) while the candidate was untouched."""
    from kbv.worker import Worker, WorkerSpec

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with Worker(WorkerSpec(build_key="threads", device="cpu", role="probe", budget_s=60)) as worker:
        assert worker.start().intra_op_threads == 1
        state = lambda: Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]  # noqa: E731
        with worker.paused():  # stopped while another worker is timed
            assert state() == "T"
        assert state() != "T"


def test_every_worker_but_the_timed_one_is_paused() -> None:
    from contextlib import contextmanager

    from kbv.performance import _others_paused

    log: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        @contextmanager
        def paused(self):
            log.append(f"stop {self.name}")
            yield
            log.append(f"go {self.name}")

    reference, subject = Fake("reference"), Fake("candidate")
    with _others_paused(reference, reference, subject, None):
        log.append("time reference")
    with _others_paused(subject, reference, subject, None):
        log.append("time candidate")
    assert log == [
        "stop candidate",
        "time reference",
        "go candidate",
        "stop reference",
        "time candidate",
        "go reference",
    ]


def test_rounds_that_disagree_are_named_in_the_warnings() -> None:
    from kbv.performance import _entry
    from kbv.protocol import TimingSettings

    settings = TimingSettings(bootstrap_resamples=50)
    quiet = {"device_ms": [0.006] * 10, "wall_ms": [0.007] * 10, "throttled": []}
    busy = {**quiet, "device_ms": [16.0] * 10}
    assert "rounds_disagree" in _entry([quiet, busy, busy], settings, "measured")["summary"]["warnings"]
    assert "rounds_disagree" not in _entry([quiet, quiet], settings, "measured")["summary"]["warnings"]


# ------------------------------------------------------------------------------- 7. suite time


def test_the_two_honest_relu_cpp_fixtures_are_one_build() -> None:
    """Compiling a C++ extension costs ~40 s of the 2-core CI machine: the honest-fixture test and
    the outcome tests share one source (one hash, one cached build)."""
    foundation, honest = (
        FOUNDATION / "relu_cpp.py",
        ROOT / "tests" / "fixtures" / "candidates" / "honest" / "relu_cpp.py",
    )
    assert foundation.read_bytes() == honest.read_bytes()


def test_the_readme_test_command_runs_in_parallel_and_ci_runs_it_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    command = next(
        line for line in readme.splitlines() if "python -m pytest" in line and line.startswith("pip install")
    )
    assert "-n 2" in command
    assert command in (ROOT / ".ci" / "run").read_text()
    assert "pytest-xdist" in (ROOT / "pyproject.toml").read_text()


def test_explain_says_when_an_evaluation_held_its_gpu_alone() -> None:
    from rich.console import Console

    from kbv.report.explain import print_record

    alone, shared = _record("passed", "verified", "m"), _record("passed", "verified", "m")
    alone.isolation = {"gpu": "alone for the whole evaluation: 6.4 GB of inputs, about 12x that"}
    shared.isolation = {"gpu": "shared with other evaluations outside the timing phase"}
    for record, shown in ((alone, True), (shared, False)):
        console = Console(width=100, record=True)
        print_record(record, console)
        assert ("GPU held alone" in console.export_text()) is shown


def test_explain_says_which_baseline_was_not_timed_and_why() -> None:
    from rich.console import Console

    from kbv.report.explain import print_record

    record = _record("passed", "verified", "m", speedup=1.4)
    summary = {"median": 0.5, "ci95_low": 0.49, "ci95_high": 0.51}
    record.timing = {  # type: ignore[assignment]
        "recipe": "flush-rotate-events-median",
        "candidate": {"summary": summary},
        "baselines": {"eager_fp32": {"summary": {**summary, "median": 0.7}}},
        "baselines_not_measured": {"eager_tf32": "same code as eager_fp32: no TF32-sensitive operator"},
    }
    console = Console(width=200, record=True)
    print_record(record, console)
    text = console.export_text()
    assert "eager_tf32" in text and "not timed: same code as eager_fp32" in text


@_NO_CUDA
def test_evaluating_on_a_gpu_this_machine_lacks_is_the_callers_error_not_the_problems() -> None:
    """Through the library (a benchmark, an RL loop), not only the command line: a DeviceError
    before any worker starts, where every pair used to come back ``problem_error``."""
    from kbv.candidates import load_candidate
    from kbv.devices import DeviceError
    from kbv.evaluation import evaluate
    from kbv.problems import load_problem
    from kbv.protocol import STANDARD

    with pytest.raises(DeviceError, match="use --device cpu"):
        evaluate(load_problem(RELU), load_candidate(FOUNDATION / "relu_plain.py"), STANDARD, "cuda")


def test_inputs_that_fail_in_the_candidates_process_say_so_and_blame_the_candidate(tmp_path: Path) -> None:
    """A candidate that breaks its process's random generator (on the H200, a swallowed failed CUDA
    graph capture) made the next draw fail inside kbv's input code: the record must say whose doing
    that was, and an honest candidate on the same problem must pass."""
    breaker = tmp_path / "breaks_rng.py"
    breaker.write_text(
        "import torch\nimport torch.nn as nn\n\n\n"
        "def _broken(*args, **kwargs):\n"
        "    raise RuntimeError('Offset increment outside graph capture encountered unexpectedly.')\n\n\n"
        "class ModelNew(nn.Module):\n"
        "    def forward(self, x):\n"
        "        torch.rand = _broken\n"
        "        torch.randn = _broken\n"
        "        return torch.relu(x)\n"
    )
    honest = tmp_path / "honest.py"
    honest.write_text(
        "import torch\nimport torch.nn as nn\n\n\n"
        "class ModelNew(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.relu(x)\n"
    )
    broken = evaluate_paths(RELU, breaker, protocol="standard", device="cpu")
    assert broken.outcome == "runtime_error", broken.error
    assert broken.error.get("blame") != "problem"
    assert "failed in the candidate's process" in broken.error["summary"], broken.error
    assert "Offset increment outside graph capture" in broken.error["summary"]
    assert evaluate_paths(RELU, honest, protocol="standard", device="cpu").outcome == "passed"


def test_the_facade_exports_each_name_from_the_module_its_type_imports_name() -> None:
    """``kbv.__all__`` lists every name ``kbv.__getattr__`` loads, and the imports editors read (under
    ``TYPE_CHECKING``, never run) import each from the module it is loaded from: a name added in one
    place only, or typed from another module, fails here."""
    import ast
    import importlib

    import kbv

    typed: dict[str, str | None] = {}
    for node in ast.walk(ast.parse(Path(kbv.__file__).read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom)
                typed.update({alias.name: statement.module for alias in statement.names})
    assert typed == kbv._EXPORTS
    assert sorted(kbv.__all__) == sorted(["__version__", *kbv._EXPORTS])
    assert all(getattr(kbv, n) is getattr(importlib.import_module(m), n) for n, m in kbv._EXPORTS.items())
