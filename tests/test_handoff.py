"""The worker-to-parent hand-over of tensors: descriptors a hostile worker writes are checked."""

from __future__ import annotations

import base64
import os

import pytest
import torch

from kbv import handoff as _handoff
from kbv import wire
from kbv._staged_handoff import Staged
from kbv.channel import memfd_available
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


def _staged_vmm(items, allocations=None):
    return {
        "transport": "cuda_vmm",
        "allocations": [{"fd_index": 0, "size": 64}, {"fd_index": 1, "size": 64}]
        if allocations is None
        else allocations,
        "items": items,
    }


def _item(allocation, offset=0, shape=(4,)):
    return {"dtype": "torch.float32", "shape": list(shape), "offset_bytes": offset, "allocation": allocation}


def test_a_staged_vmm_hand_over_reads_each_item_from_the_allocation_it_names(monkeypatch) -> None:
    """Several calls' outputs, each call's in an exported allocation of its own (``Staged``): every
    item is copied from the allocation it names, through that allocation's descriptor, and items
    come back in their order, None kept in place."""
    from kbv import _vmm

    imported: list[tuple[int, int, list]] = []

    def import_copies(fd, size, items, device):
        imported.append((fd, size, [offset for _, _, offset in items]))
        return [torch.full(shape, float(fd * 100 + offset)) for _, shape, offset in items]

    monkeypatch.setattr(_vmm, "import_copies", import_copies)
    description = _staged_vmm([_item(0), None, _item(1), _item(0, offset=16)])
    got = _handoff._from_vmm(description, [7, 9], 0)
    assert imported == [(7, 64, [0, 16]), (9, 64, [0])]
    assert [None if g is None else float(g[0]) for g in got] == [700.0, None, 900.0, 716.0]


def test_the_parents_own_shortage_copying_a_hand_over_is_not_the_workers_failure(
    monkeypatch, tmp_path
) -> None:
    """torch's out-of-memory error is a ``RuntimeError``: raised while the parent copies a hand-over
    it passes through as itself, for the caller to weigh, where any other error reading the
    worker's memory is the worker's (``HandoffError``)."""
    from kbv import _vmm

    for error, expected in (
        (torch.OutOfMemoryError("CUDA out of memory"), torch.OutOfMemoryError),
        (RuntimeError("invalid handle"), HandoffError),
    ):
        monkeypatch.setattr(_vmm, "import_copies", lambda *args, e=error: (_ for _ in ()).throw(e))
        with pytest.raises(expected):
            _handoff._from_vmm(_staged_vmm([_item(0)]), [7, 9], 0)
        monkeypatch.setattr(torch, "load", lambda *args, e=error, **kwargs: (_ for _ in ()).throw(e))
        (tmp_path / "out.pt").write_bytes(b"")
        with pytest.raises(expected):
            receive({"transport": "file", "path": str(tmp_path / "out.pt")}, "cpu")


def test_the_elements_a_hand_over_claims_are_read_from_its_items_malformed_ones_counting_none() -> None:
    items = [_item(0, shape=(4, 3)), None, {"shape": [-1, 2]}, {"shape": "x"}, "junk", _item(1, shape=(5,))]
    assert _handoff.claimed_elements({"transport": "cuda_vmm", "items": items}) == 17
    assert _handoff.claimed_elements({"items": "x"}) == 0 and _handoff.claimed_elements(None) == 0


@pytest.mark.parametrize(
    ("description", "fds", "message"),
    [
        (_staged_vmm([_item(2)]), [7, 9], "names no allocation"),  # past the allocations
        (
            _staged_vmm([{"dtype": "torch.float32", "shape": [4], "offset_bytes": 0}]),
            [7, 9],
            "names no allocation",
        ),
        (_staged_vmm([_item(True)]), [7, 9], "names no allocation"),
        (_staged_vmm([_item(0)], allocations="x"), [7, 9], "allocations, items"),
        (_staged_vmm([_item(0)], allocations=[5]), [7, 9], "allocations, items"),
        (_staged_vmm([_item(1, shape=(17,))]), [7, 9], "beyond"),  # each allocation's own bounds
        (_staged_vmm([_item(1)]), [7], "descriptor 1, but 1 came"),
    ],
)
def test_a_staged_vmm_hand_over_that_names_what_is_not_there_is_refused(description, fds, message) -> None:
    with pytest.raises(HandoffError, match=message):
        _handoff._from_vmm(description, fds, 0)


