"""What crosses to a candidate worker: seeds, settings and its own file names, never a handle to
trusted memory, a reference output or the truth (docs/architecture.md, "Outputs stay on the device")."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import FOUNDATION, RELU

from kbv import wire, wire_replies
from kbv.api import evaluate_paths
from kbv.worker import Spares, Worker, WorkerSpec

_TRUSTED_KEYS = {
    "outputs",
    "truth",
    "reference",
    "baseline",
    "handle",
    "ref_handle",
    "event_handle",
    "items",
    "master",
}


@pytest.fixture()
def requests_seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, wire.Request, str]]:
    """Every request as it goes on the wire: its worker's role, its op, the typed request (kbv.wire)
    the worker was sent, with what the parent adds to all of them (the memory rule), and the
    worker's scratch folder."""
    seen: list[tuple[str, str, wire.Request, str]] = []
    original = Worker._envelope

    def spy(self: Worker, request: wire.Request) -> wire.Envelope:
        envelope = original(self, request)
        seen.append((self.spec.role, request.op, envelope.request, str(self.scratch)))
        return envelope

    monkeypatch.setattr(Worker, "_envelope", spy)
    return seen


@pytest.fixture()
def replies_seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, wire_replies.Reply]]:
    """Every reply as the parent parsed it: its worker's role, its request's op and the typed reply
    (kbv.wire_replies)."""
    seen: list[tuple[str, str, wire_replies.Reply]] = []
    original = Worker._parsed

    def spy(self: Worker, op: str, message: dict) -> wire_replies.Reply:
        reply = original(self, op, message)
        seen.append((self.spec.role, op, reply))
        return reply

    monkeypatch.setattr(Worker, "_parsed", spy)
    return seen


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, (list, tuple)):
        return {k for v in value for k in _keys(v)}
    return set()


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def test_no_handle_reference_output_or_truth_reaches_a_candidate_worker(requests_seen, replies_seen) -> None:
    record = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    assert record.outcome == "passed"
    # Every reply was read as its own request's kind; the reference's truth requests hand over the
    # truth alone: of the realistic baseline only shapes and dtypes leave its worker.
    assert replies_seen and all(type(reply) is wire_replies.KINDS[op] for _, op, reply in replies_seen)
    truths = [reply for role, _, reply in replies_seen if isinstance(reply, wire_replies.ExpectedReply)]
    shapes = [described for reply in truths for described in reply.baseline_outputs]
    assert shapes and all(len(d) == 2 and isinstance(d[0], list) and d[1] == "float32" for d in shapes)
    to_candidate = [
        (op, request.to_json(), scratch)
        for role, op, request, scratch in requests_seen
        if role == "candidate"
    ]
    reference_scratch = {scratch for role, _, _, scratch in requests_seen if role == "reference"}
    assert to_candidate and reference_scratch
    for op, fields, scratch in to_candidate:
        json.dumps(fields)  # plain JSON: no tensor, no bytes, nothing pickled
        assert not _keys(fields) & _TRUSTED_KEYS, (op, fields)
        for text in _strings(fields):
            if text.startswith("/"):
                inside_own = text.startswith(scratch)
                # The one file of the reference's a candidate reads: redrawn parameters (inputs, not answers).
                parameters = (
                    op == "build"
                    and any(text.startswith(s) for s in reference_scratch)
                    and Path(text).name.startswith("params-")
                )
                its_own_file = text == str(FOUNDATION / "relu_plain.py")
                assert inside_own or parameters or its_own_file, (op, text)
    assert str(record.seeds["master"]) not in json.dumps([f for _, f, _ in to_candidate])


