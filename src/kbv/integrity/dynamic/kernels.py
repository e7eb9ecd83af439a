"""Checks on what ran on the device: the kernels the candidate launched (and on which stream), kernels
it built but never called, and a speedup too large for the work the problem does.
"""

from __future__ import annotations

from typing import Any

from kbv import wire, wire_replies
from kbv.integrity._registry import register_check
from kbv.integrity.dynamic._context import DynamicContext, _finding, _fmt
from kbv.records import Finding

#: A speedup above this over the fastest baseline gets a warning asking for review.
SUSPICIOUS_SPEEDUP = 10.0
#: Peak rates per device-name fragment: (dense FLOP/s ceiling, bytes/s). The FLOP ceiling is the
#: fastest honest path for an fp32 problem (bf16/fp16 tensor cores, above TF32), so an honest kernel
#: is never below the floor; lower a number to make the check stricter.
PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.04e12),
    "L40S": (362e12, 0.864e12),
    "B200": (2250e12, 8.0e12),
}
#: Unknown GPUs: more than any current part, so the floor is never too high.
DEFAULT_GPU_PEAK = (2500e12, 10e12)


def _kernels(ctx: DynamicContext) -> wire_replies.ProbeKernelsReply:
    return wire_replies.ProbeKernelsReply.of(
        ctx.once("kernels", lambda: ctx.request(ctx.session.subject, wire.ProbeKernels(inputs=ctx.draw(0))))
    )


@register_check(
    name="kernels_launched",
    order=150,
    kind="dynamic",
    default_severity="info",
    doc="""CUDA only: the names of the device kernels one forward launched (torch.profiler), split
    into library kernels (aten, cuBLAS, cuDNN, CUTLASS) and others. Evidence for reviewers.""",
)
def check_kernels_launched(ctx: DynamicContext) -> list[Finding]:
    if not ctx.on_cuda:
        return []
    info = _kernels(ctx)
    if not info.available:
        return []
    names = info.kernels
    library = set(info.library_kernels or [])
    custom = [n for n in names if n not in library]
    return [
        _finding(
            "kernels_launched",
            f"{len(names)} kernel(s), {len(custom)} non-library: "
            f"{', '.join(n[:60] for n in custom[:6]) or '-'}; library: "
            f"{', '.join(n[:60] for n in list(library)[:4]) or '-'}",
        )
    ]


@register_check(
    name="side_stream_kernels",
    order=160,
    kind="dynamic",
    default_severity="warn",
    doc="""CUDA only: kernels of one forward that the device profiler saw on a stream other than
    the one the forward was called on (a marker kernel queued there first names it). The profiler
    records every stream of the process, so this sees streams however they were obtained (a C++
    ``cudaStreamCreate`` behind a binding, ctypes, a library handle), where the static
    ``side_stream`` rule reads only the source. Work on another stream is what a side-stream hack
    keeps out of the timed region; an honest kernel that joins its streams is flagged as well, as
    the static rule flags it. A warning until a GPU run of the bundled and third-party kernels has
    shown which honest ones it flags (docs/integrity-checks.md).""",
)
def check_side_stream_kernels(ctx: DynamicContext) -> list[Finding]:
    if not ctx.on_cuda:
        return []
    info = _kernels(ctx)
    return side_stream_kernel_findings(info) if info.available else []


def side_stream_kernel_findings(info: wire_replies.ProbeKernelsReply) -> list[Finding]:
    """``side_stream_kernels`` findings from ``probe_kernels``'s reply: none when the marker's
    stream is unknown (no verdict from a probe that could not tell)."""
    current = info.current_stream
    if current is None:
        return []
    other = [(name, stream) for name, stream in info.kernel_streams or [] if stream != current]
    if not other:
        return []
    streams = sorted({str(stream) for _, stream in other})
    return [
        _finding(
            "side_stream_kernels",
            f"{len(other)} kernel(s) ran on stream {', '.join(streams)}, not on the stream the forward "
            f"was called on ({current}): {', '.join(name[:60] for name, _ in other[:4])}",
        )
    ]


@register_check(
    name="ghost_kernel",
    order=170,
    kind="dynamic",
    default_severity="fail",
    doc="""A kernel that never runs is no kernel. On every device, one forward runs under a call
    recorder (kbv.child.calls: a profile hook for calls into the candidate's functions, its
    compiled extensions, custom operators and Triton launches; a trace hook on the candidate's own
    frames for exceptions raised and caught there). It fails when the candidate built a kernel of
    its own (an extension, a Triton kernel) and none of them ran, or when its code caught an
    exception during the call and no kernel of its own ran (a try/except fallback to PyTorch,
    whether the kernel failed or does not exist); the evidence names the calls that ran. On CUDA
    it also fails when custom code was loaded yet the device profiler saw only library kernels. A
    candidate in PyTorch alone (nothing built, nothing caught) is left to ``pytorch_only``.""",
)
def check_ghost_kernel(ctx: DynamicContext) -> list[Finding]:
    calls = ctx.once("calls", lambda: ctx.request(ctx.session.subject, wire.ProbeCalls(inputs=ctx.draw(0))))
    found = unused_kernel_findings(calls)
    if found or not ctx.on_cuda:
        return found
    info = _kernels(ctx)
    if not info.available or not info.custom_code:
        return []
    names, library = info.kernels, set(info.library_kernels or [])
    if names and all(n in library for n in names):
        return [
            _finding(
                "ghost_kernel",
                f"custom code loaded ({', '.join(info.custom_code[:3])}) but only library "
                f"kernels ran: {', '.join(n[:60] for n in names[:4])}",
            )
        ]
    return []


