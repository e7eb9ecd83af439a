"""kbv.Evaluator: text and paths with one source of truth, problem names, shared batch seeds.

On the CPU with the bundled 1_ReLU problem (an evaluation takes about a second there)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from pathlib import Path

import pytest

import kbv
from kbv import _shared_reference
from kbv._evaluator import UnknownProblem
from kbv.candidates import Candidate, CandidateError, load_candidate

ROOT = Path(__file__).resolve().parents[1]
RELU = ROOT / "src/kbv/suite/problems/level1/1_ReLU.py"
HONEST = ROOT / "tests/fixtures/candidates/honest/relu_clamp.py"  # plain PyTorch: no build
HACK = ROOT / "tests/fixtures/candidates/hacks/identity_relu.py"


@pytest.fixture(scope="module")
def evaluator():
    with kbv.Evaluator(device="cpu", timeout_s=240) as ev:
        yield ev


def test_candidate_mismatch_is_impossible(tmp_path: Path) -> None:
    """The trap: a Candidate whose file is not its source (or does not exist) is refused."""
    other = "class ModelNew: pass\n"
    sha = hashlib.sha256(other.encode()).hexdigest()
    with pytest.raises(CandidateError, match="does not hold"):
        Candidate(path=HONEST, source=other, source_sha256=sha)
    with pytest.raises(CandidateError, match="cannot be read"):
        Candidate(path=tmp_path / "missing.py", source=other, source_sha256=sha)
    with pytest.raises(CandidateError, match="not the hash"):
        Candidate(path=HONEST, source=HONEST.read_text(), source_sha256=sha)
    accepted = load_candidate(HONEST)
    assert accepted.source_sha256 == hashlib.sha256(HONEST.read_bytes()).hexdigest()


def test_crlf_file_hashes_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "c.py"
    path.write_bytes(b"x = 1\r\n")
    assert load_candidate(path).source_sha256 == hashlib.sha256(b"x = 1\r\n").hexdigest()


def test_text_candidate_runs_what_it_hashes(evaluator) -> None:
    """Source text is written to a file named by its hash and read back: the record's hash is the
    text's, and the verdict is the one of the same text evaluated from its own file."""
    text = HONEST.read_text()
    record = evaluator.evaluate("level1/1_ReLU", text)
    assert record.candidate["source_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert Path(record.candidate["path"]).read_text() == text
    assert record.outcome == "passed"
    by_path = evaluator.evaluate(RELU, HONEST)
    assert by_path.outcome == "passed" and by_path.candidate["path"] == str(HONEST)


def test_problem_names_stay_in_the_tree(evaluator) -> None:
    assert evaluator.problem("level1/1_ReLU").source == RELU.read_text()
    assert (
        evaluator.problem(RELU.read_text(), name="1_ReLU").source_sha256
        == hashlib.sha256(RELU.read_bytes()).hexdigest()
    )
    for bad in ("level1/999_Nothing", "../problems/level1/1_ReLU", "/etc/passwd", "level1/../../x"):
        with pytest.raises(UnknownProblem):
            evaluator.problem_path(bad)


def test_batch_shares_seeds_and_reference_outputs(evaluator) -> None:
    """Candidates of one problem in one batch share the master seed and the reference's outputs;
    the next batch draws a new seed. A hack in the batch is still caught, the honest ones pass."""
    before = dict(_shared_reference.totals)
    pairs = [("level1/1_ReLU", HONEST.read_text())] * 2 + [("level1/1_ReLU", HACK.read_text())]
    first = evaluator.map(pairs)
    assert [r.outcome for r in first] == ["passed", "passed", "hack_detected"]
    assert len({r.seeds["master"] for r in first}) == 1
    assert _shared_reference.totals["hits"] > before["hits"]
    second = asyncio.run(evaluator.amap(pairs[:1]))
    assert second[0].seeds["master"] != first[0].seeds["master"]


def test_unknown_protocol_and_precision_are_refused(evaluator) -> None:
    with pytest.raises(Exception, match="protocol"):
        evaluator.submit("level1/1_ReLU", HONEST, protocol="no-such-protocol")
    with pytest.raises(Exception, match="precision"):
        evaluator.submit("level1/1_ReLU", HONEST, precision="fp8")
    assert evaluator.queued == 0  # nothing was queued


@pytest.mark.parametrize("keep", [True, False])
def test_next_batch_finds_its_workers_booted(monkeypatch, keep: bool) -> None:
    """Batches that come one after another (the service's): the workers of the submissions waiting
    for the next batch boot while the current one runs, so its first pair boots nothing. Without
    kept spares (a single map, as ``kbv run``'s) that pair's workers start when it begins."""
    from kbv._evaluator import Evaluator
    from kbv.worker import _spares

    taken: list[tuple[str, bool]] = []
    real_take = _spares.Spares.take

    def take(self, spec):
        taken.append((spec.role, bool(self._launched.get(_spares._spec_key(spec)))))
        return real_take(self, spec)

    queued = threading.Event()  # the first batch looks ahead only once the second is queued
    real_upcoming = Evaluator._upcoming

    def upcoming(self):
        queued.wait(60)
        return real_upcoming(self)

    monkeypatch.setattr(_spares.Spares, "take", take)
    monkeypatch.setattr(Evaluator, "_upcoming", upcoming)
    with kbv.Evaluator(device="cpu", timeout_s=240) as ev:
        ev._executor.keep_spares = keep
        first = ev.submit("level1/1_ReLU", HONEST)
        while not first.running():
            time.sleep(0.01)
        second = ev.submit("level1/1_ReLU", HACK)
        queued.set()
        assert first.result().outcome == "passed"
        assert second.result().outcome == "hack_detected"
        assert ev.batches == 2
    assert taken == [("reference", False), ("candidate", False), ("reference", keep), ("candidate", keep)]
