"""Checks on the candidate's outputs over several calls: results remembered from other inputs,
outputs left unwritten, runs that disagree, and draws whose failure did not repeat.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kbv.error_stats import finite_rms, flat_chunks
from kbv.integrity._registry import register_check
from kbv.integrity.dynamic._context import CacheCalls, DynamicContext, _finding, _fmt, _max_diff
from kbv.records import Finding


@register_check(
    name="caching_probe",
    order=110,
    kind="dynamic",
    default_severity="fail",
    doc="""Memoisation keyed on data_ptr, id(), shape or a value sample. Four calls: draw A on fresh
    buffers; draw B copied into A's buffers (same pointers, new contents); B in new buffers; a mix
    that keeps A's first/last 64 and middle elements and B's values elsewhere. A and B are fresh
    secret draws the candidate has not seen (unlike the other probes, which reuse correctness draws),
    asked for two calls at a time. Each output is judged against the reference for the values
    actually passed; the first call is the control. A call that returns, bit for bit (two sums of
    its bytes, one weighted by position, say so), an earlier call's output for other inputs (where
    the reference's answers differ by more than REPEAT_ULPS units of the output's dtype: at bf16 a
    global mean rounds the mix and its source to the same bits honestly) is a cache hit whatever
    else happened; an integer output
    (argmax indices repeat honestly) counts only when it is also wrong. Calls wrong after a right
    control fail only a candidate that passed correctness: one that failed it already errs near
    the tolerance and is right or wrong on a fresh draw by chance.""",
)
def check_caching(ctx: DynamicContext) -> list[Finding]:
    probe = ctx.cache_probe()
    verdicts, repeated = _cache_calls_judged(ctx, probe["outputs"], probe["specs"])
    if repeated:  # evidence of a cache even when the candidate is wrong everywhere
        return [_finding("caching_probe", repeated)]
    if not verdicts or not verdicts[0]["passed"]:
        note = (
            (verdicts[0].get("note") or f"max_abs_err {_fmt(verdicts[0].get('max_abs_err'))}")
            if verdicts
            else "no outputs"
        )
        if ctx.session.correct:  # right in the correctness phase, wrong on fresh buffers now: a stale answer
            return [
                _finding(
                    "caching_probe",
                    f"a call on fresh buffers is wrong ({note}) although correctness passed; a "
                    "reused address or object may have hit a cache",
                )
            ]
        return [_finding("caching_probe", f"control call was not correct ({note}); no verdict", "info")]
    bad = [
        f"{_CACHE_LABELS[i]}: max_abs_err {_fmt(v.get('max_abs_err'))} {v.get('note') or ''}".strip()
        for i, v in enumerate(verdicts)
        if i and not v["passed"]
    ]
    if bad and not ctx.session.correct:
        # A candidate that already failed correctness and errs near the tolerance passes one fresh
        # draw and fails the next by chance (an fp16-accumulated bf16 row sum at 3-4x the limit did,
        # one run in two): no evidence of a cache beyond the bit-for-bit repeats checked above.
        return [
            _finding(
                "caching_probe",
                "calls after a right control were wrong, but the candidate failed correctness "
                "already: its errors straddle the tolerance; no verdict -- " + "; ".join(bad),
                "info",
            )
        ]
    return (
        [_finding("caching_probe", "wrong output after the control was right -- " + "; ".join(bad))]
        if bad
        else []
    )


_CACHE_LABELS = (
    "fresh buffers (control)",
    "same buffers, new contents",
    "new buffers, same contents",
    "same sampled values, other data",
)


def _cache_calls_judged(
    ctx: DynamicContext, calls: Sequence[list[Any]], specs: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], str | None]:
    """Each call judged against its own draw's answers, and the first call that repeats an earlier
    one's output (:func:`_repeat_of_an_earlier_call`), read once each, in order: the parent holds
    one call's outputs and one draw's answers (asked for once per draw and request: B's two calls
    share them where one request holds both), not the four calls' outputs at once
    (:class:`kbv.integrity.dynamic._context.CacheCalls`)."""
    verdicts: list[dict[str, Any]] = []
    marks: list[tuple[Any, ...]] = []
    held: tuple[dict[str, Any], dict[str, Any]] | None = None
    for i in range(len(calls)):
        if isinstance(calls, CacheCalls) and calls.starts_request(i):
            # the parent holds nothing of the probe while the candidate runs its next calls (a
            # draw's answers too large for the evaluation to keep are asked for again after them)
            held = None
            calls.ask(calls.pair_of(i))
        if held is None or held[0] != specs[i]:
            # asked for before the call's outputs are read, and after the last draw's answers
            # went: the parent then holds nothing of the probe while the reference works
            held = None
            held = (specs[i], ctx.expected(specs[i]))
        outputs = calls[i]
        marks.append(_fingerprint(outputs))
        verdicts.append(ctx.judge(outputs, specs[i], held[1]))
        repeated = _repeat_of_an_earlier_call(ctx, i, (outputs, held[1], verdicts[i]), specs, marks)
        if repeated:
            return verdicts, repeated
        del outputs
    return verdicts, None


def _repeat_of_an_earlier_call(
    ctx: DynamicContext,
    i: int,
    judged: tuple[list[Any], dict[str, Any], dict[str, Any]],
    specs: list[dict[str, Any]],
    marks: list[tuple[Any, ...]],
) -> str | None:
    """Call ``i`` (``judged``: its outputs, the reference's answers to its draw and its verdict)
    returned, bit for bit, an earlier call's output for other input values, where the reference's
    answers to the two differ: it came from a cache, not from the inputs. Bits are compared through
    the calls' fingerprints (``marks``, :func:`_fingerprint`): the earlier call's outputs are gone
    by then. A discrete output (integer or bool, such as argmax indices) that repeats and is right
    for its own inputs is no evidence: indices of other inputs are often the same."""
    outputs, expected, verdict = judged
    for j in range(i):
        if specs[i] == specs[j] or not _same_bits(marks[i], marks[j]):
            continue
        if _uniform(outputs):  # a uniform output (all zeros, say) is a constant, which correctness judges
            return None
        truths = expected["truth"]["outputs"], ctx.expected(specs[j])["truth"]["outputs"]
        if _bitwise_equal(*truths) or _apart_by_less_than_output_ulps(outputs, *truths):
            continue  # the reference cannot tell these inputs apart either, in this precision
        if _discrete(outputs) and verdict["passed"]:
            continue  # indices (argmax) repeat honestly; floating outputs of other inputs do not
        return (
            f"call {i + 1} ({_CACHE_LABELS[i]}) returned exactly the output of call {j + 1} "
            f"({_CACHE_LABELS[j]}) for different input values"
        )
    return None


def _same_bits(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two calls' fingerprints say their outputs are equal bit for bit: every output a
    tensor (an output of another type is no evidence) and every fingerprint the same."""
    return bool(a) and a == b and all(mark is not None for mark in a)


#: Elements a fingerprint's chunk reads at once; its weights are a 256 MiB int64 tensor.
_MARK_CHUNK = 1 << 25


def _fingerprint(outputs: list[Any]) -> tuple[Any, ...]:
    """Per output its dtype, shape and two sums of its bytes read as 16-bit integers (8-bit where
    their count is odd), in int64, which wraps: their plain sum, and their sum weighted by a
    pseudo-random function of their position. Outputs equal bit for bit always share both; outputs
    that differ share them only where their differences cancel in both sums, which a permutation of
    the same values, or two honest outputs by chance, does not. An adversary that matches them
    makes its own outputs look remembered."""
    marks: list[Any] = []
    for value in outputs:
        if not isinstance(value, torch.Tensor):
            marks.append(None)
            continue
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8)
        words = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw
        total = torch.zeros((), dtype=torch.int64, device=words.device)
        weighted = torch.zeros((), dtype=torch.int64, device=words.device)
        weights = _position_weights(min(words.numel(), _MARK_CHUNK), words.device)
        for chunk, start in enumerate(range(0, words.numel(), _MARK_CHUNK)):  # one read back, not one a chunk
            part = words[start : start + _MARK_CHUNK]
            total += part.sum(dtype=torch.int64)
            weighted += (part * weights[: part.numel()]).sum() * _chunk_factor(chunk)
        marks.append((str(value.dtype), tuple(value.shape), int(total), int(weighted)))
    return tuple(marks)


