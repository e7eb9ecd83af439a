"""Input invariants (kbv.problems.structure + kbv.inputs.apply_invariants), the reduction floor of
the error model, and TF32 switched on only inside a candidate's forward."""

from __future__ import annotations

import importlib.util
import json
import math
import types
from pathlib import Path

import pytest
import torch

from kbv import correctness, inputs
from kbv.problems import ProblemError, load_problem
from kbv.problems.structure import describe_structure, infer_invariants, input_structure
from kbv.protocol import STANDARD, VERIFIED

ROOT = Path(__file__).resolve().parents[1]
HONEST_PROBLEMS = ROOT / "tests" / "fixtures" / "problems_honest"
HONEST = ROOT / "tests" / "fixtures" / "candidates" / "honest"


def _draws(make, k: int = 3) -> list[list]:
    out = []
    for seed in range(k):
        torch.manual_seed(seed)
        out.append(make())
    return out


# ------------------------------------------------------------------------------------------ inference
def test_infers_triangular_band_and_mask_patterns() -> None:
    n = 32
    found = infer_invariants(
        _draws(
            lambda: [
                torch.tril(torch.rand(n, n)),
                torch.triu(torch.rand(2, n, n), 2),
                torch.rand(n, n).tril(1).triu(-3),
                torch.rand(n, n) * (torch.arange(n) % 3 == 0),  # fixed zero columns: no band
            ]
        )
    )
    assert [f["zeros"] for f in found] == ["lower", {"triu": 2}, {"band": [-3, 1]}, "mask"]


def test_infers_value_sets_symmetry_and_integer_ranges() -> None:
    def make() -> list:
        a = torch.rand(16, 16)
        return [
            torch.randint(0, 2, (256,)).float() * 2 - 1,
            (a + a.T) / 2,
            torch.randint(0, 10, (64,)),
            torch.tril(torch.randint(0, 2, (16, 16)).float() * 2 - 1),
        ]

    pm1, sym, index, tril_pm1 = infer_invariants(_draws(make))
    assert pm1 == {"values": [-1.0, 1.0]}
    assert sym == {"symmetric": True}
    assert index == {"kept": "the problem's own draw", "range": [0, 9]}
    assert tril_pm1 == {"zeros": "lower", "values": [-1.0, 1.0]}  # 0 belongs to the pattern, not the set


@pytest.mark.parametrize("stray_in", [0, 2])
def test_a_zero_outside_the_pattern_in_the_last_draw_keeps_zero_a_free_value(stray_in: int) -> None:
    """A lower-triangular input of -1 and 1 whose zeros are the pattern's: 0 is no free value. A
    stray zero (under the allowed share) above the diagonal in the last draw keeps 0 a value the
    free entries take; one in the first draw only does not, as the last draw is what is judged."""
    n = 320  # 102,400 entries: a stray zero is under STRAY_ZEROS of them

    def draw(k: int) -> list:
        torch.manual_seed(k)
        x = torch.tril(torch.randint(0, 2, (n, n)).float() * 2 - 1)
        if k == stray_in:
            x[n - 1, 0] = 0.0
        return [x]

    (found,) = infer_invariants(draw(k) for k in range(3))
    assert found is not None and found["zeros"] == "lower"
    assert found["values"] == ([-1.0, 0.0, 1.0] if stray_in == 2 else [-1.0, 1.0])


def test_inference_holds_one_draw_at_a_time() -> None:
    """Each draw is let go once folded in, before the next is made: the parent inferred 47_Sum's
    structure at up to 42 GiB of an H100 while it kept the last draw (2026-12-07)."""
    import weakref

    alive: list[weakref.ref] = []

    def draws():
        for k in range(3):
            assert all(ref() is None for ref in alive), f"draw {k}: an earlier draw is still held"
            torch.manual_seed(k)
            x = torch.tril(torch.rand(64, 64))
            alive.append(weakref.ref(x))
            yield [x, torch.randint(0, 5, (8,))]
            del x

    (tril, index) = infer_invariants(draws())
    assert (
        tril is not None
        and tril["zeros"] == "lower"
        and index
        == {
            "kept": "the problem's own draw",
            "range": [0, 4],
        }
    )
    assert all(ref() is None for ref in alive)


