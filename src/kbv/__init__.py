"""kbv (KernelBench-Verified): honest evaluation of LLM-generated GPU kernels.

The public facade. Everything else is private and may change between releases::

    import kbv
    record = kbv.evaluate_paths("problem.py", "candidate.py", protocol="verified")
    print(record.outcome, record.speedup["best"])

Names are imported lazily so that a worker process, which imports ``kbv.child.main``, loads only
what running a model needs and never the trusted side's comparison or verdict code.
"""

from __future__ import annotations

import importlib
from typing import Any

from kbv._version import __version__

_EXPORTS = {
    "evaluate_paths": "kbv.api",
    "evaluate_replay": "kbv.api",
    "Candidate": "kbv.candidates",
    "Evaluator": "kbv._evaluator",
    "load_candidate": "kbv.candidates",
    "HarnessError": "kbv.evaluation",
    "evaluate": "kbv.evaluation",
    "Problem": "kbv.problems",
    "load_problem": "kbv.problems",
    "load_problems": "kbv.problems",
    "STANDARD": "kbv.protocol",
    "VERIFIED": "kbv.protocol",
    "Protocol": "kbv.protocol",
    "load_protocol": "kbv.protocol",
    "Finding": "kbv.records",
    "Outcome": "kbv.records",
    "Record": "kbv.records",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kbv' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
