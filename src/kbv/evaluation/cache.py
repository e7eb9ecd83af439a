"""Reference outputs kept for reuse within one evaluation (``ExpectedCache``) and its byte budget."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch


class ExpectedCache:
    """Reference outputs per (parameters, distribution, seed): the inputs, the realistic baseline's
    outputs and the float64 truth of a draw are computed once per evaluation and reused by every
    check that needs them. Bounded in bytes (least recently used out first). They depend on the
    evaluation's secret seeds, so they are shared only by evaluations given the same seeds: the
    candidates of one problem in one batch, on the CPU (:mod:`kbv._shared_reference`)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[Any, ...], tuple[dict[str, Any], int]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def get(self, key: tuple[Any, ...]) -> dict[str, Any] | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry[0]

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def put(self, key: tuple[Any, ...], value: dict[str, Any]) -> None:
        size = _nbytes(value)
        if size > self.budget_bytes:
            return
        old = self._entries.pop(key, None)
        self._bytes += size - (old[1] if old else 0)
        self._entries[key] = (value, size)
        while self._bytes > self.budget_bytes and self._entries:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped


def _nbytes(expected: dict[str, Any]) -> int:
    seen: dict[int, int] = {}
    for part in expected.values():
        for t in part.get("outputs") or []:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


#: Bytes of reference outputs an evaluation keeps for reuse (on the evaluation's device).
#: Measured on the H200: with 24 GB, a 1.6e9-element problem (the reference's float64 run, the
#: candidate's copies and the parent's cache together) ran out of the GPU's 139 GB.
EXPECTED_CACHE_BYTES = {"cuda": 8 << 30, "cpu": 1 << 30}
