"""Checks on the observe probe: what the candidate's outputs are, what they share with the inputs,
what the call changed in the inputs and the process (threads, flags, timers, kbv's own functions).
"""

from __future__ import annotations

from typing import Any

import torch

from kbv.integrity._registry import register_check
from kbv.integrity.dynamic._context import DynamicContext, _finding, _fmt
from kbv.records import Finding


@register_check(
    name="output_type",
    order=60,
    kind="dynamic",
    default_severity="fail",
    doc="""Every tensor output must be a plain torch.Tensor. A Tensor subclass or an object with
    patched methods can do its work lazily when the checker touches it, outside the timed window.
    An output that is no tensor at all (a float, None, a list) is not a hack but a wrong answer: the
    correctness check makes it ``incorrect`` with the reason, and this check stays silent.""",
)
def check_output_type(ctx: DynamicContext) -> list[Finding]:
    obs = ctx.observe()
    return [
        _finding("output_type", f"output {i} is {t}, a tensor that is not a plain torch.Tensor")
        for i, t in tensor_like_outputs(obs["candidate"].types, obs["first_tensors"])
    ]


def tensor_like_outputs(types: list[str], snapshots: list[Any]) -> list[tuple[int, str]]:
    """(index, type) of outputs that are tensors but not plain ``torch.Tensor``s.

    The worker's snapshot of an output is a tensor only for a ``torch.Tensor`` (subclasses
    stripped) or a Python number; anything else arrives as None. ``snapshots`` holds the snapshots
    or, as the observe probe keeps them, whether each one was a tensor."""
    found = []
    for i, name in enumerate(types):
        snapshot = snapshots[i] if i < len(snapshots) else None
        is_tensor = snapshot is True or isinstance(snapshot, torch.Tensor)
        if name != "torch.Tensor" and is_tensor and not _python_scalar(name):
            found.append((i, name))
    return found


def _python_scalar(type_name: str) -> bool:
    return type_name in ("builtins.float", "builtins.int", "builtins.bool", "builtins.complex")


@register_check(
    name="output_aliases_input",
    order=70,
    kind="dynamic",
    default_severity="fail",
    doc="""An output whose storage overlaps an input's (data_ptr ranges of the untyped storages), when
    the reference's outputs do not alias its inputs. Returning the input, or writing into it and
    returning a view, skips the work of producing a fresh output.""",
)
def check_output_aliases_input(ctx: DynamicContext) -> list[Finding]:
    obs = ctx.observe()
    honest = {tuple(p) for p in obs["reference"].aliasing}
    extra = [p for p in obs["candidate"].aliasing if tuple(p) not in honest]
    return [
        _finding(
            "output_aliases_input", f"output {o} shares storage with input {i} (the reference's does not)"
        )
        for o, i in extra
    ]


@register_check(
    name="input_mutation",
    order=80,
    kind="dynamic",
    default_severity="fail",
    doc="""The inputs' checksums (float64 sum and a hash of the bytes) changed across one forward call
    while the reference leaves them alone. Writing into inputs corrupts what a later check or call
    sees and can hide work (in-place ops on the caller's buffers).""",
)
def check_input_mutation(ctx: DynamicContext) -> list[Finding]:
    obs = ctx.observe()
    cand, ref = obs["candidate"], obs["reference"]
    findings = []
    for j, (before, after) in enumerate(zip(cand.input_checksums_before, cand.input_checksums_after)):
        ref_changed = ref.input_checksums_before[j] != ref.input_checksums_after[j]
        if before != after and not ref_changed:
            findings.append(
                _finding(
                    "input_mutation",
                    f"input {j} changed during the call: sum {_fmt(before and before['sum'])} -> "
                    f"{_fmt(after and after['sum'])}, sha {before and before['sha']} -> "
                    f"{after and after['sha']}",
                )
            )
    return findings


