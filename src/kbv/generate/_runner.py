"""Single-turn generation over a set of problems: prompts, requests, retries, budget, cache, files.

Outputs in the run directory:
- ``level_{L}_problem_{P}_sample_{S}_kernel.py`` for every response with a ``ModelNew`` block;
- ``generation.jsonl``: one line per (problem, sample) with the prompt, the raw response, usage,
  latency, cost and status (``ok`` | ``no_code_block`` | ``skipped: budget`` | ``error: ...``);
- ``manifest.jsonl``: which problem file each (level, problem id) stands for;
- ``generation_config.json`` and ``generation_summary.json``.
A failed request is data in the sidecar, not an exception: the run goes on.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kbv._version import __version__
from kbv.generate._cache import ResponseCache, cache_key
from kbv.generate._config import GenerationConfig, PriceTable, load_prices
from kbv.generate._extract import extract_code
from kbv.generate._prompts import Prompt, build_prompt, load_template
from kbv.generate._providers import (
    ChatRequest,
    Client,
    Completion,
    describe_error,
    is_retryable,
    known_secrets,
    make_client,
    retry_after,
)
from kbv.problems import Problem, load_problems

SIDECAR = "generation.jsonl"
MANIFEST = "manifest.jsonl"
STATUS_OK = "ok"
STATUS_NO_CODE = "no_code_block"
STATUS_BUDGET = "skipped: budget"


def kernel_filename(level: int, problem_id: int, sample: int) -> str:
    """KernelBench's candidate naming, read by ``kbv run``."""
    return f"level_{level}_problem_{problem_id}_sample_{sample}_kernel.py"


@dataclass(frozen=True)
class NumberedProblem:
    """A problem with the (level, id) its candidates are named by."""

    problem: Problem
    level: int
    problem_id: int
    assigned: bool  # True when kbv numbered it (the file carries no KernelBench level/id)


def number_problems(problems: Sequence[Problem]) -> list[NumberedProblem]:
    """Keep KernelBench levels/ids; number the rest in discovery order, level 1 by default."""
    used: set[tuple[int, int]] = set()
    keep: dict[int, tuple[int, int]] = {}
    for index, problem in enumerate(problems):
        if problem.level is not None and problem.problem_id is not None:
            pair = (problem.level, problem.problem_id)
            if pair not in used:
                used.add(pair)
                keep[index] = pair
    out = []
    counters: dict[int, int] = {}
    for index, problem in enumerate(problems):
        if index in keep:
            level, pid = keep[index]
            out.append(NumberedProblem(problem, level, pid, assigned=False))
            continue
        level = problem.level if problem.level is not None else 1
        pid = counters.get(level, 0) + 1
        while (level, pid) in used:
            pid += 1
        counters[level] = pid
        used.add((level, pid))
        out.append(NumberedProblem(problem, level, pid, assigned=True))
    return out


