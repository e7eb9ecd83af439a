"""Rewards for RL from kbv's records, and adapters for TRL and verl.

The default reward (:class:`Reward`) is 0 for every outcome but ``passed``. A passed candidate
earns ``passed_base`` plus the log2 of its comparable speedup (``speedup["best"]``: against the
fastest realistic baseline), the log clipped to ``[-passed_base, max_log2]``: so a correct kernel
never earns less than a failed one, a kernel as fast as the baseline earns ``passed_base``, and no
single lucky measurement earns more than ``passed_base + max_log2``. Defaults: 1.0 and 3.0 (a
passed kernel earns between 0 and 4; 2x faster earns 2).

Both adapters take the model's whole answer, find the code with kbv's own extractor (the last
fenced block defining ``class ModelNew``; :func:`extract_code`), send it to a ``kbv serve`` and
return the reward. An answer with no such block earns ``no_code`` (default 0) without a request.
Neither TRL nor verl is imported: the adapters are plain functions with their signatures.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kbv.generate._extract import extract_code

__all__ = ["Reward", "compute_score", "extract_code", "make_trl_reward", "make_verl_compute_score"]


@dataclass(frozen=True)
class Reward:
    """The reward of a record (a :class:`kbv.Record` or its dict, as the service returns it)."""

    passed_base: float = 1.0
    max_log2: float = 3.0
    failed: float = 0.0
    no_code: float = 0.0

    def __call__(self, record: Any) -> float:
        data = record if isinstance(record, dict) else record.to_dict()
        outcome = data.get("outcome")
        if str(getattr(outcome, "value", outcome)) != "passed":
            return self.failed
        speedup = (data.get("speedup") or {}).get("best")
        if not isinstance(speedup, (int, float)) or not math.isfinite(speedup) or speedup <= 0:
            return self.passed_base  # passed but not timed (a protocol without timing)
        return self.passed_base + min(self.max_log2, max(-self.passed_base, math.log2(speedup)))


def _completion_text(completion: Any) -> str:
    """TRL's completion: a string, or (conversational) a list of messages whose last is the answer."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    return str(completion)


def _client(client: Any, url: str | None, token: str | None) -> Any:
    if client is not None:
        return client
    from kbv.client import Client

    return Client(url or os.environ.get("KBV_SERVE_URL", "http://127.0.0.1:8000"), token)


def make_trl_reward(
    client: Any = None,
    *,
    url: str | None = None,
    token: str | None = None,
    problem_column: str = "problem",
    reward: Reward | None = None,
    protocol: str | None = None,
    precision: str | None = None,
    timeout_s: float | None = None,
) -> Callable[..., list[float]]:
    """A reward function for TRL's GRPOTrainer: ``(prompts, completions, **kwargs) -> list[float]``.

    The dataset's ``problem_column`` (TRL passes every dataset column as a keyword list) names each
    prompt's problem (``level1/19_ReLU``). The completions of one step go as one batch, so those of
    one problem share the reference's work. The records of the last call stay in the function's
    ``last_results`` (each with its ``record_id``, for ``kbv explain``)."""
    from kbv.client import evaluation

    score = reward or Reward()

    def kbv_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        problems = kwargs.get(problem_column)
        if problems is None or len(problems) != len(completions):
            raise ValueError(
                f"the dataset needs a {problem_column!r} column naming each prompt's problem "
                "(like level1/19_ReLU)"
            )
        codes = [extract_code(_completion_text(c)) for c in completions]
        items = [
            evaluation(str(p), code, protocol=protocol, precision=precision, timeout_s=timeout_s)
            for p, code in zip(problems, codes)
            if code is not None
        ]
        service = _client(client, url, token)
        results = iter(service.evaluate_many(items) if items else [])
        rewards: list[float] = []
        kept: list[dict[str, Any] | None] = []
        for code in codes:
            if code is None:
                rewards.append(score.no_code)
                kept.append(None)
                continue
            result = next(results)
            kept.append(result)
            rewards.append(score(result["record"]) if result.get("record") else score.failed)
        kbv_reward.last_results = kept  # type: ignore[attr-defined]
        return rewards

    kbv_reward.last_results = []  # type: ignore[attr-defined]
    return kbv_reward


def make_verl_compute_score(
    client: Any = None,
    *,
    url: str | None = None,
    token: str | None = None,
    reward: Reward | None = None,
    protocol: str | None = None,
    precision: str | None = None,
    timeout_s: float | None = None,
) -> Callable[..., dict[str, Any]]:
    """A ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` for verl's
    reward manager. ``ground_truth`` (or ``extra_info["problem"]``) names the problem. Returns
    ``{"score": reward, "outcome", "record_id", "speedup"}``: verl keeps the extra keys as the
    step's extra information, so any reward can be looked up with ``kbv explain RECORD_ID``."""
    from kbv.client import evaluation

    score = reward or Reward()

    def compute_score(
        data_source: Any, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        problem = (extra_info or {}).get("problem") or ground_truth
        if not isinstance(problem, str) or not problem:
            raise ValueError("give the problem name as ground_truth or extra_info['problem']")
        code = extract_code(solution_str)
        if code is None:
            return {"score": score.no_code, "outcome": "no_code", "record_id": None, "speedup": None}
        service = _client(client, url, token)
        item = evaluation(problem, code, protocol=protocol, precision=precision, timeout_s=timeout_s)
        result = service.evaluate_many([item])[0]
        record = result.get("record") or {}
        return {
            "score": score(record) if record else score.failed,
            "outcome": result.get("outcome") or result.get("status"),
            "record_id": result.get("record_id"),
            "speedup": (record.get("speedup") or {}).get("best"),
        }

    return compute_score


def compute_score(
    data_source: Any, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> dict[str, Any]:
    """verl's ``custom_reward_function`` entry point: the service at ``$KBV_SERVE_URL`` (token
    ``$KBV_SERVE_TOKEN``) with the default :class:`Reward`."""
    return make_verl_compute_score()(data_source, solution_str, ground_truth, extra_info)
