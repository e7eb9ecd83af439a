"""Worker conformance: isolation, scrubbed environment, private channel, timeouts, crashes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import RELU, load_relu_candidate, reference_worker

from kbv import wire, wire_replies
from kbv.worker import MemoryBudget, Worker, WorkerFailed, WorkerSpec
from kbv.worker._env import scrubbed_env

FIXTURES = Path(__file__).parent / "fixtures" / "candidates" / "foundation"


def _candidate_worker(name: str, budget_s: float = 60.0) -> Worker:
    return Worker(WorkerSpec(build_key=f"test-{name}", device="cpu", role="candidate", budget_s=budget_s))


def _load(worker: Worker, name: str) -> wire_replies.Reply:
    return load_relu_candidate(worker, FIXTURES / name)


def test_env_allowlist_drops_secrets(tmp_path: Path) -> None:
    parent = {
        "PATH": "/usr/bin",
        "OPENAI_API_KEY": "sk-x",
        "HF_TOKEN": "t",
        "NVIDIA_API_KEY": "k",
        "LANG": "C",
        "AWS_SECRET_ACCESS_KEY": "s",
        "RANDOM_VAR": "1",
    }
    env = scrubbed_env(parent, home=tmp_path, extensions_dir=tmp_path / "e", triton_dir=tmp_path / "t")
    assert env["PATH"] == "/usr/bin" and env["LANG"] == "C"
    assert not {"OPENAI_API_KEY", "HF_TOKEN", "NVIDIA_API_KEY", "AWS_SECRET_ACCESS_KEY", "RANDOM_VAR"} & set(
        env
    )
    assert env["HOME"] == str(tmp_path) and env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "e")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to take a uid")
def test_a_worker_without_a_passwd_entry_still_has_a_user_name(tmp_path: Path) -> None:
    """Measured on the H200: a dropped candidate worker crashed at start-up, because torch's
    inductor (imported by the profiler's first start) asks ``getpass.getuser()`` for a cache
    directory and a uid without a passwd entry has no name. The worker's environment names one."""
    import subprocess
    import sys

    from kbv.worker._privileges import worker_uid

    uid = worker_uid("test-getuser")
    env = scrubbed_env(os.environ, home=tmp_path, extensions_dir=tmp_path / "e", triton_dir=tmp_path / "t")
    script = (
        "import getpass, os, sys; os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1])); "
        "print(getpass.getuser())"
    )
    command = [sys.executable, "-c", script, str(uid)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-800:]
    assert done.stdout.strip() == "kbv-worker"
    bare = {k: v for k, v in env.items() if k not in ("USER", "LOGNAME")}
    without = subprocess.run(
        [sys.executable, "-c", script, str(uid)], env=bare, capture_output=True, text=True
    )
    assert without.returncode != 0 and "getpwuid" in without.stderr  # what the H200 run hit


def test_worker_runs_a_model_and_returns_outputs_through_files() -> None:
    with _candidate_worker("plain") as worker:
        reply = _load(worker, "relu_plain.py")
        assert reply == wire_replies.LoadReply(parameters={}, worker_seconds=reply.worker_seconds)
        out = worker.new_path("out")
        run = worker.request(wire.Run(distribution="original", seed=3, precision="native", out_path=out))
        assert isinstance(run, wire_replies.RunReply) and run.types == ["torch.Tensor"]
        assert run.outputs == {"transport": "file", "path": out, "count": 1}
        (y,) = worker.receive_outputs(run.outputs)
        assert y.shape == (2, 8) and bool((y >= 0).all())
        assert not Path(out).exists()  # read once, then deleted


def test_secrets_in_parent_environment_never_reach_the_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-should-not-leak")
    monkeypatch.setenv("KBV_TEST_SECRET", "nope")
    with _candidate_worker("spy") as worker:
        _load(worker, "relu_env_spy.py")
        reply = worker.request(
            wire.Run(distribution="original", seed=3, precision="native", out_path=worker.new_path("o"))
        )
        assert isinstance(reply, wire_replies.RunReply)


def test_timeout_kills_the_whole_process_group() -> None:
    with _candidate_worker("hang", budget_s=20.0) as worker:
        _load(worker, "relu_hang.py")
        worker.remaining_s = 3.0
        started = time.monotonic()
        with pytest.raises(WorkerFailed) as info:
            worker.request(
                wire.Run(distribution="original", seed=3, precision="native", out_path=worker.new_path("o"))
            )
        assert info.value.kind == "timeout"
        assert time.monotonic() - started < 8
        pid = int((worker.home / "grandchild.pid").read_text())
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the candidate's child process survived the timeout"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waiting for its reaper is dead for our purposes.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_stdout_is_a_log_never_a_result_and_early_exit_is_a_crash() -> None:
    with _candidate_worker("exit") as worker:
        _load(worker, "relu_exit_fake.py")
        with pytest.raises(WorkerFailed) as info:
            worker.request(
                wire.Run(distribution="original", seed=3, precision="native", out_path=worker.new_path("o"))
            )
        assert info.value.kind == "crashed"
        assert '"outcome": "passed"' in info.value.details["stdout"]  # kept as a log only


def test_a_signal_death_is_a_crash() -> None:
    with _candidate_worker("segv") as worker:
        _load(worker, "relu_segfault.py")
        with pytest.raises(WorkerFailed) as info:
            worker.request(
                wire.Run(distribution="original", seed=3, precision="native", out_path=worker.new_path("o"))
            )
        assert info.value.kind == "crashed"
        assert "exit status -11" in info.value.message


def test_errors_are_reported_with_their_kind() -> None:
    with _candidate_worker("raises") as worker:
        _load(worker, "relu_raises.py")
        with pytest.raises(WorkerFailed) as info:
            worker.request(
                wire.Run(distribution="original", seed=3, precision="native", out_path=worker.new_path("o"))
            )
        assert info.value.kind == "runtime_error"
        assert "invalid configuration argument" in info.value.message
        assert "ValueError" in info.value.details["traceback"]
        # The worker survives a Python exception and answers the next request.
        assert isinstance(worker.request(wire.Build(init_seed=2)), wire_replies.BuildReply)


def test_missing_modelnew_is_a_compile_error() -> None:
    """A file without ModelNew never ran anything: compile_error, not runtime_error."""
    with _candidate_worker("nomodel") as worker, pytest.raises(WorkerFailed) as info:
        _load(worker, "relu_no_modelnew.py")
    assert info.value.kind == "compile_error" and "defines no class ModelNew" in info.value.message


def test_reference_worker_refuses_to_redraw_for_candidates() -> None:
    with _candidate_worker("plain2") as worker:
        _load(worker, "relu_plain.py")
        with pytest.raises(WorkerFailed, match="only a reference worker"):
            worker.request(wire.Redraw(distribution="signed", seed=1, out_path=worker.new_path("p")))


def test_only_the_reference_worker_computes_a_draws_truth() -> None:
    with _candidate_worker("plain3") as worker:
        _load(worker, "relu_plain.py")
        with pytest.raises(WorkerFailed, match="only the trusted reference worker"):
            worker.request(
                wire.Expected(distribution="signed", seed=1, precision="fp32", out_path=worker.new_path("e"))
            )


def test_a_draws_truth_and_baseline_error_in_one_request_match_two_separate_runs() -> None:
    """``expected``: one generation of the inputs for the float64 truth and the baseline; the
    baseline's error computed in the reference worker equals the parent's from two ``run`` requests,
    and only the truth is handed over."""
    from kbv.correctness import baseline_error

    with reference_worker("expected", RELU, {"batch_size": 4, "dim": 64}) as worker:
        fields = {"distribution": "signed", "seed": 5, "mix_seed": None}
        reply = wire_replies.ExpectedReply.of(
            worker.request(wire.Expected(precision="fp32", out_path=worker.new_path("e"), **fields))
        )
        (truth,) = worker.receive_outputs(reply.outputs)
        separate = {}
        for precision in ("fp32", "fp64"):  # each read before the next request (the worker lets go)
            run = wire_replies.RunReply.of(
                worker.request(wire.Run(precision=precision, out_path=worker.new_path("r"), **fields))
            )
            separate[precision] = worker.receive_outputs(run.outputs)
    assert truth.dtype == torch.float64 and torch.equal(truth, separate["fp64"][0])
    assert reply.baseline_outputs == [[[4, 64], "float32"]] and reply.types == ["torch.Tensor"]
    assert reply.baseline_error == baseline_error(separate["fp32"], separate["fp64"])


def test_a_forward_that_fails_in_float64_says_so(tmp_path: Path) -> None:
    problem = tmp_path / "float32_inside.py"
    problem.write_text(
        "import torch\n"
        "class Model(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x) + self.lin(torch.zeros(x.shape[0], 8))  # float32 always\n"
        "def get_inputs():\n"
        "    return [torch.rand(4, 8)]\n"
        "def get_init_inputs():\n"
        "    return []\n"
    )
    with reference_worker("expected-f64", problem) as worker, pytest.raises(WorkerFailed) as info:
        worker.request(
            wire.Expected(distribution="original", seed=1, precision="fp32", out_path=worker.new_path("e"))
        )
    assert info.value.kind == "runtime_error"
    assert info.value.message.startswith("in float64 (the verified protocol's truth): ")


def test_a_run_says_where_its_time_went_only_when_asked() -> None:
    with _candidate_worker("steps") as worker:
        _load(worker, "relu_plain.py")
        fields = {"distribution": "original", "seed": 3, "precision": "native"}
        plain = wire_replies.RunReply.of(worker.request(wire.Run(out_path=worker.new_path("o"), **fields)))
        worker.receive_outputs(plain.outputs)
        asked = wire_replies.RunReply.of(
            worker.request(wire.Run(out_path=worker.new_path("o"), steps=True, **fields))
        )
        worker.receive_outputs(asked.outputs)
    assert plain.steps_s is None and asked.steps_s is not None
    assert set(asked.steps_s) == {"inputs", "forward", "copy", "hand_over", "release"}
    assert all(s >= 0 for s in asked.steps_s.values())


def test_malicious_output_file_cannot_run_code_in_the_parent(tmp_path: Path) -> None:
    import pickle

    from kbv.handoff import HandoffError, receive

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = tmp_path / "out.pt"
    path.write_bytes(pickle.dumps([Evil()]))
    with pytest.raises(HandoffError):
        receive({"transport": "file", "path": str(path), "count": 1}, "cpu")
    assert not (tmp_path / "pwned").exists()
    assert not path.exists()  # read once, then deleted


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
def test_harden_process_makes_the_process_non_dumpable() -> None:
    """A non-dumpable process's /proc files (environ, mem) are closed to other same-user processes."""
    code = (
        "import ctypes; from kbv.worker import harden_process; libc = ctypes.CDLL(None);"
        "before = libc.prctl(3, 0, 0, 0, 0); ok = harden_process(); after = libc.prctl(3, 0, 0, 0, 0);"
        "print(before, ok, after)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["1", "True", "0"]


def test_scratch_left_by_a_killed_parent_is_swept(tmp_path, monkeypatch) -> None:
    """A parent killed with -9 never runs close(); the next process removes what it left behind."""
    from kbv.worker import _scratch

    monkeypatch.setattr(_scratch, "scratch_parent", lambda: str(tmp_path))
    monkeypatch.setattr(_scratch, "_swept", False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / "kbv-candidate-orphan"
    orphan.mkdir()
    (orphan / ".kbv-owner").write_text(str(dead.pid))
    live = tmp_path / "kbv-reference-live"
    live.mkdir()
    (live / ".kbv-owner").write_text(str(os.getppid()))  # a live process that is not us
    foreign = tmp_path / "kbv-other-thing"
    foreign.mkdir()  # no owner file: not kbv's to delete
    worker = Worker(WorkerSpec(build_key="sweep"))
    try:
        assert not orphan.exists() and live.exists() and foreign.exists()
        assert (worker.scratch / ".kbv-owner").read_text() == str(os.getpid())
    finally:
        worker.close()


def test_only_protocols_with_dynamic_probes_warm_the_probes_while_booting() -> None:
    """The profiler's first use costs seconds per worker; ``standard`` runs no probe and skips it,
    and under ``verified`` both workers take it, so their timed calls run in processes alike."""
    from conftest import FOUNDATION, RELU

    from kbv.candidates import load_candidate
    from kbv.evaluation import worker_specs
    from kbv.problems import load_problem
    from kbv.protocol import STANDARD, VERIFIED
    from kbv.worker._spares import _spec_key

    problem, candidate = load_problem(RELU), load_candidate(FOUNDATION / "relu_plain.py")
    assert [s.warm_probes for s in worker_specs(problem, candidate, VERIFIED, "cpu")] == [True, True]
    standard = worker_specs(problem, candidate, STANDARD, "cpu")
    assert [s.warm_probes for s in standard] == [False, False]
    assert _spec_key(standard[0]) != _spec_key(
        worker_specs(problem, candidate, VERIFIED, "cpu")[0]
    )  # spares do not mix them


def test_workers_closed_together_are_all_asked_to_exit_before_any_is_waited_for(monkeypatch) -> None:
    """``close_all`` sends every worker its ``exit`` before it reads any reply or waits for any
    process, so their exits overlap; each ends gone, its scratch removed, and a later ``close`` (the
    evaluation's ``with``) does nothing more."""
    from kbv import channel as _channel
    from kbv.worker import close_all

    workers = [_candidate_worker(f"close-all-{k}") for k in range(2)]
    events: list[str] = []
    send, receive = _channel.send, _channel.receive

    def spy_send(sock, message, fds=()):
        if message.get("op") == "exit":
            events.append("ask")
        return send(sock, message, fds)

    def spy_receive(sock, *args, **kwargs):
        reply = receive(sock, *args, **kwargs)
        if reply.get("ok") is True and set(reply) == {"ok", "id"}:  # the exit reply
            events.append("reply")
        return reply

    try:
        for worker in workers:
            _load(worker, "relu_plain.py")
        monkeypatch.setattr(_channel, "send", spy_send)
        monkeypatch.setattr(_channel, "receive", spy_receive)
        close_all(workers)
        assert events == ["ask", "ask", "reply", "reply"]
        assert all(not w.alive() and not w.scratch.exists() for w in workers)
        for worker in workers:
            worker.close()
        assert events == ["ask", "ask", "reply", "reply"]  # nothing asked again
    finally:
        for worker in workers:
            worker.close()


@pytest.mark.parametrize(
    "role, free_gb, released",
    [
        ("reference", 100, False),  # 20 GB kept, 100 GB free: room for a peer's request as large
        ("reference", 15, True),  # less than it keeps is free: handed back
        ("reference", 50, True),  # more, but less than a candidate's default limit: handed back
        ("candidate", 100, True),  # a candidate's cache counts against its device limit: always
    ],
)
def test_a_worker_hands_back_a_large_cache_unless_it_is_the_reference_with_room(
    monkeypatch: pytest.MonkeyPatch, role: str, free_gb: int, released: bool
) -> None:
    from kbv.child import main as child_main

    gb = 1 << 30
    emptied: list[bool] = []
    rule = MemoryBudget().rule(role)  # the rule the parent sends a worker outside an evaluation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 30 * gb)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 10 * gb)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free_gb * gb, 141 * gb))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    child_main._release_cached_memory(rule)
    assert bool(emptied) == released
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 25 * gb)  # 5 GB cached: kept by all
    emptied.clear()
    child_main._release_cached_memory(rule)
    assert not emptied


@pytest.mark.parametrize(
    "room_gib, released",
    [
        (None, False),  # 20 GB kept, 80 GB free: more than that, and the default device limit
        (64, False),  # the parent names that limit: the same
        (0, False),  # correctness draws side by side on a GPU held alone: what it keeps is free too
        (105, True),  # a candidate whose limit was widened to 105 GiB would be short: handed back
    ],
)
def test_the_reference_leaves_the_candidates_own_device_limit_free(
    monkeypatch: pytest.MonkeyPatch, room_gib: int | None, released: bool
) -> None:
    """On the H200 a reference that kept ~45 GB beside a 7.5 GB-input problem, whose candidate's limit
    had been widened to 3/4 of the GPU, ran that candidate's cache probe out of memory; the parent
    now sends the candidate's limit as it stands (the memory rule's ``room_bytes``) with every request."""
    from kbv.child import main as child_main

    gb = 1 << 30
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 30 * gb)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 10 * gb)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (80 * gb, 141 * gb))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    budget = MemoryBudget(room_bytes=None if room_gib is None else room_gib * gb)
    child_main._release_cached_memory(budget.rule("reference"))
    assert bool(emptied) == released
    emptied.clear()
    child_main._release_cached_memory(budget.rule("candidate"))  # a candidate keeps no more than 8 GB
    assert emptied
    emptied.clear()
    child_main._release_cached_memory(None)  # no rule sent: everything goes back
    assert emptied


