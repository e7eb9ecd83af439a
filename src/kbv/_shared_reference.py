"""The reference's work shared by the candidates of one problem inside one batch.

An evaluation draws its correctness inputs from a secret master seed and computes the reference's
outputs on them (on the CPU the float64 truth and the fp32 baseline of every draw). Candidates of one
problem submitted in one batch (:class:`kbv.Evaluator`) are given the same master seed, so those
outputs are the same for each of them: the first evaluation computes them, the next ones of the
batch in the same process reuse them. Seeds rotate between batches and a new batch drops the last
one's outputs, so nothing computed under one batch's seeds serves another.

Only the reference's outputs are shared: every candidate still gets its own fresh workers, its own
draws, probes and timing. Shared on the CPU only: on a GPU the outputs live in device memory that
the next candidate's limit counts on (kbv.evaluation's room rules), so there each evaluation keeps
its own, as before.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from kbv.problems import Problem
from kbv.protocol import Protocol
from kbv.records import protocol_section


@dataclass(frozen=True)
class SharedReference:
    """What one batch's evaluations of one problem share: the batch's id and its secret master
    seed. Plain values, so it travels to an executor's host process or Ray task with the pair."""

    batch: str
    master_seed: int


_lock = threading.Lock()
_caches: dict[tuple[str, str, str, str], Any] = {}  # kbv.evaluation.ExpectedCache (it imports this module)
#: Reference outputs reused and computed in this process, over every batch so far (for tests and
#: the benchmark that measures what sharing saves).
totals = {"hits": 0, "misses": 0}


def _protocol_key(protocol: Protocol) -> str:
    return json.dumps(protocol_section(protocol), sort_keys=True, default=str)


def expected_cache(
    shared: SharedReference, problem: Problem, protocol: Protocol, device: str, new: Any
) -> Any:
    """This process's cache of the reference's outputs for ``shared``'s batch and ``problem``
    (``new`` when there is none yet); caches of any other batch are dropped first (never reused
    across batches). The evaluation must not clear it: the batch's end does."""
    key = (shared.batch, problem.source_sha256, _protocol_key(protocol), device)
    with _lock:
        drop_other_batches(shared.batch)
        return _caches.setdefault(key, new)


def drop_other_batches(batch: str | None) -> None:
    """Forget the reference outputs of every batch but ``batch`` (``None``: of every batch)."""
    for key in [k for k in _caches if k[0] != batch]:
        cache = _caches.pop(key)
        totals["hits"] += cache.hits
        totals["misses"] += cache.misses
        cache.clear()


def release_all() -> None:
    """Forget every batch's reference outputs (a batch has ended)."""
    with _lock:
        drop_other_batches(None)


def shares(device: str) -> bool:
    """Whether evaluations on ``device`` share the reference's outputs (the CPU only, see above)."""
    return not device.startswith("cuda")
