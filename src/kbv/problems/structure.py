"""Structural invariants of a problem's inputs: what every hidden distribution must keep.

A problem's ``get_inputs`` can promise more than shapes: lower-triangular matrices, targets in
{-1, 1}, symmetric matrices, indices in range. A kernel may rely on such a promise (skip the zero
triangle, read one half of a symmetric matrix), so a hidden input that breaks it would reject an
honest kernel. Invariants are inferred here, on the trusted side, from a few draws of the
problem's own ``get_inputs`` under different public seeds; a problem may declare them instead in its
``KBV`` dict (``"structure": [...]``, one entry per positional input), and a declaration wins.
:func:`kbv.inputs.make_inputs` applies them (``structure=``). The format is in
``docs/correctness.md``. Sign and range are deliberately not inferred (they stay with
``KBV["domain"]``): almost every input is ``torch.rand``, and keeping it non-negative would undo the
distributions that catch sign shortcuts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kbv import inputs as kbv_inputs
from kbv.problems._loader import Problem, ProblemError

__all__ = [
    "InputStructure",
    "describe_structure",
    "infer_invariants",
    "input_structure",
    "normalise_declared",
]

#: Public seeds of the draws inference looks at (the problem's own draws, not the secret ones).
INFERENCE_SEEDS = (1, 2, 3)
#: A float input with at most this many distinct values (the same set in every draw) is set-valued.
MAX_VALUES = 8
#: ... provided it has at least this many entries (a random 3-element tensor is not a set).
MIN_SET_NUMEL = 64
#: Zeros present in some draws but not all (chance zeros of ``torch.rand``) may be at most this
#: fraction of the entries for the zeros common to all draws to count as a fixed pattern.
STRAY_ZEROS = 1e-4

_KEYS = ("zeros", "values", "symmetric")


@dataclass(frozen=True)
class InputStructure:
    """Per positional input: its invariants (None: none) and the element count of a floating tensor
    (0 for anything else), which sets the reduction lengths of the tolerance floor."""

    invariants: list[dict[str, Any] | None]
    numels: list[int] = field(default_factory=list)

    def applied(self) -> list[dict[str, Any] | None]:
        """The invariants :func:`kbv.inputs.make_inputs` applies (descriptive keys dropped)."""
        return [
            {k: v for k, v in inv.items() if k in _KEYS} or None if inv else None for inv in self.invariants
        ]


class _Accumulator:
    """What the draws of one positional input have in common. It keeps masks and a few facts of
    the draws, never a draw: the parent inferred a 47_Sum's structure at up to 42 GiB on an H100
    while it kept the last draw beside the next one's generation (2026-12-07)."""

    def __init__(self) -> None:
        self.kind = "none"
        self.numel = 0
        self.zeros_all: torch.Tensor | None = None  # zero in every draw
        self.zeros_any: torch.Tensor | None = None  # zero in some draw
        self.values: list[float] | None = None
        self.symmetric = True
        self.range: list[int] | None = None
        self.shape: torch.Size | None = None  # the last tensor draw's
        # the last draw has a zero where an earlier draw has none (so outside the common pattern)
        self.last_zero_outside = False
        self.consistent = True

    def add(self, x: Any) -> None:
        if not isinstance(x, torch.Tensor):
            self.consistent &= self.kind in ("none", "other")
            self.kind = "other"
            return
        kind = "float" if x.is_floating_point() else "exact"
        if self.kind not in ("none", kind) or (self.shape is not None and self.shape != x.shape):
            self.consistent = False
        if not self.consistent:
            return  # no invariant is inferred (result): nothing more to fold in
        self.kind, self.numel = kind, x.numel()
        if kind == "exact":
            self._add_exact(x)
        else:
            self._add_float(x)
        self.shape = x.shape

    def _add_exact(self, x: torch.Tensor) -> None:
        if x.numel():
            lo, hi = int(x.min()), int(x.max())
            self.range = [lo, hi] if self.range is None else [min(lo, self.range[0]), max(hi, self.range[1])]

    def _add_float(self, x: torch.Tensor) -> None:
        zero = x == 0
        if self.zeros_all is None or self.zeros_any is None:
            first = True
            self.zeros_all, self.zeros_any = zero, zero.clone()
        else:
            first = False
            # This draw's zeros outside the zeros every earlier draw shares are its zeros outside
            # the common pattern once it is folded in (``zero > common``: zero here, not there).
            self.last_zero_outside = bool(torch.gt(zero, self.zeros_all).any())
            self.zeros_all &= zero
            self.zeros_any |= zero
        del zero  # before the value set's masks are made
        found = _small_value_set(x)
        self.values = found if first else (found if found == self.values else None)
        square = x.dim() >= 2 and x.shape[-1] == x.shape[-2] and x.shape[-1] > 1
        self.symmetric &= square and bool(torch.equal(x, x.mT))

    def result(self) -> dict[str, Any] | None:
        if not self.consistent or self.kind in ("none", "other") or self.shape is None:
            return None
        if self.kind == "exact":
            return {"kept": "the problem's own draw", "range": self.range}
        out: dict[str, Any] = {}
        zeros = self._zero_pattern()
        if zeros is not None:
            out["zeros"] = zeros
        values = self._free_values(zeros is not None)
        if values:
            out["values"] = values
        if self.symmetric:
            out["symmetric"] = True
        return out or None

    def _zero_pattern(self) -> Any:
        assert self.zeros_all is not None and self.zeros_any is not None
        common = int(self.zeros_all.sum())
        if common == 0 or int(self.zeros_any.sum()) - common > STRAY_ZEROS * self.numel:
            return None
        return _band(self.zeros_all) or "mask"

    def _free_values(self, has_zeros: bool) -> list[float] | None:
        if not self.values or self.numel < MIN_SET_NUMEL:
            return None
        values = list(self.values)
        if has_zeros and 0.0 in values and not self.last_zero_outside:
            values.remove(0.0)  # 0 occurs only where the zero pattern puts it
        return values or None


