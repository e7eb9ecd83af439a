"""The worker channel's wire format (kbv.wire): requests with ids, refused when malformed, on both sides."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import RELU

from kbv import channel, wire, wire_replies
from kbv.worker import Worker, WorkerSpec

#: One request of each kind, as the parent builds it.
SAMPLES: dict[str, wire.Request] = {
    "exit": wire.Exit(),
    "release": wire.Release(),
    "load": wire.Load(role="reference", device="cpu", problem_source="...", sizes={}, init_seed=1),
    "build": wire.Build(init_seed=7, state_path="/tmp/state.pt"),
    "redraw": wire.Redraw(distribution="original", seed=3, out_path="/tmp/x", hand_over=True),
    "inbox": wire.Inbox(nbytes=4096),
    "run": wire.Run(distribution="original", seed=3, precision="native", out_path="/tmp/y"),
    "expected": wire.Expected(
        distribution="original",
        seed=3,
        out_path="/tmp/z",
        precision="tf32",
        memory=wire.MemoryRule(cached_bytes_kept=8 << 30, room_bytes=0),
    ),
    "time": wire.Time(distribution="original", seeds=[1, 2], precision="native", settings={}),
    "truth_sketches": wire.TruthSketches(distribution="original", seeds=[1], sketch={"k": 8}),
    "identities": wire.Identities(),
    "probe_observe": wire.ProbeObserve(inputs={"distribution": "original", "seed": 1}),
    "probe_observe_late": wire.ProbeObserveLate(out_path="/tmp/l"),
    "probe_cache": wire.ProbeCache(distribution="original", seed_a=1, seed_b=2, out_path="/tmp/c"),
    "probe_poison": wire.ProbePoison(inputs={"seed": 1}, out_path="/tmp/p", output_nbytes=[16]),
    "probe_flops": wire.ProbeFlops(inputs={"seed": 1}),
    "probe_kernels": wire.ProbeKernels(inputs={"seed": 1}),
    "probe_calls": wire.ProbeCalls(inputs={"seed": 1}),
}


def test_every_op_the_worker_answers_is_on_the_wire_and_no_other() -> None:
    from kbv.child import main as child_main

    child_main._register_probes()  # what a worker does when it starts
    assert set(child_main._HANDLERS) | {"exit"} == wire.OPS
    assert set(SAMPLES) == wire.OPS
    assert all(SAMPLES[op].op == op and type(SAMPLES[op]) is wire.KINDS[op] for op in SAMPLES)


def test_the_field_table_is_read_from_the_dataclasses() -> None:
    """One source of truth: each kind's fields and their JSON types come from its annotations."""
    assert set(wire.FIELDS["inbox"]) == {"nbytes", "memory", "steps"}
    assert wire.FIELDS["inbox"]["nbytes"] == (int,)
    assert wire.FIELDS["build"]["state_inbox"] == (list, type(None))
    assert wire.FIELDS["probe_observe"]["delay_s"] == (int, float)


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_each_request_kind_survives_the_round_trip(op: str) -> None:
    envelope = wire.Envelope(5, SAMPLES[op])
    message = json.loads(json.dumps(envelope.to_json()))  # as the channel carries it
    assert message["op"] == op and message["id"] == 5
    fields = {k: v for k, v in message.items() if k not in ("op", "id")}
    assert set(fields) == set(wire.FIELDS[op])  # at the top level, every field of the kind
    assert wire.Envelope.from_json(message) == envelope


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ({"op": "launch_missiles", "id": 1}, "unknown request op 'launch_missiles'"),
        ({"op": 3, "id": 1}, "op must be a string"),
        ({"id": 1}, "op must be a string"),
        ({"op": "run"}, "id must be a positive integer"),
        ({"op": "run", "id": "1"}, "id must be a positive integer"),
        ({"op": "run", "id": True}, "id must be a positive integer"),
        ({"op": "run", "id": 0}, "id must be a positive integer"),
        ({"op": "run", "id": 1, "seed": 1}, r"lacks its field\(s\) \['distribution', 'out_path'\]"),
    ],
)
def test_a_malformed_request_is_refused_with_what_is_wrong(message: dict, says: str) -> None:
    with pytest.raises(wire.WireError, match=says):
        wire.Envelope.from_json(message)


