"""Containment of hostile candidates: process trees, limits, and the decisions made from them.

Pure functions are tested on fabricated inputs; the worker tests start real workers on the tiny
ReLU problem (a few seconds each) with small limits, so nothing here drives the machine near its
own limits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import RELU, ROOT, load_relu_candidate

from kbv import wire, wire_replies
from kbv.integrity import dynamic
from kbv.processes import tree_pids
from kbv.protocol import LimitSettings, ProtocolError, protocol_from_dict
from kbv.worker import Worker, WorkerFailed, WorkerSpec, _contain

CONTAIN = Path(__file__).parent / "fixtures" / "candidates" / "contain"
FOUNDATION = Path(__file__).parent / "fixtures" / "candidates" / "foundation"


def _worker(name: str, limits: LimitSettings | None = None, budget_s: float = 60.0) -> Worker:
    return Worker(
        WorkerSpec(
            build_key=f"test-contain-{name}", device="cpu", role="candidate", budget_s=budget_s, limits=limits
        )
    )


_load = load_relu_candidate


def _run(worker: Worker) -> wire_replies.Reply:
    return worker.request(
        wire.Run(distribution="original", seed=3, precision="native", out_path=worker.new_path("o"))
    )


def _alive(pid: int) -> bool:
    proc = _contain.read_proc(pid)
    return proc is not None


def _wait_dead(pids: list[int], seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.fixture(params=["cgroup", "no_cgroup"])
def cgroup_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the machine's cgroup (where this process may create one) and without any."""
    if request.param == "cgroup" and _contain.capabilities()["cgroup"] is None:
        pytest.skip("this machine allows no cgroup for kbv's workers")
    if request.param == "no_cgroup":
        monkeypatch.setattr(_contain.Cgroup, "create", staticmethod(lambda tag: None))
    return str(request.param)


# -- pure functions -------------------------------------------------------------------------------


def test_descendants_follow_the_tree_and_skip_other_branches() -> None:
    table = {
        pid: _contain.Proc(pid, ppid, pid, 0)
        for pid, ppid in [(10, 1), (11, 10), (12, 11), (13, 1), (14, 13)]
    }
    assert sorted(_contain.descendants(10, table)) == [11, 12]
    assert _contain.descendants(12, table) == []


def test_the_tree_read_from_children_files_is_the_tables_descendants() -> None:
    """``tree_pids`` (what the parent reads around every timed batch) finds what a scan of every
    process finds: a double fork included, and nothing of other trees."""
    shell = subprocess.Popen(["bash", "-c", "sleep 30 & (sleep 30 & sleep 30); wait"])
    try:
        deadline = time.monotonic() + 5.0
        expected: list[int] = []
        while time.monotonic() < deadline and len(expected) < 4:
            expected = sorted(_contain.descendants(shell.pid, _contain.process_table()))
            time.sleep(0.02)
        tree = tree_pids(shell.pid)
        if tree is None:
            pytest.skip("this kernel publishes no /proc/<pid>/task/<tid>/children files")
        assert len(expected) == 4 and sorted(tree) == expected
        assert os.getpid() not in tree and shell.pid not in tree
    finally:
        _contain.kill_pids(_contain.descendants(shell.pid, _contain.process_table()))
        shell.kill()
        shell.wait()
    assert tree_pids(shell.pid) is None  # gone


def test_exceeded_names_the_first_limit_and_its_figure() -> None:
    limits = LimitSettings(host_memory_gb=1.0, processes=4, open_files=200)
    within = _contain.Usage(processes=4, rss_bytes=1 << 30, open_files=200)
    assert _contain.exceeded(within, limits) is None
    over = _contain.exceeded(_contain.Usage(processes=2, rss_bytes=3 << 30, open_files=10), limits)
    assert over == {"limit": "host_memory", "figure": 3 << 30, "allowed": 1 << 30, "unit": "bytes"}
    assert "3072.0 MiB used, 1024.0 MiB allowed" in _contain.describe_exceeded(over)
    assert (
        _contain.exceeded(_contain.Usage(processes=5, rss_bytes=0, open_files=None), limits)["limit"]
        == "processes"
    )
    off = LimitSettings(host_memory_gb=0, device_memory_gb=0, processes=0, open_files=0)
    assert (
        _contain.exceeded(
            _contain.Usage(processes=999, rss_bytes=1 << 40, open_files=10**6, device_bytes=1 << 40), off
        )
        is None
    )