def _position_weights(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int64 weights, one a position: an odd multiplier's product with the position, its high
    bits folded into its low ones (xor-shift), multiplied again; wrapping arithmetic throughout."""
    w = torch.arange(1, n + 1, dtype=torch.int64, device=device) * _MIX_A
    w ^= w >> 29
    w *= _MIX_B
    return w


def _chunk_factor(chunk: int) -> int:
    """An odd int64 factor for chunk ``chunk``'s weighted sum, so chunks weigh their positions apart."""
    mixed = ((chunk + 1) * 0x9E3779B97F4A7C15) & (2**64 - 1)
    mixed ^= mixed >> 31
    mixed |= 1
    return mixed - 2**64 if mixed >= 2**63 else mixed


#: Odd multipliers (the golden ratio's and a MurmurHash finaliser's 64-bit constants), as int64.
_MIX_A = 0x9E3779B97F4A7C15 - 2**64
_MIX_B = 0xFF51AFD7ED558CCD - 2**64


#: Units in the last place of the output's dtype within which two truths are one answer: where the
#: truths of two draws differ by less, an honest kernel rounding to that dtype can return the same
#: bits for both. At bf16 the mix of the caching probe (another draw's values but for 129 positions)
#: moves a global mean or sum by well under one ulp (6 KernelBench level-2 references repeated their
#: output bit for bit on an H100, 2026-12-06); at fp32 the same mix moves it thousands of ulps.
REPEAT_ULPS = 4


def _apart_by_less_than_output_ulps(outputs: list[Any], a: list[Any], b: list[Any]) -> bool:
    """Whether truths ``a`` and ``b`` differ, element by element, by less than :data:`REPEAT_ULPS`
    units of ``outputs``' floating dtype at the larger of the element's magnitude and the truth's
    RMS (an element near zero is computed at the scale of its neighbours)."""
    if len(outputs) != len(a) or len(a) != len(b):
        return False
    for out, x, y in zip(outputs, a, b):
        if not all(isinstance(t, torch.Tensor) for t in (out, x, y)) or x.shape != y.shape:
            return False
        if not out.is_floating_point() or not x.is_floating_point():
            return False
        unit = REPEAT_ULPS * torch.finfo(out.dtype).eps
        floor = max(finite_rms(x), finite_rms(y))
        for cx, cy in flat_chunks(x, y):
            cx, cy = cx.double(), cy.double()
            # In place where it can be: this runs beside two float64 truths and a call's outputs,
            # with 1.7 GiB left on an H100 for 63_conv_standard_2D at bf16 (2026-12-08).
            limit = cx.abs()
            torch.maximum(limit, cy.abs(), out=limit)
            limit.clamp_min_(floor).mul_(unit)
            same = torch.sub(cx, cy).abs_() <= limit
            del limit
            same |= cx == cy
            same |= cx.isnan() & cy.isnan()
            if not bool(same.all()):
                return False
    return True


def _discrete(outputs: list[Any]) -> bool:
    return all(isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex()) for x in outputs)


