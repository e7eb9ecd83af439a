"""The trusted reference's truth requests: the float64 truth and the realistic baseline of a
correctness draw (``expected``), and the truth of the timed calls' unseen inputs (``truth_sketches``)."""

from __future__ import annotations

from typing import Any

import torch

from kbv import handoff as _handoff
from kbv import inputs as kbv_inputs
from kbv import sketch as _sketch
from kbv import wire, wire_replies
from kbv.child.forward import (
    _as_outputs,
    _classify,
    _device_bytes,
    _forward_recording,
    _make_inputs,
    _message,
    _model_for,
    _set_precision_flags,
    _shape_and_dtype,
    _State,
    _Steps,
    _type_names,
)

#: Input bytes up to which the reference keeps a draw's float32 inputs while its float64 forward
#: runs, so the draw is generated once for both forwards; above it, as a share of the device's
#: memory, the inputs are generated again for the baseline (the 7.5 GB-input problems' reference
#: already needed 72 GB of the H200 for its float64 forward alone).
SHARED_DRAW_SHARE = 1 / 16
#: The reference makes a draw's float64 copy from a host copy of it (``kbv.inputs.upcast_from_host``)
#: where the device has less free for it than this many times that copy (the copy, and as much
#: again for the float64 forward's work): its float32 values are then gone from the device before
#: the copy is made, instead of beside it. On an H100 45_Average_Pooling_2D's reference held its
#: 16 GiB draw and asked for the 32 GiB copy beside a candidate of 16.6 GiB, and ran out
#: (2026-12-07, benchmarks/results/2026-12-07-h100-bf16-audit-sweeps-acceptance/). Elsewhere the
#: copy is made on the device: the host's round trip costs seconds a draw at that size.
HOST_UPCAST_BELOW = 2.0


def _expected(state: _State, request: wire.Expected) -> wire_replies.ExpectedReply:
    """What judging one draw needs, from the trusted reference alone: the float64 truth and the
    realistic baseline (``precision``: TF32 on a GPU, fp32 on the CPU) on the same inputs, the
    baseline's error against the truth computed here (``kbv.error_stats.baseline_error``), and only
    the truth handed over; the baseline's outputs never leave this process (their shapes and dtypes
    do). The float64 inputs are an upcast copy of the float32 draw, made before either forward runs,
    so a forward that writes into its inputs cannot change the other's."""
    if state.role != "reference":
        raise PermissionError("only the trusted reference worker computes a draw's truth")
    from kbv.error_stats import baseline_error  # numbers, not a verdict (the reference worker only)

    draw = (request.distribution, request.seed, request.mix_seed)
    steps = _Steps(request.steps, state.device.type == "cuda")
    narrow = _make_inputs(state, draw[0], draw[1], "fp32", draw[2])
    # None: the draw is freed for the float64 forward and drawn again for the baseline
    args: list[Any] | None = None
    on_host = _upcast_on_host(state, narrow)
    if on_host:
        host = kbv_inputs.draw_to_host(narrow)
        del narrow  # the device's copy goes back before the float64 one is made
        wide = kbv_inputs.upcast_from_host(host, state.device)
        del host
    else:
        wide = kbv_inputs.upcast_draw(narrow)
        if kbv_inputs.draw_bytes(narrow) <= SHARED_DRAW_SHARE * _device_bytes(state):
            args = narrow
        del narrow
    steps.mark("inputs_upcast_on_host" if on_host else "inputs")
    _set_precision_flags("fp64")
    try:
        with torch.no_grad():
            truth = _as_outputs(_model_for(state, "fp64")(*wide))
    except Exception as exc:  # e.g. a forward that makes float32 tensors of its own
        if _classify(exc, "expected") == "cuda_error":
            raise  # keeps its kind: it ends this worker
        raise RuntimeError(
            f"in float64 (the verified protocol's truth): {_message(exc, 'expected')}"
        ) from exc
    del wide
    steps.mark("forward_fp64")
    if args is None:
        args = _make_inputs(state, draw[0], draw[1], "fp32", draw[2])
    precision = request.precision
    _set_precision_flags(precision)
    recording = request.record_operators
    with torch.no_grad():
        baseline, operators = (
            _forward_recording(state.model, args) if recording else (state.model(*args), None)
        )
    del args
    baseline = _as_outputs(baseline)
    steps.mark("forward")
    kept_truth = [_handoff.plain_copy(o, state.device, copy=False) for o in truth]
    kept_baseline = [_handoff.plain_copy(o, state.device, copy=False) for o in baseline]
    try:
        error: dict[str, Any] = baseline_error(kept_baseline, kept_truth)
    except ValueError as exc:  # the problem's fault: the parent says so
        error = {"structure_error": str(exc)}
    steps.mark("baseline_error")
    handed = _handoff.hand_over(kept_truth, state.device, request.out_path, state.handed, state.handoff)
    steps.mark("hand_over")
    return wire_replies.ExpectedReply(
        types=_type_names(baseline),
        truth_types=_type_names(truth),
        baseline_outputs=[_shape_and_dtype(o) for o in kept_baseline],
        baseline_error=error,
        outputs=handed,
        tf32_operators=operators,
        upcast_on_host=on_host,
        steps_s=steps.taken(),
    )