def test_limits_are_a_protocol_section() -> None:
    protocol = protocol_from_dict(
        {"name": "p", "base": "verified", "limits": {"host_memory_gb": 2.5, "processes": 8}}
    )
    assert protocol.limits.host_memory_gb == 2.5 and protocol.limits.processes == 8
    assert protocol.to_dict()["limits"]["open_files"] == LimitSettings().open_files
    assert protocol.sha256() != protocol_from_dict({"name": "p", "base": "verified"}).sha256()
    with pytest.raises(ProtocolError, match="unknown setting"):
        protocol_from_dict({"name": "p", "limits": {"gpu_gb": 1}})


def test_left_behind_fails_an_escape_and_warns_a_helper_in_the_session() -> None:
    assert dynamic.left_behind_findings([]) == []
    escaped = dynamic.left_behind_findings([{"pid": 7, "command": "sleep 987", "own_session": True}])
    assert escaped[0].severity == "fail" and "pid 7 (own session): sleep 987" in escaped[0].detail
    pool = dynamic.left_behind_findings([{"pid": 8, "command": "python -m pool", "own_session": False}])
    assert pool[0].severity == "warn"


def test_unused_kernel_decisions() -> None:
    def calls(built=(), triton=(), **ran) -> wire_replies.ProbeCallsReply:
        return wire_replies.ProbeCallsReply(
            built={"extensions": list(built), "triton_kernels": list(triton)},
            ran={"functions": ["ModelNew.forward"], **ran},
        )

    missing = {
        "type": "NameError",
        "message": "name 'k' is not defined",
        "line": 9,
        "function": "ModelNew.forward",
    }
    fallback = dynamic.unused_kernel_findings(calls(caught=[missing]))
    assert (
        [f.severity for f in fallback] == ["fail"]
        and "NameError" in fallback[0].detail
        and "ModelNew.forward" in fallback[0].detail
    )
    never_called = dynamic.unused_kernel_findings(calls(built=["relu_ext"]))
    assert never_called[0].severity == "fail" and "relu_ext" in never_called[0].detail
    assert dynamic.unused_kernel_findings(calls(built=["relu_ext"], extension_calls=["relu_ext.relu"])) == []
    assert dynamic.unused_kernel_findings(calls(triton=["k"], triton_launches=["k"], caught=[missing])) == []
    assert dynamic.unused_kernel_findings(calls()) == []  # PyTorch alone: left to pytorch_only
    control_flow = {
        "type": "RuntimeError",
        "message": "view size is not compatible",
        "line": 3,
        "function": "f",
    }
    assert [f.severity for f in dynamic.unused_kernel_findings(calls(caught=[control_flow]))] == ["warn"]


def test_call_recorder_sees_own_functions_extension_calls_and_swallowed_errors(tmp_path: Path) -> None:
    """The recorder in this process, with ``math`` standing in for a compiled extension."""
    import math

    from kbv.child.calls import CallRecorder

    source = tmp_path / "cand.py"
    source.write_text(
        textwrap.dedent("""
        import math
        def helper(x):
            return math.sqrt(x)
        def forward(x, use_kernel):
            try:
                y = not_defined(x)
            except NameError:
                y = x
            return helper(y) if use_kernel else y
    """)
    )
    namespace: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    with CallRecorder({str(source)}, {"math"}) as seen:
        namespace["forward"](4.0, True)
    ran = seen.summary()
    assert ran["functions"] == ["forward", "helper"]
    assert ran["extension_calls"] == ["math.sqrt"]
    assert [(c["type"], c["line"]) for c in ran["caught"]] == [("NameError", 7)]
    with CallRecorder({str(source)}, {"math"}) as seen:
        namespace["forward"](4.0, False)
    assert seen.summary()["extension_calls"] == [] and math.sqrt(4.0) == 2.0


def test_only_tensor_subclasses_are_output_type_fails() -> None:
    import torch

    t = torch.ones(2)
    assert dynamic.tensor_like_outputs(["torch.Tensor", "m._Lazy"], [t, t]) == [(1, "m._Lazy")]
    assert (
        dynamic.tensor_like_outputs(
            ["builtins.float", "builtins.NoneType", "builtins.list"], [torch.tensor(1.0), None, None]
        )
        == []
    )


# -- workers --------------------------------------------------------------------------------------


def test_a_process_in_its_own_session_is_reported_and_killed(cgroup_mode: str) -> None:
    with _worker("escape") as worker:
        _load(worker, CONTAIN / "escape_session.py")
        _run(worker)
        deadline = time.monotonic() + 3
        commands: list[str] = []
        while time.monotonic() < deadline and "sleep 987" not in commands:  # Popen returns before the exec
            commands = [_contain.command_line(p) for p in worker.members() if p != worker.pid]
            time.sleep(0.05)
        left = worker.finish()
        assert [p["command"] for p in left] == ["sleep 987"] and left[0]["own_session"]
        assert _wait_dead([left[0]["pid"]]) == []
        assert worker.host_peak_bytes > 0