def _uniform(outputs: list[Any]) -> bool:
    return all(isinstance(x, torch.Tensor) and _all_one_value(x) for x in outputs)


# Both read a chunk at a time: on a GPU ``x == v`` and ``torch.equal`` make a bool temporary of the
# whole tensor, and the cache probe asks them while the parent holds two float64 truths and the
# call's outputs. A 2.1e9-element output's 1.99 GiB was what an H100 had no room for in the
# parent, with 35.9 GiB of tensors in use (63_conv_standard_2D's cached mutant at bf16, 2026-12-08).
def _all_one_value(x: torch.Tensor) -> bool:
    if x.numel() <= 1:
        return True
    first = x.reshape(-1)[0]
    return all(bool((chunk == first).all()) for (chunk,) in flat_chunks(x))


def _bitwise_equal(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        isinstance(x, torch.Tensor)
        and isinstance(y, torch.Tensor)
        and x.shape == y.shape
        and x.dtype == y.dtype
        and all(torch.equal(cx, cy) for cx, cy in flat_chunks(x, y))
        for x, y in zip(a, b)
    )


def _nan_where_finite(got: list[Any], truth: list[Any]) -> int:
    count = 0
    for g, t in zip(got, truth):
        if (
            isinstance(g, torch.Tensor)
            and isinstance(t, torch.Tensor)
            and g.is_floating_point()
            and g.shape == t.shape
        ):
            # in chunks: isfinite of a float64 truth makes a temporary as large as the truth (14 GB
            # for 34_InstanceNorm, which ran the parent of an 80 GB H100 out of memory)
            for gc, tc in flat_chunks(g, t):
                count += int((torch.isnan(gc) & torch.isfinite(tc)).sum())
    return count


