"""``kbv.Evaluator``: evaluations from Python objects and text, with warm workers between calls.

An RL run scores thousands of generated kernels per step. The Evaluator keeps what a fresh
``kbv.evaluate_paths`` call pays again every time: the executor and its warm host processes, the
loaded problems, and within one batch the reference's outputs on the batch's secret draws
(:mod:`kbv._shared_reference`). Every candidate still runs in fresh, contained workers of its own.

Submissions are gathered into batches by one dispatcher thread: whatever is waiting when the
executor becomes free is the next batch (``map`` submits its pairs as one). The candidates of one
problem inside one batch share a master seed; every batch draws new seeds.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kbv.candidates import Candidate, candidate_from_source, load_candidate
from kbv.problems import Problem, ProblemError, bundled_suite_dir, check_importable, load_problem
from kbv.protocol import Protocol
from kbv.records import Record

ProblemLike = Problem | str | Path
CandidateLike = Candidate | str | Path

#: Waiting submissions the executor may boot workers for ahead (more than any spares' depth).
_LOOK_AHEAD = 8

#: A problem or candidate given as text holds a newline; a name or a path never does.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")


class UnknownProblem(ProblemError):
    """A problem name that names no file of the Evaluator's problem tree."""


@dataclass
class _Job:
    problem: Problem
    candidate: Candidate
    protocol: Protocol
    timeout_s: float | None
    future: Future[Record] = field(default_factory=Future)


class _BatchEvaluate:
    """The executor's ``evaluate_fn`` for one batch: ``kbv.evaluation.evaluate`` with the batch's
    master seed of the pair's problem. A plain object, so it travels to a host process or Ray."""

    uses_spares = True  # the sequential executor hands it the workers it boots ahead

    def __init__(self, batch: str, seeds: dict[str, int]) -> None:
        self.batch = batch
        self.seeds = seeds

    def __call__(
        self, problem: Problem, candidate: Candidate, protocol: Protocol, device: str, **kwargs: Any
    ) -> Record:
        from kbv._shared_reference import SharedReference
        from kbv.evaluation import evaluate

        shared = SharedReference(self.batch, self.seeds[problem.source_sha256])
        return evaluate(problem, candidate, protocol, device, shared=shared, **kwargs)


def resolve_protocol(protocol: str | Path | Protocol, precision: str | None = None) -> Protocol:
    """``protocol`` (a name, a .toml file or a Protocol) in ``precision`` (fp32, bf16, fp16; None:
    the protocol's own), as ``kbv.evaluate_paths`` resolves them."""
    from kbv.api import resolve_protocol as resolve

    return resolve(protocol, precision)