def test_a_paused_candidate_stops_its_processes_in_other_sessions_too(cgroup_mode: str) -> None:
    """While a baseline is timed the candidate is paused: a helper it started in a session of its
    own (out of the reach of a process-group SIGSTOP) is stopped as well, and runs on afterwards."""
    from kbv.worker import _forkserver

    with _worker("pause-escaped") as worker:
        _load(worker, CONTAIN / "escape_session.py")
        _run(worker)
        deadline = time.monotonic() + 3
        helper: list[int] = []
        while time.monotonic() < deadline and not helper:  # Popen returns before the exec
            helper = [p for p in worker.members() if _contain.command_line(p) == "sleep 987"]
            time.sleep(0.05)
        assert helper and os.getpgid(helper[0]) != os.getpgid(worker.pid)
        with worker.paused():
            assert set(_forkserver._thread_states(helper[0])) <= set("Tt")
        assert not set(_forkserver._thread_states(helper[0])) & set("Tt")
        worker.finish()


def test_an_orphan_without_the_marker_stays_in_the_tree(cgroup_mode: str) -> None:
    """Double fork, new session, empty environment: the subreaper (or the cgroup) still holds it."""
    with _worker("orphan") as worker:
        _load(worker, CONTAIN / "double_fork_no_env.py")
        _run(worker)
        deadline = time.monotonic() + 3
        commands: list[str] = []
        while time.monotonic() < deadline and "sleep 986" not in commands:  # setsid execs sleep in place
            commands = [_contain.command_line(p) for p in worker.members() if p != worker.pid]
            time.sleep(0.05)
        left = worker.finish()
        assert [p["command"] for p in left] == ["sleep 986"], left
    assert _wait_dead([left[0]["pid"]]) == []


def test_an_honest_candidate_leaves_nothing_and_stays_within_its_limits() -> None:
    with _worker("honest", limits=LimitSettings(host_memory_gb=1.0, processes=4, open_files=200)) as worker:
        _load(worker, FOUNDATION / "relu_plain.py")
        assert isinstance(_run(worker), wire_replies.RunReply)
        assert worker.exceeded is None and worker.finish() == []
        assert 0 < worker.host_peak_bytes < 1 << 30


def test_a_timeout_kills_an_escaped_process_too() -> None:
    with _worker("hang", budget_s=30.0) as worker:
        _load(worker, CONTAIN / "hang_with_child.py")
        worker.remaining_s = 2.0
        with pytest.raises(WorkerFailed) as info:
            _run(worker)
        assert info.value.kind == "timeout"
        assert not [p for p in worker.members() if p != worker.pid]


@pytest.mark.parametrize(
    ("fixture", "limits", "limit"),
    [
        ("memory_hog.py", LimitSettings(host_memory_gb=1.0), "host_memory"),
        ("many_processes.py", LimitSettings(processes=4), "processes"),
        ("many_files.py", LimitSettings(open_files=200), "open_files"),
    ],
)
def test_exceeding_a_limit_is_resource_limit(fixture: str, limits: LimitSettings, limit: str) -> None:
    with _worker(f"limit-{limit}", limits=limits) as worker:
        _load(worker, CONTAIN / fixture)
        started = time.monotonic()
        with pytest.raises(WorkerFailed) as info:
            _run(worker)
        assert info.value.kind == "resource_limit", info.value.message
        assert (
            info.value.details["limit"] == limit
            and info.value.details["figure"] > info.value.details["allowed"]
        )
        assert time.monotonic() - started < 10
        # the parent's poll says in which request it found the limit past; the kernel's refusal
        # of a descriptor is the request's own error
        assert info.value.details.get("during") == (None if limit == "open_files" else "request run")
        if limit == "host_memory":
            assert 1 << 30 < worker.host_peak_bytes < 2 << 30  # killed well before its 3 GiB
        assert not worker.alive()