_RUN = {"distribution": "original", "seed": 1, "out_path": "/tmp/r"}


@pytest.mark.parametrize(
    ("op", "fields", "says"),
    [
        ("run", {**_RUN, "answer": 42}, "'run' request has no field 'answer'"),
        ("inbox", {"nbytes": "4096"}, "'nbytes' must be int, not str"),
        ("inbox", {"nbytes": True}, "'nbytes' must be int, not bool"),
        ("build", {"init_seed": 1, "state_inbox": {"w": 1}}, "'state_inbox' must be list or null"),
        ("run", {**_RUN, "memory": {"cached_bytes_kept": 1.5}}, "'cached_bytes_kept' must be int, not float"),
        ("run", {**_RUN, "memory": {"cached_bytes_kept": 1, "spare": 2}}, "memory rule has no field 'spare'"),
        ("run", {**_RUN, "memory": 7}, "'memory' must be MemoryRule or null, not int"),
    ],
)
def test_a_field_its_op_does_not_take_or_of_another_type_is_refused(op: str, fields: dict, says: str) -> None:
    with pytest.raises(wire.WireError, match=says):
        wire.request(op, **fields)
    with pytest.raises(wire.WireError, match=says):  # and so it is where the worker parses it
        wire.Envelope.from_json({"op": op, "id": 1, **fields})
    if set(fields) <= set(wire.FIELDS[op]) and "memory" not in fields:  # and as the parent builds it
        with pytest.raises(wire.WireError, match=says.split(" request")[-1].strip()):
            wire.KINDS[op](**fields)


def test_an_accepted_twin_of_each_refused_request() -> None:
    assert wire.request("run", **_RUN, memory={"cached_bytes_kept": 1, "room_bytes": None}).memory == (
        wire.MemoryRule(cached_bytes_kept=1)
    )
    assert wire.request("inbox", nbytes=4096) == wire.Inbox(nbytes=4096)
    assert wire.Build(init_seed=1, state_inbox=[{"w": 1}]).state_inbox == [{"w": 1}]


def test_what_the_parent_sends_is_checked_as_the_worker_reads_it() -> None:
    """A tuple goes on the wire as a list and a NumPy scalar as a number: both are accepted."""
    import numpy as np

    request = wire.TruthSketches(distribution="original", seeds=(1, 2), sketch={"seed": np.int64(3)})  # type: ignore[arg-type]
    assert request.seeds == [1, 2] and request.sketch == {"seed": 3}


def test_fields_may_not_shadow_the_envelope() -> None:
    with pytest.raises(wire.WireError, match="envelope's 'id'"):
        wire.request("run", **_RUN, id=2)
    with pytest.raises(wire.WireError, match="holds a request"):
        wire.Envelope(1, {"seed": 2})  # type: ignore[arg-type]
    assert wire.Envelope(1, wire.Run(**_RUN)).request.seed == 1  # the accepted twin


def test_a_reply_is_accepted_only_for_the_request_it_answers() -> None:
    wire.check_reply({"ok": True, "id": 4}, 4)
    wire.check_reply({"ok": False, "id": 4, "error": {"kind": "runtime_error"}}, 4)  # the candidate's failure
    for reply in ({"ok": True, "id": 3}, {"ok": True}, {"ok": True, "id": True}):
        with pytest.raises(wire.WireError, match="out of order"):
            wire.check_reply(reply, 4 if reply.get("id") is not True else 1)
    with pytest.raises(wire.WireError, match="refused request 4"):
        wire.check_reply({"ok": False, "id": 4, "error": {"kind": wire.MALFORMED, "message": "?"}}, 4)


def _reference() -> Worker:
    worker = Worker(WorkerSpec(build_key="test-wire", device="cpu", role="reference", budget_s=60.0))
    worker.start()
    source = RELU.read_text()
    worker.request(wire.Load(role="reference", device="cpu", problem_source=source, sizes={}, init_seed=1))
    return worker


