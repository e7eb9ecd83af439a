"""The protocol audit: its generators, its equivalence rule and its numbers.

The generators are checked on the trusted side only (no worker): each control computes the
reference's function and each mutant does not; the report's numbers come from fixed records. The
whole audit through workers is `benchmarks/protocol_audit.py` (and the CPU figures in
docs/protocol-audit.md).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kbv.problems import bundled_suite_dir, load_problem
from kbv.protocol_audit import _generate as gen
from kbv.protocol_audit import _sources as src
from kbv.protocol_audit._report import by_design, caught_by, make_row, summarize, wilson
from kbv.records import DistributionResult, Finding, Record

SUITE = bundled_suite_dir()


def _specs(path: Path, tmp_path: Path) -> dict[tuple[str, str], gen.Spec]:
    return {(s.kind, s.variant): s for s in gen.problem_specs(load_problem(path), "cpu", tmp_path)}


def _problem(
    tmp_path: Path, forward: str, domain: str = "any", init: str = "", extra_inputs: str = ""
) -> Path:
    path = tmp_path / "p" / "tiny.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        textwrap.dedent(f'''
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        rows = 8
        cols = 64
        KBV = {{"domain": "{domain}"}}


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                {init or "pass"}

            def forward(self, x):
                return {forward}


        def get_inputs():
            return [torch.rand(rows, cols){extra_inputs}]


        def get_init_inputs():
            return []
    ''')
    )
    return path


# ------------------------------------------------------------------------------------ controls
def test_controls_compute_the_reference(tmp_path: Path) -> None:
    specs = _specs(SUITE / "level1" / "14_SumReduction.py", tmp_path)
    for order in ("blocked", "reversed", "sequential"):
        spec = specs[("reordered", order)]
        assert spec.status == "evaluate", spec.note
        assert (
            "_kbv_reduce(" in spec.source
            and "torch.sum(" not in spec.source.split("import math as _kbv_math")[0]
        )
    assert specs[("reference", "")].status == "evaluate"
    assert (
        "class ModelNew" in specs[("reference", "")].source
        and "class Model(" not in specs[("reference", "")].source
    )
    assert ("tf32", "") not in specs  # no matmul or convolution: no TF32 control


def test_reordered_sums_agree_with_torch_and_sequential_is_short_only(tmp_path: Path) -> None:
    namespace: dict[str, object] = {}
    exec(src.REDUCE_HELPER, namespace)  # noqa: S102 - kbv's own helper, no candidate code
    reduce = namespace["_kbv_reduce"]
    x = torch.randn(3, 300, 5)
    for order in ("blocked", "reversed"):
        got = reduce(x, 1, True, op="mean", order=order)  # type: ignore[operator]
        torch.testing.assert_close(got, x.mean(1, keepdim=True), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(reduce(x, op="sum", order=order), x.sum(), rtol=1e-4, atol=1e-4)  # type: ignore[operator]
    short = x[:, :200]
    got = reduce(short, 1, True, op="mean", order="sequential")  # type: ignore[operator]
    torch.testing.assert_close(got, short.mean(1, keepdim=True), rtol=1e-5, atol=1e-6)
    # A long one is refused before its Python loop starts (1e9 steps for a KernelBench loss).
    with pytest.raises(Exception, match="300") as refused:
        reduce(x, 1, op="sum", order="sequential")  # type: ignore[operator]
    assert type(refused.value).__name__ == src.LONG_REDUCTION_ERROR
    specs = _specs(SUITE / "level1" / "20_MSELoss.py", tmp_path)  # a 16384-long mean on the CPU
    assert specs[("reordered", "sequential")].status == "skipped"
    assert specs[("reordered", "blocked")].status == "evaluate"


def test_blocked_order_copies_nothing_as_large_as_its_input_and_differs_from_one_sum() -> None:
    """36_RMSNorm_'s 64-long reduction of a 7 GiB input: the blocked control once padded it to
    256 (28 GiB more) and ran out of memory on the H200. Blocks are now views of the input."""
    from torch.utils._python_dispatch import TorchDispatchMode

    namespace: dict[str, object] = {}
    exec(src.REDUCE_HELPER, namespace)  # noqa: S102 - kbv's own helper, no candidate code
    reduce = namespace["_kbv_reduce"]
    sizes: list[int] = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() != input_storage:
                sizes.append(out.numel())
            return out

    x = torch.randn(8, 64, 33, 17)
    input_storage = x.untyped_storage().data_ptr()  # views of the input are not new memory
    with Sizes():
        got = reduce(x, 1, True, op="mean", order="blocked")  # type: ignore[operator]
    torch.testing.assert_close(got, x.mean(1, keepdim=True), rtol=1e-5, atol=1e-6)
    assert sizes and max(sizes) <= x.numel() // 8, sizes  # 8 partials per row at most, no copy
    rows = torch.randn(4096, 64)
    blocked = reduce(rows, 1, op="sum", order="blocked")  # type: ignore[operator]
    assert (blocked != rows.sum(1)).any()  # another float32 order, not the reference's own
    torch.testing.assert_close(blocked, rows.sum(1), rtol=1e-5, atol=1e-5)


def test_helper_classes_are_renamed_and_tf32_control_restores_flags(tmp_path: Path) -> None:
    source = (
        "import torch.nn as nn\nclass Block(nn.Module):\n    pass\nclass Model(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.b = Block()\n"
    )
    out = src.reference_control(source)
    assert "class _KbvBlock" in out and "self.b = _KbvBlock()" in out and "class ModelNew" in out
    specs = _specs(SUITE / "level1" / "25_Matmul_Square.py", tmp_path)
    assert specs[("tf32", "")].status == "evaluate" and "finally:" in specs[("tf32", "")].source


def test_a_control_that_breaks_is_a_generator_error(tmp_path: Path) -> None:
    path = _problem(tmp_path, "x.sum(dim=1, keepdim=True)")
    draft = gen._Draft(
        "control",
        "reference",
        "",
        lambda: "class ModelNew:\n    def __init__(self):\n        raise RuntimeError('broken')\n",
    )
    problem = load_problem(path)
    reference = problem.load()
    draws = gen._domain_draws(problem, reference, "cpu")
    spec = gen._check(problem, draft, {}, reference, draws, tmp_path, 0, "cpu")
    assert spec.status == "generator_error" and "broken" in spec.note


# ------------------------------------------------------------------------------------ mutants
def test_mutants_of_relu_are_not_equivalent_where_the_domain_has_negatives(tmp_path: Path) -> None:
    specs = _specs(SUITE / "level1" / "1_ReLU.py", tmp_path)
    kinds = {k for k, _ in specs}
    assert {
        "zeros",
        "constant",
        "cached",
        "scaled",
        "bf16",
        "fp16",
        "first_rows",
        "stride",
        "head_tail",
        "input",
        "relu_identity",
    } <= kinds
    assert all(s.status == "evaluate" for s in specs.values() if s.role == "mutant"), [
        (s.kind, s.note) for s in specs.values()
    ]
    assert ("drop_op", "torch.relu(x)") not in specs  # would return the input: that is the input mutant


def test_identity_for_relu_is_equivalent_on_a_positive_domain(tmp_path: Path) -> None:
    specs = _specs(_problem(tmp_path, "torch.relu(x) * 2.0", domain="positive"), tmp_path)
    assert specs[("relu_identity", "torch.relu(x)")].status == "equivalent"
    assert specs[("zeros", "")].status == "evaluate"  # zeros are never equivalent to a nonzero output


def test_equivalence_holds_for_a_constant_output_and_a_no_op(tmp_path: Path) -> None:
    specs = _specs(SUITE / "level2" / "6_Gemm_Clamp_Min_Constant.py", tmp_path)
    assert specs[("constant", "")].status == "equivalent" and specs[("cached", "")].status == "equivalent"
    assert specs[("zeros", "")].status == "evaluate"
    dropout = _specs(SUITE / "level2" / "4_Linear_Softmax_Dropout.py", tmp_path / "d")
    assert dropout[("drop_op", "self.dropout(torch.softmax(self.linear(x), dim=1))")].status == "equivalent"
    assert dropout[("drop_op", "torch.softmax(self.linear(x), dim=1)")].status == "evaluate"


def test_shape_changing_or_raising_mutants_are_not_viable(tmp_path: Path) -> None:
    specs = _specs(SUITE / "level1" / "16_MaxReduction.py", tmp_path)
    assert specs[("drop_op", "torch.max(x, dim=self.dim)")].status == "not_viable"


def test_wrapped_mutants_compute_what_they_say(tmp_path: Path) -> None:
    path = _problem(tmp_path, "torch.tanh(x)")
    x = torch.randn(8, 64)
    for kind, expect in (
        ("zeros", torch.zeros_like(x)),
        ("scaled", torch.tanh(x) * 1.01),
        ("stride", torch.tanh(x.reshape(-1)[torch.arange(512) - torch.arange(512) % 2].reshape(8, 64))),
        ("first_rows", torch.tanh(x[torch.arange(8) % 2].reshape(8, 64))),
    ):
        model = _build(tmp_path, path, src.wrapped_mutant(path.read_text(), kind), kind)
        torch.testing.assert_close(model(x), expect)
    cached = _build(tmp_path, path, src.wrapped_mutant(path.read_text(), "cached"), "cached")
    first = cached(x)
    torch.testing.assert_close(cached(torch.randn(8, 64)), first)
    low = _build(tmp_path, path, src.wrapped_mutant(path.read_text(), "bf16"), "bf16")
    out = low(x)
    assert out.dtype == torch.float32 and 0 < (out - torch.tanh(x)).abs().max() < 1e-2
    head_tail = _build(tmp_path, path, src.wrapped_mutant(path.read_text(), "head_tail"), "head_tail")(
        x
    ).reshape(-1)
    k = 512 // 8
    assert torch.equal(head_tail[:k], torch.tanh(x).reshape(-1)[:k]) and not torch.allclose(
        head_tail, torch.tanh(x).reshape(-1)
    )


def _build(tmp_path: Path, problem: Path, source: str, name: str) -> torch.nn.Module:
    file = tmp_path / f"{name}.py"
    file.write_text(source)
    return gen._import(file).ModelNew().eval()


def _sampled_by_index(t: torch.Tensor, how: str) -> torch.Tensor:
    """What each sampler means, written as the index of every element (the definition)."""
    n = t.numel()
    j = torch.arange(n)
    if how == "stride":
        index = j - j % 2
    elif how == "first_rows" and t.dim() >= 2 and t.shape[0] >= 4:
        row = n // t.shape[0]
        index = (j // row) % (t.shape[0] // 4) * row + j % row
    elif how == "first_rows":
        index = j % max(1, n // 4)
    else:
        k = max(1, n // 8)
        m = (j - k) % (2 * k)
        index = torch.where((j < k) | (j >= n - k), j, torch.where(m < k, m, n - 2 * k + m))
    return t.reshape(-1)[index].reshape(t.shape)


class _LargestIndex(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements of any integer tensor an operation made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("how", ["stride", "first_rows", "head_tail"])
def test_samplers_match_their_definition_without_an_index_of_every_element(tmp_path: Path, how: str) -> None:
    """The samplers are built from slices: an int64 index of all 2.1e9 elements of
    48_Mean_reduction's input took 115 GB on the H200, and the audit counted two mutants as killed
    by the device-memory limit, not by a check."""
    namespace: dict = {}
    exec(src._WRAP_COMMON.split("_KBV_STATE")[0], namespace)
    sample = namespace["_kbv_sample"]
    for shape in [(8, 64), (5, 3), (4, 1), (7,), (2,), (3,), (17,), (9, 2, 3), (16, 4, 4)]:
        t = torch.randn(shape)
        expect = _sampled_by_index(t, how)
        with _LargestIndex() as seen:
            got = sample(t, how)
        assert got.shape == t.shape and torch.equal(got, expect), (how, shape)
        assert seen.largest <= max(shape[0], 1) if len(shape) > 1 else seen.largest == 0, (how, shape)
    assert sample(torch.arange(6), how).dtype == torch.int64  # integer inputs pass through


def test_drop_op_and_relu_identity_edit_one_operation() -> None:
    source = (SUITE / "level2" / "9_Gemm_BiasAdd_Hardtanh_Mish.py").read_text()
    sites = src.drop_sites(source)
    assert sites[:3] == ["self.linear(x) + self.bias", "F.hardtanh(y)", "F.mish(y)"]
    dropped = src.drop_op_mutant(source, sites.index("F.mish(y)"))
    assert "return y" in dropped and "F.mish" not in dropped
    relu = src.relu_identity_mutant((SUITE / "level3" / "1_MLP.py").read_text(), 0)
    assert "_kbv_nn.Identity()" in relu and "nn.ReLU()" not in relu
    with pytest.raises(IndexError):
        src.drop_op_mutant(source, len(sites))


# ------------------------------------------------------------------------------------ numbers
def test_wilson_interval_known_values() -> None:
    low, high = wilson(0, 10)  # type: ignore[misc]
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson(5, 10)  # type: ignore[misc]
    assert (low, high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    low, high = wilson(80, 80)  # type: ignore[misc]
    assert high == pytest.approx(1.0) and low == pytest.approx(0.9542, abs=1e-4)
    assert wilson(0, 0) is None


def _record(
    outcome: str,
    dists: list[tuple[str, bool, float]] | list[tuple[str, bool, float, float]],
    findings: tuple[str, ...] = (),
    mode: str = "error_model",
) -> Record:
    def tolerance(norm_tol: float) -> dict[str, object]:
        if mode == "allclose":
            return {"mode": "allclose", "atol": 1e-4, "rtol": 1e-4}
        return {"mode": "error_model", "outputs": [{"kind": "float", "norm_tol": norm_tol}]}

    return Record(
        problem={"name": "p", "source_sha256": "a"},
        candidate={"source_sha256": "b"},
        protocol={"name": "x"},
        device={},
        outcome=outcome,
        correct=outcome == "passed",
        distributions=[
            DistributionResult(n, True, ok, *((0.0, 0.1) if not err else (err[0], err[0])), tolerance(tol))
            for n, ok, tol, *err in dists
        ],
        findings=[Finding.fail(f, "") for f in findings],
    )


def _spec(role: str, kind: str, problem: str = "p") -> SimpleNamespace:
    return SimpleNamespace(problem=problem, role=role, kind=kind, variant="")


def test_summary_numbers_from_fixed_records() -> None:
    ok = [("original", True, 1e-6), ("signed", True, 1e-6)]
    rows = [
        make_row(_spec("control", "reference"), _record("passed", ok)),
        make_row(
            _spec("control", "reordered", "q"),
            _record("incorrect", [("original", True, 1e-6), ("wide", False, 1e-6)]),
        ),
        make_row(
            _spec("mutant", "zeros"),
            _record("incorrect", [("original", False, 1e-6), ("signed", False, 1e-6)]),
        ),
        make_row(_spec("mutant", "input"), _record("hack_detected", ok, ("output_aliases_input",))),
        make_row(_spec("mutant", "relu_identity", "q"), _record("passed", ok)),
        make_row(
            _spec("mutant", "fp16"), _record("passed", [("original", True, 2.4e-3)])
        ),  # TF32-sized tolerance
        make_row(_spec("mutant", "fp16", "q"), _record("passed", ok)),
    ]
    s = summarize({"name": "x", "version": 1}, rows)
    assert (
        s["false_rejection"]["count"] == 1
        and s["false_rejection"]["n"] == 2
        and s["false_rejection"]["rate"] == 0.5
    )
    assert s["false_rejection"]["ci95"] == [pytest.approx(wilson(1, 2)[0]), pytest.approx(wilson(1, 2)[1])]  # type: ignore[index]
    assert (s["kill"]["count"], s["kill"]["n"]) == (2, 4)  # the by-design fp16 is apart
    assert s["by_kind"]["fp16"] == {**s["by_kind"]["fp16"], "count": 0, "n": 1, "by_design": 1}
    assert s["caught_by"] == {"original": 1, "signed": 1, "output_aliases_input": 1}
    assert [r["kind"] for r in s["surviving_mutants"]] == ["relu_identity", "fp16"]
    assert s["rejected_controls"][0]["errors"] == [
        {"name": "wide", "passed": False, "max_abs_err": 0.0, "rel_err": 0.1, "note": ""}
    ]
    assert s["worst_problems"][0] == {"problem": "q", "rejected_controls": 1, "surviving_mutants": 2}


def test_by_design_needs_the_stated_tolerance_to_cover_the_perturbation() -> None:
    assert by_design("fp16", _record("passed", [("original", True, 2.4e-3), ("signed", True, 1e-3)]))
    assert not by_design("bf16", _record("passed", [("original", True, 2.4e-3)]))  # 2**-8 > 2.4e-3
    assert not by_design("fp16", _record("passed", [("original", True, 1e-6)]))
    assert not by_design(
        "scaled", _record("passed", [("original", True, 0.0)], mode="allclose")
    )  # rtol 1e-4 only
    assert not by_design("zeros", _record("passed", [("original", True, 1.0)]))  # no bounded perturbation


def test_by_design_ignores_distributions_where_the_output_is_exact() -> None:
    # 9_Matmul_Subtract_Multiply_ReLU on the H200: its output is all zeros on original and signed
    # inputs (ReLU after subtracting 2), so the fp16 mutant is exact there under a 1e-6 floor, and
    # within the TF32 error model (2.2e-3) wherever the output is not zero
    exact_then_admitted = [("original", True, 1e-6, 0.0), ("signed", True, 1e-6, 0.0), ("wide", True, 2.2e-3)]
    assert by_design("fp16", _record("passed", exact_then_admitted))
    # a perturbation that shows under a tight tolerance is a miss, whatever the others admit
    assert not by_design("fp16", _record("passed", [("original", True, 1e-6, 4e-7), ("wide", True, 2.2e-3)]))
    # exact everywhere: nothing admitted the perturbation (the judge's to leave out, not a design)
    assert not by_design("fp16", _record("passed", [("original", True, 1e-6, 0.0)]))
    assert caught_by(_record("timeout", [])) == ["timeout"] and caught_by(_record("incorrect", [])) == [
        "structure"
    ]


def test_cli_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kbv.cli import main

    assert main(["protocol", "audit", "--problems", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["protocol", "audit", "--problems", str(tmp_path), "--protocol", "bogus"]) == 2
    assert "unknown protocol" in capsys.readouterr().err
    assert main(["protocol"]) == 2
    assert "kbv protocol audit" in capsys.readouterr().err


def test_only_controls_or_only_mutants_are_generated_and_counted(tmp_path: Path) -> None:
    """``--only controls`` (the false-rejection rate alone, a short run) leaves the mutants out of
    the candidates, the pairs and the left-out counts, and the other way round."""
    from kbv.protocol_audit import audit_protocols

    problem = _problem(tmp_path, "torch.relu(x).sum(dim=1)")
    for roles, other in ((("control",), "mutant"), (("mutant",), "control")):
        result = audit_protocols(
            problem,
            ["verified"],
            device="cpu",
            db=tmp_path / roles[0] / "a.sqlite",
            evaluate=False,
            roles=roles,
        )
        assert result.specs and {s.role for s in result.specs} == set(roles)
        evaluated = [s for s in result.specs if s.status == "evaluate"]
        assert result.summaries[0]["pairs"] == len(evaluated) and evaluated
        assert not any(s.role == other for s in result.specs)
    with pytest.raises(ValueError, match="roles"):
        audit_protocols(problem, ["verified"], device="cpu", db=tmp_path / "x.sqlite", roles=("honest",))


def test_only_the_named_kinds_are_generated_and_counted(tmp_path: Path) -> None:
    """``kinds`` (the kinds a claim is about, on every problem of a slow machine) keeps those
    kinds alone; a kind the audit does not generate is a usage error, not an empty audit."""
    from kbv.protocol_audit import audit_protocols

    problem = _problem(tmp_path, "torch.relu(x).sum(dim=1)")
    kinds = ("zeros", "first_rows")
    result = audit_protocols(
        problem, ["verified"], device="cpu", db=tmp_path / "a.sqlite", evaluate=False, kinds=kinds
    )
    assert {s.kind for s in result.specs} == set(kinds)
    assert result.summaries[0]["pairs"] == 2
    everything = audit_protocols(
        problem, ["verified"], device="cpu", db=tmp_path / "a.sqlite", evaluate=False
    )
    assert {"reference", "constant", "stride"} <= {s.kind for s in everything.specs}
    with pytest.raises(ValueError, match="kinds"):
        audit_protocols(problem, ["verified"], device="cpu", db=tmp_path / "x.sqlite", kinds=("zero",))


def test_domain_draws_are_made_afresh_and_the_same_each_time(tmp_path: Path) -> None:
    """The judge makes each draw when it calls a model (at KernelBench sizes every draw's inputs and
    outputs at once would not fit a GPU), so the reference and the generated model must get the
    very same inputs from the same recipe, and no two calls share a tensor."""
    problem = load_problem(SUITE / "level1" / "1_ReLU.py")
    reference = problem.load(problem.sizes_for("cpu"))
    draws = gen._domain_draws(problem, reference, "cpu")
    assert len(draws) == len(gen.kbv_inputs.BASE_DISTRIBUTIONS) * len(gen.EQUIVALENCE_SEEDS)
    for make in draws[:3]:
        first, again = make(), make()
        assert all(
            torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(first, again, strict=True)
        )
    outputs = list(gen._calls(reference, "Model", draws, "cpu"))
    assert len(outputs) == len(draws) and torch.equal(outputs[0][0], torch.relu(draws[0]()[0]))


def test_the_judged_models_are_made_on_the_draws_device() -> None:
    """A problem with parameters is judged with its weights where its inputs are (on the H200 the
    reference's convolution was made on the CPU beside CUDA inputs and the problem left out)."""
    import types

    made_on = []

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))
            made_on.append(self.weight.device.type)

        def forward(self, x):
            return x * self.weight

    module = types.SimpleNamespace(Model=Model, ModelNew=Model, get_init_inputs=lambda: [])
    draws = [lambda: [torch.ones(3, device="meta")]]
    (out,) = next(gen._calls(module, "ModelNew", draws, "meta", module))
    assert out[0].device.type == "meta" and made_on == ["meta", "meta"]