def unused_kernel_findings(calls: wire_replies.ProbeCallsReply) -> list[Finding]:
    """``ghost_kernel`` findings from one recorded forward (``probe_calls``'s reply)."""
    built, ran = calls.built, calls.ran
    own = [*ran.get("extension_calls", []), *ran.get("custom_ops", []), *ran.get("triton_launches", [])]
    if own:
        return []
    evidence = (
        f"calls of its own that ran: {', '.join(ran.get('functions', [])[:8]) or 'none'}; no extension "
        "function, custom operator or Triton launch ran"
    )
    made = [*built.get("extensions", []), *built.get("triton_kernels", [])]
    caught = ran.get("caught") or []
    if caught:
        # With nothing built, only an exception saying the called thing does not exist is a fallback
        # from a kernel; another caught error in PyTorch-only code is control flow, and warns.
        first = next((c for c in caught if _names_missing(c)), caught[0])
        what = (
            f"{first.get('type')} ({first.get('message', '')[:100]}) at line {first.get('line')} in "
            f"{first.get('function')}"
        )
        severity = "fail" if made or _names_missing(first) else "warn"
        return [
            _finding(
                "ghost_kernel",
                f"during one forward the candidate's code raised and caught {what}, and no kernel "
                f"of its own ran: the result is PyTorch's; {evidence}",
                severity,
            )
        ]
    if made:
        return [
            _finding(
                "ghost_kernel",
                f"built {', '.join(made[:4])} but during one forward none of its kernels ran; {evidence}",
            )
        ]
    return []


_MISSING = ("NameError", "UnboundLocalError", "AttributeError", "ImportError", "ModuleNotFoundError")


def _names_missing(caught: dict[str, Any]) -> bool:
    """The caught exception says the thing called does not exist (or is None)."""
    message = str(caught.get("message", ""))
    return caught.get("type") in _MISSING or (caught.get("type") == "TypeError" and "NoneType" in message)


def _peaks(ctx: DynamicContext) -> tuple[float, float, str]:
    hello = ctx.session.reference.hello
    name = str(((hello.device if hello is not None else None) or {}).get("name", ""))
    for key, peak in PEAKS.items():
        if key in name:
            return (*peak, name)
    return (*DEFAULT_GPU_PEAK, f"{name or 'unknown GPU'} (default ceiling)")


@register_check(
    name="plausibility",
    order=180,
    kind="dynamic",
    default_severity="fail",
    doc="""A candidate time below the physical floor: max(FLOPs of the reference (FlopCounterMode, in
    the reference worker) / peak FLOP rate, bytes of inputs + outputs / peak bandwidth), peaks from a
    table keyed by device name (CUDA only). A speedup over the fastest baseline above 10x
    is a warning asking for review even when nothing else fired.""",
)
def check_plausibility(ctx: DynamicContext) -> list[Finding]:
    session = ctx.session
    summary = ((session.timing or {}).get("candidate") or {}).get("summary") or {}
    cand_ms = ctx.corrections.get("trusted_candidate_ms") or summary.get("median")
    if not session.correct or not cand_ms:
        return []
    findings = []
    best = ctx.speedup().get("best")
    if best is not None and best > SUSPICIOUS_SPEEDUP:
        findings.append(
            _finding(
                "plausibility",
                f"speedup {best:.3g}x over the fastest baseline exceeds {SUSPICIOUS_SPEEDUP:g}x; "
                f"review this candidate (measured {_fmt(cand_ms)} ms)",
                "warn",
            )
        )
    if not ctx.on_cuda:
        return findings  # CPU peaks vary too much for a floor; FlopCounterMode alone costs seconds
    facts = ctx.once("flops", lambda: ctx.request(session.reference, wire.ProbeFlops(inputs=ctx.draw(0))))
    flops_peak, bw_peak, where = _peaks(ctx)
    nbytes = facts.input_bytes + facts.output_bytes
    floor_ms = max(facts.flops / flops_peak, nbytes / bw_peak) * 1e3
    if cand_ms < floor_ms:
        findings.insert(
            0,
            _finding(
                "plausibility",
                f"median {_fmt(cand_ms)} ms is below the physical floor {_fmt(floor_ms)} ms on "
                f"{where}: {facts.flops:.3g} FLOP at {flops_peak:.3g} FLOP/s, {nbytes} bytes at "
                f"{bw_peak:.3g} B/s",
            ),
        )
    return findings