@register_check(
    name="background_work",
    order=90,
    kind="dynamic",
    default_severity="fail",
    doc="""Threads or processes left running by a call, or outputs that change after the call
    returned. Python thread count (threading.active_count), descendant processes (/proc) are
    compared before the call, right after it and after a short delay; the outputs are copied right
    after the call and again after the delay. Threads started during the call (threading.setprofile)
    are held 50 ms at their first Python event and must have finished when the call returns: a pool
    joined before returning passes, a thread left to finish the work fails even when it would have
    won the race. Growth of OS-level threads alone (a native pool) is a warning.""",
)
def check_background_work(ctx: DynamicContext) -> list[Finding]:
    obs = ctx.observe()
    cand, ref = obs["candidate"], obs["reference"]
    act = cand.activity
    before, after, later = act["before"], act["after"], act["after_delay"]
    delay = f"{obs['delay_s']:.3g}s"
    findings = []
    grew_py = max(after["python_threads"], later["python_threads"]) - before["python_threads"]
    # Threads the call started and waited for (a joined pool) are its own work; one still alive
    # when it returned outlives it.
    outlived = cand.threads_alive_at_return
    if grew_py > 0 or outlived > 0:
        findings.append(
            _finding(
                "background_work",
                f"Python threads: {before['python_threads']} before the call, "
                f"{after['python_threads']} right after, {later['python_threads']} after "
                f"{delay}; {cand.threads_started} started during the call, "
                f"{outlived} of them still running when it returned",
            )
        )
    # Counted from before the warm-up call too: a process that call left running (and the observed
    # call found still there) is work outliving a call as much as one the observed call starts.
    first = act.get("before_first_call", before)["processes"]
    grew_proc = max(after["processes"], later["processes"]) - min(first, before["processes"])
    if grew_proc > 0:
        findings.append(
            _finding(
                "background_work",
                f"child processes: {first} before the first call, {before['processes']} before the "
                f"observed call, {after['processes']} right after, {later['processes']} after "
                f"{delay}",
            )
        )
    diff = obs["late_diff"]
    if diff > 0:
        findings.append(
            _finding(
                "background_work",
                "the outputs changed after the call returned: max |late - returned| = "
                f"{_fmt(diff)} after {delay}",
            )
        )
    ref_act = ref.activity
    ref_growth = (
        max(ref_act["after"]["os_threads"], ref_act["after_delay"]["os_threads"])
        - ref_act["before"]["os_threads"]
    )
    grew_os = max(after["os_threads"], later["os_threads"]) - before["os_threads"]
    if not findings and grew_os > max(0, ref_growth):
        findings.append(
            _finding(
                "background_work",
                f"OS threads grew from {before['os_threads']} to "
                f"{max(after['os_threads'], later['os_threads'])} across one call (reference: "
                f"+{ref_growth})",
                "warn",
            )
        )
    return findings


#: Flags whose change alters fp32 numerics; a change to the others (autotuning, determinism) warns.
_NUMERIC_FLAGS = (
    "cuda.matmul.allow_tf32",
    "cudnn.allow_tf32",
    "float32_matmul_precision",
    "default_dtype",
    "cuda.matmul.allow_fp16_reduced_precision_reduction",
)


@register_check(
    name="global_flags",
    order=100,
    kind="dynamic",
    default_severity="fail",
    doc="""Global numeric switches (TF32 for matmul and cuDNN, float32 matmul precision, default dtype,
    reduced-precision reductions; cuDNN benchmark/deterministic and deterministic algorithms as
    warnings) compared between worker start-up (before the candidate was imported) and after a
    call. Switching TF32 on in an fp32 problem buys speed with precision the task did not allow.""",
)
def check_global_flags(ctx: DynamicContext) -> list[Finding]:
    flags = ctx.observe()["candidate"].flags
    start, now = flags["start"], flags["after_call"]
    findings = []
    for name in sorted(set(start) | set(now)):
        if start.get(name) != now.get(name):
            severity = "fail" if name in _NUMERIC_FLAGS else "warn"
            when = "at import" if flags["before_call"].get(name) == now.get(name) else "during a call"
            findings.append(
                _finding(
                    "global_flags",
                    f"{name} changed {when}: {start.get(name)!r} -> {now.get(name)!r}",
                    severity,
                )
            )
    return findings


@register_check(
    name="timer_tampering",
    order=40,
    kind="dynamic",
    default_severity="fail",
    doc="""Timing functions (time.perf_counter and friends, torch.cuda.Event and synchronize,
    kbv.child.timing's own functions) replaced since the worker took their identity snapshot before
    importing the candidate.""",
)
def check_timer_tampering(ctx: DynamicContext) -> list[Finding]:
    changed = ctx.observe()["candidate"].identities_changed
    return (
        [_finding("timer_tampering", f"replaced after import: {', '.join(changed[:12])}")] if changed else []
    )


@register_check(
    name="harness_patched",
    order=50,
    kind="dynamic",
    default_severity="fail",
    doc="""Functions and classes of the kbv modules loaded in the candidate worker (its own probes,
    timing, inputs, the worker entry point) replaced after the candidate was imported, compared by
    identity with a snapshot taken at worker start-up. Patching the harness in-process is tampering
    whatever the patch does.""",
)
def check_harness_patched(ctx: DynamicContext) -> list[Finding]:
    changed = ctx.observe()["candidate"].harness_changed
    return (
        [
            _finding(
                "harness_patched",
                f"{len(changed)} kbv function(s) replaced in the worker: {', '.join(changed[:10])}",
            )
        ]
        if changed
        else []
    )