def test_staged_outputs_off_the_gpu_are_copied_when_each_call_returns(tmp_path) -> None:
    """Off a GPU's exported memory, ``Staged`` keeps a plain copy of each call's outputs and hands all
    over at the end: what a call's output becomes after the call returned is not what is handed."""
    cpu = torch.device("cpu")
    keep: list = []
    staged = Staged(cpu, str(tmp_path / "out.pt"), keep, "file")
    first = torch.ones(3)
    staged.add([first])
    first.fill_(5.0)  # a candidate that rewrites its last output later
    staged.add([torch.zeros(2), None])
    handed = staged.handed()
    assert handed["sizes"] == [1, 2]
    got = receive(handed["outputs"], "cpu")
    assert torch.equal(got[0], torch.ones(3)) and torch.equal(got[1], torch.zeros(2)) and got[2] is None


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


@pytest.mark.skipif(not memfd_available(), reason="no memory files on this system")
def test_a_memory_file_hand_over_round_trips_without_a_path_and_closes_on_release(tmp_path) -> None:
    """A trusted CPU worker's hand-over: every tensor's bytes in an anonymous memory file whose
    descriptor goes beside the reply, each at an aligned offset; nothing is written at ``path``,
    and the worker closes its descriptor on release. Every dtype a worker may hand over survives."""
    cpu = torch.device("cpu")
    values = [
        torch.tensor([True, False, True]),
        torch.arange(6.0).reshape(2, 3).t(),
        None,
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.randn(3, dtype=torch.complex64),
        torch.randn(4).bfloat16(),
        torch.arange(5, dtype=torch.int64),
    ]
    keep: list = []
    path = tmp_path / "out.pt"
    copies = [None if v is None else _handoff.plain_copy(v, cpu) for v in values]
    description = _handoff.hand_over(copies, cpu, str(path), keep, transport="memfd")
    assert description["transport"] == "memfd" and description["fd_index"] == 0
    assert all(item is None or item["offset_bytes"] % 16 == 0 for item in description["items"])
    fds = _handoff.fds_to_send(keep)
    assert len(fds) == 1 and not path.exists()
    assert os.readlink(f"/proc/self/fd/{fds[0]}").startswith("/memfd:kbv-handover")
    received = [os.dup(fds[0])]  # what the parent gets: its own descriptor of the same file
    try:
        got = receive(description, "cpu", received)
    finally:
        os.close(received[0])
    for sent, back in zip(values, got, strict=True):
        assert (sent is None and back is None) or (back.dtype == sent.dtype and torch.equal(back, sent))
    _handoff.release(keep)
    assert keep == []
    with pytest.raises(OSError):
        os.fstat(fds[0])


@pytest.mark.skipif(not memfd_available(), reason="no memory files on this system")
def test_a_memory_file_is_read_whole_when_one_read_returns_part_of_it(monkeypatch) -> None:
    """Linux returns at most about 2 GiB from one read: the parent reads on until the file's bytes
    are all there (a 2.1 GB hand-over came back short before, measured outside the suite)."""
    cpu = torch.device("cpu")
    keep: list = []
    values = [torch.arange(1000.0)]
    description = _handoff.hand_over(values, cpu, "/unused", keep, transport="memfd")
    preadv, reads = os.preadv, []

    def at_most_1000_bytes(fd: int, buffers: list, offset: int) -> int:
        reads.append(offset)
        return preadv(fd, [buffers[0][:1000]], offset)

    monkeypatch.setattr(os, "preadv", at_most_1000_bytes)
    received = [os.dup(_handoff.fds_to_send(keep)[0])]
    try:
        (got,) = receive(description, "cpu", received)
    finally:
        os.close(received[0])
        _handoff.release(keep)
    assert torch.equal(got, values[0])
    assert reads == [0, 1000, 2000, 3000]  # 4,000 bytes, 1,000 a read


