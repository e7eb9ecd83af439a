"""benchmarks/wall_excess.py: ``side_stream_timing``'s arithmetic replayed on stored records."""

from __future__ import annotations

import sys

from benchmark_scripts import BENCHMARKS, load_script


def _record(candidate_wall_extra_ms: float) -> dict:
    def rnd(device: float, extra: float) -> dict:
        return {"device_ms": [device] * 5, "wall_ms": [device + extra] * 5}

    return {
        "problem": {"name": "1_ReLU"},
        "candidate": {"path": "/x/relu.py"},
        "outcome": "passed",
        "timing": {
            "candidate": {"rounds": [rnd(0.05, 0.02), rnd(0.05, candidate_wall_extra_ms)]},
            "baselines": {"eager_fp32": {"rounds": [rnd(0.3, 0.02), rnd(0.3, 0.03)]}},
        },
    }


def test_a_round_that_hid_time_fires_and_says_how_much(monkeypatch) -> None:
    """Reject: one round whose wall clock ran 0.5 ms past its events (allowed: the baselines'
    upper median excess 0.03 ms, over half the device time, plus 0.05 ms). Accept: an excess like the
    baselines'. An untimed record gives no row."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("bracket_replay", None)
    script = load_script("wall_excess")
    hid = script.replay(_record(0.5))
    assert hid["fires"] and abs(hid["hidden_ms"] - 0.47) < 1e-9
    assert abs(hid["allowed_ms"] - (0.03 + 0.05)) < 1e-9  # the upper median, as the check takes it
    honest = script.replay(_record(0.02))
    assert not honest["fires"] and honest["hidden_ms"] <= 0
    assert script.replay({"timing": {}, "problem": {"name": "p"}, "candidate": {"path": "c"}}) is None