def _small_value_set(x: torch.Tensor) -> list[float] | None:
    """The sorted distinct values of ``x`` when there are at most MAX_VALUES of them, else None.

    Candidates come from the first 4096 entries; one equality pass per candidate confirms them, so
    a large tensor is never sorted."""
    if x.numel() == 0:
        return None
    flat = x.reshape(-1)
    candidates = torch.unique(flat[:4096])
    if candidates.numel() > MAX_VALUES or not bool(torch.isfinite(candidates).all()):
        return None
    covered = torch.zeros_like(flat, dtype=torch.bool)
    for value in candidates:
        covered |= flat == value
    return [float(v) for v in candidates.tolist()] if bool(covered.all()) else None


def _band(zeros: torch.Tensor) -> Any:
    """The band form (``{"tril": k}``, ``{"triu": k}``, ``{"band": [lo, hi]}``) of a zero mask over the
    last two dims, the same in every leading slice; None when the mask is no band."""
    if zeros.dim() < 2:
        return None
    rows, cols = zeros.shape[-2:]
    slices = zeros.reshape(-1, rows, cols)
    first = slices[0]
    if not bool((slices == first).all()):
        return None
    keep = ~first
    filled = keep.any(dim=1)
    if not bool(filled.any()):
        return None
    row = torch.arange(rows, device=zeros.device)
    first_col = torch.argmax(keep.to(torch.uint8), dim=1)
    last_col = cols - 1 - torch.argmax(keep.flip(1).to(torch.uint8), dim=1)
    lo = int((first_col - row)[filled].min())
    hi = int((last_col - row)[filled].max())
    ones = torch.ones(rows, cols, dtype=torch.bool, device=zeros.device)
    if not bool(torch.equal(keep, ones.tril(hi).triu(lo))):
        return None
    lo_free, hi_free = lo <= -(rows - 1), hi >= cols - 1
    if lo_free and hi_free:
        return None
    if lo_free:
        return "lower" if hi == 0 else {"tril": hi}
    if hi_free:
        return "upper" if lo == 0 else {"triu": lo}
    return {"band": [lo, hi]}


def infer_invariants(draws: Iterable[list[Any]]) -> list[dict[str, Any] | None]:
    """Invariants common to ``draws`` (each the list ``get_inputs()`` returned), per positional input.

    ``draws`` may be a generator: each draw is folded in and let go before the next is asked for,
    so one is alive at a time if the generator lets its own go too (``_compute``'s does)."""
    accumulators: list[_Accumulator] | None = None
    for draw in draws:
        if accumulators is None:
            accumulators = [_Accumulator() for _ in draw]
        if len(draw) != len(accumulators):
            raise ProblemError(
                f"get_inputs() returned {len(draw)} inputs in one draw and {len(accumulators)} in another"
            )
        for acc, value in zip(accumulators, draw):
            acc.add(value)
            del value
        del draw
    return [acc.result() for acc in accumulators or []]


