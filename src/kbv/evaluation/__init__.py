"""One evaluation, end to end: problem x candidate x protocol -> Record.

The parent owns seeds, comparison, statistics and the verdict (``orchestrator``). It starts a
reference worker (which only ever loads the problem) and a candidate worker (which loads the
candidate), sends them per-call seeds (``requests``), draws the correctness inputs and judges what
comes back (``draws``, ``reference``), holds the GPU as its memory budget says (``budget``) and
writes the record (``records``).

Every name other modules and tests import from ``kbv.evaluation`` is re-exported here; a test that
replaces a function patches the module that looks it up (``kbv.evaluation.draws``, ...).
"""

from __future__ import annotations

from kbv.evaluation.budget import (
    GPU_ALONE_COPIES,
    GPU_ALONE_SHARE,
    SIDE_BY_SIDE_SHARE,
    TIMING_SETS_BYTES,
    _gpu_hold,
    _hold_alone_for_outputs,
    _room_for_candidate,
    _room_not_kept,
    _side_by_side,
    _widen_device_limit,
    timing_input_sets,
)
from kbv.evaluation.cache import EXPECTED_CACHE_BYTES, ExpectedCache
from kbv.evaluation.context import (
    REFERENCE_TIMEOUT_S,
    STANDARD_SEED,
    HarnessError,
    _Context,
    _GpuState,
    _Seeds,
    default_device,
)
from kbv.evaluation.draws import draws_ahead, draws_overlap
from kbv.evaluation.orchestrator import Session, _end_containment, evaluate, worker_specs
from kbv.evaluation.reference import _reference_outputs, _usable_reference

__all__ = [
    "EXPECTED_CACHE_BYTES",
    "GPU_ALONE_COPIES",
    "GPU_ALONE_SHARE",
    "REFERENCE_TIMEOUT_S",
    "SIDE_BY_SIDE_SHARE",
    "STANDARD_SEED",
    "TIMING_SETS_BYTES",
    "ExpectedCache",
    "HarnessError",
    "Session",
    "_Context",
    "_GpuState",
    "_Seeds",
    "_end_containment",
    "_gpu_hold",
    "_hold_alone_for_outputs",
    "_reference_outputs",
    "_room_for_candidate",
    "_room_not_kept",
    "_side_by_side",
    "_usable_reference",
    "_widen_device_limit",
    "default_device",
    "draws_ahead",
    "draws_overlap",
    "evaluate",
    "timing_input_sets",
    "worker_specs",
]
