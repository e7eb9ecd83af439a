"""The timing phase's requests: one timed batch (``time``) on kept or unseen input sets, and the
check that the timing functions captured at load are still the ones in place (``identities``)."""

from __future__ import annotations

import time
from typing import Any

import torch

from kbv import inputs as kbv_inputs
from kbv import sketch as _sketch
from kbv import wire, wire_replies
from kbv.child import timing as kbv_timing
from kbv.child.forward import (
    _as_outputs,
    _device_bytes,
    _make_inputs,
    _model_for,
    _set_precision_flags,
    _State,
    _Steps,
)
from kbv.protocol import timing_settings_from_dict


def _time(state: _State, request: wire.Time) -> wire_replies.TimeReply:
    """One timed batch. With ``sketch`` (a seed and a map frequency per output, the same in every
    worker's request of a round) every timed call's outputs are sketched (``kbv.sketch``) right after
    the call returned and was synchronised and timed, outside the timed region: the same work for
    every call, so nothing tells one call from another; the sketches come back with the samples.
    With ``unseen_seeds`` (``timing.unseen_inputs``) timed call ``i`` runs on the draw of the i-th
    seed, made just before it outside the timed region and dropped once its outputs are sketched;
    the kept sets of ``seeds`` serve the warm-up only."""
    precision = request.precision
    _set_precision_flags(precision)
    settings = timing_settings_from_dict(request.settings)
    seeds = [int(s) for s in request.seeds]
    unseen_seeds = [int(s) for s in request.unseen_seeds or []]
    steps = _Steps(request.steps, state.device.type == "cuda")
    input_sets = _timing_inputs(state, request.distribution, seeds, precision)
    steps.mark("inputs")
    model = _model_for(state, precision)
    last: list[Any] = [None] * len(input_sets)
    spec = request.sketch
    sketches: list[list[dict[str, Any]]] = []
    sketch_s = [0.0]
    unseen_out: list[Any] = [None]

    def call(k: int) -> None:
        last[k] = model(*input_sets[k])

    def unseen(i: int) -> Any:
        if i >= len(unseen_seeds):
            raise RuntimeError(f"timed call {i} has no unseen input set ({len(unseen_seeds)} sent)")
        unseen_out[0] = None  # the previous call's set and outputs go before the next is drawn
        args = _make_inputs(state, request.distribution, unseen_seeds[i], precision)

        def run() -> None:
            unseen_out[0] = model(*args)

        return run

    def outputs_of(i: int) -> Any:
        return unseen_out[0] if unseen_seeds else last[i % len(input_sets)]

    def on_sample(i: int, device_ms: float, wall_ms: float) -> None:
        assert spec is not None  # passed to the recipe only with a spec
        started = time.perf_counter()
        sketches.append(_sketch.sketch_outputs(_as_outputs(outputs_of(i)), spec, state.device))
        if steps.on:
            if state.device.type == "cuda":
                torch.cuda.synchronize()
            sketch_s[0] += time.perf_counter() - started

    flush = kbv_timing.make_l2_flush(state.device) if settings.l2_flush else None
    with torch.no_grad():
        measurement = kbv_timing.measure(
            call,
            settings=settings,
            n_input_sets=len(input_sets),
            timer=state.timer,
            flush=flush,
            on_sample=on_sample if spec is not None else None,
            unseen=unseen if unseen_seeds else None,
        )
    unseen_out[0] = None
    if steps.on:
        steps.mark("measure")
        timed_s = sum(measurement.wall_ms) / 1e3
        # the recipe's seconds split: the timed calls, their sketches, and the rest (warm-up, the
        # unseen sets' draws, the L2 flushes, the synchronisations around each call)
        steps.seconds["timed_calls"] = timed_s
        steps.seconds["sketches"] = sketch_s[0]
        steps.seconds["warmup_flush_sync"] = steps.seconds.pop("measure") - timed_s - sketch_s[0]
    return wire_replies.TimeReply(
        measurement=measurement.to_dict(),
        sketches=sketches if spec is not None else None,
        steps_s=steps.taken(),
    )


#: Bytes of timing input sets a worker keeps between the timing phase's requests, as a share of the
#: device's memory (on the CPU, :data:`KEPT_TIMING_INPUTS_CPU`): each round and each baseline then
#: times the sets the first request drew instead of drawing them again (on the H200 a draw of a
#: median problem's inputs costs 10-50 ms, and ``verified`` asks for 3 sets in up to 9 requests).
KEPT_TIMING_INPUTS_SHARE = 1 / 32


KEPT_TIMING_INPUTS_CPU = 1 << 30


def _timing_inputs(state: _State, distribution: str, seeds: list[int], precision: str) -> list[Any]:
    """The input sets of a timed batch: the ones kept from the phase's previous request when it
    named the same draws (the values are the same: a draw is a function of its seed), else drawn
    now and kept when they are small. Reusing them tells the worker nothing it did not know: every
    round times the same seeds, and within a round each set is called ten times already."""
    kind = "fp64" if precision == "fp64" else "fp32"
    key = (distribution, tuple(seeds), kind)
    if state.timing_inputs is not None and state.timing_inputs[0] == key:
        return state.timing_inputs[1]
    state.timing_inputs = None
    sets = [_make_inputs(state, distribution, s, precision) for s in seeds]
    limit = (
        KEPT_TIMING_INPUTS_SHARE * _device_bytes(state)
        if state.device.type == "cuda"
        else KEPT_TIMING_INPUTS_CPU
    )
    if kbv_inputs.draw_bytes(sets) <= limit:
        state.timing_inputs = (key, sets)
    return sets


def _identities(state: _State, request: wire.Identities) -> wire_replies.IdentitiesReply:
    return wire_replies.IdentitiesReply(changed=kbv_timing.verify_identities(state.identities))