@register_check(
    name="unwritten_output",
    order=120,
    kind="dynamic",
    default_severity="fail",
    doc="""Output memory that the candidate never wrote. Freed allocator memory is filled with NaN
    before each of two calls on the same values in fresh buffers; NaN where the float64 truth is
    finite means the output was (partly) left as found; so does a poisoned run judged wrong from a
    candidate that passed correctness (a merely incorrect candidate is the correctness verdict's).""",
)
def check_unwritten_output(ctx: DynamicContext) -> list[Finding]:
    probe = ctx.poison_probe()
    expected = ctx.expected(probe["spec"])  # once: a truth the cache cannot keep is computed anew
    truth = expected["truth"]["outputs"]
    findings = []
    for k in range(len(probe["runs"])):  # one run's outputs held at a time (HandedCalls)
        run = probe["runs"][k]
        nans = _nan_where_finite(run, truth)
        verdict = ctx.judge(run, probe["spec"], expected)
        del run
        if nans:
            findings.append(
                _finding(
                    "unwritten_output",
                    f"poisoned run {k + 1}: {nans} NaN element(s) where the truth is finite",
                )
            )
        elif not verdict["passed"] and ctx.session.correct:
            findings.append(
                _finding(
                    "unwritten_output",
                    f"poisoned run {k + 1} is wrong: max_abs_err "
                    f"{_fmt(verdict.get('max_abs_err'))} {verdict.get('note') or ''}".strip(),
                )
            )
    return findings[:1]


@register_check(
    name="nondeterminism",
    order=130,
    kind="dynamic",
    default_severity="warn",
    doc="""Two calls on identical values in fresh buffers disagree by more than the reference's own
    run-to-run difference (measured by running the reference twice). Within tolerance it is a
    warning (atomics reorder sums); when one of the runs is judged wrong it fails.""",
)
def check_nondeterminism(ctx: DynamicContext) -> list[Finding]:
    probe = ctx.poison_probe()
    runs = probe["runs"]
    if len(runs) < 2:
        return []
    cand_diff = _max_diff(runs[0], runs[1])  # the two runs held only for their difference
    ref_runs = ctx.reference_runs(probe["spec"], "fp32", repeats=2)
    ref_diff = _max_diff(ref_runs[0], ref_runs[1])
    del ref_runs
    if cand_diff <= ref_diff:
        return []
    expected = ctx.expected(probe["spec"])
    passed = [ctx.judge(runs[k], probe["spec"], expected)["passed"] for k in range(len(runs))]
    severity = "warn" if all(passed) else "fail"
    return [
        _finding(
            "nondeterminism",
            f"two runs on identical inputs differ by {_fmt(cand_diff)} (reference: "
            f"{_fmt(ref_diff)}); runs judged {passed}",
            severity,
        )
    ]


@register_check(
    name="transient_mismatch",
    order=140,
    needs_probe=False,
    kind="dynamic",
    default_severity="warn",
    doc="""A correctness draw failed, then passed every re-run on the same inputs (the evaluation
    re-runs a failing draw before it counts). By default one such draw is a warning and two or more
    fail (unstable outputs: a racy kernel is not correct); the verified protocol raises it to fail
    on the first, since a wrong output on given inputs was demonstrated. The record says which draw
    and by how much, so a runtime glitch can be told from a racy kernel.""",
)
def check_transient_mismatch(ctx: DynamicContext) -> list[Finding]:
    return transient_findings(ctx.transients)


def transient_findings(transients: list[dict[str, Any]]) -> list[Finding]:
    """The ``transient_mismatch`` finding for the draws whose failure did not repeat (if any)."""
    if not transients:
        return []
    described = "; ".join(
        f"{t['draw']}: first run max_abs_err={_fmt(t.get('max_abs_err'))}, "
        f"rel_err={_fmt(t.get('rel_err'))}, then {t['reruns']} re-run(s) passed"
        for t in transients
    )
    severity = "warn" if len(transients) == 1 else "fail"
    return [
        _finding(
            "transient_mismatch",
            f"{len(transients)} draw(s) failed once and not again: {described}",
            severity,
        )
    ]