def test_a_problem_checked_once_is_read_back_from_the_store_file_and_its_files_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit resumed (or only reported) does not run a finished problem's controls and mutants
    again: the second call reads what the first found from the store file, writes the sources
    under its own work directory, and runs nothing; a changed problem is checked again."""
    path = _problem(tmp_path, "torch.relu(x).sum(dim=1, keepdim=True)")
    problem = load_problem(path)
    cache = gen.SpecCache(tmp_path / "audit.sqlite")
    first = gen.problem_specs(problem, "cpu", tmp_path / "work1", cache)
    assert any(s.status == "evaluate" for s in first)

    def no_runs(*args, **kwargs):
        raise AssertionError("a cached problem was checked again")

    monkeypatch.setattr(gen, "_problem_specs", no_runs)
    again = gen.problem_specs(problem, "cpu", tmp_path / "work2", cache)
    assert [(s.kind, s.variant, s.status, s.note, s.sha256) for s in again] == [
        (s.kind, s.variant, s.status, s.note, s.sha256) for s in first
    ]
    for spec in again:
        if spec.path:
            assert (
                spec.path.startswith(str(tmp_path / "work2")) and Path(spec.path).read_text() == spec.source
            )
    changed = load_problem(_problem(tmp_path, "torch.relu(x).mean(dim=1, keepdim=True)"))
    with pytest.raises(AssertionError, match="checked again"):
        gen.problem_specs(changed, "cpu", tmp_path / "work3", cache)


def _same_whole(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The equivalence rule on whole tensors, as it read before it was chunked."""
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite) or not torch.equal(
        a[~finite].nan_to_num(), b[~finite].nan_to_num()
    ):
        return False
    if not finite.any():
        return True
    return bool((a[finite] - b[finite]).abs().max() <= gen.EQUIVALENCE_RTOL * b[finite].abs().max())


