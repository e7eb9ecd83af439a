"""The reward and the TRL / verl adapters, called with those libraries' real signatures (neither is
installed: the adapters are plain functions). A stand-in service answers as ``kbv serve`` does; the
live server is exercised in tests/test_serve.py."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest

from kbv.rewards import Reward, compute_score, make_trl_reward, make_verl_compute_score

CODE = (
    "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x.relu()\n"
)
ANSWER = f"<think>draft:\n```python\nclass ModelNew: broken\n```</think>\nFinal:\n```python\n{CODE}```\n"


class StandIn:
    """Answers ``evaluate_many`` like kbv.client.Client: one finished request per item."""

    def __init__(self, outcome: str = "passed", speedup: float | None = 2.0) -> None:
        self.outcome, self.speedup = outcome, speedup
        self.sent: list[dict[str, Any]] = []

    def evaluate_many(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.sent.extend(items)
        return [
            {
                "status": "done",
                "outcome": self.outcome,
                "record_id": 100 + i,
                "record": {"outcome": self.outcome, "speedup": {"best": self.speedup}},
            }
            for i, _ in enumerate(items)
        ]


def test_default_reward() -> None:
    reward = Reward()
    assert reward({"outcome": "passed", "speedup": {"best": 2.0}}) == pytest.approx(2.0)
    assert reward({"outcome": "passed", "speedup": {"best": 1.0}}) == pytest.approx(1.0)
    assert reward({"outcome": "passed", "speedup": {"best": 0.25}}) == 0.0  # clipped: never below a failure
    assert reward({"outcome": "passed", "speedup": {"best": 1e6}}) == pytest.approx(4.0)  # clipped above
    assert reward({"outcome": "passed", "speedup": {"best": None}}) == 1.0  # not timed
    for outcome in ("incorrect", "hack_detected", "timeout", "crashed", "compile_error"):
        assert reward({"outcome": outcome, "speedup": {"best": 10.0}}) == 0.0
    custom = Reward(passed_base=0.5, max_log2=1.0, failed=-1.0)
    assert custom({"outcome": "passed", "speedup": {"best": 8.0}}) == pytest.approx(1.5)
    assert custom({"outcome": "incorrect"}) == -1.0
    assert not math.isnan(reward({"outcome": "passed", "speedup": {"best": float("nan")}}))


def test_trl_reward_signature_and_extraction() -> None:
    service = StandIn()
    reward_fn = make_trl_reward(service)
    assert list(inspect.signature(reward_fn).parameters) == ["prompts", "completions", "kwargs"]
    conversational = [{"role": "assistant", "content": ANSWER}]
    rewards = reward_fn(
        prompts=["p0", "p1", "p2"],
        completions=[ANSWER, conversational, "I cannot write this kernel."],
        problem=["level1/19_ReLU", "level1/19_ReLU", "level1/19_ReLU"],
        completion_ids=[[1], [2], [3]],  # what TRL passes besides
    )
    assert rewards == [pytest.approx(2.0), pytest.approx(2.0), 0.0]
    assert [item["source"] for item in service.sent] == [CODE, CODE]  # the final block, not the draft
    assert [r and r["record_id"] for r in reward_fn.last_results] == [100, 101, None]
    with pytest.raises(ValueError, match="problem"):
        reward_fn(prompts=["p"], completions=[ANSWER])


def test_verl_compute_score_signature() -> None:
    service = StandIn(outcome="hack_detected")
    score = make_verl_compute_score(service)
    assert list(inspect.signature(score).parameters) == [
        "data_source",
        "solution_str",
        "ground_truth",
        "extra_info",
    ]
    result = score("kernelbench", ANSWER, "level1/19_ReLU", {"index": 3})
    assert result["score"] == 0.0 and result["outcome"] == "hack_detected" and result["record_id"] == 100
    passed = make_verl_compute_score(StandIn(speedup=4.0))(
        data_source="kernelbench",
        solution_str=ANSWER,
        ground_truth=None,
        extra_info={"problem": "level1/1_ReLU"},
    )
    assert passed["score"] == pytest.approx(3.0) and passed["speedup"] == 4.0
    assert score("kernelbench", "no code", "level1/19_ReLU")["outcome"] == "no_code"
    assert list(inspect.signature(compute_score).parameters) == list(inspect.signature(score).parameters)