def normalise_declared(declared: Any, n_inputs: int, where: str) -> list[dict[str, Any] | None]:
    """A problem's ``KBV["structure"]`` checked and normalised; ProblemError says what is wrong.

    One entry per positional input: None (infer it), or a dict with any of ``zeros``, ``values``
    and ``symmetric`` (an empty dict declares that the input has none)."""
    if not isinstance(declared, (list, tuple)) or len(declared) != n_inputs:
        raise ProblemError(
            f"{where}: KBV['structure'] must be a list with one entry per input ({n_inputs}), not "
            f"{declared!r}"
        )
    out: list[dict[str, Any] | None] = []
    for i, entry in enumerate(declared):
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, dict) or set(entry) - set(_KEYS):
            raise ProblemError(
                f"{where}: KBV['structure'][{i}] must be None or a dict of {', '.join(_KEYS)}, not {entry!r}"
            )
        if "zeros" in entry and entry["zeros"] != "mask":
            try:
                kbv_inputs.band_limits(entry["zeros"])
            except ValueError as exc:
                raise ProblemError(f"{where}: KBV['structure'][{i}]: {exc}") from exc
        values = entry.get("values")
        if values is not None and (
            not isinstance(values, (list, tuple))
            or not values
            or not all(isinstance(v, (int, float)) for v in values)
        ):
            raise ProblemError(
                f"{where}: KBV['structure'][{i}]['values'] must be a non-empty list of numbers"
            )
        clean = {k: v for k, v in entry.items() if v not in (None, False)}
        if "values" in clean:
            clean["values"] = sorted(float(v) for v in clean["values"])
        out.append({**clean, "source": "declared"})
    return out


_CACHE: dict[str, InputStructure] = {}


def input_structure(problem: Problem, device: str = "cpu") -> InputStructure:
    """The problem's input invariants at the sizes it runs with on ``device``, inferred once per
    problem source, sizes and device type (cached in this process); a declaration wins per input.

    Draws run here, in the trusted parent, on ``device``. Raises ProblemError when the problem's
    ``get_inputs`` fails or its declaration is malformed."""
    dev = torch.device(device)
    sizes = problem.sizes_for(dev.type)
    key = json.dumps([problem.source_sha256, sizes, dev.type], sort_keys=True, default=str)
    if key not in _CACHE:
        _CACHE[key] = _compute(problem, dev, sizes)
    return _CACHE[key]


def _compute(problem: Problem, device: torch.device, sizes: dict[str, Any]) -> InputStructure:
    module = problem.load(sizes)
    numels: list[int] = []

    def draws() -> Iterator[list[Any]]:
        for seed in INFERENCE_SEEDS:
            draw = kbv_inputs.make_inputs(module, "original", seed, device)
            numels[:] = [
                v.numel() if isinstance(v, torch.Tensor) and v.is_floating_point() else 0 for v in draw
            ]
            yield draw
            del draw  # before the next draw is made

    try:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            found = infer_invariants(draws())
    except ProblemError:
        raise
    except Exception as exc:
        raise ProblemError(
            f"problem file {problem.path}: get_inputs() failed ({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the workers need the memory more than this process
    inferred = [{**inv, "source": "inferred"} if inv else None for inv in found]
    declared = problem.extras.get("structure")
    if declared is not None:
        for i, entry in enumerate(normalise_declared(declared, len(inferred), str(problem.path))):
            if entry is not None:
                inferred[i] = entry
    return InputStructure(invariants=inferred, numels=numels)


def describe_structure(problem: Problem, device: str = "cpu") -> list[dict[str, Any]]:
    """What ``kbv problems audit`` shows: one entry per input with invariants (``input`` is its
    position); never raises (a broken problem gives one entry with ``error``)."""
    try:
        found = input_structure(problem, device)
    except ProblemError as exc:
        return [{"error": str(exc)}]
    return [{"input": i, **inv} for i, inv in enumerate(found.invariants) if inv]