def test_a_timed_batch_request_names_no_call_and_is_the_baselines_own(
    requests_seen, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The candidate's worker can read its own ``time`` requests: none names a call (no secret
    picks to be honest on), and each is exactly the request the baseline's batch of the same round
    got, but for the precision. Every timed call comes back sketched, none held back; which ones are
    judged is picked in the parent after the batch."""
    monkeypatch.setenv("KBV_CACHE_DIR", str(tmp_path))  # a cached baseline would time no rounds
    record = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    assert record.outcome == "passed"
    timed = [
        (role, request)
        for role, _, request, _ in requests_seen
        if isinstance(request, wire.Time) and request.sketch is not None
    ]
    to_candidate = [request for role, request in timed if role == "candidate"]
    to_baseline = [request for role, request in timed if role == "reference"]
    rounds = record.timing["median_precision"]["rounds"]  # 3, and more while a median was imprecise
    assert rounds >= record.protocol["settings"]["timing"]["rounds"]
    assert len(to_candidate) == rounds and len(to_baseline) >= rounds
    # a timed batch's request holds these and nothing else (no call is named)
    assert set(wire.FIELDS["time"]) == {
        *("distribution", "seeds", "precision", "settings", "sketch", "unseen_seeds", "memory", "steps")
    }
    for request in to_candidate:
        assert request.sketch is not None and set(request.sketch) == {"seed", "omega"}
    # every timed call has a draw of its own: no seed twice, none of them a warm-up set's
    unseen = [seed for request in to_candidate for seed in request.unseen_seeds or []]
    assert len(unseen) == len(set(unseen)) == rounds * record.protocol["settings"]["timing"]["repeats"]
    assert not set(unseen) & set(to_candidate[0].seeds)
    assert record.seeds["unseen_timing_nonce"] != 0
    same_round = {request.sketch["seed"]: request for request in to_baseline if request.sketch}
    for request in to_candidate:
        assert request.sketch is not None
        baseline = same_round[request.sketch["seed"]]
        # the same batch but for the precision and the memory rule (the reference's leaves room)
        assert replace(request, precision="", memory=None) == replace(baseline, precision="", memory=None)
    checked = record.timing["timed_outputs"]
    # every timed call sketched; the calls judged are picked in the parent after each batch
    assert checked["timed_calls"] == sum(len(r["device_ms"]) for r in record.timing["candidate"]["rounds"])
    assert checked["checked"] == sum(len(calls) for calls in checked["judged_calls"].values())
    assert checked["checked"] < checked["timed_calls"]
    assert checked["wrong"] == [] and checked["max_ratio"] < 1


def test_unseen_timing_seeds_are_each_evaluations_own() -> None:
    """Two evaluations that share a master seed (candidates of one problem in one batch) still time
    different unseen draws: a result one kept where it outlives it finds none of the other's."""
    from kbv.evaluation import _Seeds

    one, two = _Seeds(master=7, fixed=False, timing_nonce=1), _Seeds(master=7, fixed=False, timing_nonce=2)
    assert one.draw("original", 0) == two.draw("original", 0)  # the shared correctness draws
    assert not set(one.unseen(0, 10) + one.unseen(1, 10)) & set(two.unseen(0, 10) + two.unseen(1, 10))
    assert len(set(one.unseen(0, 10) + one.unseen(1, 10))) == 20


def test_reference_output_files_are_gone_before_the_candidate_runs(requests_seen) -> None:
    """Every file a reference wrote for the parent is deleted when the parent has read it."""
    evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="standard", device="cpu")
    written = [
        request.out_path
        for role, _, request, _ in requests_seen
        if role == "reference" and isinstance(request, wire.Run)
    ]
    assert written and not any(Path(p).exists() for p in written)


def test_a_spare_is_launched_ahead_and_handed_to_the_evaluation_that_asks_for_it() -> None:
    spec = WorkerSpec(build_key="test-spare", device="cpu", role="candidate", budget_s=60)
    with Spares() as spares:
        spares.expect([[spec]])
        spares.launch_expected()
        worker = spares.take(spec)
        assert worker.alive() and worker.wait_ready().pid == worker.pid
        fresh = spares.take(spec)  # nothing left: a new, unlaunched worker
        assert fresh.pid is None
        worker.close()
        fresh.close()