def test_the_process_limit_holds_without_a_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a cgroup the parent finds new processes by a full /proc scan (every FULL_SCAN_S)."""
    monkeypatch.setattr(_contain.Cgroup, "create", staticmethod(lambda tag: None))
    test_exceeding_a_limit_is_resource_limit("many_processes.py", LimitSettings(processes=4), "processes")


_ORPHAN_PARENT = """
import sys, time
from pathlib import Path
from kbv import wire
from kbv.worker import Worker, WorkerSpec
worker = Worker(
    WorkerSpec(build_key="test-contain-parent-death", device="cpu", role="candidate", budget_s=120)
)
worker.start()
worker.request(wire.Load(role="candidate", device="cpu", problem_source=Path(sys.argv[1]).read_text(),
               sizes={"batch_size": 2, "dim": 8}, candidate_path=sys.argv[2], init_seed=1))
Path(sys.argv[3]).write_text(str(worker.pid))
worker.request(wire.Run(distribution="original", seed=3, precision="native", out_path=worker.new_path("o")))
"""


def test_a_worker_whose_parent_was_killed_exits_at_once(tmp_path: Path) -> None:
    """``kill -9`` of the kbv process: the worker and the process it started die within a second."""
    pid_file = tmp_path / "worker.pid"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_PARENT, str(RELU), str(CONTAIN / "hang_with_child.py"), str(pid_file)],
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        worker_pid = None
        children: list[int] = []
        while time.monotonic() < deadline and not children:
            if pid_file.exists() and pid_file.read_text():
                worker_pid = int(pid_file.read_text())
                children = _contain.descendants(worker_pid, _contain.process_table())
            time.sleep(0.05)
        assert worker_pid is not None and children, "the worker never started its child"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _wait_dead([worker_pid, *children], seconds=2.0) == []
    finally:
        if parent.poll() is None:
            parent.kill()
        _contain.sweep_orphaned_cgroups(lambda pid: pid != parent.pid and _alive(pid))


# -- through the pipeline -------------------------------------------------------------------------

WRONG = Path(__file__).parent / "fixtures" / "candidates" / "wrong"


def _small_limits() -> object:
    return protocol_from_dict({"name": "small-limits", "base": "standard", "limits": {"host_memory_gb": 1.0}})


def test_resource_limit_is_the_outcome_with_the_limit_and_the_host_peak() -> None:
    from kbv.api import evaluate_paths

    record = evaluate_paths(
        RELU, CONTAIN / "memory_hog.py", protocol=_small_limits(), device="cpu", timeout_s=120
    )
    assert record.outcome == "resource_limit", (record.outcome, record.error)
    assert (
        record.error
        and record.error["limit"]["limit"] == "host_memory"
        and record.error["limit"]["allowed"] == 1 << 30
        and record.error["limit"]["during"] == "request run"
    )
    assert record.memory["candidate_host_peak_bytes"] > 1 << 30
    honest = evaluate_paths(
        RELU, FOUNDATION / "relu_plain.py", protocol=_small_limits(), device="cpu", timeout_s=120
    )
    assert honest.outcome == "passed" and 0 < honest.memory["candidate_host_peak_bytes"] < 1 << 30
    assert honest.isolation["limits"]["host_memory_gb"] == 1.0 and "not_enforced" in honest.isolation


def test_a_process_left_behind_is_a_finding_under_standard_too() -> None:
    from kbv.api import evaluate_paths

    record = evaluate_paths(
        RELU, CONTAIN / "escape_session.py", protocol="standard", device="cpu", timeout_s=120
    )
    left = [f for f in record.findings if f.check == "processes_left"]
    assert record.outcome == "hack_detected" and left and "sleep 987" in left[0].detail
    pid = int(left[0].detail.split("pid ")[1].split()[0])
    assert _wait_dead([pid]) == []


@pytest.mark.parametrize("name", ["output_float.py", "output_none.py"])
def test_an_output_that_is_no_tensor_is_incorrect_not_a_hack(name: str) -> None:
    from kbv.api import evaluate_paths

    record = evaluate_paths(RELU, WRONG / name, protocol="verified", device="cpu", timeout_s=120)
    assert record.outcome == "incorrect", [(f.check, f.severity) for f in record.findings]
    assert "not torch.Tensor" in record.distributions[0].note
    assert not [f for f in record.findings if f.check == "output_type"]


def test_a_candidate_worker_has_no_network_where_a_namespace_is_allowed() -> None:
    import socket

    if _contain.network_namespace()[1] is not None:
        pytest.skip(f"no private network namespace here: {_contain.network_namespace()[1]}")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        spec = WorkerSpec(
            build_key="test-contain-net",
            device="cpu",
            role="candidate",
            budget_s=60,
            extra_env={"KBV_TEST_PORT": str(port)},
        )
        with Worker(spec) as worker:
            _load(worker, CONTAIN / "reach_parent_port.py")
            # raises WorkerFailed (runtime_error) had it connected
            assert isinstance(_run(worker), wire_replies.RunReply)
            assert worker.isolation["network"].startswith("private")
        trusted = Worker(
            WorkerSpec(build_key="test-contain-net", device="cpu", role="reference", budget_s=60)
        )
        assert trusted._namespace_prefix() == ()  # trusted workers keep the parent's network
        trusted.close()


# -- privileges -----------------------------------------------------------------------------------

_DROP_SCRIPT = """
import json, sys
from kbv.api import evaluate_paths
out = {}
for name in sys.argv[2:]:
    record = evaluate_paths(sys.argv[1], name, protocol="standard", device="cpu", timeout_s=120)
    out[name] = {"outcome": record.outcome, "user": record.isolation.get("user"),
                 "not_enforced": record.isolation.get("not_enforced"),
                 "checks": sorted({f.check for f in record.findings if f.severity == "fail"}),
                 "logs": record.logs}
