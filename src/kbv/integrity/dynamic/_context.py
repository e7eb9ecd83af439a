"""The dynamic checks' context: the live session and each probe's results, computed once.

Probes run in the workers (``kbv.child.probes``) and report raw observations; this context asks for
them, caches them for the checks that read them and turns a candidate's failure inside a probe into
``_ProbeFailed`` (a reference's into ``_ReferenceProbeFailed``: kbv's problem, never the candidate's).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn, overload

import torch

from kbv import wire, wire_replies
from kbv.devices import release_cached_blocks
from kbv.integrity._registry import get_check
from kbv.records import Finding
from kbv.worker import WorkerFailed

#: The observe probe looks at the outputs and the thread count again this long after the call
#: returned: OBSERVE_DELAY_FORWARDS of the reference's forward times (the parent's own timing of the
#: eager baseline, never a figure the candidate reports), at least OBSERVE_DELAY_MIN_S and at most
#: OBSERVE_DELAY_S (also the delay when no baseline was timed). Why the look need not be longer:
#: docs/integrity-dynamic.md, "How long the look waits".
OBSERVE_DELAY_S = 0.2
OBSERVE_DELAY_MIN_S = 0.02
OBSERVE_DELAY_FORWARDS = 4
#: Worker failures that end the evaluation (the evaluation records them as outcomes).
_REFUSE = ("crashed", "timeout", "cuda_error", "resource_limit")


def reference_forward_ms(timing: dict[str, Any] | None) -> float | None:
    """The slowest timed baseline's median wall milliseconds a call (the reference's forward as the
    parent timed it), or None when no baseline was timed."""
    medians = [
        entry.get("wall_summary", {}).get("median")
        for entry in ((timing or {}).get("baselines") or {}).values()
        if isinstance(entry, dict)
    ]
    finite = [float(m) for m in medians if isinstance(m, (int, float)) and math.isfinite(m) and m > 0]
    return max(finite) if finite else None


def _out_of_memory(failure: WorkerFailed) -> bool:
    """A probe that ran out of memory shows no hack: it ends the evaluation as the candidate's
    ``runtime_error``, as an ordinary call that runs out does, not as ``hack_detected``. (On an H200
    shared with other evaluations, the reference itself was called a hack by ``caching_probe`` when
    the device filled up under it.) Not passed either way: a candidate gains nothing by running out."""
    return "out of memory" in failure.message.lower()


class _ProbeFailed(Exception):
    """The candidate raised inside a probe (its worker is still alive)."""


class _ReferenceProbeFailed(Exception):
    """The reference raised inside a probe: kbv's problem, reported as info, never blamed on the candidate."""