def test_spares_still_booting_are_stopped_for_a_timed_phase_and_boot_after_it() -> None:
    """``Spares.quiet``: a spare whose greeting was not read is stopped (state T) inside, goes on
    after, and greets as usual; one already greeted is left alone."""
    spec = WorkerSpec(build_key="test-quiet", device="cpu", role="reference", budget_s=60)
    greeted = WorkerSpec(build_key="test-quiet-2", device="cpu", role="reference", budget_s=60)
    with Spares(depth=2) as spares:
        spares.expect([[spec], [greeted]])
        spares.launch_expected()
        ready = _launched(spares, "test-quiet-2")
        ready.wait_ready()
        with spares.quiet():
            booting = _launched(spares, "test-quiet")
            assert _state(booting.pid) == "T" and _state(ready.pid) != "T"
        worker = spares.take(spec)
        assert _state(worker.pid) != "T" and worker.wait_ready().pid == worker.pid
        worker.close()


def test_a_spare_that_died_while_booting_is_not_handed_out() -> None:
    import signal

    spec = WorkerSpec(build_key="test-dead-spare", device="cpu", role="reference", budget_s=60)
    with Spares() as spares:
        spares.expect([[spec]])
        spares.launch_expected()
        dead = _launched(spares, "test-dead-spare")
        os.kill(dead.pid, signal.SIGKILL)
        dead._proc.wait()
        fresh = spares.take(spec)
        assert fresh is not dead and fresh.pid is None  # a new worker, launched by the evaluation
        fresh.close()


def _launched(spares: Spares, build_key: str) -> Worker:
    """The first spare launched for ``build_key``."""
    return next(w for key, workers in spares._launched.items() if key[0] == build_key for w in workers)


def _state(pid: int | None) -> str:
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0]


def test_the_phases_and_each_probe_are_in_the_record_and_printed() -> None:
    from kbv.report.explain import phases_line

    record = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    phases = record.phases_s
    assert {"correctness", "timing", "integrity", "total"} <= set(phases)
    probes = {k for k in phases if k.startswith("probe:")}
    assert {"probe:observe", "probe:cache", "probe:poison"} <= probes
    assert (
        sum(phases[k] for k in probes) <= phases["integrity"] + 1e-6
    )  # probes are part of the integrity phase
    line = phases_line(phases)
    assert line.startswith("time: total") and "correctness" in line
    # A probe is printed from 0.05 s on; on the CPU the observation may take less.
    assert "(probes: observe 0.1" in phases_line({**phases, "probe:observe": 0.1})
    # Each check's seconds are in the record too; the slowest (from 0.5 s) are named, slowest first.
    checks = {k for k in phases if k.startswith("check:")}
    assert {"check:caching_probe", "check:unwritten_output", "check:output_type"} <= checks
    assert sum(phases[k] for k in checks) <= phases["integrity"] + 1e-6
    quick = {**{k: 0.01 for k in checks}, "total": 1.0}
    assert "slowest checks" not in phases_line(quick)
    slow = {**quick, "check:caching_probe": 10.4, "check:unwritten_output": 0.6, "check:output_type": 0.7}
    assert phases_line(slow).endswith(
        "(slowest checks: caching_probe 10.4, output_type 0.7, unwritten_output 0.6)"
    )


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="the uid drop is decided for a root parent only"
)
def test_a_gpu_candidate_worker_is_dropped_as_on_the_cpu_and_then_hands_over_exported_memory() -> None:
    """Legacy CUDA IPC handles do not open across uids (measured on the H200), exported VMM memory
    does: a CUDA candidate worker is dropped wherever a CPU one would be, and a dropped worker is
    told to hand its outputs over as ``cuda_vmm``; one that keeps the parent's uid, as ``cuda_ipc``."""
    decided = {}
    for device in ("cpu", "cuda:0"):
        spec = WorkerSpec(build_key="test-drop-on-gpu", device=device, role="candidate", budget_s=10)
        worker = Worker(spec)
        try:
            worker._command(["python", "-c", "pass"], worker.scratch)
            decided[device] = (worker.uid, worker._no_drop, worker.handoff)
        finally:
            worker.close()
    assert decided["cuda:0"][:2] == decided["cpu"][:2]
    uid, _, handoff = decided["cuda:0"]
    assert handoff == ("cuda_vmm" if uid is not None else "cuda_ipc")
    assert decided["cpu"][2] == "file"  # a CPU candidate writes into its own scratch