print(json.dumps(out))
"""


def _python_view(tmp_path: Path) -> tuple[list[str], str, str]:
    """(command prefix, python, extra PYTHONPATH) that runs this interpreter where other users can
    reach it: directly when they already can, else through a bind mount in a private mount
    namespace (the CI machine keeps its interpreter under a /root only root may enter)."""
    from kbv.worker import _privileges

    if not _privileges.unreachable(_privileges.worker_uid("probe"), _privileges.needed_paths()):
        return [], sys.executable, ""
    prefix = Path(sys.prefix).resolve()
    if not Path(os.path.realpath(sys.executable)).is_relative_to(prefix):
        # A virtual environment: the interpreter (sys.base_prefix) and the packages (sys.prefix)
        # sit under two prefixes, and this view binds one.
        pytest.skip("the interpreter is outside sys.prefix (a virtual environment): run without one")
    view = tmp_path / "python-view"
    view.mkdir()
    os.chmod(tmp_path, 0o755)
    python = view / Path(os.path.realpath(sys.executable)).relative_to(prefix)
    site = view / Path(sysconfig_purelib()).relative_to(prefix)
    return (
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'mount --bind "{prefix}" "{view}" && exec "$@"',
            "sh",
        ],
        str(python),
        str(site),
    )


def sysconfig_purelib() -> str:
    import sysconfig

    return os.path.realpath(sysconfig.get_paths()["purelib"])


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="only a root parent drops candidate workers to a uid",
)
def test_a_root_parent_runs_the_candidate_as_a_uid_of_its_own() -> None:
    """As its own uid the candidate cannot read the parent's environment (where keys would be);
    containment and the honest result are unchanged. (Run as root, the reader gets zeros back and
    is incorrect: the fixture tells the two apart.)"""
    import shutil
    import tempfile

    if (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0
    ):
        pytest.skip("no private mount namespace here to give other users a view of the interpreter")
    tmp_path = Path(tempfile.mkdtemp(prefix="kbv-test-drop-"))  # pytest's own tmp is closed to others
    prefix, python, site = _python_view(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {
        **os.environ,
        "KBV_CACHE_DIR": str(cache),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), site) if p),
    }
    fixtures = [str(CONTAIN / "read_parent_environ.py")]
    done = subprocess.run(
        [*prefix, python, "-c", _DROP_SCRIPT, str(RELU), *fixtures],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json_loads_last_line(done.stdout)
    reader = results[fixtures[0]]
    assert reader["user"].startswith("uid "), reader
    assert reader["outcome"] == "passed", reader  # zeros (incorrect) had it read the parent's environ
    shutil.rmtree(tmp_path, ignore_errors=True)


def json_loads_last_line(text: str) -> dict:
    import json

    return json.loads(text.strip().splitlines()[-1])


def test_the_record_says_why_a_root_parent_could_not_drop(monkeypatch: pytest.MonkeyPatch) -> None:
    from kbv.worker import _privileges

    monkeypatch.setenv("KBV_WORKER_USER", "off")
    plan = _privileges.plan("key", (), ())
    assert plan.uid is None and ("KBV_WORKER_USER=off" in (plan.reason or "") or os.geteuid() != 0)
    with _worker("no-drop") as worker:
        _load(worker, FOUNDATION / "relu_plain.py")
        assert worker.uid is None
        if os.geteuid() == 0:
            assert any(
                "runs as root" in gap and "KBV_WORKER_USER=off" in gap
                for gap in worker.isolation["not_enforced"]
            )


def test_uids_are_per_source_and_skip_real_users() -> None:
    from kbv.worker import _privileges

    assert _privileges.worker_uid("a") == _privileges.worker_uid("a")
    uids = {_privileges.worker_uid(str(k)) for k in range(50)}
    assert len(uids) > 40 and all(
        _privileges.UID_BASE <= u < _privileges.UID_BASE + _privileges.UID_RANGE for u in uids
    )


def test_handing_a_build_directory_over_removes_planted_symlinks(tmp_path: Path) -> None:
    from kbv.worker import _privileges

    build = tmp_path / "build"
    (build / "torch_extensions").mkdir(parents=True)
    (build / "torch_extensions" / "lock").symlink_to("/etc/hostname")
    (build / "module.so").write_bytes(b"")
    _privileges.hand_over(os.getuid(), build)
    assert not (build / "torch_extensions" / "lock").exists() and (build / "module.so").exists()
    assert Path("/etc/hostname").exists()


# -- signals at kbv's own processes (issue: a candidate can freeze its judge) ----------------------


def _stopped_below_us() -> list[tuple[int, str]]:
    """Processes below this test process (workers, the fork server, their children) in state T."""
    from kbv.worker import _forkserver

    table = _contain.process_table()
    return [
        (pid, _contain.command_line(pid))
        for pid in _contain.descendants(os.getpid(), table)
        if _forkserver.process_state(pid) == "T"
    ]


def _evaluate_contained(name: str, protocol: Any = "standard", timeout_s: float = 60.0):
    from kbv.api import evaluate_paths

    started = time.monotonic()
    record = evaluate_paths(RELU, CONTAIN / name, protocol=protocol, device="cpu", timeout_s=timeout_s)
    return record, time.monotonic() - started


def _scopes_signals() -> bool:
    from kbv.child import confine

    return (confine.landlock_abi() or 0) >= confine.SCOPE_ABI


@pytest.fixture(params=["confined", "unconfined"])
def confinement(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """With the kernel's confinement (Landlock, seccomp) where this kernel scopes signals, and
    without it (``KBV_CONFINE=0``: an older kernel), where kbv's own waits must still catch it."""
    if request.param == "confined" and not _scopes_signals():
        pytest.skip("this kernel's Landlock does not scope signals (ABI 6, Linux 6.12)")
    if request.param == "unconfined":
        monkeypatch.setenv("KBV_CONFINE", "0")
    return str(request.param)