def test_random_inputs_have_no_invariants() -> None:
    """Sign and range are never inferred; chance zeros, ReLU zeros and tiny tensors are no structure."""
    found = infer_invariants(
        _draws(
            lambda: [
                torch.rand(64, 64),
                torch.relu(torch.randn(4096)),
                torch.rand(3),
                torch.randint(0, 2, (8,)).float(),
                2.5,
            ]
        )
    )
    assert found == [None, None, None, None, None]


def test_declaration_wins_and_a_bad_one_is_a_problem_error(tmp_path: Path) -> None:
    source = (HONEST_PROBLEMS / "tril_matmul.py").read_text()
    declared = tmp_path / "declared.py"
    declared.write_text(source + '\nKBV = {"structure": [{}, {"zeros": {"tril": 0}, "symmetric": False}]}\n')
    found = input_structure(load_problem(declared), "cpu").invariants
    assert found == [{"source": "declared"}, {"zeros": {"tril": 0}, "source": "declared"}]
    bad = tmp_path / "bad.py"
    bad.write_text(source + '\nKBV = {"structure": [{"zeros": "diagonal"}, None]}\n')
    with pytest.raises(ProblemError, match=r"unknown zero pattern 'diagonal'"):
        input_structure(load_problem(bad), "cpu")
    assert "error" in describe_structure(load_problem(bad))[0]


# ------------------------------------------------------------------------------------------ applying
def _problem(make) -> types.SimpleNamespace:
    return types.SimpleNamespace(get_inputs=make)