@dataclass
class DynamicContext:
    """The session plus probe results computed once and shared between checks.

    Probes run on the correctness draws of the session's probe distribution (``draw(k)``), so the
    reference outputs they are judged against were already computed; each probe's seconds go to
    ``session.phases`` (the first check that needs a shared probe pays for it)."""

    session: Any
    _cache: dict[str, Any] = field(default_factory=dict)
    #: What checks correct, for the caller to apply (checks never change the session): ``speedup``
    #: (the corrected speedups) and ``trusted_candidate_ms`` (the per-call time the parent's
    #: bracket supports), both from timing_disagreement; later checks read them here.
    corrections: dict[str, Any] = field(default_factory=dict)

    @property
    def timing(self) -> dict[str, Any] | None:
        """The evaluation's timing section (what the checks that need no probe read)."""
        return self.session.timing  # type: ignore[no-any-return]

    @property
    def transients(self) -> list[dict[str, Any]]:
        """The correctness draws whose failure did not repeat."""
        return list(self.session.transients)

    def speedup(self) -> dict[str, Any]:
        """The speedups as the checks so far leave them (corrected, else the session's)."""
        return dict(self.corrections.get("speedup") or self.session.speedup or {})

    # -- plumbing -------------------------------------------------------------------------------
    def once(self, key: str, compute: Any) -> Any:
        """A probe's result, computed at most once: a probe's failure is kept and raised to every
        reader (as one :meth:`concurrently` stored)."""
        if key not in self._cache:
            started = time.monotonic()
            within = getattr(self.session, "within_phase", contextlib.nullcontext)
            try:
                with within(key):
                    self._cache[key] = compute()
            except (_ProbeFailed, _ReferenceProbeFailed) as exc:
                # Kept, as concurrently() keeps it: each later reader raises it again instead of
                # running the probe again (seven checks read the observation; a reference that
                # failed it on an H100 ran it seven times, 3.8 s, 2026-12-07).
                self._cache[key] = exc
                raise
            finally:
                count_seconds(self.session, key, time.monotonic() - started)
        value = self._cache[key]
        if isinstance(value, Exception):
            raise value
        return value

    def request(self, worker: Any, request: wire.Request) -> wire_replies.Reply:
        self._room_for(worker)
        return self._answer(worker, lambda: worker.request(request))

    def _reference_failed(self, failure: WorkerFailed) -> NoReturn:
        """Raise what the trusted reference's failure inside a probe becomes: the checks that need
        that probe are ``not checked`` (info), kbv's gap and never the candidate's fault, except
        where the reference ran out of device memory. That failure goes to the evaluation as it
        is, which decides whose it is (``kbv.evaluation.budget._starved_reference``): kbv's
        ``HarnessError`` where the candidate kept within its limit, the candidate's failure where
        it held more. Left as ``not checked``, a candidate could hold the GPU until the reference's
        probes ran out and pass the checks they serve unexamined."""
        if self.on_cuda and _out_of_memory(failure):
            raise failure
        raise _ReferenceProbeFailed(f"{failure.kind}: {failure.message.strip()[-300:]}") from failure

    def _room_for(self, worker: Any) -> None:
        """Before a probe's calls to the candidate, hand the parent's unused cached blocks back: the
        judged outputs of the earlier probes (two outputs' worth after the observation, 14.7 GiB for
        KernelBench's 37_FrobeniusNorm_) would otherwise stay reserved at the candidate's peak, and an
        80 GB card was then too small for it. The reference's own probes need no such room."""
        if worker is self.session.subject:
            release_cached_blocks(str(self.session.device))

    def _answer(self, worker: Any, receive: Any) -> wire_replies.Reply:
        try:
            return receive()  # type: ignore[no-any-return]
        except WorkerFailed as exc:
            if worker is self.session.reference:
                self._reference_failed(exc)
            if exc.kind in _REFUSE or _out_of_memory(exc):
                raise
            raise _ProbeFailed(
                f"{exc.kind}: {exc.message.strip().splitlines()[-1] if exc.message.strip() else ''}"
            ) from exc

    def handed(self, worker: Any, reply: wire_replies.Reply) -> list[list[Any]]:
        """The output lists a probe handed over (``sizes`` says how to split them), as the parent's
        copies, all read now."""
        return list(self.handed_calls(worker, reply))

    def handed_calls(self, worker: Any, reply: wire_replies.Reply) -> HandedCalls:
        """A probe's calls' outputs (a probe_observe, probe_cache or probe_poison reply: {sizes,
        outputs}), each call's read when a check asks for it (:class:`HandedCalls`)."""
        described = getattr(reply, "outputs", None) or {}
        return HandedCalls(worker, described.get("outputs"), described.get("sizes"))

    def handed_one(self, worker: Any, reply: wire_replies.Reply) -> list[Any]:
        """The one output list a probe handed over (:meth:`handed`)."""
        groups = self.handed(worker, reply)
        if len(groups) != 1:
            raise _ProbeFailed("the worker's probe outputs do not match their description")
        return groups[0]

    def concurrently(self, requests: dict[str, tuple[Any, wire.Request]]) -> None:
        """Run independent probes in both workers at once (``{cache key: (worker, request)}``);
        each result is kept under its key as :meth:`once` would, a failure is raised when read."""
        started = time.monotonic()
        sent = []
        for key, (worker, request) in requests.items():
            if key not in self._cache:
                self._room_for(worker)
                sent.append((key, worker, worker.send_request(request)))
        for key, worker, request_id in sent:
            try:
                self._cache[key] = self._answer(worker, lambda w=worker, i=request_id: w.receive_reply(i))
            except (_ProbeFailed, _ReferenceProbeFailed) as exc:
                self._cache[key] = exc
        if sent:
            count_seconds(self.session, "+".join(k for k, _, _ in sent), time.monotonic() - started)

    def release(self, key: str) -> None:
        """Drop a probe's results once no later check reads them (their outputs hold device memory)."""
        if self._cache.pop(key, None) is not None and self.on_cuda:
            torch.cuda.empty_cache()

    @property
    def on_cuda(self) -> bool:
        return str(self.session.device).startswith("cuda")

    # -- reference side ---------------------------------------------------------------------------
    def reference_runs(self, spec: dict[str, Any], precision: str, repeats: int = 1) -> list[list[Any]]:
        """Fresh reference runs (not the shared ones): for its own run-to-run spread."""
        try:
            return list(self.session.reference_runs(spec, precision, repeats))
        except WorkerFailed as exc:
            self._reference_failed(exc)

    def expected(self, spec: dict[str, Any]) -> dict[str, Any]:
        """What the evaluation's judge needs for one input spec (computed once per evaluation): the
        reference (its shapes and dtypes, and its values under allclose), the float64 truth and the
        realistic baseline (TF32 on the GPU, fp32 on the CPU)."""
        if self.on_cuda and not getattr(self.session, "expected_kept", lambda: True)():
            # An answer too large to keep is computed again now: the reference's float64 copy of
            # the draw needs room beside the candidate, and where the device has less free than
            # twice that copy the reference makes it through the host, seconds a draw
            # (kbv.child.truth.HOST_UPCAST_BELOW). The blocks the parent's allocator holds unused
            # count as taken until they are handed back.
            release_cached_blocks(str(self.session.device))
        try:
            return dict(self.session.reference_outputs(spec))
        except WorkerFailed as exc:
            self._reference_failed(exc)

    def judge(
        self, outputs: list[Any], spec: dict[str, Any], expected: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """``outputs`` judged against ``spec``'s reference answers (``expected``, where the caller
        holds them already: a float64 truth too large for the evaluation's cache is computed
        again by every call of :meth:`expected`)."""
        return self.session.judge(_wrap(outputs), self.expected(spec) if expected is None else expected)

    def distribution(self) -> str:
        """The probe distribution: signed inputs where correctness ran them (identity-on-ReLU must
        not pass), else the protocol's first distribution."""
        return str(self.session.probe_distribution)

    def draw(self, k: int) -> dict[str, Any]:
        """Correctness draw ``k`` of the probe distribution (its reference outputs are known)."""
        return dict(self.session.draw_spec(k))

    def observe_delay_s(self) -> float:
        """Seconds between the observed call's return and the look (``OBSERVE_DELAY_S`` above)."""
        forward_ms = reference_forward_ms(self.timing)
        if forward_ms is None:
            return OBSERVE_DELAY_S
        return min(OBSERVE_DELAY_S, max(OBSERVE_DELAY_MIN_S, OBSERVE_DELAY_FORWARDS * forward_ms / 1e3))

    # -- probes -----------------------------------------------------------------------------------
    def observe(self) -> dict[str, Any]:
        def compute() -> dict[str, Any]:
            spec = self.draw(0)
            delay_s = self.observe_delay_s()
            sub, ref = self.session.subject, self.session.reference
            side_by_side = bool(getattr(self.session, "side_by_side", False))
            to_candidate = wire.ProbeObserve(
                inputs=spec,
                delay_s=delay_s,
                out_path=sub.new_path("probe-observe"),
                deferred=side_by_side,
            )
            to_reference = wire.ProbeObserve(
                inputs=spec, delay_s=0.0, hand_outputs=False, out_path=ref.new_path("probe-observe")
            )
            if not side_by_side:
                # A GPU held alone whose two forwards would not fit beside each other: the
                # candidate's observation (with its delay) ends before the reference's starts.
                cand = self.request(sub, to_candidate)
                first, late = self.handed(sub, cand)
                looked = _looked(first, late)
                del first, late  # what the checks read of them is kept; the reference needs the room
                if self.on_cuda:
                    release_cached_blocks(str(self.session.device))
                refr = self.request(ref, to_reference)
                return self._observed(spec, delay_s, cand, refr, looked)
            # Each observation counts its own process's threads and children, and the reference's
            # runs beside the candidate's; on a GPU, so do the reference's answers to the cache
            # probe's draws. On the CPU those answers fill the look's delay instead (below), where
            # a core is free; beside the call they would contend with it. The candidate's reply is
            # read even when the reference failed: a reply left unread would answer the next
            # request.
            self._room_for(sub)
            sent = sub.send_request(to_candidate), ref.send_request(to_reference)
            try:
                refr = self._answer(ref, lambda: ref.receive_reply(sent[1]))
                if self.on_cuda:
                    self._expected_quietly(self.cache_specs())
            finally:
                cand = self._answer(sub, lambda: sub.receive_reply(sent[0]))
            first = self.handed_one(sub, cand)
            # The candidate's call has returned; its look after delay_s waits for its next
            # request (kbv.child.probes), so the delay passes while the reference answers the cache
            # probe's draws, on the CPU too: no call of the candidate runs now, only what a call left
            # behind, which is what the look is for (a thread still alive at the return fails
            # background_work), and which ran beside the reference's work before as well.
            if not self.on_cuda:
                self._expected_quietly(self.cache_specs())
            late_reply = wire_replies.ProbeObserveLateReply.of(
                self.request(sub, wire.ProbeObserveLate(out_path=sub.new_path("probe-observe-late")))
            )
            late = self.handed_one(sub, late_reply)
            observed = wire_replies.ProbeObserveReply.of(cand)
            cand = replace(observed, activity={**observed.activity, "after_delay": late_reply.after_delay})
            return self._observed(spec, delay_s, cand, refr, _looked(first, late))

        return self.once("observe", compute)

    @staticmethod
    def _observed(
        spec: dict[str, Any],
        delay_s: float,
        cand: wire_replies.Reply,
        refr: wire_replies.Reply,
        looked: dict[str, Any],
    ) -> dict[str, Any]:
        """The observations as the checks read them (``looked``: :func:`_looked`)."""
        return {"spec": spec, "delay_s": delay_s, "candidate": cand, "reference": refr, **looked}

    def cache_specs(self) -> list[dict[str, Any]]:
        """The cache probe's four calls' inputs: two draws the candidate has never seen (a cache must
        not find them from correctness), A, B, B again and their mix; drawn once per evaluation."""
        if "cache_specs" not in self._cache:
            dist = self.distribution()
            seed_a, seed_b = self.session.fresh_seed("cache-a"), self.session.fresh_seed("cache-b")
            self._cache["cache_specs"] = [
                {"distribution": dist, "seed": seed_a},
                {"distribution": dist, "seed": seed_b},
                {"distribution": dist, "seed": seed_b},
                {"distribution": dist, "seed": seed_a, "mix_seed": seed_b},
            ]
        return list(self._cache["cache_specs"])

    def _expected_quietly(self, specs: list[dict[str, Any]]) -> None:
        """The reference's answers to ``specs`` computed ahead of the check that reads them (the
        evaluation keeps them); a failure here is left for that check to meet and report. Not where
        the evaluation's cache cannot keep them: computed and dropped, they were four float64 truths
        of 12 GiB each for nothing, on an H100 (2026-12-07)."""
        if not getattr(self.session, "expected_kept", lambda: True)():
            return
        for spec in specs:
            with contextlib.suppress(_ReferenceProbeFailed):
                self.expected(spec)

    def cache_probe(self) -> dict[str, Any]:
        """The cache probe's four calls (:class:`CacheCalls`, asked for two at a time) and their
        draws: ``{"outputs": calls, "specs": specs}``."""

        def compute() -> dict[str, Any]:
            calls = CacheCalls(self, self.cache_specs())
            calls.ask(0)  # the first pair now: a failure is the probe's, kept for every reader
            return {"outputs": calls, "specs": calls.specs}

        return self.once("cache", compute)

    def cache_calls(self, specs: list[dict[str, Any]], asked: list[int]) -> HandedCalls:
        """The candidate's cache probe calls ``asked`` (indices among its four), handed over."""
        sub = self.session.subject
        reply = self.request(
            sub,
            wire.ProbeCache(
                distribution=specs[0]["distribution"],
                seed_a=specs[0]["seed"],
                seed_b=specs[1]["seed"],
                out_path=sub.new_path("probe-cache"),
                calls=asked,
            ),
        )
        calls = self.handed_calls(sub, reply)
        if len(calls) != len(asked):
            raise _ProbeFailed("the worker's probe outputs do not match their description")
        return calls

    def poison_probe(self) -> dict[str, Any]:
        def compute() -> dict[str, Any]:
            spec = self.draw(1)
            sub = self.session.subject
            reply = self.request(
                sub,
                wire.ProbePoison(
                    inputs=spec, out_path=sub.new_path("probe-poison"), output_nbytes=self._truth_nbytes(spec)
                ),
            )
            return {"spec": spec, "runs": self.handed_calls(sub, reply)}

        return self.once("poison", compute)

    def _truth_nbytes(self, spec: dict[str, Any]) -> list[int]:
        """The bytes of ``spec``'s float64 truth, output by output: blocks of exactly these sizes are
        what the CPU heap hands back to ``torch.empty`` (``kbv.child.poison.poison_freed_memory``). Where the
        evaluation's cache cannot keep a draw's answers they are counted from the outputs' element
        counts, not asked for: asking would compute a float64 truth (12 GiB for a 1.6e9-element
        output) only to read its sizes."""
        counted = getattr(self.session, "output_numels", lambda: None)()
        if counted and not getattr(self.session, "expected_kept", lambda: True)():
            return [8 * int(n) for n in counted]
        return [
            int(t.numel() * t.element_size())
            for t in self.expected(spec)["truth"]["outputs"]
            if isinstance(t, torch.Tensor)
        ]


def count_seconds(session: Any, name: str, seconds: float) -> None:
    """Add ``seconds`` to the session's phase ``name`` (a probe's, ``observe``; a check's,
    ``check:NAME``), where the session keeps phases (a test's fake may not)."""
    phases = getattr(session, "phases", None)
    if phases is not None:
        phases[name] = phases.get(name, 0.0) + seconds


#: What a check's info finding says where the reference failed the probe it needs: kbv's gap,
#: never the candidate's fault (sweeps list such checks as not made).
NOT_CHECKED = "not checked"


#: Hand-overs described item by item, whose items a read can take one call's of: a GPU's exported
#: memory and IPC handles. A file is read once, whole (and removed as it is read).
_ITEM_TRANSPORTS = ("cuda_vmm", "cuda_ipc")


class _Calls(Sequence[list[Any]]):
    """A probe's calls' outputs read by index (``calls[k]``: :meth:`_call`), or a slice of them."""

    @overload
    def __getitem__(self, k: int) -> list[Any]: ...

    @overload
    def __getitem__(self, k: slice) -> list[list[Any]]: ...

    def __getitem__(self, k: int | slice) -> list[Any] | list[list[Any]]:
        if isinstance(k, slice):
            return [self._call(i) for i in range(len(self))[k]]
        return self._call(range(len(self))[k])  # an IndexError past the end, as a list's

    def _call(self, k: int) -> list[Any]:
        raise NotImplementedError


class HandedCalls(_Calls):
    """The outputs of a probe's calls, call ``k``'s read as ``calls[k]``: copied into the parent's
    memory at each read and not kept here, so a check that reads one call at a time holds one
    call's outputs. The cache probe's four calls held at once were 32 GiB of an 80 GB H100's for
    87_conv_pointwise_2D, and kbv's parent ran out (2026-12-07). Where the hand-over is a file (a
    candidate on the CPU) it is read once, whole, and kept.

    A read is valid only until the worker's next reply: the descriptors that came with this one
    are closed then, and their numbers may be reused. A later read is kbv's error, raised."""

    def __init__(self, worker: Any, description: Any, sizes: Any) -> None:
        if not isinstance(sizes, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes
        ):
            raise _ProbeFailed("the worker's probe outputs do not match their description")
        self.worker, self.description, self.sizes = worker, description, list(sizes)
        self._reply = getattr(worker, "last_span", None)
        self._whole: list[Any] | None = None
        items = description.get("items") if isinstance(description, dict) else None
        self._items = items if description_by_item(description) else None
        if self._items is not None and len(self._items) != sum(self.sizes):
            raise _ProbeFailed("the worker's probe outputs do not match their description")

    def __len__(self) -> int:
        return len(self.sizes)

    def _call(self, k: int) -> list[Any]:
        start = sum(self.sizes[:k])
        if self._items is None:
            whole = self._read_whole()
            return whole[start : start + self.sizes[k]]
        part = self._receive({**self.description, "items": self._items[start : start + self.sizes[k]]}, 1)
        if len(part) != self.sizes[k]:
            raise _ProbeFailed("the worker's probe outputs do not match their description")
        return part

    def _read_whole(self) -> list[Any]:
        if self._whole is None:
            whole = self._receive(self.description, len(self.sizes))
            if len(whole) != sum(self.sizes):
                raise _ProbeFailed("the worker's probe outputs do not match their description")
            self._whole = whole
        return self._whole

    def _receive(self, description: Any, calls: int) -> list[Any]:
        if getattr(self.worker, "last_span", None) is not self._reply:
            raise RuntimeError(
                "kbv read a probe's hand-over after the worker's next reply: its descriptors are "
                "closed (a harness error, not the candidate's)"
            )
        try:
            return list(self.worker.receive_outputs(description, calls))
        except WorkerFailed as exc:
            if _out_of_memory(exc):
                raise
            raise _ProbeFailed(exc.message) from exc


#: The cache probe's calls asked for in one request. Four at once, the candidate held four
#: calls' outputs while the reference answered their draws, and on an 80 GB H100 the reference ran
#: out beside them (38_L1Norm_ with TF32: the candidate 40.7 GiB, the reference 24.0 held and 16.0
#: asked for, 2026-12-07). Two at a time it holds two.
CACHE_CALLS_ASKED = ((0, 1), (2, 3))


class CacheCalls(_Calls):
    """The cache probe's four calls' outputs, call ``k``'s read as ``calls[k]``, each pair of
    :data:`CACHE_CALLS_ASKED` asked of the candidate when its first call is read. Asking for the
    next pair lets go of the last one's hand-over (the worker's next request does), so each call
    is read once, in order: reading a call of a pair already let go is kbv's error, raised."""

    def __init__(self, ctx: DynamicContext, specs: list[dict[str, Any]]) -> None:
        self.ctx, self.specs = ctx, specs
        self._pair: int | None = None
        self._handed: HandedCalls | None = None

    def __len__(self) -> int:
        return len(self.specs)

    def _call(self, k: int) -> list[Any]:
        pair = self.pair_of(k)
        if pair != self._pair:
            self.ask(pair)
        assert self._handed is not None
        return self._handed[CACHE_CALLS_ASKED[pair].index(k)]

    @staticmethod
    def pair_of(k: int) -> int:
        """The index in :data:`CACHE_CALLS_ASKED` of the request that asks for call ``k``."""
        return next(p for p, asked in enumerate(CACHE_CALLS_ASKED) if k in asked)

    def starts_request(self, k: int) -> bool:
        """Whether reading call ``k`` asks the candidate for its pair (not held now)."""
        return self.pair_of(k) != self._pair

    def ask(self, pair: int) -> None:
        """Ask the candidate for the calls of pair ``pair`` (after the pair before it, never again)."""
        if self._pair is not None and pair <= self._pair:
            raise RuntimeError(
                f"kbv read the cache probe's calls {list(CACHE_CALLS_ASKED[pair])} after their "
                "hand-over was let go (a harness error, not the candidate's)"
            )
        self._handed = None
        if self._pair is None:  # the first pair: cache_probe's own phase counts it
            self._handed = self.ctx.cache_calls(self.specs, list(CACHE_CALLS_ASKED[pair]))
        else:
            started = time.monotonic()
            within = getattr(self.ctx.session, "within_phase", contextlib.nullcontext)
            try:
                with within("cache"):
                    self._handed = self.ctx.cache_calls(self.specs, list(CACHE_CALLS_ASKED[pair]))
            finally:
                count_seconds(self.ctx.session, "cache", time.monotonic() - started)
        self._pair = pair


def description_by_item(description: Any) -> bool:
    """Whether a hand-over's items can be read one call's at a time (:data:`_ITEM_TRANSPORTS`)."""
    return (
        isinstance(description, dict)
        and description.get("transport") in _ITEM_TRANSPORTS
        and isinstance(description.get("items"), list)
    )


def _looked(first: list[Any], late: list[Any]) -> dict[str, Any]:
    """What the checks read of the observed call's outputs and of the look after the delay: their
    difference and which were tensors. The outputs themselves would hold device memory all phase."""
    tensors = [isinstance(t, torch.Tensor) for t in first]
    return {"late_diff": _max_diff(first, late), "first_tensors": tensors}


def _wrap(outputs: list[Any]) -> dict[str, Any]:
    return {
        "outputs": list(outputs),
        "types": ["torch.Tensor" if isinstance(o, torch.Tensor) else type(o).__name__ for o in outputs],
    }


def _max_diff(a: list[Any], b: list[Any]) -> float:
    """Largest elementwise difference between two output lists (inf when shapes differ or NaN appears)."""
    worst = 0.0
    for x, y in zip(a, b):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            worst = max(worst, 0.0 if x == y else math.inf)
            continue
        if x.shape != y.shape:
            return math.inf
        if x.numel() == 0:
            continue
        flat_x, flat_y = x.reshape(-1), y.reshape(-1)
        for start in range(0, flat_x.numel(), _DIFF_CHUNK):  # bounded float64 temporaries
            xd, yd = (
                flat_x[start : start + _DIFF_CHUNK].double(),
                flat_y[start : start + _DIFF_CHUNK].double(),
            )
            if bool((torch.isnan(xd) != torch.isnan(yd)).any()):
                return math.inf
            worst = max(worst, float((xd - yd).abs().nan_to_num(nan=0.0, posinf=math.inf).max()))
    return worst if len(a) == len(b) else math.inf


_DIFF_CHUNK = 1 << 25


def _finding(check: str, detail: str, severity: str | None = None) -> Finding:
    return Finding(check, severity or get_check(check).default_severity, detail)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"