@dataclass
class GenerationSummary:
    """Totals of one run; ``statuses`` counts sidecar lines by status (errors grouped as "error")."""

    run_dir: Path
    jobs: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    attempts: int = 0
    cache_hits: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0  # paid in this run (cache hits cost nothing)
    cost_known: bool = True
    problem_errors: list[tuple[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "jobs": self.jobs,
            "statuses": dict(self.statuses),
            "requests": self.requests,
            "attempts": self.attempts,
            "cache_hits": self.cache_hits,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": round(self.cost_usd, 6) if self.cost_known else None,
            "problem_errors": [{"path": p, "error": e} for p, e in self.problem_errors],
        }

    @property
    def all_failed(self) -> bool:
        return self.jobs > 0 and self.statuses.get("error", 0) == self.jobs


class _Budget:
    """Requests and tokens spent so far; a request is issued only while both are under their cap."""

    def __init__(self, max_requests: int | None, max_tokens: int | None) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = 0
        self.tokens = 0
        self._lock = threading.Lock()

    def reserve(self) -> bool:
        with self._lock:
            if self.max_requests is not None and self.requests >= self.max_requests:
                return False
            if self.max_tokens is not None and self.tokens >= self.max_tokens:
                return False
            self.requests += 1
            return True

    def spend(self, tokens: int) -> None:
        with self._lock:
            self.tokens += tokens


@dataclass(frozen=True)
class _Job:
    item: NumberedProblem
    sample: int
    prompt: Prompt
    request: ChatRequest


class _Run:
    """One generation run; methods are called from the worker threads."""

    def __init__(
        self,
        config: GenerationConfig,
        run_dir: Path,
        client: Client,
        cache: ResponseCache | None,
        prices: PriceTable,
        sleep: Callable[[float], None],
        summary: GenerationSummary,
    ) -> None:
        self.config, self.run_dir, self.client, self.cache = config, run_dir, client, cache
        self.prices, self.sleep, self.summary = prices, sleep, summary
        self.budget = _Budget(config.max_requests, config.max_tokens_total)
        self.secrets = known_secrets(config.api_key_env)
        self._lock = threading.Lock()
        self._sidecar = (run_dir / SIDECAR).open("w")

    def close(self) -> None:
        self._sidecar.close()

    def scrub(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "[redacted]")
        return text

    def execute(self, job: _Job) -> str:
        key = cache_key(job.request, job.sample)
        completion = self.cache.get(key) if self.cache else None
        record: dict[str, Any] = {
            "cache_hit": completion is not None,
            "cache_key": key,
            "attempts": 0,
            "latency_s": 0.0,
        }
        if completion is None:
            if not self.budget.reserve():
                return self._finish(job, record, None, STATUS_BUDGET)
            try:
                completion = self._request(job, record)
            except Exception as exc:  # any failed request is an outcome of this job, not of the run
                return self._finish(job, record, None, "error: " + describe_error(exc, self.secrets))
            self.budget.spend(completion.input_tokens + completion.output_tokens)
            if self.cache:
                self.cache.put(key, job.request, completion)
        code = extract_code(completion.text)
        if code is None:
            return self._finish(job, record, completion, STATUS_NO_CODE)
        name = kernel_filename(job.item.level, job.item.problem_id, job.sample)
        (self.run_dir / name).write_text(code)
        record["kernel"] = name
        return self._finish(job, record, completion, STATUS_OK)

    def _request(self, job: _Job, record: dict[str, Any]) -> Completion:
        started = time.monotonic()
        for attempt in range(self.config.retries + 1):
            record["attempts"] = attempt + 1
            try:
                completion = self.client.complete(job.request)
                break
            except Exception as exc:
                if attempt >= self.config.retries or not is_retryable(exc):
                    record["latency_s"] = round(time.monotonic() - started, 4)
                    raise
                self.sleep(self._backoff(attempt, exc))
        record["latency_s"] = round(time.monotonic() - started, 4)
        completion.text = self.scrub(completion.text)
        completion.reasoning = self.scrub(completion.reasoning)
        return completion

    def _backoff(self, attempt: int, exc: BaseException) -> float:
        ceiling = min(self.config.backoff_max, self.config.backoff_base * (2**attempt))
        delay = random.uniform(ceiling / 2, ceiling)  # jitter spreads out threads that failed together
        hint = retry_after(exc)
        if hint is not None:
            delay = max(delay, min(hint, self.config.backoff_max))
        return delay

    def _finish(self, job: _Job, record: dict[str, Any], completion: Completion | None, status: str) -> str:
        problem = job.item.problem
        usage = {"input_tokens": 0, "output_tokens": 0, "reasoning_tokens": 0}
        cost = None
        if completion is not None:
            usage = {
                "input_tokens": completion.input_tokens,
                "output_tokens": completion.output_tokens,
                "reasoning_tokens": completion.reasoning_tokens,
            }
            cost = self.prices.cost(
                job.request.provider, job.request.model, completion.input_tokens, completion.output_tokens
            )
        line = {
            "problem": {
                "name": problem.name,
                "level": job.item.level,
                "id": job.item.problem_id,
                "path": str(problem.path),
                "source_sha256": problem.source_sha256,
            },
            "sample": job.sample,
            "status": status,
            "kernel": record.get("kernel"),
            "provider": job.request.provider,
            "model": job.request.model,
            "base_url": job.request.base_url,
            "params": {
                k: v
                for k, v in job.request.cache_fields().items()
                if k not in {"provider", "model", "base_url", "prompt", "system"}
            },
            "template": job.prompt.template,
            "template_sha256": job.prompt.template_sha256,
            "backend": job.prompt.backend,
            "input_blind": job.prompt.input_blind,
            "prompt_sha256": job.prompt.sha256,
            "prompt": job.prompt.text,
            "response": completion.text if completion else None,
            "reasoning": completion.reasoning if completion else None,
            "finish_reason": completion.finish_reason if completion else None,
            "response_model": completion.response_model if completion else None,
            "usage": usage,
            "cost_usd": cost,
            "latency_s": record["latency_s"],
            "attempts": record["attempts"],
            "cache_hit": record["cache_hit"],
            "cache_key": record["cache_key"],
            "kbv_version": __version__,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        text = self.scrub(json.dumps(line))
        with self._lock:
            self._sidecar.write(text + "\n")
            self._sidecar.flush()
            self._count(status, record, completion, cost)
        return status

    def _count(
        self, status: str, record: dict[str, Any], completion: Completion | None, cost: float | None
    ) -> None:
        s = self.summary
        s.statuses["error" if status.startswith("error") else status] += 1
        s.attempts += record["attempts"]
        if record["cache_hit"]:
            s.cache_hits += 1
        elif record["attempts"]:
            s.requests += 1
            if completion is not None:
                s.input_tokens += completion.input_tokens
                s.output_tokens += completion.output_tokens
                if cost is None:
                    s.cost_known = False
                else:
                    s.cost_usd += cost


def generate(
    problems: str | Path | Sequence[Problem],
    config: GenerationConfig,
    run_dir: str | Path,
    *,
    client: Client | None = None,
    progress: bool = True,
    sleep: Callable[[float], None] = time.sleep,
) -> GenerationSummary:
    """Generate ``config.samples`` candidates per problem into ``run_dir``.

    ``problems`` is a path (file, directory or KernelBench tree) or loaded problems. ``client``
    replaces the provider client (tests, custom transports). Raises ProviderError, PromptError or
    ConfigError for setup problems; request failures are recorded, never raised.
    """
    run_dir = Path(run_dir)
    summary = GenerationSummary(run_dir=run_dir)
    if isinstance(problems, (str, Path)):
        loaded, errors = load_problems(problems)
        summary.problem_errors = [(str(p), e) for p, e in errors]
    else:
        loaded = list(problems)
    template = load_template(config.template)
    prices = load_prices(config.prices)
    client = client or make_client(config.provider, config.base_url, config.api_key_env, config.timeout)
    numbered = number_problems(loaded)
    jobs = [job for item in numbered for job in _jobs_for(item, config, template)]
    summary.jobs = len(jobs)

    run_dir.mkdir(parents=True, exist_ok=True)
    _write_manifest(run_dir, numbered)
    (run_dir / "generation_config.json").write_text(json.dumps(config.public(), indent=2) + "\n")
    cache = None
    if config.use_cache:
        cache = ResponseCache(
            Path(config.cache_dir) if config.cache_dir else run_dir / ".cache" / "responses"
        )

    run = _Run(config, run_dir, client, cache, prices, sleep, summary)
    try:
        _execute_all(run, jobs, config.concurrency, progress, label=f"{config.provider}:{config.model}")
    finally:
        run.close()
        (run_dir / "generation_summary.json").write_text(json.dumps(summary.to_json(), indent=2) + "\n")
    return summary


def _jobs_for(item: NumberedProblem, config: GenerationConfig, template: Any) -> list[_Job]:
    prompt = build_prompt(item.problem.source, config.backend, template, config.input_blind, config.precision)
    request = ChatRequest(
        provider=config.provider,
        model=config.model,
        base_url=config.base_url,
        prompt=prompt.text,
        system=config.system,
        temperature=config.temperature,
        max_tokens=config.max_tokens,
        reasoning_effort=config.reasoning_effort,
        thinking_budget=config.thinking_budget,
        extra_body=dict(config.extra_body),
    )
    return [_Job(item, sample, prompt, request) for sample in range(config.samples)]


def _write_manifest(run_dir: Path, numbered: list[NumberedProblem]) -> None:
    with (run_dir / MANIFEST).open("w") as handle:
        for item in numbered:
            handle.write(
                json.dumps(
                    {
                        "level": item.level,
                        "problem_id": item.problem_id,
                        "name": item.problem.name,
                        "path": str(item.problem.path),
                        "source_sha256": item.problem.source_sha256,
                        "numbered_by_kbv": item.assigned,
                    }
                )
                + "\n"
            )


def _execute_all(run: _Run, jobs: list[_Job], concurrency: int, progress: bool, label: str) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task(f"generate {label}", total=len(jobs), status="")
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            futures = [pool.submit(run.execute, job) for job in jobs]
            try:
                for future in as_completed(futures):
                    future.result()
                    s = run.summary
                    not_ok = sum(s.statuses.values()) - s.statuses.get(STATUS_OK, 0)
                    bar.update(
                        task,
                        advance=1,
                        status=f"ok {s.statuses.get(STATUS_OK, 0)}  cached {s.cache_hits}  not ok {not_ok}",
                    )
            except BaseException:
                for future in futures:  # an interrupt stops new requests; the cache keeps the finished ones
                    future.cancel()
                raise


__all__ = ["generate", "GenerationSummary", "number_problems", "kernel_filename"]
