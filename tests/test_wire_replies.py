"""The worker's replies (kbv.wire_replies): one dataclass per kind, built by the worker, parsed and
checked by the parent; a malformed reply is the candidate's failure in its worker, kbv's in a
trusted one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import RELU, load_relu_candidate

from kbv import wire, wire_replies
from kbv.worker import Worker, WorkerFailed, WorkerSpec

_OUTPUTS = {"transport": "file", "path": "/tmp/o.pt", "count": 1}
_HANDED = {"sizes": [1], "outputs": _OUTPUTS}
_ACTIVITY = {"python_threads": 1, "os_threads": 4, "processes": 0}

#: One well-formed reply of each kind, as a worker's handler builds it.
SAMPLES: dict[str, wire_replies.Reply] = {
    "exit": wire_replies.ExitReply(),
    "release": wire_replies.ReleaseReply(),
    "load": wire_replies.LoadReply(parameters={"weight": [4, 4]}),
    "build": wire_replies.BuildReply(parameters="matched_seed"),
    "redraw": wire_replies.RedrawReply(names=["weight"], outputs=_OUTPUTS),
    "inbox": wire_replies.InboxReply(inbox={"transport": "cuda_vmm", "fd_index": 0, "size": 4096}),
    "run": wire_replies.RunReply(types=["torch.Tensor"], outputs=_OUTPUTS, memory=None),
    "expected": wire_replies.ExpectedReply(
        types=["torch.Tensor"],
        truth_types=["torch.Tensor"],
        baseline_outputs=[[[4], "float32"]],
        baseline_error={"norm": 0.0},
        outputs=_OUTPUTS,
        tf32_operators={"sensitive": [], "operators": 1},
        steps_s={"inputs": 0.1},
    ),
    "time": wire_replies.TimeReply(measurement={"device_ms": [1.0]}, sketches=[[{"sum": 1.0}]]),
    "truth_sketches": wire_replies.TruthSketchesReply(sets=[[None]], omega=[2.0]),
    "identities": wire_replies.IdentitiesReply(changed=[]),
    "probe_observe": wire_replies.ProbeObserveReply(
        outputs=None,
        types=["torch.Tensor"],
        input_checksums_before=[{"sum": 1.0, "sha": "a"}],
        input_checksums_after=[{"sum": 1.0, "sha": "a"}],
        aliasing=[],
        activity={"before": _ACTIVITY, "after": _ACTIVITY, "after_delay": _ACTIVITY},
        threads_started=0,
        threads_alive_at_return=0,
        flags={"start": {}, "before_call": {}, "after_call": {}},
        identities_changed=[],
        harness_changed=[],
    ),
    "probe_observe_late": wire_replies.ProbeObserveLateReply(outputs=_HANDED, after_delay=_ACTIVITY),
    "probe_cache": wire_replies.ProbeCacheReply(calls=4, outputs=_HANDED),
    "probe_poison": wire_replies.ProbePoisonReply(runs=2, outputs=_HANDED),
    "probe_flops": wire_replies.ProbeFlopsReply(flops=10, input_bytes=64, output_bytes=64),
    "probe_kernels": wire_replies.ProbeKernelsReply(
        available=True, kernels=["k"], custom_code=[], current_stream=7, kernel_streams=[["k", 7]]
    ),
    "probe_calls": wire_replies.ProbeCallsReply(built={"extensions": []}, ran={"functions": []}),
}


#: A change that leaves a field out of the message.
DROP = "<dropped>"


def _message(reply: wire_replies.Reply, **changes: object) -> dict:
    """``reply`` as the worker sends it (through JSON), with ``changes`` (:data:`DROP`: left out)."""
    message = json.loads(json.dumps({"ok": True, "id": 5, **reply.to_json(), "worker_seconds": 0.25}))
    message.update(changes)
    return {k: v for k, v in message.items() if v != DROP}


def test_every_request_kind_has_its_reply_kind() -> None:
    assert set(wire_replies.KINDS) == wire.OPS == set(SAMPLES)
    assert all(type(SAMPLES[op]) is wire_replies.KINDS[op] for op in SAMPLES)


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_each_reply_kind_survives_the_round_trip(op: str) -> None:
    parsed = wire_replies.parse(op, _message(SAMPLES[op]))
    assert parsed == dataclasses.replace(SAMPLES[op], worker_seconds=0.25)


def test_a_field_left_at_its_default_is_left_off_the_wire() -> None:
    assert wire_replies.ExitReply().to_json() == {}
    assert set(SAMPLES["run"].to_json()) == {"types", "outputs"}


@pytest.mark.parametrize(
    ("op", "changes", "match"),
    [
        ("run", {"types": DROP}, r"lacks its field\(s\) \['types'\]"),
        ("run", {"outputs": "/tmp/o.pt"}, "'outputs' must be dict, not str"),
        ("run", {"types": "torch.Tensor"}, "'types' must be list, not str"),
        ("run", {"types": [1]}, r"'types\[\]' must be str, not int"),
        ("run", {"truth": []}, "has no field 'truth'"),
        ("build", {"parameters": {"weight": [4]}}, "'parameters' must be str, not dict"),
        ("probe_flops", {"flops": True}, "'flops' must be int, not bool"),
        ("probe_flops", {"flops": 1.5}, "'flops' must be int, not float"),
        ("probe_observe", {"threads_alive_at_return": DROP}, "threads_alive_at_return"),
        ("time", {"worker_seconds": "0.1"}, "'worker_seconds' must be int or float, not str"),
        ("time", {"ok": 1}, "'ok' must be a bool"),
        ("time", {"ok": DROP}, "'ok' must be a bool"),
        ("exit", {"ok": False}, r"lacks its field\(s\) \['error'\]"),
        ("exit", {"ok": False, "error": "boom"}, "Failed reply's 'error' must be dict, not str"),
        ("run", {"ok": False, "error": {"kind": "runtime_error"}}, "failed 'run' reply has no field"),
    ],
)
def test_a_malformed_reply_is_refused(op: str, changes: dict, match: str) -> None:
    with pytest.raises(wire.WireError, match=match):
        wire_replies.parse(op, _message(SAMPLES[op], **changes))


def test_a_failed_reply_and_the_well_formed_twins_of_the_refused_are_accepted() -> None:
    error = {"kind": "runtime_error", "type": "ValueError", "message": "x", "traceback": ""}
    failed = wire_replies.parse("time", {"ok": False, "id": 5, "error": error, "worker_seconds": 0.1})
    assert failed == wire_replies.Failed(error=error, worker_seconds=0.1)
    flops = wire_replies.parse("probe_flops", _message(SAMPLES["probe_flops"], flops=3))
    assert isinstance(flops, wire_replies.ProbeFlopsReply) and flops.flops == 3
    assert wire_replies.parse("time", _message(SAMPLES["time"], worker_seconds=1)).worker_seconds == 1
    with pytest.raises(wire.WireError, match="must be a JSON object"):
        wire_replies.parse("run", [1, 2])


def test_the_worker_cannot_build_a_malformed_reply() -> None:
    """The worker's side: a handler's reply is checked when it is made, before it is sent."""
    with pytest.raises(wire.WireError, match="'types' must be list"):
        wire_replies.RunReply(types="torch.Tensor", outputs=_OUTPUTS)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        wire_replies.RunReply(types=["torch.Tensor"])  # type: ignore[call-arg]


def test_a_reply_is_read_as_its_requests_kind_only() -> None:
    run = SAMPLES["run"]
    assert wire_replies.RunReply.of(run) is run
    with pytest.raises(wire.WireError, match="a TimeReply was awaited, not a RunReply"):
        wire_replies.TimeReply.of(run)


def test_the_hello_is_parsed_and_checked() -> None:
    hello = {"op": "hello", "pid": 7, "python": "3.11", "torch": "2.5", "cuda_available": False}
    parsed = wire_replies.parse_hello({**hello, "intra_op_threads": 1})
    assert parsed.pid == 7 and parsed.device is None and parsed.to_json()["intra_op_threads"] == 1
    with pytest.raises(wire.WireError, match="intra_op_threads"):
        wire_replies.parse_hello(hello)
    with pytest.raises(wire.WireError, match="'pid' must be int"):
        wire_replies.parse_hello({**hello, "intra_op_threads": 1, "pid": "7"})
    with pytest.raises(wire.WireError, match="must be its hello"):
        wire_replies.parse_hello({"ok": True, "id": 1})


#: Code that rewrites every reply the worker sends that carries output types, dropping them: what a
#: candidate (or a problem) sharing the worker's process can do to the channel.
_DROP_TYPES = """
from kbv import channel as _channel

