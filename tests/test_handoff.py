"""The worker-to-parent hand-over of tensors: descriptors a hostile worker writes are checked."""

from __future__ import annotations

import base64

import pytest
import torch

from kbv import handoff as _handoff
from kbv.handoff import HandoffError, receive


def _descriptor(**changes):
    item = {
        "dtype": "torch.float32",
        "shape": [4, 4],
        "stride": [4, 1],
        "offset": 0,
        "storage": {
            "device": 0,
            "handle": base64.b64encode(b"h" * 64).decode(),
            "size": 64,
            "offset_bytes": 0,
            "ref_handle": base64.b64encode(b"/torch_1_2_3").decode(),
            "ref_offset": 0,
            "event_handle": None,
            "event_sync": False,
        },
    }
    storage = changes.pop("storage", {})
    item.update(changes)
    item["storage"] = {**item["storage"], **storage}
    return item


def test_a_valid_descriptor_passes_the_checks() -> None:
    dtype, shape, stride, offset, _ = _handoff._checked(_descriptor())
    assert (dtype, shape, stride, offset) == (torch.float32, [4, 4], [4, 1], 0)


@pytest.mark.parametrize(
    "changes",
    [
        {"dtype": "torch.qint8"},  # not a dtype the parent accepts
        {"shape": [4, -1]},
        {"shape": [4, 4], "stride": [4]},
        {"offset": -1},
        {"shape": [5, 4]},  # reaches past the 64-byte storage
        {"offset": 1},  # so does a view shifted by one element
        {"storage": {"size": -5}},
        {"storage": {"handle": 7}},
        {"shape": [True, 4]},
    ],
)
def test_descriptors_outside_their_storage_or_malformed_are_refused(changes) -> None:
    with pytest.raises(HandoffError):
        _handoff._checked(_descriptor(**changes))


def _vmm_description(**changes):
    description = {
        "transport": "cuda_vmm",
        "fd_index": 0,
        "size": 2 << 20,
        "items": [{"dtype": "torch.float32", "shape": [4, 4], "offset_bytes": 0}, None],
    }
    description.update(changes)
    return description


def test_a_valid_vmm_description_passes_the_checks() -> None:
    fd, size, items = _handoff._checked_vmm(_vmm_description(), [17])
    assert (fd, size, items) == (17, 2 << 20, [(torch.float32, [4, 4], 0), None])
    # nothing to import: no descriptor needed
    assert _handoff._checked_vmm(_vmm_description(fd_index=None, items=[None]), [])[2] == [None]


@pytest.mark.parametrize(
    ("changes", "fds", "message"),
    [
        ({}, [], "descriptor 0, but 0 came"),  # the reply brought no descriptor
        ({"fd_index": 1}, [17], "descriptor 1"),
        ({"fd_index": True}, [17], "descriptor True"),
        ({"fd_index": -1}, [17], "descriptor -1"),
        ({"size": -1}, [17], "items, size"),
        ({"items": "x"}, [17], "items, size"),
        ({"items": [{"dtype": "torch.qint8", "shape": [4], "offset_bytes": 0}]}, [17], "malformed"),
        ({"items": [{"dtype": "torch.float32", "shape": [4, -4], "offset_bytes": 0}]}, [17], "malformed"),
        ({"items": [{"dtype": "torch.float32", "shape": [4], "offset_bytes": -8}]}, [17], "malformed"),
        ({"items": [{"dtype": "torch.float32", "shape": [4], "offset_bytes": 1.5}]}, [17], "malformed"),
        # one element past the end of the claimed allocation
        (
            {"size": 64, "items": [{"dtype": "torch.float32", "shape": [17], "offset_bytes": 0}]},
            [17],
            "beyond",
        ),
        (
            {"size": 64, "items": [{"dtype": "torch.float64", "shape": [8], "offset_bytes": 8}]},
            [17],
            "beyond",
        ),
    ],
)
def test_vmm_descriptions_outside_their_allocation_or_without_their_descriptor_are_refused(
    changes, fds, message
) -> None:
    with pytest.raises(HandoffError, match=message):
        _handoff._checked_vmm(_vmm_description(**changes), fds)


def test_a_vmm_hand_over_for_a_cpu_evaluation_is_refused() -> None:
    with pytest.raises(HandoffError, match="CPU evaluation"):
        receive(_vmm_description(), "cpu", [17])