@pytest.mark.skipif(not memfd_available(), reason="no memory files on this system")
def test_a_memory_file_hand_over_that_lies_about_its_bytes_is_refused() -> None:
    good = {"dtype": "torch.float32", "shape": [4], "offset_bytes": 16}

    name = "kbv-handover-test"

    def described(item: dict | None = None, **changes: object) -> dict:
        fields = {"transport": "memfd", "fd_index": 0, "name": name, "size": 64, "items": [item or good]}
        return {**fields, **changes}

    fd = os.memfd_create(name)
    try:
        os.write(fd, bytes(64))
        assert torch.equal(receive(described(), "cpu", [fd])[0], torch.zeros(4))  # accept
        refused = [
            (described(fd_index=1), "no descriptor"),
            (described(fd_index=True), "no descriptor"),
            (described(size=65), "holds 64 of the 65"),
            (described({**good, "shape": [13]}), "outside the file"),
            (described({**good, "offset_bytes": 4}), "off alignment"),
            (described({**good, "dtype": "torch.object"}), "malformed memory-file item"),
            (described(items=None), "malformed memory-file hand-over"),
            (described(name="kbv-handover-another"), "not the memory file"),  # another reply's
        ]
        for description, message in refused:
            with pytest.raises(HandoffError, match=message):
                receive(description, "cpu", [fd])
    finally:
        os.close(fd)


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
            wire.Load(
                role="reference",
                device="cuda",
                problem_source=RELU.read_text(),
                sizes={"batch_size": 4, "dim": 1024},
                init_seed=1,
                handoff=transport,
            )
        )
        reply = worker.request(
            wire.Run(distribution="signed", seed=3, precision="fp32", out_path=worker.new_path("o"))
        )
        assert reply.outputs["transport"] == transport
        if transport == "cuda_vmm":
            inflated = {**reply.outputs, "size": reply.outputs["size"] * 4}
            inflated["items"] = [{**inflated["items"][0], "shape": [4, 1024 * 4 * 4]}]
            with pytest.raises(WorkerFailed, match="could not be opened"):
                worker.receive_outputs(inflated)
        (y,) = worker.receive_outputs(reply.outputs)
        again = worker.receive_outputs(
            worker.request(
                wire.Run(distribution="signed", seed=3, precision="fp32", out_path=worker.new_path("o"))
            ).outputs
        )[0]
    assert y.is_cuda and y.shape == (4, 1024) and bool((y >= 0).all())
    assert torch.equal(y, again)  # still readable after the worker is gone: the parent owns the copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_exports_each_calls_outputs_at_once_and_keeps_no_other_copy() -> None:
    """On a GPU with exported memory, each call's outputs go into an allocation of their own as the
    call returns: once the call's own tensors are gone, the caching allocator holds nothing of them
    (four 64 MiB outputs, the cache probe's calls), and the parent reads every one back, each from
    its allocation, values as they were when their call returned."""
    device = torch.device("cuda", torch.cuda.current_device())
    keep: list = []
    staged = Staged(device, "/unused", keep, "cuda_vmm")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for k in range(4):
        output = torch.full((16 << 20,), float(k), device=device)  # 64 MiB
        staged.add([output, None])
        output.fill_(-1.0)  # rewritten after its call returned: not what was handed over
        del output
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before, k
    handed = staged.handed()
    assert handed["sizes"] == [2, 2, 2, 2] and len(handed["outputs"]["allocations"]) == 4
    got = receive(handed["outputs"], f"cuda:{device.index}", _handoff.fds_to_send(keep))
    assert [g is None for g in got] == [False, True] * 4
    assert [float(g.min()) for g in got if g is not None] == [0.0, 1.0, 2.0, 3.0]
    assert [float(g.max()) for g in got if g is not None] == [0.0, 1.0, 2.0, 3.0]
    _handoff.release(keep)
    assert keep == []


# ------------------------------------------------------------------------------------------------
# the parent writing a model's parameters into a worker's own inbox


def _named() -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor([1.5, -2.0], dtype=torch.float64),
        "steps": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 5),
    }


def test_an_inbox_layout_aligns_every_tensor_and_its_views_read_them_back() -> None:
    """What the parent writes at ``inbox_layout``'s offsets, ``inbox_tensors`` reads back by name with
    its dtype and shape (a CPU byte buffer stands in for the worker's device allocation)."""
    from kbv import _vmm

    named = _named()
    items, needed = _handoff.inbox_layout(named)
    assert [i["name"] for i in items] == list(named)
    assert all(i["offset_bytes"] % _vmm.ALIGN == 0 for i in items)
    assert needed >= max(
        i["offset_bytes"] + named[i["name"]].numel() * named[i["name"]].element_size() for i in items
    )
    inbox = torch.zeros(needed, dtype=torch.uint8)
    for item in items:
        raw = named[item["name"]].reshape(-1).view(torch.uint8)
        inbox[item["offset_bytes"] : item["offset_bytes"] + raw.numel()] = raw
    views = _handoff.inbox_tensors([inbox], items, torch.device("cpu"))
    assert set(views) == set(named)
    for name, value in named.items():
        assert views[name].dtype == value.dtype and torch.equal(views[name], value), name


