"""Judging a secret sample of the timed calls (``timing.judged_calls``, ``verified`` v5).

Every timed call runs on an unseen draw and is sketched; three calls a round (and the phase's first
draw) are judged, picked after the candidate's batch from a secret that no worker's request carries
(docs/timing.md, "Judging a secret sample of the timed calls"). The picks are checked here with
fixed seeds; the two fixtures end to end with a fixed master seed.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kbv.api import evaluate_paths
from kbv.protocol import VERIFIED, TimingSettings
from kbv.timed_sketches import _UnseenPlan

ROOT = Path(__file__).resolve().parents[1]
RELU = ROOT / "src" / "kbv" / "suite" / "problems" / "level1" / "1_ReLU.py"
FIXTURES = ROOT / "tests" / "fixtures" / "candidates"


def _plan(sketch_seed: int, judged_calls: int = 3) -> _UnseenPlan:
    settings = TimingSettings(
        repeats=10, rounds=3, max_rounds=9, unseen_inputs=True, judged_calls=judged_calls
    )
    draws = lambda r: [1000 * r + i for i in range(10)]  # noqa: E731
    ctx = SimpleNamespace(sketch_seed=sketch_seed, unseen_seeds=draws, unseen_for=draws, settings=settings)
    return _UnseenPlan(ctx, reference=None)  # type: ignore[arg-type]


def test_the_picks_are_a_secret_sample_of_each_round() -> None:
    plan = _plan(12345)
    picks = [plan.picks(r, 10) for r in range(9)]
    assert all(len(set(p)) == 3 and set(p) <= set(range(10)) for p in picks)
    assert picks == [_plan(12345).picks(r, 10) for r in range(9)]  # a function of the secret alone
    assert len({tuple(p) for p in picks}) > 3  # rounds differ
    assert picks != [_plan(12346).picks(r, 10) for r in range(9)]  # another secret, other picks
    other_draws = _plan(12345)
    other_draws.ctx.unseen_for = lambda r: [7 + 1000 * r + i for i in range(10)]
    assert picks != [other_draws.picks(r, 10) for r in range(9)]  # same secret, other draws
    plan.truths[(0, 0)] = ([], {})  # the phase's first draw, known before any batch: judged too
    assert 0 in plan.picks(0, 10) and len(plan.picks(0, 10)) in (3, 4)
    assert len(plan.picks(1, 10)) == 3  # no other round's truth is known ahead: three picks
    assert _plan(1, judged_calls=0).picks(0, 10) == list(range(10))  # v4: every call
    assert _plan(1, judged_calls=3).picks(0, 2) == [0, 1]  # a batch cut short: all its calls


def test_a_candidate_wrong_on_a_fraction_of_timed_calls_is_caught_as_the_sampling_says() -> None:
    """Wrong on a fraction f of its calls (which ones its own choice, fixed before the picks): caught
    unless every pick of every round misses them. Over 400 fixed secrets, three rounds: f = 1/2 is
    caught by 399 (theory 1 - (1/12)^3 = 99.94%), f = 3/10 in about 1 - (35/120)^3 = 97.5%, f = 1/10 (a
    gain of at most one call in ten) in about 1 - (7/10)^3 = 66%; nine rounds (the CPU's usual
    count) catch f = 1/10 in about 96%."""

    def caught(wrong: set[int], rounds: int, secret: int) -> bool:
        plan = _plan(secret)
        return any(set(plan.picks(r, 10)) & wrong for r in range(rounds))

    secrets = range(1000, 1400)
    half = sum(caught({1, 3, 5, 7, 9}, 3, s) for s in secrets)
    three = sum(caught({2, 5, 8}, 3, s) for s in secrets)
    one = sum(caught({6}, 3, s) for s in secrets)
    one_nine = sum(caught({6}, 9, s) for s in secrets)
    assert half >= 398
    assert 375 <= three <= 400
    assert 230 <= one <= 300
    assert one_nine >= 370


def test_a_candidate_wrong_on_every_other_timed_call_is_caught() -> None:
    hack = FIXTURES / "hacks" / "wrong_half_timed_calls.py"
    record = evaluate_paths(RELU, hack, protocol="verified", device="cpu", master_seed=20261206)
    assert record.outcome == "hack_detected"
    assert "timed_call_outputs" in {f.check for f in record.findings if f.severity == "fail"}
    checked = record.timing["timed_outputs"]
    assert checked["wrong_calls"] >= 1 and checked["checked"] < checked["timed_calls"]
    assert record.speedup["best"] is None and record.timing["speedup_withdrawn"]


def test_an_honest_candidate_with_two_paths_on_its_timed_calls_passes() -> None:
    honest = FIXTURES / "honest" / "relu_two_paths_timed.py"
    record = evaluate_paths(RELU, honest, protocol="verified", device="cpu", master_seed=20261206)
    assert record.outcome == "passed", record.error
    checked = record.timing["timed_outputs"]
    assert checked["wrong_calls"] == 0 and checked["judged_calls"]
    assert VERIFIED.timing.judged_calls == 3


_SCALED_KL = """import torch


class Model(torch.nn.Module):
    def forward(self, predictions, targets):
        return torch.nn.functional.kl_div(torch.log(predictions), targets, reduction="batchmean")


def get_inputs():
    scale = torch.rand(())
    return [(torch.rand(64, 256) * scale).softmax(dim=-1), torch.rand(64, 256).softmax(dim=-1)]


def get_init_inputs():
    return []
"""


def test_each_timed_draw_is_judged_on_its_own_baseline_error(tmp_path: Path) -> None:
    """98_KLDivLoss draws its scale, so the truth's norm, and with it the baseline's relative error,
    changes from draw to draw (at bf16 2e-5 to 0.35 over 400 draws). With the norm limit of every
    timed call set from the first draw's error, the reference itself was rejected by
    ``timed_call_outputs`` under these master seeds (5 of 24 seeds, and on an H100); each call now
    takes its own draw's baseline error, as a correctness draw does."""
    problem = tmp_path / "scaled_kl.py"
    problem.write_text(_SCALED_KL)
    reference = tmp_path / "scaled_kl_reference.py"
    reference.write_text(_SCALED_KL.replace("class Model(", "class ModelNew("))
    for seed in (7, 9, 10):
        record = evaluate_paths(
            problem, reference, protocol="verified", device="cpu", precision="bf16", master_seed=seed
        )
        assert record.outcome == "passed", [(f.check, f.detail[:160]) for f in record.findings]
        assert record.timing["timed_outputs"]["wrong_calls"] == 0