def test_the_worker_releases_what_it_exported_and_sends_only_its_descriptors() -> None:
    """``release`` closes every exported allocation (one a candidate broke does not stop the others);
    ``fds_to_send`` lists only exported descriptors, in the order the descriptions number them."""
    from kbv import _vmm

    closed = []

    class _Fake(_vmm.Exported):
        def close(self) -> None:
            if self.closed:
                return
            self.closed = True
            closed.append(self.fd)
            if self.fd == 5:
                raise OSError("closed by the candidate")

    keep = [torch.ones(2), _Fake(fd=5, size=0, ptr=0, handle=0), _Fake(fd=9, size=0, ptr=0, handle=0)]
    assert _handoff.fds_to_send(keep) == [5, 9]
    _handoff.release(keep)
    assert closed == [5, 9] and keep == []


def test_only_torch_refcount_objects_may_be_named() -> None:
    assert _handoff._refcount_name(base64.b64encode(b"/torch_123_456_7").decode()) == b"/torch_123_456_7"
    for name in (b"/etc/passwd", b"/torch_../../x", b"torch_1", b""):
        with pytest.raises(HandoffError):
            _handoff._refcount_name(base64.b64encode(name).decode())


def test_unknown_transports_and_cuda_handles_for_a_cpu_evaluation_are_refused() -> None:
    with pytest.raises(HandoffError, match="transport"):
        receive({"transport": "pickle", "data": "..."}, "cpu")
    with pytest.raises(HandoffError, match="CPU evaluation"):
        receive({"transport": "cuda_ipc", "items": [_descriptor()]}, "cpu")
    with pytest.raises(HandoffError):
        receive(["not", "a", "description"], "cpu")


def test_a_file_hand_over_round_trips_and_is_deleted(tmp_path) -> None:
    path = tmp_path / "out.pt"
    values = [
        _handoff.plain_copy(torch.arange(6.0).reshape(2, 3).t(), torch.device("cpu")),
        None,
        _handoff.plain_copy(2.5, torch.device("cpu")),
    ]
    keep: list = []
    description = _handoff.hand_over(values, torch.device("cpu"), str(path), keep)
    assert description["transport"] == "file" and keep == []
    got = receive(description, "cpu")
    assert torch.equal(got[0], torch.arange(6.0).reshape(2, 3).t()) and got[0].is_contiguous()
    assert got[1] is None and float(got[2]) == 2.5
    assert not path.exists()


def test_a_file_holding_something_other_than_tensors_is_refused(tmp_path) -> None:
    path = tmp_path / "out.pt"
    torch.save({"not": "a list"}, path)
    with pytest.raises(HandoffError, match="not a list of tensors"):
        receive({"transport": "file", "path": str(path)}, "cpu")


def test_a_tensor_subclass_is_handed_over_as_a_plain_tensor() -> None:
    class Lazy(torch.Tensor):
        pass

    value = torch.ones(3).as_subclass(Lazy)
    copy = _handoff.plain_copy(value, torch.device("cpu"))
    assert type(copy) is torch.Tensor and torch.equal(copy, torch.ones(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transport", ["cuda_ipc", "cuda_vmm"])
def test_cuda_hand_over_between_processes_copies_into_parent_memory(transport: str) -> None:
    """A worker shares a CUDA output (an IPC handle, or exported VMM memory whose descriptor comes
    with the reply); the parent's copy is its own and survives the worker. A VMM description that
    claims more than the allocation holds is refused by the driver, not read past its end."""
    from conftest import RELU

    from kbv.worker import Worker, WorkerFailed, WorkerSpec

    with Worker(WorkerSpec(build_key="test-ipc", device="cuda", role="reference", budget_s=120)) as worker:
        worker.start()
        worker.request(
            "load",
            role="reference",
            device="cuda",
            problem_path=str(RELU),
            sizes={"batch_size": 4, "dim": 1024},
            init_seed=1,
            handoff=transport,
        )
        reply = worker.request(
            "run", distribution="signed", seed=3, precision="fp32", out_path=worker.new_path("o")
        )
        assert reply["outputs"]["transport"] == transport
        if transport == "cuda_vmm":
            inflated = {**reply["outputs"], "size": reply["outputs"]["size"] * 4}
            inflated["items"] = [{**inflated["items"][0], "shape": [4, 1024 * 4 * 4]}]
            with pytest.raises(WorkerFailed, match="could not be opened"):
                worker.receive_outputs(inflated)
        (y,) = worker.receive_outputs(reply["outputs"])
        again = worker.receive_outputs(
            worker.request(
                "run", distribution="signed", seed=3, precision="fp32", out_path=worker.new_path("o")
            )["outputs"]
        )[0]
    assert y.is_cuda and y.shape == (4, 1024) and bool((y >= 0).all())
    assert torch.equal(y, again)  # still readable after the worker is gone: the parent owns the copy