@pytest.mark.parametrize("distribution", list(inputs.BASE_DISTRIBUTIONS) + ["wide_positive", "sparse_unit"])
def test_every_distribution_keeps_the_invariants(distribution: str) -> None:
    def make() -> list:
        a = torch.rand(24, 24)
        return [
            torch.tril(torch.rand(24, 24)),
            torch.randint(0, 2, (512,)).float() * 2 - 1,
            a + a.T,
            torch.rand(24, 24) * (torch.arange(24) % 2 == 0),
            torch.randint(0, 7, (5,)),
        ]

    structure = infer_invariants(_draws(make))
    got = inputs.make_inputs(_problem(make), distribution, 11, "cpu", structure=structure, precision="fp64")
    again = inputs.make_inputs(_problem(make), distribution, 11, "cpu", structure=structure, precision="fp64")
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    tril, pm1, sym, masked, index = got
    assert torch.equal(tril, torch.tril(tril))
    assert set(pm1.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(sym, sym.T)
    assert bool((masked[:, 1::2] == 0).all())
    assert int(index.min()) >= 0 and int(index.max()) < 7
    if distribution != "original":  # the free entries still change: the distribution is not undone
        plain = inputs.make_inputs(_problem(make), "original", 11, "cpu")
        assert not torch.equal(tril.float(), plain[0]) and not torch.equal(sym.float(), plain[2])


def test_without_invariants_a_triangle_skipping_kernel_is_wrong() -> None:
    """The control: the structure is what makes the honest tril kernel right on hidden inputs."""
    spec = importlib.util.spec_from_file_location("tril_skip", HONEST / "tril_matmul_skip_zeros.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    problem = _problem(lambda: [torch.tril(torch.rand(128, 128)), torch.tril(torch.rand(128, 128))])
    structure = infer_invariants(_draws(problem.get_inputs))
    for structured, expect_equal in ((structure, True), (None, False)):
        a, b = inputs.make_inputs(problem, "signed", 5, "cpu", structure=structured)
        same = torch.allclose(module.ModelNew()(a, b), torch.tril(a @ b), rtol=1e-4, atol=1e-4)
        assert same is expect_equal


# ------------------------------------------------------------------------------------------ the floor
def test_reduction_lengths_from_shapes() -> None:
    outs = [torch.zeros(()), torch.zeros(16), torch.zeros(16, 1024)]
    assert correctness.reduction_lengths([16 * 1024, 1024, 0], outs) == [16 * 1024, 1024, 1]


def _scalar_verdict(rel_err: float, length: int, settings=VERIFIED.correctness) -> bool:
    truth = torch.tensor(1.0 / 6.0, dtype=torch.float64)
    base = correctness.baseline_error([truth * (1 + 6e-8)], [truth])  # PyTorch's own error, 6e-8
    out = (truth * (1 + rel_err)).to(torch.float32)
    passed, *_ = correctness.compare_error_model([out], [truth], base, settings, [length])
    return passed


def test_floor_accepts_honest_summation_orders_and_rejects_a_bias() -> None:
    billion, four_m = 32768 * 32768, 1 << 22
    assert (
        correctness.reduction_floor(billion, VERIFIED.correctness)
        == VERIFIED.correctness.reduction_floor_cap
        == 1e-3
    )
    assert correctness.reduction_floor(four_m, VERIFIED.correctness) == pytest.approx(2.0**-24 * 16384)
    # issue 12: loss kernels over ~1e9 elements, and a 4M mean of 16384 sequential block sums
    for err, length in (
        (1.2e-6, billion),
        (2.9e-6, billion),
        (1.3e-6, four_m),
        (1.2e-5, four_m),
        (2e-4, four_m),
    ):
        assert _scalar_verdict(err, length), (err, length)
        assert not _scalar_verdict(err, 1)  # without the floor (length 1) each was rejected
    for length in (billion, four_m, 1 << 20):
        assert not _scalar_verdict(1e-2, length)
        assert not _scalar_verdict(-1e-2, length)
    assert not _scalar_verdict(2.9e-6, billion, STANDARD.correctness)  # reduction_block 0: no floor


def test_floor_is_recorded_per_output() -> None:
    truth = [torch.ones((), dtype=torch.float64), torch.ones(8, dtype=torch.float64)]
    base = correctness.baseline_error([t.float() for t in truth], truth)
    _, _, _, tol = correctness.compare_error_model(
        [t.float() for t in truth], truth, base, VERIFIED.correctness, [1 << 20, 1]
    )
    first, second = tol["outputs"]
    assert first["reduction_length"] == 1 << 20 and first["reduction_floor"] == pytest.approx(2.0**-24 * 4096)
    assert second["reduction_floor"] == 0.0 and math.isclose(
        second["norm_tol"], VERIFIED.correctness.norm_floor
    )


# ------------------------------------------------------------------------------------------ TF32
def test_scoped_tf32_candidate_restores_the_global_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("tf32_scoped", HONEST / "tf32_scoped.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen: list[tuple[bool, bool]] = []
    real = torch.matmul

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        return real(a, b)

    monkeypatch.setattr(torch, "matmul", spy)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    module.ModelNew()(torch.rand(4, 8), torch.rand(8, 4))
    assert seen == [(True, True)]
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


# ------------------------------------------------------------------------------------------ records
def test_record_keeps_the_invariants_and_a_replay_uses_them(tmp_path: Path) -> None:
    from kbv.api import evaluate_paths, evaluate_replay

    problem = HONEST_PROBLEMS / "tril_matmul.py"
    record = evaluate_paths(problem, HONEST / "tril_matmul_skip_zeros.py", protocol="standard", device="cpu")
    assert record.outcome == "passed", record.error
    assert record.seeds["structure"] == [{"zeros": "lower", "source": "inferred"}] * 2
    stored = json.loads(record.to_json())
    stored["seeds"]["structure"] = [
        {"zeros": "upper", "source": "declared"},
        None,
    ]  # as if inferred otherwise
    path = tmp_path / "record.json"
    path.write_text(json.dumps(stored))
    replayed = evaluate_replay(path, device="cpu")
    assert replayed.seeds["structure"] == stored["seeds"]["structure"]


def test_audit_shows_the_invariants() -> None:
    from kbv.problems_audit import audit_problems

    [result] = audit_problems([load_problem(HONEST_PROBLEMS / "tril_matmul.py")], device="cpu", seed=1)
    assert result.to_dict()["structure"] == [
        {"input": 0, "zeros": "lower", "source": "inferred"},
        {"input": 1, "zeros": "lower", "source": "inferred"},
    ]