@pytest.mark.parametrize(
    "case",
    [
        "equal",
        "within",
        "beyond_late",
        "scale_early",
        "nan_same",
        "nan_moved",
        "inf_sign",
        "all_nan",
        "reshaped",
    ],
)
def test_equivalence_compared_in_chunks_decides_as_on_whole_tensors(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule is applied a chunk at a time (a whole KernelBench output in float64 with its masks
    ran the trusted run out of device memory on the H200), and decides as the whole-tensor rule:
    the largest difference anywhere against the largest magnitude anywhere."""
    import kbv.error_stats

    monkeypatch.setattr(kbv.error_stats, "CHUNK_ELEMENTS", 7)
    b = torch.linspace(-1.0, 1.0, 60).reshape(6, 10)
    a = b.clone()
    if case == "within":
        a[5, 9] += 5e-7
    elif case == "beyond_late":
        a[5, 9] += 1e-5  # in the last chunk only
    elif case == "scale_early":  # the scale that allows a late difference sits in the first chunk
        b[0, 0], a[0, 0] = 100.0, 100.0
        a[5, 9] += 5e-5
    elif case == "nan_same":
        a[3, 3] = b[3, 3] = float("nan")
    elif case == "nan_moved":
        a[3, 3], b[3, 4] = float("nan"), float("nan")
    elif case == "inf_sign":
        a[2, 2], b[2, 2] = float("inf"), float("-inf")
    elif case == "all_nan":
        a.fill_(float("nan"))
        b.fill_(float("nan"))
    elif case == "reshaped":  # the same values in another shape are not the same output
        a = a.reshape(10, 6)
    expected = {
        "equal": True,
        "within": True,
        "beyond_late": False,
        "scale_early": True,
        "reshaped": False,
    }.get(case)
    assert gen._same(a, b) == _same_whole(a, b)
    if expected is not None:
        assert gen._same(a, b) is expected


def test_a_trusted_run_out_of_device_memory_is_the_harness_failing_not_a_mutant_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the H200 the judge ran out of memory on identity-for-ReLU and called it not viable, which
    left a live mutant out of the counts. It raises now, the problem is listed by the audit and
    nothing is cached, so the next call judges it again; a source that raises on its own is still
    not viable."""
    path = _problem(tmp_path, "torch.relu(x) * 2.0")
    problem = load_problem(path)
    real_calls = gen._calls

    def calls_out_of_memory(module, cls, draws, device, reference=None):
        if cls == "ModelNew" and "relu_identity" in getattr(module, "__file__", ""):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB.")
        return real_calls(module, cls, draws, device, reference)

    monkeypatch.setattr(gen, "_calls", calls_out_of_memory)
    cache = gen.SpecCache(tmp_path / "audit.sqlite")
    with pytest.raises(gen.JudgeOutOfMemory, match="relu_identity.*ran out of device memory"):
        gen.problem_specs(problem, "cpu", tmp_path / "work", cache)
    assert cache.get(cache.key(problem, "cpu")) is None
    monkeypatch.setattr(gen, "_calls", real_calls)
    specs = {(s.kind, s.variant): s for s in gen.problem_specs(problem, "cpu", tmp_path / "work", cache)}
    assert specs[("relu_identity", "torch.relu(x)")].status == "evaluate"


def test_a_report_from_the_store_runs_nothing_and_gives_the_audits_figures_on_another_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--report-only`` reads the environment of the store's records (device name, torch) and what
    the trusted runs found from the store file: on a machine with another torch, and no worker to
    probe the device with, it gives the evaluating run's figures and runs nothing. A problem the
    store holds no trusted run of is listed, not judged."""
    import kbv.execute
    from kbv.protocol_audit import audit_protocols

    problem = _problem(tmp_path, "torch.relu(x) * 2.0")
    db = tmp_path / "audit.sqlite"
    done = audit_protocols(problem, ["standard", "verified"], device="cpu", db=db, roles=("control",))
    assert [s["evaluated"] for s in done.summaries] == [1, 1]

    def runs_nothing(*args, **kwargs):
        raise AssertionError("a report from the store ran something")

    monkeypatch.setattr(gen, "_problem_specs", runs_nothing)
    monkeypatch.setattr(kbv.execute, "make_executor", runs_nothing)
    monkeypatch.setattr(torch, "__version__", "0.0.0-elsewhere")
    report = audit_protocols(
        problem, ["standard", "verified"], device="cpu", db=db, evaluate=False, roles=("control",)
    )
    assert report.env == done.env and not report.errors
    strip = [{k: v for k, v in s.items() if k != "rows"} for s in done.summaries]
    assert [{k: v for k, v in s.items() if k != "rows"} for s in report.summaries] == strip

    from kbv.cli import main

    args = ["protocol", "audit", "--problems", str(problem), "--device", "cpu", "--db", str(db)]
    assert main([*args, "--report-only", "--only", "controls", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["evaluated"] for line in out.splitlines()] == [1, 1]
    assert f"records of {done.env['device_name']} with torch {done.env['torch']}" in err

    other = _problem(tmp_path / "o", "torch.relu(x) * 3.0")
    missing = audit_protocols(other, ["verified"], device="cpu", db=db, evaluate=False, roles=("control",))
    assert missing.errors and "no trusted run" in missing.errors[0][1] and not missing.specs


def test_judged_sources_leave_nothing_behind_in_the_audit_process(tmp_path: Path) -> None:
    """Every generated source is imported to be judged; left in ``sys.modules``, a ``cached``
    mutant's first output stayed alive (on the GPU at KernelBench sizes) for the rest of the audit
    process, one more per problem. After judging, no judged module and no such output remains."""
    import gc
    import sys
    import weakref

    problem = load_problem(_problem(tmp_path, "torch.relu(x) * 2.0"))
    before = {n for n in sys.modules if n.startswith("kbv_audit_")}
    kept: list[weakref.ref] = []
    real_calls = gen._calls

    def watched(module, cls, draws, device, reference=None):
        for outputs in real_calls(module, cls, draws, device, reference):
            cached = getattr(module, "_KBV_STATE", {}).get("outputs")
            for t in cached if isinstance(cached, (list, tuple)) else [cached]:
                if isinstance(t, torch.Tensor):
                    kept.append(weakref.ref(t))
            yield outputs

    gen._calls, saved = watched, gen._calls
    try:
        specs = gen.problem_specs(problem, "cpu", tmp_path / "work")
    finally:
        gen._calls = saved
    assert any(s.kind == "cached" for s in specs) and kept
    assert {n for n in sys.modules if n.startswith("kbv_audit_")} == before
    assert all(ref() is None for ref in kept), "a cached mutant's output outlived its judging"
    gc.collect()