def test_the_reference_is_told_the_candidates_limit_as_it_stands() -> None:
    """Every request to the reference carries the candidate's device limit, widened or not; during
    the correctness draws of an evaluation holding its GPU alone (they run side by side), none."""
    from kbv import evaluation
    from kbv.protocol import LimitSettings

    budget = MemoryBudget()
    gpu = evaluation._GpuState(held="shared", device_total_bytes=141 << 30, budget=budget)
    ctx = SimpleNamespace(gpu=gpu)
    subject = SimpleNamespace(spec=WorkerSpec(build_key="x", limits=LimitSettings(device_memory_gb=64.0)))
    evaluation._room_for_candidate(ctx, subject)  # type: ignore[arg-type]
    assert budget.rule("reference").room_bytes == 64 << 30
    ctx.gpu.drawing = True  # shared with other evaluations: the limit still
    evaluation._room_for_candidate(ctx, subject)  # type: ignore[arg-type]
    assert budget.rule("reference").room_bytes == 64 << 30
    ctx.gpu.held = "alone for the whole evaluation"
    budget.candidate_device_gb = 105.5  # the limit widened, in the budget
    evaluation._room_for_candidate(ctx, subject)  # type: ignore[arg-type]
    assert budget.rule("reference").room_bytes == 0
    ctx.gpu.drawing = False
    evaluation._room_for_candidate(ctx, subject)  # type: ignore[arg-type]
    assert budget.rule("reference").room_bytes == int(105.5 * (1 << 30))
    subject.spec = WorkerSpec(build_key="x")  # no limit: the whole device
    evaluation._room_for_candidate(ctx, subject)  # type: ignore[arg-type]
    assert budget.rule("reference").room_bytes == 141 << 30