def test_spares_are_kept_launched_depth_pairs_ahead() -> None:
    """depth 2: the first launch starts the next two pairs' workers (two alike count twice) and not
    the third's; after one is taken, the next launch tops up to two pairs ahead, so the pair that
    was beyond the first two is launched while two evaluations still come before it (launched in
    waves instead, a short evaluation waited for the wave it had just started)."""
    spec = WorkerSpec(build_key="test-wave", device="cpu", role="reference", budget_s=60)
    other = WorkerSpec(build_key="test-wave-2", device="cpu", role="reference", budget_s=60)
    taken = []
    with Spares(depth=2) as spares:
        spares.expect([[spec], [spec], [other]])  # beyond depth: the third is not launched yet
        spares.launch_expected()
        assert sum(len(w) for w in spares._launched.values()) == 2
        taken.append(spares.take(spec))
        spares.expect([[spec], [other]])
        spares.launch_expected()  # tops up: the other pair's worker now boots ahead of its turn
        assert sum(len(w) for w in spares._launched.values()) == 2
        taken.append(spares.take(spec))
        taken.append(spares.take(other))
        assert all(w.pid for w in taken) and len({w.pid for w in taken}) == 3
    for worker in taken:
        worker.close()


def test_on_the_cpu_the_reference_hands_over_by_memory_file_and_the_draws_overlap(
    requests_seen, replies_seen
) -> None:
    """On the CPU the reference's outputs reach the parent as an anonymous memory file whose
    descriptor only the parent receives (no path a candidate could open beside it), so each draw
    runs in both workers at once, as on a GPU: the candidate is asked before the reference answers."""
    from kbv.evaluation import draws_overlap

    assert draws_overlap("cuda") and draws_overlap("cpu")
    record = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    assert record.outcome == "passed", [(f.check, f.detail[:120]) for f in record.findings]
    handed = [
        (role, reply.outputs["transport"])
        for role, _, reply in replies_seen
        if isinstance(getattr(reply, "outputs", None), dict) and "transport" in reply.outputs
    ]
    assert {t for role, t in handed if role == "reference"} == {"memfd"}, handed
    assert {t for role, t in handed if role == "candidate"} == {"file"}, handed
    ops = [(role, type(r).__name__) for role, _, r, _ in requests_seen]
    first_run = ops.index(("candidate", "Run"))
    assert ops[first_run + 1] == ("reference", "Expected"), "the draw was not asked of both at once"


