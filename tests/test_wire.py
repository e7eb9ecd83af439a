"""The worker channel's wire format (kbv.wire): requests with ids, refused when malformed, on both sides."""

from __future__ import annotations

import pytest
from conftest import RELU

from kbv import channel, wire
from kbv.worker import Worker, WorkerSpec

#: One request of each kind, with fields as the parent sends them.
SAMPLES = {
    "exit": {},
    "load": {"role": "reference", "device": "cpu", "problem_source": "...", "sizes": {}, "init_seed": 1},
    "build": {"init_seed": 7, "state_path": "/tmp/state.pt"},
    "redraw": {"distribution": "original", "seed": 3, "out_path": "/tmp/x", "hand_over": True},
    "inbox": {"nbytes": 4096},
    "run": {"distribution": "original", "seed": 3, "precision": "native", "out_path": "/tmp/y"},
    "expected": {"distribution": "original", "seed": 3, "out_path": "/tmp/z", "room_bytes": 0},
    "time": {"distribution": "original", "seeds": [1, 2], "precision": "native", "settings": {}},
    "truth_sketches": {"distribution": "original", "seeds": [1], "sketch": {"k": 8}},
    "identities": {},
    "probe_observe": {"inputs": {"distribution": "original", "seed": 1}},
    "probe_cache": {"distribution": "original", "seed_a": 1, "seed_b": 2, "out_path": "/tmp/c"},
    "probe_poison": {"inputs": {"seed": 1}, "out_path": "/tmp/p", "output_nbytes": [16]},
    "probe_flops": {"inputs": {"seed": 1}},
    "probe_kernels": {"inputs": {"seed": 1}},
    "probe_calls": {"inputs": {"seed": 1}},
}


def test_every_op_the_worker_answers_is_on_the_wire_and_no_other() -> None:
    from kbv.child import main as child_main

    child_main._register_probes()  # what a worker does when it starts
    assert set(child_main._HANDLERS) | {"exit"} == wire.OPS
    assert set(SAMPLES) == wire.OPS


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_each_request_kind_survives_the_round_trip(op: str) -> None:
    request = wire.Request(op, 5, SAMPLES[op])
    message = request.to_json()
    assert message["op"] == op and message["id"] == 5
    fields = {k: v for k, v in message.items() if k not in ("op", "id")}
    assert fields == SAMPLES[op]  # at the top level, the names the handlers read
    assert wire.Request.from_json(message) == request


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
    ],
)
def test_a_malformed_request_is_refused_with_what_is_wrong(message: dict, says: str) -> None:
    with pytest.raises(wire.WireError, match=says):
        wire.Request.from_json(message)


@pytest.mark.parametrize(
    ("op", "fields", "says"),
    [
        ("run", {"seed": 1, "answer": 42}, "'run' request has no field 'answer'"),
        ("inbox", {"nbytes": "4096"}, "'nbytes' must be int, not str"),
        ("inbox", {"nbytes": True}, "'nbytes' must be int, not bool"),
        ("build", {"init_seed": 1, "state_inbox": {"w": 1}}, "'state_inbox' must be list or null"),
        ("expected", {"room_bytes": 1.5}, "'room_bytes' must be int or null, not float"),
    ],
)
def test_a_field_its_op_does_not_take_or_of_another_type_is_refused(op: str, fields: dict, says: str) -> None:
    with pytest.raises(wire.WireError, match=says):
        wire.Request(op, 1, fields)
    with pytest.raises(wire.WireError, match=says):  # and so it is where the worker parses it
        wire.Request.from_json({"op": op, "id": 1, **fields})


def test_what_the_parent_sends_is_checked_as_the_worker_reads_it() -> None:
    """A tuple goes on the wire as a list and a NumPy scalar as a number: both are accepted."""
    import numpy as np

    fields = wire.plain({"distribution": "original", "seeds": (1, 2), "sketch": {"seed": np.int64(3)}})
    assert wire.Request("truth_sketches", 1, fields).fields == {
        "distribution": "original",
        "seeds": [1, 2],
        "sketch": {"seed": 3},
    }


def test_fields_may_not_shadow_the_envelope() -> None:
    with pytest.raises(wire.WireError, match="envelope's 'id'"):
        wire.Request("run", 1, {"id": 2})
    with pytest.raises(wire.WireError, match="must be a mapping"):
        wire.Request("run", 1, [("seed", 2)])  # type: ignore[arg-type]
    assert wire.Request("run", 1, {"seed": 2}).fields == {"seed": 2}  # the accepted twin


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
    worker.request("load", role="reference", device="cpu", problem_source=source, sizes={}, init_seed=1)
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
        reply = worker.request("build", init_seed=2)  # the worker still answers well-formed requests
        assert reply["ok"] and reply["id"] == worker._last_id


def test_a_reply_read_for_another_request_is_a_harness_error() -> None:
    with _reference() as worker:
        worker.send_request("build", init_seed=2)
        worker._awaited[0] += 1  # as if the reply of an earlier request had been left unread
        with pytest.raises(wire.WireError, match="out of order"):
            worker.receive_reply()