def test_an_inbox_is_only_read_when_one_was_opened() -> None:
    items, _ = _handoff.inbox_layout(_named())
    with pytest.raises(ValueError, match="no inbox"):
        _handoff.inbox_tensors([], items, torch.device("cpu"))


def test_a_cpu_worker_opens_no_inbox() -> None:
    with pytest.raises(ValueError, match="CUDA workers only"):
        _handoff.open_inbox(64, torch.device("cpu"), "cuda_ipc", [])


def _inbox_ipc(nbytes: int, **changes):
    return {
        "transport": "cuda_ipc",
        "items": [
            _descriptor(dtype="torch.uint8", shape=[nbytes], stride=[1], storage={"size": nbytes}, **changes)
        ],
    }


@pytest.mark.parametrize(
    ("description", "fds", "message"),
    [
        (None, [], "not described"),
        ({"transport": "file", "path": "/tmp/x"}, [], "malformed inbox"),
        ({"transport": "cuda_ipc", "items": []}, [], "malformed inbox"),
        ("small_ipc", [], "cannot hold"),
        ("float_ipc", [], "cannot hold"),
        ({"transport": "cuda_vmm", "fd_index": 0, "size": 64}, [17], "beyond"),
        ({"transport": "cuda_vmm", "fd_index": 1, "size": 1 << 20}, [17], "descriptor"),
    ],
)
def test_an_inbox_that_cannot_hold_the_parameters_is_refused_before_anything_is_written(
    description, fds, message
) -> None:
    """A worker's inbox description is checked first: too small, of another dtype, malformed, or
    naming a descriptor that did not come with the reply: nothing is opened, nothing written."""
    named = _named()
    items, needed = _handoff.inbox_layout(named)
    if description == "small_ipc":
        description = _inbox_ipc(needed - 1)
    elif description == "float_ipc":
        description = {"transport": "cuda_ipc", "items": [_descriptor()]}
    with pytest.raises(HandoffError, match=message):
        _handoff.fill_inbox(description, fds, named, items, "cuda:0")


