"""What measuring one pair needs from the evaluation: :class:`MeasureContext` (and
:class:`UnseenJudge`), read by ``kbv.performance``, ``kbv.timed_sketches`` and ``kbv.baseline_cache``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kbv import wire
from kbv.protocol import CorrectnessSettings, TimingSettings


@dataclass(frozen=True)
class UnseenJudge:
    """What judging timed calls on unseen draws needs beside the reference's ``truth_sketches``
    replies: the correctness settings (the error model's norm limit) and the problem's input element
    counts (each output's reduction length, :func:`kbv.correctness.reduction_lengths`)."""

    settings: CorrectnessSettings
    input_numels: tuple[int, ...]


class MeasureContext:
    """What measuring one pair needs from the pipeline."""

    def __init__(
        self,
        *,
        problem: Any,
        device: str,
        settings: TimingSettings,
        seeds: list[int],
        init_seed: int,
        device_info: dict[str, Any],
        torch_version: str,
        load: wire.Load,
        sketch_seed: int | None = None,
        timed_reference: Callable[[int], dict[str, Any]] | None = None,
        build: Callable[[], None] | None = None,
        recheck_brackets: bool = False,
        tf32_operators: dict[str, Any] | None = None,
        precision: str = "fp32",
        unseen_seeds: Callable[[int], list[int]] | None = None,
        unseen_judge: UnseenJudge | None = None,
    ) -> None:
        """``sketch_seed`` (derived from the evaluation's master seed) draws each round's sketch basis;
        ``timed_reference(seed)`` is what judging a timed call on the timing input set of ``seed``
        needs (``kbv.correctness.timed_reference`` of the pipeline's expected outputs); without both
        the timed outputs are not checked. ``build`` builds both models with the timing parameters;
        ``recheck_brackets`` times ``kbv.performance.RECHECK_BATCHES`` trusted batches after the
        rounds when the parent's brackets disagree with the candidate's samples
        (``timing_disagreement`` reads them).
        ``tf32_operators`` is the trusted reference worker's account of its forward
        (:func:`kbv.child.tf32_ops.summary`); None when it was not recorded. ``precision`` is the
        evaluation's (``Protocol.precision``): the workers hold the models and draw the inputs in it.

        ``unseen_seeds(r)`` (``timing.unseen_inputs``) is one seed per timed call of round ``r``,
        none of them drawn before: every batch of the round times its calls on those draws, and the
        warm-up alone rotates over ``seeds``. ``unseen_judge`` lets the trusted reference reduce each
        such draw's truth to its sketch in its own process (one ``truth_sketches`` request a round,
        under the error model); without it each draw's reference comes from ``timed_reference``."""
        self.problem = problem
        self.device = device
        self.settings = settings
        self.seeds = seeds
        self.init_seed = init_seed
        self.device_info = device_info
        self.torch_version = torch_version
        self.load = load
        self.sketch_seed = sketch_seed
        self.timed_reference = timed_reference
        self.build = build
        self.recheck_brackets = recheck_brackets
        self.tf32_operators = tf32_operators
        self.precision = precision
        self.unseen_seeds = unseen_seeds
        self.unseen_judge = unseen_judge
        if settings.unseen_inputs and unseen_seeds is None:
            raise ValueError(
                "timing.unseen_inputs needs MeasureContext.unseen_seeds (one seed per timed call)"
            )

    def unseen_for(self, r: int) -> list[int] | None:
        """The seeds of round ``r``'s timed calls, or None where timed calls rotate over ``seeds``."""
        if not self.settings.unseen_inputs or self.unseen_seeds is None:
            return None
        return list(self.unseen_seeds(r))

    @property
    def checks_timed_outputs(self) -> bool:
        return self.sketch_seed is not None and self.timed_reference is not None
