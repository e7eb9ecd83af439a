"""kbv (KernelBench-Verified): honest evaluation of LLM-generated GPU kernels.

The public facade. Everything else is private and may change between releases::

    import kbv
    record = kbv.evaluate_paths("problem.py", "candidate.py", protocol="verified")
    print(record.outcome, record.speedup["best"])

Names are imported lazily so that a worker process, which imports ``kbv.child.main``, loads only
what running a model needs and never the trusted side's comparison or verdict code. Editors and
type checkers see the real names through the imports under ``TYPE_CHECKING``, which never run
(``tests/test_layers.py`` checks that a worker's imports do not reach them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kbv._version import __version__

if TYPE_CHECKING:
    from kbv._evaluator import Evaluator
    from kbv.api import evaluate_paths, evaluate_replay
    from kbv.candidates import Candidate, load_candidate
    from kbv.evaluation import HarnessError, evaluate
    from kbv.problems import Problem, load_problem, load_problems
    from kbv.protocol import STANDARD, VERIFIED, Protocol, load_protocol
    from kbv.records import Finding, Outcome, Record

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

# A literal list, so that linters and editors know every name is exported (tests/test_first_hour.py
# checks that it names _EXPORTS and what the imports above import).
__all__ = [
    "__version__",
    "evaluate_paths",
    "evaluate_replay",
    "Candidate",
    "Evaluator",
    "load_candidate",
    "HarnessError",
    "evaluate",
    "Problem",
    "load_problem",
    "load_problems",
    "STANDARD",
    "VERIFIED",
    "Protocol",
    "load_protocol",
    "Finding",
    "Outcome",
    "Record",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kbv' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