def test_without_memory_files_the_reference_output_file_is_gone_before_the_candidate_runs_the_draw(
    requests_seen, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the system has no memory files the reference's outputs pass through a file: each draw
    is asked of the reference first (the parent reads and deletes the file), then of the candidate,
    which could otherwise read the file half-written beside it (``steal_reference_outputs``)."""
    from kbv.evaluation import draws

    monkeypatch.delattr(os, "memfd_create")
    assert not draws.draws_overlap("cpu") and draws.draws_overlap("cuda:1")
    record = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="standard", device="cpu")
    assert record.outcome == "passed"
    runs = [(i, role, r.seed) for i, (role, _, r, _) in enumerate(requests_seen) if isinstance(r, wire.Run)]
    candidate = {seed: i for i, role, seed in runs if role == "candidate"}
    reference = {seed: i for i, role, seed in reversed(runs) if role == "reference"}  # its first run
    assert candidate, "no correctness draw was run"
    for seed, asked in candidate.items():
        assert reference[seed] < asked, f"draw {seed}: the candidate was asked before the reference ran"


@pytest.mark.parametrize("same_filesystem", [True, False], ids=["linked", "copied"])
def test_a_file_given_to_a_worker_is_a_fresh_readable_name_with_the_same_bytes(
    tmp_path: Path, same_filesystem: bool
) -> None:
    """``Worker.give``: a fresh name in the worker's scratch (never one the worker prepared), the
    same bytes, readable by other uids; a symlink planted in the scratch is not written through.
    Beside the scratch (a trusted worker's file) it is a hard link: no copy of 256 MB of weights."""
    import shutil
    import tempfile

    worker = Worker(WorkerSpec(build_key="test-give", device="cpu", role="candidate", budget_s=10))
    home = Path(tempfile.mkdtemp(dir=worker.scratch.parent)) if same_filesystem else tmp_path
    source = home / "params.pt"
    source.write_bytes(b"kbv-params" * 1000)
    try:
        elsewhere = tmp_path / "elsewhere"
        (worker.scratch / "planted").symlink_to(elsewhere)
        given = Path(worker.give(str(source)))
        assert given.parent == worker.scratch and given.name.startswith("given-")
        assert given.read_bytes() == source.read_bytes()
        assert given.stat().st_mode & 0o044 == 0o044
        assert not elsewhere.exists()
        assert Path(worker.give(str(source))) != given  # every call a new name
        linked = given.stat().st_ino == source.stat().st_ino
        assert linked == (same_filesystem and os.stat(home).st_dev == os.stat(worker.scratch).st_dev)
    finally:
        worker.close()
        if same_filesystem:
            shutil.rmtree(home, ignore_errors=True)


def test_overlapped_draws_and_builds_judge_as_the_sequential_ones(
    requests_seen, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The GPU's order, forced on the CPU: the candidate's build reply is read after the first
    draw's reference work and each draw runs beside the reference's; the reference submitted as the
    candidate (parameters redrawn and sent as a file) still passes every distribution."""
    from conftest import SUITE

    from kbv.evaluation import draws

    problem = SUITE / "level2" / "3_Matmul_Scale_Residual.py"
    candidate = tmp_path / "reference_as_candidate.py"
    candidate.write_text(problem.read_text().replace("class Model(", "class ModelNew("))
    monkeypatch.setattr(draws, "draws_overlap", lambda device: True)
    record = evaluate_paths(problem, candidate, protocol="verified", device="cpu")
    assert record.outcome == "passed", [(f.check, f.detail[:120]) for f in record.findings]
    assert all(d.passed for d in record.distributions if d.applicable)
    ops = [(role, op) for role, op, _, _ in requests_seen]
    build = ops.index(("candidate", "build"), ops.index(("reference", "redraw")))
    assert ops[build + 1] == ("candidate", "run"), "the first draw is not asked right after the build"
    assert ("reference", "run") in ops[build + 2 :]  # and the reference works while both are pending


_SQRT_PROBLEM = """import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


def get_inputs():
    return [torch.rand(64, 32)]


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("overlap", [False, True], ids=["one_after_the_other", "overlapped"])
def test_a_draw_the_reference_moves_to_a_domain_variant_is_run_by_the_candidate_on_that_variant(
    requests_seen, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, overlap: bool
) -> None:
    """sqrt is not finite on signed inputs: the reference falls back to the positive variant, and
    the candidate's judged run of every draw is on the variant the reference used; one after the
    other it runs each draw once, overlapped it runs the dropped variant too (it was already asked)."""
    from kbv.evaluation import draws

    problem = tmp_path / "sqrt_problem.py"
    problem.write_text(_SQRT_PROBLEM)
    candidate = tmp_path / "sqrt_candidate.py"
    candidate.write_text(_SQRT_PROBLEM.replace("class Model(", "class ModelNew("))
    monkeypatch.setattr(draws, "draws_overlap", lambda device: overlap)
    record = evaluate_paths(problem, candidate, protocol="verified", device="cpu")
    assert record.outcome == "passed", [(f.check, f.detail[:120]) for f in record.findings]
    moved = [d for d in record.distributions if "domain-preserving variant" in (d.note or "")]
    assert moved, "no distribution fell back: the test proves nothing"
    runs = [
        (r.seed, r.distribution)
        for role, _, r, _ in requests_seen
        if role == "candidate" and isinstance(r, wire.Run)
    ]
    last = dict(runs)  # per seed, the distribution of its last (judged) run
    assert any(d.endswith("_positive") for d in last.values())
    per_seed = {seed: sum(1 for s, _ in runs if s == seed) for seed in last}
    if overlap:
        assert max(per_seed.values()) == 2
    else:
        assert set(per_seed.values()) == {1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_redrawn_parameters_reach_the_candidate_through_its_inbox_and_no_handle_goes_to_it(
    requests_seen, tmp_path: Path
) -> None:
    """The reference submitted as the candidate passes `verified` with its parameters redrawn per
    distribution and written by the parent into an inbox the candidate opened: no parameter file,
    and still nothing trusted among the candidate's requests."""
    from conftest import SUITE

    problem = SUITE / "level2" / "3_Matmul_Scale_Residual.py"
    candidate = tmp_path / "reference_as_candidate.py"
    candidate.write_text(problem.read_text().replace("class Model(", "class ModelNew("))
    record = evaluate_paths(problem, candidate, protocol="verified", device="cuda", timeout_s=600)
    assert record.outcome == "passed", (record.error, [(f.check, f.detail[:120]) for f in record.findings])
    assert record.seeds["parameters"] == "state_dict"
    to_candidate = [request for role, _, request, _ in requests_seen if role == "candidate"]
    builds = [r for r in to_candidate if isinstance(r, wire.Build) and r.state_inbox]
    assert len(builds) >= len([d for d in record.distributions if d.applicable])
    assert sum(isinstance(r, wire.Inbox) for r in to_candidate) == len(builds)
    for request in to_candidate:
        fields = request.to_json()
        json.dumps(fields)
        assert not _keys(fields) & _TRUSTED_KEYS, (request.op, fields)
        assert not isinstance(request, wire.Build) or request.state_path is None, request


def test_no_worker_is_told_where_the_problem_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers get the problem's text, never its path: not in a request, their command line or their
    environment (a candidate that learnt it could rewrite the file; ``test_hack_fixtures`` has one)."""
    seen: list[tuple[str, wire.Request, list[bytes]]] = []
    original = Worker._envelope

    def spy(self: Worker, request: wire.Request) -> wire.Envelope:
        envelope = original(self, request)
        exposed = []
        for name in ("cmdline", "environ"):
            with open(f"/proc/{self.pid}/{name}", "rb") as handle:
                exposed.append(handle.read())
        seen.append((self.spec.role, envelope.request, exposed))
        return envelope

    monkeypatch.setattr(Worker, "_envelope", spy)
    record = evaluate_paths(RELU, FOUNDATION / "relu_plain.py", protocol="verified", device="cpu")
    assert record.outcome == "passed"
    loads = [request for _, request, _ in seen if isinstance(request, wire.Load)]
    assert {role for role, request, _ in seen if isinstance(request, wire.Load)} == {"reference", "candidate"}
    assert all(load.problem_source == RELU.read_text() for load in loads)
    needles = {str(RELU), str(RELU.resolve()), str(RELU.parent)}
    for role, request, exposed in seen:
        fields = request.to_json()
        assert not needles & set(_strings(fields)), (role, request.op)
        assert not any(n in json.dumps(fields) for n in needles), (role, request.op)
        for blob in exposed:
            assert not any(n.encode() in blob for n in needles), (role, request.op)