def test_an_inbox_for_a_cpu_evaluation_is_refused() -> None:
    named = _named()
    items, needed = _handoff.inbox_layout(named)
    with pytest.raises(HandoffError, match="not on CUDA"):
        _handoff.fill_inbox(_inbox_ipc(needed), [], named, items, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transport", ["cuda_ipc", "cuda_vmm"])
def test_redrawn_parameters_reach_a_candidate_worker_through_an_inbox_of_its_own(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU the reference hands its redrawn parameters to the parent, the candidate opens an
    empty inbox and the parent writes them there: the candidate's model then computes what the
    reference's does, and not what its own seeded initialisation did. An inbox too small for them
    is the worker's failure, found before anything is written."""
    from conftest import SUITE

    from kbv.worker import Worker, WorkerFailed, WorkerSpec

    problem = SUITE / "level2" / "3_Matmul_Scale_Residual.py"
    common = {"device": "cuda", "problem_source": problem.read_text(), "init_seed": 1, "handoff": transport}
    if transport == "cuda_ipc":  # where the candidate keeps the parent's uid (the IPC inbox, bounded)
        monkeypatch.setenv("KBV_WORKER_USER", "off")

    def run(worker: Worker, precision: str) -> torch.Tensor:
        reply = worker.request(
            wire.Run(distribution="signed", seed=3, precision=precision, out_path=worker.new_path("o"))
        )
        return worker.receive_outputs(reply.outputs)[0]

    spec = {"device": "cuda", "budget_s": 300}
    with (
        Worker(WorkerSpec(build_key="test-inbox-r", role="reference", **spec)) as reference,
        Worker(WorkerSpec(build_key="test-inbox-c", role="candidate", **spec)) as subject,
    ):
        reference.start()
        subject.start()
        if subject.uid is not None and transport == "cuda_ipc":
            pytest.skip("a candidate under a uid of its own hands over exported VMM memory only")
        # in its scratch: a candidate under a uid of its own cannot enter pytest's root-only tmp_path
        candidate = subject.scratch / "reference_as_candidate.py"
        candidate.write_text(problem.read_text().replace("class Model(", "class ModelNew("))
        candidate.chmod(0o644)
        reference.request(wire.Load(role="reference", **common))
        subject.request(wire.Load(role="candidate", candidate_path=str(candidate), **common))
        seeded = run(subject, "native")
        reply = reference.request(
            wire.Redraw(distribution="signed", seed=5, out_path=reference.new_path("p"), hand_over=True)
        )
        named = dict(zip(reply.names, reference.receive_outputs(reply.outputs), strict=True))
        items, needed = _handoff.inbox_layout(named)
        small = subject.request(wire.Inbox(nbytes=needed // 2)).inbox
        if transport == "cuda_ipc":  # a VMM inbox is rounded up to the driver's granularity
            with pytest.raises(WorkerFailed, match="cannot hold"):
                subject.fill_inbox(small, named, items)
        opened = subject.request(wire.Inbox(nbytes=needed)).inbox
        assert opened["transport"] == transport
        subject.fill_inbox(opened, named, items)
        assert subject.request(wire.Build(init_seed=1, state_inbox=items)).parameters == "state_dict"
        loaded = run(subject, "native")
        expected = run(reference, "native")
    assert torch.equal(loaded, expected)
    assert not torch.allclose(seeded, expected)


# ------------------------------------------------------------------------------------------------
# a worker's IPC storage bounded by the allocation the driver opened


@pytest.mark.parametrize(
    ("driver_range", "offset", "nbytes", "message"),
    [
        ((1000, 4096), 0, 4096, None),
        ((1000, 4096), 96, 4000, None),
        ((1000, 4096), 96, 4001, "reaches past its allocation"),
        ((1000, 4096), 0, 1 << 30, "reaches past its allocation"),
        ((512, 1 << 20), 0, 64, "reaches past its allocation"),  # the mapping is inside another allocation
        (None, 0, 64, "could not be bounded"),
    ],
)
def test_a_claimed_storage_must_lie_inside_the_allocation_the_driver_opened(
    monkeypatch: pytest.MonkeyPatch, driver_range, offset, nbytes, message
) -> None:
    """The storage a worker's IPC descriptor claims (offset and size) is held against what the
    driver says the allocation at the mapping's start is; a driver that cannot say refuses it."""
    from kbv import _vmm

    def address_range(ptr: int) -> tuple[int, int]:
        if driver_range is None:
            raise _vmm.VmmError("address range returned CUresult 1")
        return driver_range

    monkeypatch.setattr(_vmm, "address_range", address_range)
    if message is None:
        _handoff.inside_allocation(1000, offset, nbytes)
    else:
        with pytest.raises(HandoffError, match=message):
            _handoff.inside_allocation(1000, offset, nbytes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_candidate_ipc_descriptor_claiming_more_than_its_allocation_is_refused_before_any_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A candidate worker of the parent's own uid hands its outputs over by IPC. A descriptor whose
    storage claims 256 MiB past a small output (beyond the allocator's block) is refused before the
    parent reads anything; the honest descriptor of the same reply is read."""
    from conftest import FOUNDATION, RELU

    from kbv.worker import Worker, WorkerFailed, WorkerSpec

    monkeypatch.setenv("KBV_WORKER_USER", "off")
    spec = WorkerSpec(build_key="test-ipc-bound", device="cuda", role="candidate", budget_s=120)
    with Worker(spec) as worker:
        worker.start()
        worker.request(
            wire.Load(
                role="candidate",
                device="cuda",
                problem_source=RELU.read_text(),
                candidate_path=str(FOUNDATION / "relu_plain.py"),
                sizes={"batch_size": 4, "dim": 1024},
                init_seed=1,
                handoff="cuda_ipc",
            )
        )
        reply = worker.request(
            wire.Run(distribution="signed", seed=3, precision="native", out_path=worker.new_path("o"))
        )
        (item,) = reply.outputs["items"]
        claimed = (256 << 20) // 4
        storage = {**item["storage"], "size": (item["offset"] + claimed) * 4}
        inflated = {
            **reply.outputs,
            "items": [{**item, "shape": [claimed], "stride": [1], "storage": storage}],
        }
        with pytest.raises(WorkerFailed, match="past its allocation"):
            worker.receive_outputs(inflated)
        (y,) = worker.receive_outputs(reply.outputs)
    assert y.shape == (4, 1024) and bool((y >= 0).all())


def test_a_driver_allocation_out_of_memory_says_so() -> None:
    """A hand-over whose cuMemCreate ran out of device memory reads as out of memory (the candidate's
    runtime error in a probe), not as an unexplained CUresult (which a probe called a hack)."""
    from kbv import _vmm
    from kbv.integrity.dynamic import _out_of_memory
    from kbv.worker import WorkerFailed

    with pytest.raises(_vmm.VmmError) as raised:
        _vmm._check(2, "create")
    assert _out_of_memory(WorkerFailed("runtime_error", str(raised.value)))
    with pytest.raises(_vmm.VmmError, match="CUresult 1$"):
        _vmm._check(1, "map")
    _vmm._check(0, "map")