def test_a_worker_refuses_a_malformed_request_and_echoes_the_id_of_a_good_one() -> None:
    with _reference() as worker:
        assert worker._sock is not None
        channel.send(worker._sock, {"op": "build", "init_seed": 1})  # no id: nothing of it runs
        refusal = channel.receive(worker._sock, deadline=None, alive=worker.alive)
        assert refusal["ok"] is False and refusal["error"]["kind"] == wire.MALFORMED
        assert "id must be a positive integer" in refusal["error"]["message"]
        channel.send(worker._sock, {"op": "no_such_op", "id": 99})
        refusal = channel.receive(worker._sock, deadline=None, alive=worker.alive)
        assert refusal["id"] == 99 and "unknown request op" in refusal["error"]["message"]
        # the worker still answers well-formed requests, with their ids (Worker.receive_reply checks them)
        assert isinstance(worker.request(wire.Build(init_seed=2)), wire_replies.BuildReply)


def test_a_reply_read_for_another_request_is_a_harness_error() -> None:
    with _reference() as worker:
        worker.send_request(wire.Build(init_seed=2))
        worker._awaited[0] += 1  # as if the reply of an earlier request had been left unread
        with pytest.raises(wire.WireError, match="out of order"):
            worker.receive_reply()


def test_a_deferred_reply_is_read_by_its_request_id() -> None:
    """Replies come in order; the reply of a request sent earlier is kept for its own id while a
    later one's is awaited, and read from there: no flag says that one is pending."""
    with _reference() as worker:
        build = worker.send_request(wire.Build(init_seed=3))
        identities = worker.send_request(wire.Identities())
        # the build's reply read first, kept; each parsed into its own request's reply kind
        assert isinstance(worker.receive_reply(identities), wire_replies.IdentitiesReply)
        assert isinstance(worker.receive_reply(build), wire_replies.BuildReply)
        with pytest.raises(wire.WireError, match="no request sent"):
            worker.receive_reply(build)  # read once


def test_each_request_carries_the_parents_memory_rule() -> None:
    """The worker's budget decides the rule; a reference may keep more beside its candidate's room."""
    from kbv.worker import CACHED_BYTES_KEPT, DEFAULT_ROOM_BYTES, MemoryBudget

    budget = MemoryBudget()
    assert budget.rule("candidate") == wire.MemoryRule(cached_bytes_kept=CACHED_BYTES_KEPT)
    assert budget.rule("reference").room_bytes == DEFAULT_ROOM_BYTES
    budget.room_bytes = 0
    assert budget.rule("reference") == wire.MemoryRule(cached_bytes_kept=CACHED_BYTES_KEPT, room_bytes=0)
    with _reference() as worker:
        sent: list[dict] = []
        original = channel.send
        try:
            channel.send = lambda sock, message, **kw: sent.append(message) or original(sock, message, **kw)  # type: ignore[assignment]
            worker.budget = budget
            worker.request(wire.Build(init_seed=4))
        finally:
            channel.send = original  # type: ignore[assignment]
        assert sent[-1]["memory"] == {"cached_bytes_kept": CACHED_BYTES_KEPT, "room_bytes": 0}


def _memory_files(pid: int) -> int:
    """How many anonymous memory files (a hand-over on the CPU) process ``pid`` holds open."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("/memfd:"))


@pytest.mark.skipif(not channel.memfd_available(), reason="needs memory files (memfd_create)")
def test_a_release_lets_go_of_the_hand_over_and_runs_nothing() -> None:
    """What the worker handed over stays open until its next request; a ``release`` is such a
    request, and changes nothing else (the model answers as before)."""
    with _reference() as worker:
        pid = worker.members()[0]
        run = wire.Run(distribution="original", seed=3, precision="fp32", out_path=worker.new_path("out"))
        first = worker.receive_outputs(wire_replies.RunReply.of(worker.request(run)).outputs)
        assert _memory_files(pid) >= 1, "the hand-over was not a memory file"
        assert isinstance(worker.request(wire.Release()), wire_replies.ReleaseReply)
        assert _memory_files(pid) == 0
        again = worker.receive_outputs(wire_replies.RunReply.of(worker.request(run)).outputs)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