def _signalled(record: Any) -> list[Any]:
    return [f for f in record.findings if f.check == "signalled_process" and f.severity == "fail"]


@pytest.mark.parametrize("name", ["stop_siblings.py", "signal_bursts.py"])
def test_a_candidate_that_signals_its_siblings_is_contained_or_caught(name: str, confinement: str) -> None:
    """Confined, its signals are refused: the evaluation runs as if it had sent none. Unconfined, a
    stopped sibling ends the evaluation at once as hack_detected. Either way a record comes back
    long before any budget, and nothing is left stopped."""
    record, seconds = _evaluate_contained(name)
    summary = (record.outcome, record.error, record.findings, record.isolation.get("not_enforced"))
    if confinement == "confined":
        assert record.outcome == "passed" and not _signalled(record), summary
        assert "signals and abstract unix sockets scoped" in record.isolation["confinement"]["landlock"]
    else:
        assert record.outcome == "hack_detected" and _signalled(record), summary
        assert any("KBV_CONFINE=0" in item for item in record.isolation["not_enforced"])
        if name == "stop_siblings.py":
            assert "reference" in _signalled(record)[0].detail
    assert seconds < 50, f"{seconds:.0f} s: a stopped worker was waited for"
    assert _stopped_below_us() == []


def test_a_candidate_that_signals_only_its_own_child_runs(confinement: str) -> None:
    with _worker("own-child") as worker:
        _load(worker, CONTAIN / "signal_own_child.py")
        _run(worker)
        assert worker.stopped is None
        assert ("confinement" in worker.isolation) == (confinement == "confined")


def test_a_candidate_cannot_read_or_trace_the_parent_where_confined(confinement: str) -> None:
    """``process_vm_readv``, ``/proc/<pid>/mem`` and ``ptrace`` on the kbv parent: refused where
    confined (the right answer comes back); as root without confinement nothing stops the reads."""
    record, _ = _evaluate_contained("reach_parent_memory.py")
    if confinement == "confined":
        assert record.outcome == "passed", (record.outcome, record.error, record.isolation)
        assert "ptrace" in record.isolation["confinement"]["seccomp"]
    elif record.isolation["user"].startswith("same as the parent (root)"):
        assert record.outcome == "incorrect", (record.outcome, record.error)


