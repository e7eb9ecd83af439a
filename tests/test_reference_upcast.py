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
        errors.append(truth._expected(state, request).baseline_error)
    assert errors[0] == errors[1]
    assert errors[0]["outputs"][0]["norm"] > 0  # a real comparison: float32 against float64