class Evaluator:
    """Evaluate candidates against problems from Python, keeping workers and problems warm.

    ::

        with kbv.Evaluator(device="cuda", problems="KernelBench/KernelBench") as ev:
            record = ev.evaluate("level1/19_ReLU", completion_code)
            records = ev.map([("level1/19_ReLU", code) for code in completions])

    ``problems``: the tree that problem names are looked up in (default: kbv's bundled suite).
    ``executor``: ``None`` (one evaluation at a time in this process, workers booted ahead),
    ``"local"`` (one slot per GPU, or ``workers`` CPU slots) or ``"ray"`` (``address``).
    ``share_reference``: let candidates of one problem in one batch share the reference's outputs.
    """

    def __init__(
        self,
        *,
        device: str | None = None,
        gpus: str | list[int] | None = None,
        protocol: str | Path | Protocol = "verified",
        precision: str | None = None,
        problems: str | Path | None = None,
        executor: str | None = None,
        workers: int | None = None,
        address: str | None = None,
        timeout_s: float | None = None,
        share_reference: bool = True,
        max_batch: int = 256,
    ) -> None:
        from kbv.devices import check_device
        from kbv.evaluation import default_device
        from kbv.execute import make_executor

        self.device = device or default_device()
        check_device(self.device)
        self.protocol = resolve_protocol(protocol, precision)
        self.problems_root = Path(problems) if problems is not None else bundled_suite_dir()
        self.timeout_s = timeout_s
        self.share_reference = share_reference
        self.max_batch = max_batch
        # World-readable: an unprivileged candidate worker reads its file here (kbv.worker._privileges).
        self._scratch = Path(tempfile.mkdtemp(prefix="kbv-evaluator-"))
        self._scratch.chmod(0o755)
        self._executor = make_executor(
            executor or "sequential", device=self.device, gpus=gpus, workers=workers, address=address
        )
        if hasattr(self._executor, "keep_spares"):
            # One map after another: the next batch's first pairs boot while this one runs.
            self._executor.keep_spares = True
        self._problems: dict[str, Problem] = {}
        self._pending: list[_Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self.batches = 0
        self._thread = threading.Thread(target=self._dispatch, name="kbv-evaluator", daemon=True)
        self._thread.start()

    # --- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, cancel_pending: bool = False) -> None:
        """Finish what was submitted (or cancel what has not started), then release the workers."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if cancel_pending:
                for job in self._pending:
                    job.future.cancel()
                self._pending.clear()
            self._cond.notify_all()
        self._thread.join()
        self._executor.close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    # --- inputs -------------------------------------------------------------------------------

    def problem(self, problem: ProblemLike, name: str = "problem") -> Problem:
        """A problem given as a :class:`Problem`, a file path, a name in the problem tree
        (``level1/19_ReLU``) or the problem's source text (``name`` names it), loaded once."""
        if isinstance(problem, Problem):
            return problem
        text = str(problem)
        key = ("text:" if "\n" in text else "ref:") + text
        if key not in self._problems:
            self._problems[key] = self._load_problem(problem, name)
        return self._problems[key]

    def _load_problem(self, problem: str | Path, name: str) -> Problem:
        text = str(problem)
        if "\n" in text:  # source text: a file of its own, named by its hash
            sha = hashlib.sha256(text.encode()).hexdigest()
            if not _NAME.match(name) or "/" in name:
                raise ProblemError(f"problem name {name!r} must be a plain file stem like 19_ReLU")
            path = self._scratch / "problems" / sha / f"{name}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            path.parent.chmod(0o755)
        elif isinstance(problem, Path) or Path(text).is_file():
            path = Path(text)
        else:
            path = self.problem_path(text)
        loaded = load_problem(path)
        check_importable(loaded)
        return loaded

    def problem_path(self, name: str) -> Path:
        """The file of problem ``name`` (``level1/19_ReLU``, ``.py`` optional) in the problem tree;
        :class:`UnknownProblem` when there is none (names never leave the tree)."""
        stem = name[:-3] if name.endswith(".py") else name
        if not _NAME.match(stem) or ".." in stem.split("/"):
            raise UnknownProblem(f"{name!r} is not a problem name (like level1/19_ReLU)")
        root = self.problems_root.resolve()
        path = (root / f"{stem}.py").resolve()
        if root not in path.parents or not path.is_file():
            raise UnknownProblem(f"no problem {name!r} in {self.problems_root}")
        return path

    def candidate(self, candidate: CandidateLike, label: str = "") -> Candidate:
        """A candidate given as a :class:`Candidate`, a file path, or source text (a ``str`` that
        holds a newline; one without is a path). Text is written once to a file of the Evaluator's,
        named by its hash, and read back: what runs is what the record hashes."""
        if isinstance(candidate, Candidate):
            return candidate
        if isinstance(candidate, Path):
            return load_candidate(candidate, label=label)
        if "\n" in candidate:
            return self.candidate_text(candidate, label)
        return load_candidate(candidate, label=label)

    def candidate_text(self, source: str, label: str = "") -> Candidate:
        """A candidate from source text, whatever it holds (no newline needed: never a path)."""
        return candidate_from_source(source, self._scratch / "candidates", label=label or "inline")

    # --- calls --------------------------------------------------------------------------------

    def submit(
        self,
        problem: ProblemLike,
        candidate: CandidateLike,
        *,
        protocol: str | Path | Protocol | None = None,
        precision: str | None = None,
        timeout_s: float | None = None,
        label: str = "",
    ) -> Future[Record]:
        """Queue one evaluation; the future holds its record (or the harness error)."""
        return self._enqueue([self._job(problem, candidate, protocol, precision, timeout_s, label)])[0]

    def evaluate(
        self,
        problem: ProblemLike,
        candidate: CandidateLike,
        *,
        protocol: str | Path | Protocol | None = None,
        precision: str | None = None,
        timeout_s: float | None = None,
        label: str = "",
    ) -> Record:
        """Evaluate one pair and return its record."""
        return self.submit(
            problem, candidate, protocol=protocol, precision=precision, timeout_s=timeout_s, label=label
        ).result()

    def submit_many(
        self,
        pairs: Iterable[tuple[ProblemLike, CandidateLike]],
        *,
        protocol: str | Path | Protocol | None = None,
        precision: str | None = None,
        timeout_s: float | None = None,
        label: str = "",
    ) -> list[Future[Record]]:
        """Queue pairs together (one batch, unless larger than ``max_batch``), in order."""
        jobs = [self._job(p, c, protocol, precision, timeout_s, label) for p, c in pairs]
        return self._enqueue(jobs)

    def map(
        self,
        pairs: Iterable[tuple[ProblemLike, CandidateLike]],
        *,
        protocol: str | Path | Protocol | None = None,
        precision: str | None = None,
        timeout_s: float | None = None,
        label: str = "",
    ) -> list[Record]:
        """Evaluate pairs as one batch; records in the pairs' order. A harness error (kbv's or the
        problem's own failure, not the candidate's) is raised once every pair has finished."""
        futures = self.submit_many(
            pairs, protocol=protocol, precision=precision, timeout_s=timeout_s, label=label
        )
        return _results(futures)

    async def aevaluate(
        self,
        problem: ProblemLike,
        candidate: CandidateLike,
        *,
        protocol: str | Path | Protocol | None = None,
        precision: str | None = None,
        timeout_s: float | None = None,
        label: str = "",
    ) -> Record:
        """:meth:`evaluate` for asyncio code (the loop is never blocked)."""
        future = await asyncio.to_thread(
            self.submit,
            problem,
            candidate,
            protocol=protocol,
            precision=precision,
            timeout_s=timeout_s,
            label=label,
        )
        return await asyncio.wrap_future(future)

    async def amap(
        self,
        pairs: Iterable[tuple[ProblemLike, CandidateLike]],
        *,
        protocol: str | Path | Protocol | None = None,
        precision: str | None = None,
        timeout_s: float | None = None,
        label: str = "",
    ) -> list[Record]:
        """:meth:`map` for asyncio code."""
        futures = await asyncio.to_thread(
            self.submit_many,
            list(pairs),
            protocol=protocol,
            precision=precision,
            timeout_s=timeout_s,
            label=label,
        )
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
        return _results(futures)

    # --- state ----------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Submissions not yet handed to the executor."""
        with self._cond:
            return len(self._pending)

    def health(self) -> dict[str, Any]:
        return self._executor.health()

    def stats(self) -> dict[str, Any]:
        return self._executor.stats()

    # --- internals ------------------------------------------------------------------------------

    def _job(
        self,
        problem: ProblemLike,
        candidate: CandidateLike,
        protocol: str | Path | Protocol | None,
        precision: str | None,
        timeout_s: float | None,
        label: str,
    ) -> _Job:
        resolved = (
            self.protocol
            if protocol is None and precision is None
            else resolve_protocol(protocol if protocol is not None else self.protocol, precision)
        )
        return _Job(
            self.problem(problem),
            self.candidate(candidate, label=label),
            resolved,
            timeout_s if timeout_s is not None else self.timeout_s,
        )

    def _enqueue(self, jobs: list[_Job]) -> list[Future[Record]]:
        with self._cond:
            if self._closed:
                raise RuntimeError("this Evaluator is closed; make a new one")
            self._pending.extend(jobs)
            self._cond.notify_all()
        return [job.future for job in jobs]

    def _next_batch(self) -> list[_Job] | None:
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if not self._pending:
                return None
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            return batch

    def _dispatch(self) -> None:
        while (batch := self._next_batch()) is not None:
            self.batches += 1
            try:
                self._run_batch(batch)
            except BaseException as exc:  # the executor itself failed: every unfinished future says so
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)
            finally:
                from kbv._shared_reference import release_all

                release_all()  # this process's shares of the batch (sequential executor)

    def _run_batch(self, batch: list[_Job]) -> None:
        from kbv.inputs import new_seed

        batch_id = uuid.uuid4().hex
        seeds = {job.problem.source_sha256: 0 for job in batch}
        for sha in seeds:
            seeds[sha] = new_seed()  # secret, one per problem of this batch, never reused
        groups: dict[tuple[str, float | None], list[_Job]] = {}
        for job in batch:
            groups.setdefault((_protocol_id(job.protocol), job.timeout_s), []).append(job)
        executor: Any = self._executor
        from kbv.evaluation import evaluate

        executor.evaluate_fn = _BatchEvaluate(batch_id, seeds) if self.share_reference else evaluate
        if hasattr(executor, "uses_spares"):
            executor.uses_spares = True
        for jobs in groups.values():
            self._run_group(jobs)

    def _run_group(self, jobs: list[_Job]) -> None:
        waiting: dict[tuple[int, int], list[_Job]] = {}
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                waiting.setdefault((id(job.problem), id(job.candidate)), []).append(job)
        if not waiting:
            return

        def on_record(
            problem: Problem, candidate: Candidate, record: Record | None, exc: Exception | None
        ) -> None:
            job = waiting[(id(problem), id(candidate))].pop(0)
            if record is not None:
                job.future.set_result(record)
            else:
                job.future.set_exception(exc or RuntimeError("the evaluation returned nothing"))

        pairs = [(job.problem, job.candidate) for group in waiting.values() for job in group]
        executor: Any = self._executor
        ahead = {"upcoming": self._upcoming} if getattr(executor, "keep_spares", False) else {}
        executor.map(
            pairs,
            jobs[0].protocol,
            timeout_s=jobs[0].timeout_s,
            on_record=on_record,
            should_skip=lambda problem, candidate: False,
            **ahead,
        )

    def _upcoming(self) -> list[tuple[tuple[Problem, Candidate], Protocol]]:
        """The submissions waiting for the next batch, first first, each with the protocol it will
        run under: the executor boots their workers while the current batch ends."""
        with self._cond:
            waiting = list(self._pending[:_LOOK_AHEAD])
        return [((job.problem, job.candidate), job.protocol.with_timeout(job.timeout_s)) for job in waiting]


def _protocol_id(protocol: Protocol) -> str:
    from kbv._shared_reference import _protocol_key

    return _protocol_key(protocol)


def _results(futures: Sequence[Future[Record]]) -> list[Record]:
    errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error
    return [f.result() for f in futures]
