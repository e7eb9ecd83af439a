"""The candidate's static scan, run in a thread beside the workers' loading (``integrity.static``)."""

from __future__ import annotations

import threading
import time

from kbv.evaluation.context import _Context
from kbv.records import Finding


class StaticScan:
    """The candidate's static scan in a thread of its own (``integrity.static``), started with the
    evaluation: pure Python over the candidate's and the problem's text, 6-30 ms a candidate on the
    CPU, which the workers' loading hides. :func:`static_findings_joined` waits for it."""

    def __init__(self, ctx: _Context) -> None:
        self._ctx = ctx
        self.findings: list[Finding] = []
        self.seconds = 0.0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kbv-static-scan", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kbv import integrity

        started = time.monotonic()
        ctx = self._ctx
        try:
            self.findings = integrity.static_scan(
                ctx.candidate.source,
                path=str(ctx.candidate.path),
                problem_source=ctx.problem.source,
                # 16-bit compute is the precision of a bf16 or fp16 evaluation, not a hack; what goes
                # below it is caught by the tolerance (the below_precision check); TF32 rules are
                # fp32's alone.
                problem_dtype_fp32=ctx.protocol.precision == "fp32",
            )
        except BaseException as exc:  # kbv's own failure: raised where the findings are joined
            self._error = exc
        self.seconds = time.monotonic() - started

    def join(self) -> list[Finding]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.findings


def static_findings_joined(ctx: _Context) -> None:
    """The static scan's findings (at the protocol's severity) at the head of the evaluation's
    findings, once; its own seconds as the ``static_scan`` phase (it ran beside other phases)."""
    scan, ctx.found.static_scan = ctx.found.static_scan, None
    if scan is None:
        return
    from kbv import integrity

    found = integrity.apply_severity(scan.join(), ctx.protocol.integrity)
    ctx.found.findings[:0] = found
    ctx.found.phases["static_scan"] = scan.seconds