_send = _channel.send


def _without_types(sock, message, **kwargs):
    if isinstance(message, dict) and "types" in message:
        message = {k: v for k, v in message.items() if k != "types"}
    return _send(sock, message, **kwargs)


_channel.send = _without_types
"""


def _run(worker: Worker) -> wire_replies.Reply:
    return worker.request(
        wire.Run(distribution="original", seed=3, precision="native", out_path=worker.new_path("o"))
    )


def test_a_candidates_malformed_reply_is_its_own_runtime_error(tmp_path: Path) -> None:
    candidate = tmp_path / "drops_types.py"
    candidate.write_text(_DROP_TYPES + "\nimport torch\n\n\nclass ModelNew(torch.nn.ReLU):\n    pass\n")
    honest = tmp_path / "honest.py"
    honest.write_text("import torch\n\n\nclass ModelNew(torch.nn.ReLU):\n    pass\n")
    for path in (candidate, honest):
        spec = WorkerSpec(build_key="test-replies", device="cpu", role="candidate", budget_s=60.0)
        with Worker(spec) as worker:
            load_relu_candidate(worker, path)
            if path is honest:
                assert isinstance(_run(worker), wire_replies.RunReply)
                continue
            with pytest.raises(WorkerFailed) as info:
                _run(worker)
    assert info.value.kind == "runtime_error" and info.value.role == "candidate"
    assert "the worker's reply is malformed" in info.value.message and "'types'" in info.value.message


def test_a_trusted_workers_malformed_reply_is_a_harness_error(tmp_path: Path) -> None:
    problem = tmp_path / "drops_types.py"
    problem.write_text(_DROP_TYPES + "\n" + RELU.read_text())
    spec = WorkerSpec(build_key="test-replies", device="cpu", role="reference", budget_s=60.0)
    with Worker(spec) as worker:
        worker.start()
        worker.request(
            wire.Load(
                role="reference",
                device="cpu",
                problem_source=problem.read_text(),
                sizes={"batch_size": 2, "dim": 8},
                init_seed=1,
            )
        )
        with pytest.raises(wire.WireError, match=r"lacks its field\(s\) \['types'\]"):
            _run(worker)
