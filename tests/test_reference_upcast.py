"""The reference's float64 copy of a large draw made from a host copy where the device is short of
room (``kbv.child.truth._upcast_on_host``): when it is taken, and that the truth is the same."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from kbv import wire
from kbv.child import main as child_main
from kbv.child import truth
from kbv.child.forward import _State

GIB = 1 << 30


def _cuda_with(
    monkeypatch: pytest.MonkeyPatch, free: int, reserved: int, allocated: int
) -> types.SimpleNamespace:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    return types.SimpleNamespace(device=torch.device("cuda", 0))


def _draw_of(gib: float) -> list:
    """A stand-in for a float32 draw of ``gib`` GiB: only its element count is read."""
    return [torch.empty(1).expand(int(gib * GIB / 4))]


def test_a_draw_is_upcast_on_the_host_only_where_the_device_is_short_of_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """45_Average_Pooling_2D on an H100 (2026-12-07): a 16 GiB float32 draw, whose float64 copy is
    32 GiB, beside 24 GiB free: made from the host. With room for the copy and its forward's work
    (twice the copy), on the device as before; the allocator's unused blocks count as room."""
    draw = _draw_of(16)
    assert truth._upcast_on_host(_cuda_with(monkeypatch, 24 * GIB, 0, 0), draw)
    assert not truth._upcast_on_host(_cuda_with(monkeypatch, 70 * GIB, 0, 0), draw)
    assert not truth._upcast_on_host(_cuda_with(monkeypatch, 40 * GIB, 40 * GIB, 16 * GIB), draw)
    assert not truth._upcast_on_host(types.SimpleNamespace(device=torch.device("cpu")), draw)


PROBLEM = """
import torch

class Model(torch.nn.Module):
    def forward(self, x, y):
        return (x * y).sum(dim=1), torch.nn.functional.smooth_l1_loss(x, y)

def get_inputs():
    return [torch.rand(64, 300), torch.rand(64, 300)]

def get_init_inputs():
    return []
"""


def test_the_truth_made_from_a_host_copy_is_the_truth(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One truth request by each path on the same draw: the same truth and the same baseline (the
    draw made again for it), so the same baseline error, to the last bit."""
    state = _State()
    child_main._load(state, wire.Load(role="reference", device="cpu", problem_source=PROBLEM, init_seed=1))
    errors = []
    for on_host in (False, True):
        monkeypatch.setattr(truth, "_upcast_on_host", lambda state, narrow, on_host=on_host: on_host)
        request = wire.Expected(distribution="spiked", seed=11, out_path=str(tmp_path / f"truth-{on_host}"))
        reply = truth._expected(state, request)
        assert reply.upcast_on_host == on_host  # the parent counts those seconds (below)
        errors.append(reply.baseline_error)
    assert errors[0] == errors[1]
    assert errors[0]["outputs"][0]["norm"] > 0  # a real comparison: float32 against float64


def test_the_record_counts_the_seconds_of_answers_whose_copy_went_through_the_host() -> None:
    """On an H100 a 1.6e9-element problem's `integrity` took 10 s more in one run than in the next
    (2026-12-07), the reference's answers seconds each where its float64 copy goes through the
    host: the record says how long those took (``phases_s["reference:upcast_on_host"]``), and
    nothing where none did."""
    from kbv import wire_replies
    from kbv.evaluation import reference as _reference
    from kbv.worker._process import RequestSpan

    def answered(on_host: bool) -> dict:
        reply = wire_replies.ExpectedReply(
            types=[],
            truth_types=[],
            baseline_outputs=[],
            baseline_error={},
            outputs={},
            upcast_on_host=on_host,
        )
        worker = types.SimpleNamespace(
            receive_reply=lambda request_id: reply,
            receive_outputs=lambda description: [],
            last_span=RequestSpan(10.0, 12.5, None),
        )
        ctx = types.SimpleNamespace(
            cache=types.SimpleNamespace(expected=types.SimpleNamespace(put=lambda key, value: None)),
            found=types.SimpleNamespace(phases={}),
        )
        _reference._expected_reply(ctx, worker, _reference._Asked(("k",), 1, False))
        return ctx.found.phases

    assert answered(True) == {"reference:upcast_on_host": 2.5}
    assert answered(False) == {}
