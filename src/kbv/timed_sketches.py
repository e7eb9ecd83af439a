"""Every timed call's outputs, judged by their sketches (``kbv.sketch``, ``timed_call_outputs``).

``kbv.performance`` times the rounds; the plans here say what each timed request carries (the
round's sketch seed and the map's frequencies) and judge every sketch the worker returned against
the reference's for the same inputs: the timing input sets' (:class:`_SketchPlan`), or each unseen
draw's float64 truth, sketched by the trusted reference worker (:class:`_UnseenPlan`).
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import torch

from kbv import correctness, wire, wire_replies
from kbv import sketch as kbv_sketch
from kbv.seeds import derive_seed
from kbv.worker import Worker

if TYPE_CHECKING:
    from kbv.measure_context import MeasureContext, UnseenJudge


class _SketchPlan:
    """Every timed call's outputs, judged by their sketches (``kbv.sketch``, ``timed_call_outputs``).

    Each round has a sketch seed of its own; the parent sends it, with the map's frequency per output
    (``kbv.sketch.omega_for`` of the reference's RMS on the first timing input set), in every ``time``
    request of the round, the candidate's and the baselines' alike. The worker sketches every timed
    call's outputs right after the call returned, outside the timed region, and the sketches come
    back with the samples; the parent judges each against the reference's sketch for the same
    input set (``kbv.correctness.judge_sketch``). Nothing in a request says which calls matter: every
    call does, so a candidate that reads its own request learns nothing it could exploit. The
    reference's sketches for every round are computed before the first batch, one input set at a
    time, and its outputs are not kept; the baselines' sketches are judged the same way, as a
    calibration of the judge."""

    def __init__(self, ctx: MeasureContext) -> None:
        assert ctx.timed_reference is not None and ctx.sketch_seed is not None
        picker = random.Random(ctx.sketch_seed)
        settings = ctx.settings
        self.round_seeds = [
            picker.getrandbits(63) for _ in range(max(1, settings.rounds, settings.max_rounds))
        ]
        self.ctx = ctx
        first = range(max(1, settings.rounds))
        # One input set's reference at a time: its sketches for every round are taken and its
        # tensors dropped before the next set's are computed (all sets' float64 truths at once held
        # 56 GB in the parent on the H200 for an 8.5 GB output). The map's frequency per output
        # comes from the first set's RMS (the sets are draws of one distribution).
        self.omegas: list[float] = []
        by_set: list[list[list[dict[str, Any]]]] = []  # per input set, per round, per output
        self.references = []
        for seed in ctx.seeds:
            ref = ctx.timed_reference(seed)
            if not self.omegas:
                self.omegas = [kbv_sketch.omega_for(float(rms)) for rms in ref["rms"]]
            by_set.append(self._sketches(ref, first))
            self.references.append(
                {
                    **{k: v for k, v in ref.items() if k != "targets"},
                    "like": [correctness.stand_in(o) for o in ref["like"]],
                }
            )
            del ref
        # Per round, per input set, per output: the reference's sketch (the rounds after the first
        # ``rounds``, timed only until precise, get theirs when they start: :meth:`spec`).
        self.targets = [[sketches[r] for sketches in by_set] for r in first]
        self.checked, self.wrong_calls, self.max_ratio = 0, 0, 0.0
        self.wrong: list[dict[str, Any]] = []
        self.baselines: dict[str, dict[str, Any]] = {}

    def _sketches(self, ref: dict[str, Any], rounds: range) -> list[list[dict[str, Any]]]:
        """Per round of ``rounds``, per output: the sketch of one input set's reference."""
        return [
            [_target_sketch(t, self.round_seeds[r], i, self.omegas[i]) for i, t in enumerate(ref["targets"])]
            for r in rounds
        ]

    def spec(self, r: int) -> dict[str, Any]:
        """What every ``time`` request of round ``r`` carries: the same for every worker. A round
        beyond those sketched so far gets the reference's sketches first, from its outputs asked for
        again (the evaluation's cache holds them, or the reference worker computes them anew)."""
        if r >= len(self.targets):
            assert self.ctx.timed_reference is not None
            new = range(len(self.targets), r + 1)
            by_set = []
            for seed in self.ctx.seeds:
                by_set.append(self._sketches(self.ctx.timed_reference(seed), new))
            self.targets += [[sketches[i] for sketches in by_set] for i in range(len(new))]
        return {"seed": self.round_seeds[r], "omega": list(self.omegas)}

    def _verdicts(self, r: int, measurement: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
        """(call, verdict) for each judged timed call of a batch: every call here
        (``measurement`` loses its ``sketches``)."""
        sketches = measurement.pop("sketches", None)
        got = sketches if isinstance(sketches, list) else []
        verdicts = []
        for i in range(len(measurement["device_ms"])):
            entry = got[i] if i < len(got) else None
            target, reference = self._expected(r, i)
            verdicts.append((i, correctness.judge_sketch(entry, target, reference, self.omegas)))
        return verdicts

    def _expected(self, r: int, i: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The reference's sketches and judging data for timed call ``i`` of round ``r``."""
        k = self.input_set(i)
        return self.targets[r][k], self.references[k]

    def input_set(self, i: int) -> int:
        """Which input set timed call ``i`` ran on (the record's ``wrong[].input_set``)."""
        return i % len(self.references)

    def judge(self, r: int, measurement: dict[str, Any]) -> None:
        """Judge every timed call of the candidate's batch of round ``r``."""
        for i, verdict in self._verdicts(r, measurement):
            self.checked += 1
            if verdict["passed"]:
                self.max_ratio = max(self.max_ratio, float(verdict["ratio"]))
                continue
            self.wrong_calls += 1
            if len(self.wrong) < WRONG_CALLS_LISTED:
                self.wrong.append(
                    {
                        "round": r,
                        "call": i,
                        "input_set": self.input_set(i),
                        "ratio": verdict["ratio"],
                        "note": verdict["note"],
                    }
                )

    def calibrate(self, name: str, r: int, measurement: dict[str, Any]) -> None:
        """Judge a baseline's batch the same way: its ratios show how far honest outputs sit from the
        limit (a calibration of the judge; a baseline is never blamed)."""
        verdicts = [v for _, v in self._verdicts(r, measurement)]
        seen = self.baselines.setdefault(name, {"checked": 0, "wrong": 0, "max_ratio": 0.0})
        seen["checked"] += len(verdicts)
        seen["wrong"] += sum(1 for v in verdicts if not v["passed"])
        finite = [float(v["ratio"]) for v in verdicts if v["ratio"] is not None and math.isfinite(v["ratio"])]
        seen["max_ratio"] = max([seen["max_ratio"], *finite])

    def summary(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "wrong_calls": self.wrong_calls,
            "wrong": self.wrong,
            "max_ratio": self.max_ratio,
            "limit": correctness.SKETCH_LIMIT,
            "projections": kbv_sketch.PROJECTIONS,
            "omega": list(self.omegas),
            "baselines": self.baselines,
            "method": (
                "every timed call of every candidate batch: a sketch of its outputs (kbv.sketch) taken "
                "right after the call returned, judged against the reference's sketch for the same "
                "input set"
            ),
        }


class _UnseenPlan(_SketchPlan):
    """Timed calls judged by their sketches when every timed call runs on a draw of its own
    (``timing.unseen_inputs``): the round's draws are the ``unseen_seeds`` of every batch of the
    round, and call ``i`` is judged against draw ``i``'s truth. Under the error model with an
    :class:`UnseenJudge` the trusted reference reduces each judged draw's truth to its sketch in its
    own process (``truth_sketches`` requests: no truth crosses to the parent, no baseline forward but
    the phase's first draw's, whose error sets every call's norm limit); otherwise each judged draw's
    reference comes from ``timed_reference`` and is sketched here.

    With ``judged_calls`` (k > 0) every call is still sketched in the worker, but only k calls of a
    round are judged, picked after the candidate's batch returned from a secret no request carries
    (:meth:`picks`), with the phase's first draw (its truth calibrates the judge) judged as well:
    the reference computes k float64 truths a round instead of one per call (docs/timing.md, "Judging
    a secret sample of the timed calls"). The baselines' batches of a round are judged on the same
    calls once the picks exist."""

    def __init__(self, ctx: MeasureContext, reference: Worker) -> None:
        assert ctx.sketch_seed is not None and ctx.unseen_seeds is not None
        picker = random.Random(ctx.sketch_seed)
        settings = ctx.settings
        self.round_seeds = [
            picker.getrandbits(63) for _ in range(max(1, settings.rounds, settings.max_rounds))
        ]
        self.ctx, self.reference = ctx, reference
        self.omegas = []
        self.like: list[Any] | None = None
        # (round, call) -> (the reference's sketch per output, its judging data)
        self.truths: dict[tuple[int, int], tuple[list[dict[str, Any]], dict[str, Any]]] = {}
        self.picked: dict[int, list[int]] = {}  # per round: the calls judged
        self.pending: dict[int, list[tuple[str, dict[str, Any]]]] = {}  # baselines' batches to judge
        self.references = []
        self.checked, self.wrong_calls, self.max_ratio = 0, 0, 0.0
        self.timed_calls = 0
        self.wrong = []
        self.baselines = {}

    def spec(self, r: int) -> dict[str, Any]:
        if not self.omegas:  # the phase's first draw: the map's frequencies, the judge's norm limit
            self._truth_for(0, [0])
        return {"seed": self.round_seeds[r], "omega": list(self.omegas)}

    def picks(self, r: int, n: int) -> list[int]:
        """The calls of round ``r``'s batches (``n`` timed calls) that are judged: all of them without
        ``judged_calls``, else ``judged_calls`` of them drawn from a seed derived from the parent's
        secret sketch seed (never sent to a worker: the round seeds sent are drawn from it, not it)
        and the round's draws (candidates of one batch share their master seed, never their draws),
        with every call whose truth is already known (the phase's first draw)."""
        k = self.ctx.settings.judged_calls
        if k <= 0 or k >= n:
            return list(range(n))
        assert self.ctx.sketch_seed is not None
        draws = self.ctx.unseen_for(r) or []
        chooser = random.Random(derive_seed(self.ctx.sketch_seed, "judged-calls", r, n, *draws))
        known = {i for (rr, i) in self.truths if rr == r and i < n}
        return sorted(set(chooser.sample(range(n), k)) | known)

    def _truth_for(self, r: int, calls: list[int]) -> None:
        """The reference's sketch of each of ``calls``' draws in round ``r`` not known yet."""
        seeds = self.ctx.unseen_for(r) or []
        missing = [i for i in calls if (r, i) not in self.truths and i < len(seeds)]
        if not missing:
            return
        chosen = [seeds[i] for i in missing]
        if self.ctx.unseen_judge is not None and self.ctx.unseen_judge.settings.mode == "error_model":
            targets, references = self._from_reference_worker(r, chosen, self.ctx.unseen_judge)
        else:
            targets, references = self._from_timed_reference(r, chosen)
        for i, target, reference in zip(missing, targets, references, strict=True):
            self.truths[(r, i)] = (target, reference)

    def _from_reference_worker(
        self, r: int, seeds: list[int], judge: UnseenJudge
    ) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
        """Each draw's sketch and judging data from the reference worker, which also runs the
        realistic baseline on every draw: its error there sets that call's norm limit, as a
        correctness draw's does. One draw's error says little of the next's where the truth's norm
        varies from draw to draw (98_KLDivLoss draws its scale: at bf16 the baseline's relative error
        spans 2e-5 to 0.35 over 400 draws, and a limit from the first draw alone rejected the
        reference itself on an H100, 2026-12-06)."""
        first = self.like is None
        # TF32 exists only for fp32: a bf16 or fp16 evaluation's realistic baseline is eager in it
        on_cuda = self.ctx.device.startswith("cuda") and self.ctx.precision == "fp32"
        sketch = {"seed": self.round_seeds[r], "omega": list(self.omegas) if self.omegas else None}
        reply = wire_replies.TruthSketchesReply.of(
            self.reference.request(
                wire.TruthSketches(
                    distribution="original",
                    seeds=seeds,
                    sketch=sketch,
                    baseline="tf32" if on_cuda else "fp32",
                )
            )
        )
        errors = reply.baseline_errors or []
        if len(errors) != len(seeds) or any(
            not isinstance(e, dict) or "structure_error" in e for e in errors
        ):
            raise RuntimeError(f"the reference worker's baseline errors on unseen timing draws: {errors}")
        if first:
            if reply.baseline_outputs is None:
                raise RuntimeError(
                    "the reference worker described no baseline outputs of an unseen timing draw"
                )
            self.like = [correctness.described_like(d) for d in reply.baseline_outputs]
            self.omegas = [float(w) for w in reply.omega or []]
        assert self.like is not None
        sets = reply.sets
        if len(sets) != len(seeds):
            raise RuntimeError(f"the reference worker sketched {len(sets)} of {len(seeds)} unseen draws")
        lengths = correctness.reduction_lengths(judge.input_numels, self.like)
        judged = [
            correctness.unseen_reference(summary, self.like, error, judge.settings, lengths)
            for summary, error in zip(sets, errors, strict=True)
        ]
        return [t for t, _ in judged], [ref for _, ref in judged]

    def _from_timed_reference(
        self, r: int, seeds: list[int]
    ) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
        assert self.ctx.timed_reference is not None
        targets, references = [], []
        for seed in seeds:
            ref = self.ctx.timed_reference(seed)
            if not self.omegas:
                self.omegas = [kbv_sketch.omega_for(float(rms)) for rms in ref["rms"]]
            seed_r = self.round_seeds[r]
            targets.append(
                [_target_sketch(t, seed_r, i, self.omegas[i]) for i, t in enumerate(ref["targets"])]
            )
            references.append(
                {
                    **{k: v for k, v in ref.items() if k != "targets"},
                    "like": [correctness.stand_in(o) for o in ref["like"]],
                }
            )
            del ref
        return targets, references

    def _expected(self, r: int, i: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return self.truths[(r, i)]

    def _verdicts(self, r: int, measurement: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
        """(call, verdict) for each call of :meth:`picks`; a call that came back with no sketch at
        all is wrong whether picked or not (that needs no truth)."""
        sketches = measurement.pop("sketches", None)
        got = sketches if isinstance(sketches, list) else []
        n = len(measurement["device_ms"])
        # every call (no ``judged_calls``), or the round's picks, drawn once for all its batches
        if self.ctx.settings.judged_calls <= 0:
            picks = self.picks(r, n)
        else:
            if r not in self.picked:
                self.picked[r] = self.picks(r, n)
            picks = self.picked[r]
        self._truth_for(r, picks)
        verdicts = []
        for i in range(n):
            entry = got[i] if i < len(got) else None
            if i in picks:
                target, reference = self._expected(r, i)
                verdicts.append((i, correctness.judge_sketch(entry, target, reference, self.omegas)))
            elif not isinstance(entry, list):
                note = "the worker reported no sketch of this call's outputs"
                verdicts.append((i, {"passed": False, "ratio": None, "note": note}))
        return verdicts

    def calibrate(self, name: str, r: int, measurement: dict[str, Any]) -> None:
        """A baseline's batch runs before the candidate's in a round: its sketches wait for the
        round's picks, drawn once the candidate's batch returned (:meth:`judge`)."""
        if self.ctx.settings.judged_calls <= 0:
            super().calibrate(name, r, measurement)
            return
        kept = {"sketches": measurement.pop("sketches", None), "device_ms": list(measurement["device_ms"])}
        self.pending.setdefault(r, []).append((name, kept))

    def judge(self, r: int, measurement: dict[str, Any]) -> None:
        self.timed_calls += len(measurement["device_ms"])
        super().judge(r, measurement)
        for name, kept in self.pending.pop(r, []):
            super().calibrate(name, r, kept)

    def input_set(self, i: int) -> int:
        return i  # every timed call has a draw of its own

    def summary(self) -> dict[str, Any]:
        found = super().summary()
        found["unseen_inputs"] = True
        k = self.ctx.settings.judged_calls
        found["timed_calls"] = self.timed_calls
        found["judged_calls"] = {str(r): calls for r, calls in sorted(self.picked.items())}
        found["method"] = (
            "every timed call of every candidate batch on an input set drawn for it alone, which no "
            "earlier call saw, its outputs sketched (kbv.sketch) right after the call returned; "
            + (
                "every sketch judged"
                if k <= 0
                else f"{k} calls a round (and the phase's first draw) picked after the batch from a "
                "secret no worker saw, their sketches judged"
            )
            + " against the reference's sketch of the same draw's float64 truth"
        )
        return found


def _plan_for(ctx: MeasureContext, reference: Worker) -> _SketchPlan | None:
    """How the timed calls' outputs are judged: None where they are not."""
    if not ctx.checks_timed_outputs:
        return None
    if ctx.settings.unseen_inputs:
        return _UnseenPlan(ctx, reference)
    return _SketchPlan(ctx)


#: Wrong timed calls listed in the record (all are counted in ``wrong_calls``).
WRONG_CALLS_LISTED = 10


def _target_sketch(target: Any, seed: int, index: int, omega: float) -> dict[str, Any]:
    return kbv_sketch.sketch_tensor(target, seed, index, omega) if isinstance(target, torch.Tensor) else {}