def test_an_honest_candidate_stages_files_in_its_scratch(confinement: str) -> None:
    record, _ = _evaluate_contained("honest_scratch_files.py")
    assert record.outcome == "passed", (record.outcome, record.error)


def test_confinement_refuses_writes_outside_scratch_and_build_directory(tmp_path: Path) -> None:
    """The layer itself, in a forked child: writes beneath the named directory and to /dev/null
    work; a write beside it, a signal to the parent and ptrace fail."""
    from kbv.child import confine

    if confine.landlock_abi() is None:
        pytest.skip("no Landlock on this kernel")
    allowed, outside = tmp_path / "scratch", tmp_path / "elsewhere"
    allowed.mkdir()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        facts = confine.apply([str(allowed)])
        results = []
        for attempt in (
            lambda: (allowed / "f").write_text("x"),
            lambda: Path("/dev/null").write_text("x"),
            lambda: outside.write_text("x"),
            lambda: os.kill(os.getppid(), 0),
        ):
            try:
                attempt()
                results.append("ok")
            except OSError as exc:
                results.append(str(exc.errno))
        os.write(write, repr((results, facts["not_enforced"])).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    results, missing = eval(os.read(read, 65536).decode())  # noqa: S307 - our own child's repr
    assert results[:3] == ["ok", "ok", "13"], (results, missing)
    if _scopes_signals():
        assert results[3] == "1", results  # EPERM: outside its domain
    assert not outside.exists()


def test_a_confined_process_names_its_own_threads_and_no_one_elses(tmp_path: Path) -> None:
    """The CUDA driver names the threads it starts through /proc/self/task/<tid>/comm (refused,
    cuInit fails): a confined process may write its own threads' names, not its parent's."""
    import threading

    from kbv.child import confine

    if confine.landlock_abi() is None:
        pytest.skip("no Landlock on this kernel")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        confine.apply([str(tmp_path)])
        waiting = threading.Event()
        thread = threading.Thread(target=waiting.wait)
        thread.start()
        results = []
        for target in (f"/proc/self/task/{thread.native_id}/comm", f"/proc/{os.getppid()}/comm"):
            try:
                Path(target).write_text("renamed")
                results.append("ok")
            except OSError as exc:
                results.append(str(exc.errno))
        waiting.set()
        thread.join()
        os.write(write, repr(results).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    results = eval(os.read(read, 65536).decode())  # noqa: S307 - our own child's repr
    assert results[0] == "ok", results
    assert results[1] in ("1", "13"), results  # EPERM or EACCES: not its own process


def test_the_seccomp_filter_denies_what_it_names_and_allows_the_rest() -> None:
    from kbv.child import confine

    program = confine.seccomp_program("x86_64")
    assert program[-1][3] == 0x00050000 | 1 and program[-2][3] == 0x7FFF0000  # EPERM; allow
    denied = {k for code, _, _, k in program if code == 0x15}
    assert {101, 310, 311, 438}.issubset(denied)  # ptrace, process_vm_readv/writev, pidfd_getfd
    for index, (code, jt, jf, _) in enumerate(program):
        if code in (0x15, 0x35):  # every jump to "deny" lands on the EPERM return
            target = index + 1 + (jt or jf)
            assert (jt or jf) == 0 or target == len(program) - 1


def test_an_ahead_of_time_build_is_confined_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build process imports the candidate (its ``load_inline`` runs there), as the parent's
    uid: a write outside its build directory and home is refused, as in the worker."""
    from kbv.candidates import load_candidate
    from kbv.child import confine
    from kbv.worker.builds import compile_candidate

    if confine.landlock_abi() is None:
        pytest.skip("no Landlock on this kernel")
    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path / "cache"))
    outside = tmp_path / "outside.txt"
    source = tmp_path / "1_ReLU.py"
    source.write_text(
        f"import torch.utils.cpp_extension\nopen({str(outside)!r}, 'w').write('x')\n"
        "class ModelNew:\n    pass\n"
    )
    result = compile_candidate(load_candidate(source))
    assert result.status == "failed" and not outside.exists(), result


# -- what a candidate writes ----------------------------------------------------------------------


def _small_disk() -> Any:
    """A disk limit small enough that the 4 GiB fixtures stop after 64 MiB (this machine's
    /dev/shm is shared RAM: nothing larger is ever written)."""
    return protocol_from_dict({"name": "small-disk", "base": "standard", "limits": {"disk_gb": 0.0625}})


@pytest.mark.parametrize("name", ["write_4gib_one_file.py", "write_4gib_many_files.py"])
def test_writing_4_gib_is_resource_limit_with_the_figure(name: str) -> None:
    record, _ = _evaluate_contained(name, protocol=_small_disk())
    assert record.outcome == "resource_limit", (record.outcome, record.error)
    limit = record.error["limit"]
    assert limit["limit"] == "disk" and limit["allowed"] == 64 << 20 and limit["figure"] > limit["allowed"]
    assert limit["figure"] < 2 << 30, limit  # stopped long before 4 GiB
    assert record.isolation["limits"]["disk_gb"] == 0.0625
    assert not list(Path("/dev/shm").glob("kbv-candidate-*/home/filler*"))  # the scratch is gone


def test_an_honest_candidate_writes_within_a_small_disk_limit() -> None:
    record, _ = _evaluate_contained("honest_scratch_files.py", protocol=_small_disk())
    assert record.outcome == "passed", (record.outcome, record.error)


def test_the_disk_limit_counts_allocated_bytes_once_and_skips_given_files(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 100_000)
    os.link(tmp_path / "a", tmp_path / "hard")
    with open(tmp_path / "sparse", "wb") as handle:  # 1 GiB long, nothing in it
        handle.truncate(1 << 30)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "given").write_bytes(b"y" * 200_000)
    given = os.stat(tmp_path / "sub" / "given")
    counted = _contain.files_bytes([tmp_path], {(given.st_dev, given.st_ino)})
    assert 100_000 <= counted < 150_000
    limits = LimitSettings(disk_gb=1.0)
    over = _contain.exceeded(_contain.Usage(1, 0, None, disk_bytes=2 << 30), limits)
    assert over == {"limit": "disk", "figure": 2 << 30, "allowed": 1 << 30, "unit": "bytes"}


def test_the_disk_limit_at_its_default_keeps_the_protocol_hash() -> None:
    from kbv.protocol import VERIFIED

    default = protocol_from_dict({"name": "verified", "base": "verified", "version": VERIFIED.version})
    assert "disk_gb" not in default.to_dict()["limits"]
    assert _small_disk().to_dict()["limits"]["disk_gb"] == 0.0625
    assert _small_disk().sha256() != protocol_from_dict({"name": "small-disk", "base": "standard"}).sha256()


def test_a_candidate_that_stops_its_own_worker_is_a_timeout_at_once() -> None:
    record, seconds = _evaluate_contained("stop_itself.py", timeout_s=120)
    assert record.outcome == "timeout" and "found stopped" in record.error["message"], record.error
    assert not _signalled(record) and seconds < 30
    assert _stopped_below_us() == []


def test_confinement_says_what_it_could_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine kbv knows no system call numbers for: nothing applied, and the reason given."""
    from kbv.child import confine

    monkeypatch.setattr(confine.platform, "machine", lambda: "sparc64")
    facts = confine.apply(["/nowhere"])
    assert facts["landlock"] is None and facts["seccomp"] is None
    assert "sparc64" in facts["not_enforced"][0]
    assert confine.landlock_abi() is None


def test_confinement_holds_for_an_ordinary_user() -> None:
    """kbv run as an ordinary user (no capability): Landlock and seccomp still apply (no_new_privs
    is all they need), and a signal to a process outside the domain of the same uid is refused."""
    from kbv.child import confine

    if os.geteuid() != 0 or confine.landlock_abi() is None:
        pytest.skip("needs root to become an ordinary user, and Landlock")
    import shutil
    import tempfile

    allowed = Path(tempfile.mkdtemp(prefix="kbv-test-confine-", dir="/dev/shm"))  # reachable by nobody
    os.chmod(allowed, 0o777)
    read, write = os.pipe()
    sibling = subprocess.Popen(["sleep", "30"], user=65534, group=65534, extra_groups=[])
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        facts = confine.apply([str(allowed)])
        results = []
        for attempt in (lambda: (allowed / "f").write_text("x"), lambda: os.kill(sibling.pid, 0)):
            try:
                attempt()
                results.append("ok")
            except OSError as exc:
                results.append(str(exc.errno))
        os.write(write, repr((results, facts)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    sibling.kill()
    sibling.wait()
    results, facts = eval(os.read(read, 65536).decode())  # noqa: S307 - our own child's repr
    shutil.rmtree(allowed, ignore_errors=True)
    assert facts["landlock"] and facts["seccomp"], facts
    assert results[0] == "ok", results
    if _scopes_signals():
        assert results[1] == "1", results  # the same uid, outside its domain: EPERM