def test_the_device_limit_polled_is_the_one_the_budget_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """An evaluation that holds its GPU alone widens its candidate's device-memory limit in its
    budget (kbv.evaluation.budget); the parent's limit poll reads it there. NVML's per-process
    figure is faked: 100 GiB is over the protocol's 64 GiB but within the 105.3 GiB widened on an
    H200, and is not killed; 110 GiB is, against the widened figure. The worker's spec is never
    edited."""
    from kbv import evaluation, telemetry
    from kbv.protocol import LimitSettings

    gib = 1 << 30
    spec = WorkerSpec(build_key="test-widened", device="cuda", role="candidate", limits=LimitSettings())
    used = {"bytes": 100 * gib}
    worker = Worker(spec)
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    worker._proc = sleeper
    monkeypatch.setattr(
        telemetry, "process_memory_bytes", lambda device, pid: used["bytes"] if pid == sleeper.pid else None
    )
    with worker:
        assert worker.poll() == {
            "limit": "device_memory",
            "figure": 100 * gib,
            "allowed": 64 * gib,
            "unit": "bytes",
        }
        budget = worker.budget = MemoryBudget()
        h200 = wire_replies.Hello(
            pid=1,
            python="3",
            torch="2",
            cuda_available=True,
            intra_op_threads=1,
            device={"total_memory_bytes": 143771 * (1 << 20)},
        )
        assert "raised from 64 GiB to 105.3 GiB" in evaluation._widen_device_limit(budget, worker, h200)
        assert worker._watch() and worker.exceeded is None  # over the old limit, under the widened one
        assert worker.isolation["limits"]["device_memory_gb"] == 105.3  # the record names the limit in force
        used["bytes"] = 110 * gib
        worker._last_poll = 0.0  # the next poll now, not POLL_S later
        worker._receiving = "probe_cache"  # as while the parent waits for that request's reply
        assert not worker._watch() and not worker.alive()
        assert worker.exceeded == {
            "limit": "device_memory",
            "figure": 110 * gib,
            "allowed": int(105.3 * gib),
            "unit": "bytes",
            "during": "request probe_cache",  # the record says in which request the limit was found
        }
        assert str(worker._exceeded_failure(worker.exceeded)).endswith("allowed (request probe_cache)")
        assert worker.spec is spec and spec.limits == LimitSettings()


def test_a_reply_that_fails_to_arrive_leaves_no_request_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the parent reads a request's reply, a limit found past is charged to that request; once
    the read has failed, the worker is waiting on none, and a later poll says so."""
    worker = Worker(WorkerSpec(build_key="test-receiving"))
    worker._awaited.append(7)
    worker._sent[7] = ("probe_observe", time.monotonic())
    seen: list[str] = []

    def failing_read() -> dict:
        seen.append(worker.request_running())
        raise WorkerFailed("crashed", "the worker died while the parent waited")

    monkeypatch.setattr(worker, "_receive", failing_read)
    with pytest.raises(WorkerFailed):
        worker.receive_reply()
    assert seen == ["request probe_observe"]
    assert worker.request_running() == "between requests"