def _upcast_on_host(state: _State, narrow: list[Any]) -> bool:
    """Whether the draw's float64 copy is made from a host copy (:data:`HOST_UPCAST_BELOW`): on a
    GPU whose free memory, with what this process's allocator holds unused, is short of it."""
    if state.device.type != "cuda":
        return False
    free, _total = torch.cuda.mem_get_info(state.device)
    unused = torch.cuda.memory_reserved(state.device) - torch.cuda.memory_allocated(state.device)
    return free + unused < HOST_UPCAST_BELOW * kbv_inputs.draw_bytes(narrow, as_float64=True)


def _truth_sketches(state: _State, request: wire.TruthSketches) -> wire_replies.TruthSketchesReply:
    """The trusted reference's side of judging timed calls on unseen inputs (``timing.unseen_inputs``):
    for each of ``seeds`` (one per timed call of a round) the float64 truth of its draw, reduced
    here to what judging a sketch needs (``kbv.error_stats.truth_summary``: the sketch under
    ``sketch``, the sum of squares of its finite values), and never handed over. Without ``omega`` in the spec
    (the phase's first request) the map's frequency per output comes from the first draw's RMS and
    is returned. With ``baseline`` (a precision) every draw also runs the realistic baseline, whose
    error against that draw's truth (``kbv.error_stats``) sets the norm tolerance of the timed call
    on it, as a correctness draw's does; the first draw's outputs' shapes and dtypes are what a
    candidate's must have."""
    if state.role != "reference":
        raise PermissionError("only the trusted reference worker computes a draw's truth")
    from kbv.error_stats import finite_rms, truth_summary  # numbers, not a verdict

    spec = dict(request.sketch)
    baseline_precision = request.baseline
    sets: list[list[dict[str, Any] | None]] = []
    reply: dict[str, Any] = {}
    for k, seed in enumerate(int(s) for s in request.seeds):
        narrow = _make_inputs(state, request.distribution, seed, "fp32")
        wide = kbv_inputs.upcast_draw(narrow)
        _set_precision_flags("fp64")
        with torch.no_grad():
            outputs = _as_outputs(_model_for(state, "fp64")(*wide))
        truth = [_handoff.plain_copy(o, state.device, copy=False) for o in outputs]
        del wide, outputs
        if spec.get("omega") is None:
            spec["omega"] = [_sketch.omega_for(finite_rms(t)) for t in truth]
            reply["omega"] = spec["omega"]
        if baseline_precision is not None:
            error = _baseline_error_on(
                state, str(baseline_precision), narrow, truth, reply if k == 0 else None
            )
            reply.setdefault("baseline_errors", []).append(error)
        del narrow
        sets.append(truth_summary(truth, int(spec["seed"]), [float(w) for w in spec["omega"]]))
        del truth
    return wire_replies.TruthSketchesReply(sets=sets, **reply)


def _baseline_error_on(
    state: _State, precision: str, narrow: list[Any], truth: list[Any], described: dict[str, Any] | None
) -> dict[str, Any]:
    """The realistic baseline's error on one draw against its truth; with ``described``, the
    baseline's output shapes, dtypes and types go there too (what a candidate's must be)."""
    from kbv.error_stats import baseline_error  # numbers, not a verdict (the reference worker only)

    _set_precision_flags(precision)
    with torch.no_grad():
        outputs = _as_outputs(state.model(*narrow))
    base = [_handoff.plain_copy(o, state.device, copy=False) for o in outputs]
    del outputs
    if described is not None:
        described["baseline_outputs"] = [_shape_and_dtype(o) for o in base]
        described["types"] = _type_names(base)
    try:
        return baseline_error(base, truth)
    except ValueError as exc:  # the problem's fault: the parent says so
        return {"structure_error": str(exc)}
