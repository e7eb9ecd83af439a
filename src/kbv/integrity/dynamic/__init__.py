"""Dynamic reward-hack checks: probe a running candidate, decide in the trusted parent.

The candidate worker runs probes (``kbv.child.probes``) that report raw observations; the
reference worker runs the same probes on the problem's own ``Model`` so the parent knows what honest
behaviour looks like (a reference may itself alias or mutate its inputs). Every verdict about
outputs is made here, against reference outputs the parent obtained from the reference worker, with
the evaluation's own judge. ``docs/integrity-dynamic.md`` describes each check and its blind spots.

Checks run in the order the registry gives them (each check's ``order``): ``timing_disagreement``
may correct the speedup (:attr:`DynamicContext.corrections`, which ``plausibility`` reads and the
caller applies; no check changes the session). Probe results are cached in a
:class:`DynamicContext`, so each probe runs at most once per evaluation.

The checks are grouped by concern: ``timing`` (the timing section), ``observed`` (the observe
probe), ``outputs`` (outputs over several calls), ``kernels`` (what ran on the device, and
plausibility) and ``containment`` (the evaluation's end); ``_run`` runs them.
"""

from __future__ import annotations

from kbv.integrity.dynamic._context import (
    NOT_CHECKED,
    OBSERVE_DELAY_S,
    DynamicContext,
    _max_diff,
    _out_of_memory,
    _ProbeFailed,
    _ReferenceProbeFailed,
)
from kbv.integrity.dynamic._run import (
    DynamicResult,
    Recorded,
    containment_findings,
    dynamic_order,
    findings_without_probes,
    run_dynamic_checks,
)
from kbv.integrity.dynamic.containment import (
    ContainmentContext,
    check_device_lock_tampering,
    check_processes_left,
    check_signalled_process,
    left_behind_findings,
    lock_tampering_findings,
    signalled_findings,
)
from kbv.integrity.dynamic.kernels import (
    DEFAULT_GPU_PEAK,
    PEAKS,
    SUSPICIOUS_SPEEDUP,
    check_ghost_kernel,
    check_kernels_launched,
    check_plausibility,
    check_side_stream_kernels,
    side_stream_kernel_findings,
    unused_kernel_findings,
)
from kbv.integrity.dynamic.observed import (
    check_background_work,
    check_global_flags,
    check_harness_patched,
    check_input_mutation,
    check_output_aliases_input,
    check_output_type,
    check_timer_tampering,
    tensor_like_outputs,
)
from kbv.integrity.dynamic.outputs import (
    check_caching,
    check_nondeterminism,
    check_transient_mismatch,
    check_unwritten_output,
    transient_findings,
)
from kbv.integrity.dynamic.timing import (
    LIE_FACTOR,
    check_side_stream,
    check_timed_call_outputs,
    check_timing_disagreement,
    timed_call_findings,
)

__all__ = [
    "DEFAULT_GPU_PEAK",
    "LIE_FACTOR",
    "NOT_CHECKED",
    "OBSERVE_DELAY_S",
    "PEAKS",
    "SUSPICIOUS_SPEEDUP",
    "ContainmentContext",
    "DynamicContext",
    "DynamicResult",
    "Recorded",
    "_ProbeFailed",
    "_ReferenceProbeFailed",
    "_max_diff",
    "_out_of_memory",
    "check_background_work",
    "check_caching",
    "check_device_lock_tampering",
    "check_ghost_kernel",
    "check_global_flags",
    "check_harness_patched",
    "check_input_mutation",
    "check_kernels_launched",
    "check_nondeterminism",
    "check_output_aliases_input",
    "check_output_type",
    "check_plausibility",
    "check_processes_left",
    "check_side_stream",
    "check_side_stream_kernels",
    "check_signalled_process",
    "check_timed_call_outputs",
    "check_timer_tampering",
    "check_timing_disagreement",
    "check_transient_mismatch",
    "check_unwritten_output",
    "containment_findings",
    "dynamic_order",
    "findings_without_probes",
    "left_behind_findings",
    "lock_tampering_findings",
    "run_dynamic_checks",
    "side_stream_kernel_findings",
    "signalled_findings",
    "tensor_like_outputs",
    "timed_call_findings",
    "transient_findings",
    "unused_kernel_findings",
]
