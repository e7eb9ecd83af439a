"""Hidden input distributions, domain variants, parameter redraws and seeds (CPU, deterministic)."""

from __future__ import annotations

import math
import random
import types

import pytest
import torch

from kbv import _input_fills, inputs, seeds
from kbv.inputs import (
    BASE_DISTRIBUTIONS,
    DISTRIBUTIONS,
    derive_seed,
    domain_fallback,
    make_inputs,
    new_seed,
    redraw_parameters,
)


def _problem(*shapes: tuple[int, ...], extra: bool = True) -> types.SimpleNamespace:
    def get_inputs() -> list:
        values: list = [torch.rand(*s) for s in shapes]
        if extra:
            values += [torch.randint(0, 1000, (64,)), 7]
        return values

    return types.SimpleNamespace(get_inputs=get_inputs)


ROWS = _problem((16, 4096))


def _x(distribution: str, seed: int = 1234, **kw) -> torch.Tensor:
    return make_inputs(ROWS, distribution, seed, "cpu", **kw)[0]


def test_names_are_documented_and_include_the_seven():
    for name in ("original", "signed", "wide", "shifted", "blockwise", "sparse", "spiked"):
        assert name in DISTRIBUTIONS and DISTRIBUTIONS[name]
    assert BASE_DISTRIBUTIONS == ("original", "signed", "wide", "shifted", "blockwise", "sparse", "spiked")
    with pytest.raises(ValueError, match="unknown input distribution"):
        make_inputs(ROWS, "nope", 1, "cpu")


def test_original_is_the_problems_own_draw_under_the_seed():
    torch.manual_seed(99)
    expected = torch.rand(16, 4096)
    assert torch.equal(_x("original", seed=99), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="where CUDA exists every seed goes to it too")
def test_a_cpu_draw_seeds_the_cpu_generator_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.manual_seed`` also hands the seed to CUDA's lazy initialisation, which formats the
    caller's stack every time: most of a small draw's cost. A CPU draw seeds the CPU generator
    alone, with the values ``torch.manual_seed`` gives (the test above)."""
    lazy: list = []
    real = torch.cuda.random._lazy_call
    monkeypatch.setattr(torch.cuda.random, "_lazy_call", lambda *a, **k: lazy.append(a) or real(*a, **k))
    for seed in range(5):
        _x("signed", seed=seed)
    assert lazy == []
    torch.manual_seed(1)
    assert lazy  # what the test guards against is still what torch.manual_seed does


def test_signed_is_zero_mean_with_the_original_magnitude():
    x = _x("signed")
    assert (x < 0).float().mean() > 0.4
    assert abs(float(x.mean())) < 0.02
    rms_original = float(_x("original").pow(2).mean().sqrt())
    assert float(x.pow(2).mean().sqrt()) == pytest.approx(rms_original, rel=0.05)


def test_wide_spans_many_decades_with_both_signs():
    x = _x("wide")
    mag = x.abs()
    assert float(mag.min()) <= 1e-3 and float(mag.max()) >= 1e3
    assert (x < 0).any() and (x > 0).any()
    # log-uniform: every decade is populated
    for lo in range(-3, 3):
        assert ((mag >= 10.0**lo) & (mag < 10.0 ** (lo + 1))).sum() > 100
    # exp without max-subtraction overflows
    assert torch.isinf(torch.exp(x)).any()


def test_shifted_has_a_large_common_offset_and_small_spread():
    for seed in range(6):
        x = _x("shifted", seed=seed)
        assert abs(float(x.mean())) > 500 * float(x.std())
        assert 0.5 < float(x.std()) < 2
    signs = {float(_x("shifted", seed=s).mean()) > 0 for s in range(12)}
    assert signs == {True, False}


def test_blockwise_starts_like_the_original_then_changes():
    for seed in range(5):
        original = _x("original", seed=seed)
        x = _x("blockwise", seed=seed)
        flat = x.reshape(-1)
        # the first and last elements, and the start and end of every row, are the original draw in [0, 1)
        assert torch.equal(flat[:64], original.reshape(-1)[:64])
        assert torch.equal(flat[-64:], original.reshape(-1)[-64:])
        assert ((flat[:64] >= 0) & (flat[:64] < 1)).all()
        assert torch.equal(x[:, :512], original[:, :512])
        assert torch.equal(x[:, -512:], original[:, -512:])
        # later chunks are negative and/or large
        tail = flat[x.numel() // 8 :]
        assert float(tail.min()) < -10 or float(tail.abs().max()) > 100
        assert (tail < 0).any()
        assert (flat < 0).float().mean() > 0.1
        # not identically distributed: chunk means differ wildly
        means = torch.stack([c.abs().mean() for c in flat.chunk(16)])
        assert float(means.max() / means.min()) > 100


def test_blockwise_small_tensors():
    tiny = types.SimpleNamespace(
        get_inputs=lambda: [torch.rand(1), torch.rand(3), torch.rand(0), torch.rand(())]
    )
    a, b, c, d = make_inputs(tiny, "blockwise", 5, "cpu")
    assert a.shape == (1,) and b.shape == (3,) and c.shape == (0,) and d.shape == ()
    assert 0 <= float(a) < 1  # a single element is "the first elements"


def test_determinism_same_seed_same_inputs_different_seed_different():
    for name in DISTRIBUTIONS:
        a = make_inputs(ROWS, name, 42, "cpu")
        b = make_inputs(ROWS, name, 42, "cpu")
        c = make_inputs(ROWS, name, 43, "cpu")
        assert torch.equal(a[0], b[0]), name
        assert torch.equal(a[1], b[1]), name
        assert not torch.equal(a[0], c[0]), name


def test_transform_does_not_reuse_the_problems_random_stream():
    # signed draws must not be a function of the original uniform draw of the same seed
    x = _x("signed", seed=3)
    torch.manual_seed(3)
    assert not torch.equal(x, torch.randn(16, 4096) * x.pow(2).mean().sqrt())


def test_integer_and_plain_inputs_are_untouched_but_seeded():
    for name in DISTRIBUTIONS:
        values = make_inputs(ROWS, name, 11, "cpu")
        torch.manual_seed(11)
        torch.rand(16, 4096)
        expected_ints = torch.randint(0, 1000, (64,))
        assert torch.equal(values[1], expected_ints), name
        assert values[1].dtype == torch.int64
        assert values[2] == 7
    assert not torch.equal(make_inputs(ROWS, "wide", 11, "cpu")[1], make_inputs(ROWS, "wide", 12, "cpu")[1])


def test_fp64_sees_the_fp32_values_upcast():
    for name in DISTRIBUTIONS:
        single = make_inputs(ROWS, name, 8, "cpu")
        double = make_inputs(ROWS, name, 8, "cpu", precision="fp64")
        assert single[0].dtype == torch.float32 and double[0].dtype == torch.float64
        assert torch.equal(double[0], single[0].double()), name
        assert torch.equal(double[1], single[1])
    with pytest.raises(ValueError):
        make_inputs(ROWS, "wide", 8, "cpu", precision="fp16")


def test_half_inputs_stay_half():
    half = types.SimpleNamespace(get_inputs=lambda: [torch.rand(64, 64, dtype=torch.float16)])
    for name in BASE_DISTRIBUTIONS:
        (x,) = make_inputs(half, name, 2, "cpu")
        assert x.dtype == torch.float16 and torch.isfinite(x).all(), name


def test_positive_domain_variants_are_positive():
    for base in BASE_DISTRIBUTIONS[1:]:
        for x in (_x(f"{base}_positive"), _x(base, domain="positive")):
            assert (x > 0).all(), base
        unit = _x(f"{base}_unit")
        assert ((unit > 0) & (unit < 1)).all(), base
        assert ((_x(base, domain="unit-interval") > 0) & (_x(base, domain="unit-interval") < 1)).all()
    wide = _x("wide_positive")
    assert float(wide.min()) <= 1e-3 and float(wide.max()) >= 1e3
    assert float(_x("shifted_positive").mean()) > 500
    # the positive blockwise variant still starts and ends with the original draw
    assert torch.equal(_x("blockwise_positive").reshape(-1)[:32], _x("original").reshape(-1)[:32])
    assert torch.equal(_x("blockwise_positive").reshape(-1)[-32:], _x("original").reshape(-1)[-32:])
    # the positive sparse variant differs from the original draw only at a few large or tiny values
    changed = _x("sparse_positive") != _x("original")
    assert 0 < int(changed.sum()) <= _input_fills.SPARSE_MAX


def test_probabilities_domain_sums_to_one_along_the_last_dim():
    for name in DISTRIBUTIONS:
        x = _x(name, domain="probabilities")
        if name == "original":
            assert torch.equal(x, _x("original"))
            continue
        assert (x >= 0).all()
        torch.testing.assert_close(x.double().sum(-1), torch.ones(16, dtype=torch.float64), rtol=0, atol=1e-4)


def test_per_input_domains():
    two = types.SimpleNamespace(get_inputs=lambda: [torch.rand(8, 32), torch.rand(8, 32)])
    a, b = make_inputs(two, "signed", 1, "cpu", domain=["any", "positive"])
    assert (a < 0).any() and (b > 0).all()
    with pytest.raises(ValueError):
        make_inputs(two, "signed", 1, "cpu", domain=["any"])
    with pytest.raises(ValueError):
        make_inputs(two, "signed", 1, "cpu", domain="negative")


def test_domain_fallback_chain():
    assert domain_fallback("original") is None
    for base in BASE_DISTRIBUTIONS[1:]:
        assert domain_fallback(base) == f"{base}_positive"
        assert domain_fallback(f"{base}_positive") == f"{base}_unit"
        assert domain_fallback(f"{base}_unit") is None
        for name in (base, f"{base}_positive", f"{base}_unit"):
            assert name in DISTRIBUTIONS


def test_kl_div_style_problem_is_finite_under_the_fallback():
    def get_inputs() -> list:
        return [torch.rand(8, 128).softmax(-1), torch.rand(8, 128).softmax(-1)]

    kl = types.SimpleNamespace(get_inputs=get_inputs)

    def reference(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.kl_div(torch.log(p), q, reduction="batchmean")

    assert not torch.isfinite(reference(*make_inputs(kl, "signed", 3, "cpu")))
    fallback = domain_fallback("signed")
    assert fallback is not None
    assert torch.isfinite(reference(*make_inputs(kl, fallback, 3, "cpu")))
    assert torch.isfinite(reference(*make_inputs(kl, "wide", 3, "cpu", domain="probabilities")))


def test_get_inputs_runs_under_the_device_context():
    seen = []

    def get_inputs() -> list:
        seen.append(torch.empty(1).device)
        return [torch.rand(4, device="cpu")]

    (x,) = make_inputs(types.SimpleNamespace(get_inputs=get_inputs), "original", 1, torch.device("meta"))
    assert seen == [torch.device("meta")]
    assert x.device == torch.device("meta"), "tensors created elsewhere are moved to the device"


def test_seeds():
    seeds = {new_seed() for _ in range(64)}
    assert len(seeds) == 64 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(5, "draw", 1) == derive_seed(5, "draw", 1)
    assert derive_seed(5, "draw", 1) != derive_seed(5, "draw", 2)
    assert derive_seed(5, "draw", 1) != derive_seed(6, "draw", 1)
    assert derive_seed(5, 1) != derive_seed(5, "1")
    assert derive_seed(5, "ab", "c") != derive_seed(5, "a", "bc")
    assert 0 <= derive_seed(2**64 - 1, "x") < 2**63
    with pytest.raises(ValueError):
        derive_seed(-1)


class _Net(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.norm = torch.nn.BatchNorm1d(width)
        self.scale = torch.nn.Parameter(torch.rand(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * self.scale


def test_redraw_original_reinitialises_under_the_seed():
    net = _Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    a = redraw_parameters(net, "original", 1)
    b = redraw_parameters(net, "original", 1)
    c = redraw_parameters(net, "original", 2)
    assert set(a) == set(before)
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert torch.equal(net.state_dict()[k], before[k]), "the model must not be modified"
    assert not torch.equal(a["linear.weight"], before["linear.weight"])
    assert not torch.equal(a["linear.weight"], c["linear.weight"])
    bound = 1 / 8**0.5
    assert float(a["linear.weight"].abs().max()) <= bound
    # uncovered parameter: a permutation of its own values
    assert torch.equal(a["scale"].sort().values, before["scale"].sort().values)
    # with the constructor arguments the Model is rebuilt exactly under the seed
    rebuilt = redraw_parameters(net, "original", 1, init_inputs=[8])
    assert torch.equal(
        rebuilt["linear.weight"], redraw_parameters(net, "original", 1, init_inputs=[8])["linear.weight"]
    )
    assert ((rebuilt["scale"] >= 0) & (rebuilt["scale"] < 1)).all()
    net.load_state_dict(rebuilt)


def test_redraw_signed_keeps_magnitude_and_running_var_positive():
    net = _Net(64)
    state = redraw_parameters(net, "signed", 4)
    w = state["linear.weight"]
    assert (w < 0).any() and (w > 0).any()
    rms = float(net.linear.weight.detach().pow(2).mean().sqrt())
    assert float(w.pow(2).mean().sqrt()) == pytest.approx(rms, rel=0.1)
    assert (state["norm.running_var"] > 0).all()
    assert not torch.equal(state["norm.running_var"], torch.ones(64))
    assert (state["norm.bias"] != 0).any(), "zero-initialised biases are exercised"
    assert torch.equal(state["norm.num_batches_tracked"], net.norm.num_batches_tracked)
    assert torch.equal(state["linear.weight"], redraw_parameters(net, "signed", 4)["linear.weight"])
    net.load_state_dict(state)
    out = net.eval()(torch.randn(4, 64))
    assert torch.isfinite(out).all()
    positive = redraw_parameters(net, "wide_positive", 4)
    assert all((v > 0).all() for k, v in positive.items() if v.is_floating_point())


def test_module_imports_only_stdlib_torch_and_protocol():
    """kbv.inputs and its parts (the seeds, the fills) import nothing else of kbv."""
    import ast
    from pathlib import Path

    roots = set()
    for module in (inputs, seeds, _input_fills):
        for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
            if isinstance(node, ast.Import):
                roots |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                roots.add(node.module)
    import sys

    allowed = set(sys.stdlib_module_names) | {
        "torch",
        "__future__",
        "kbv.protocol",
        "kbv.seeds",
        "kbv._input_fills",
    }
    assert {r for r in roots if r.split(".")[0] not in allowed and r not in allowed} == set()


# --------------------------------------------------------------------------------------------------
# blockwise layout and sparse: samplers of fixed positions


def _relu_sampler_caught(x: torch.Tensor, window: slice) -> bool:
    """A ReLU that returns its input when ``x.reshape(-1)[window]`` is non-negative: wrong on ``x``?"""
    flat = x.reshape(-1)
    return bool((flat[window] >= 0).all()) and bool((flat < 0).any())


def test_blockwise_catches_head_tail_and_row_end_samplers_on_every_seed():
    relu = _problem((8, 1024), extra=False)
    flat1d = _problem((4096,), extra=False)
    for seed in range(40):
        for problem in (relu, flat1d):
            (x,) = make_inputs(problem, "blockwise", seed, "cpu")
            n = x.numel()
            assert _relu_sampler_caught(x, slice(0, 64)), seed
            assert _relu_sampler_caught(x, slice(n - 64, n)), seed
        (x,) = make_inputs(relu, "blockwise", seed, "cpu")
        rows = x.reshape(-1, 1024)
        assert (rows[:, :128] >= 0).all() and (rows[:, -128:] >= 0).all()  # row ends: the original draw
        interior = rows[:, 128:-128]
        # between the row ends values change from block to block: some all-negative, some large
        assert (interior < 0).float().mean() > 0.2 and float(interior.abs().max()) > 100


def test_blockwise_altered_chunks_are_never_tiny():
    for n in (8, 100, 4096, 65536, 1_000_003):
        for seed in range(20):
            rng = random.Random(seed)
            head, tail, bounds = _input_fills._blockwise_bounds(n, rng)
            assert bounds[0] == head and bounds[-1] == n - tail
            assert n / 16 - 1 <= head <= n / 8 and n / 16 - 1 <= tail <= n / 8
            sizes = [b - a for a, b in zip(bounds, bounds[1:])]
            assert len(sizes) == min(_input_fills.BLOCKWISE_CHUNKS - 2, n - head - tail)
            assert min(sizes) >= (n - head - tail) / len(sizes) / 2 - 1, (n, sizes)


def test_sparse_is_the_original_draw_except_a_few_wide_values_at_secret_positions():
    original = _x("original", seed=5)
    x = _x("sparse", seed=5)
    changed = (x != original).reshape(-1).nonzero().flatten()
    assert len(changed) == _input_fills._sparse_count(x.numel()) == 16  # 65536 // 4096
    values = x.reshape(-1)[changed]
    assert float(values.abs().max()) > 1 or float(values.abs().min()) < 1e-2  # wide, not like [0, 1)
    other = (_x("sparse", seed=6) != _x("original", seed=6)).reshape(-1).nonzero().flatten()
    assert set(changed.tolist()) != set(other.tolist())  # positions come from the seed
    assert _input_fills._sparse_count(1) == 1 and _input_fills._sparse_count(16) == 2
    assert (
        _input_fills._sparse_count(8192) == _input_fills.SPARSE_MIN
        and _input_fills._sparse_count(10**9) == _input_fills.SPARSE_MAX
    )
    tiny = types.SimpleNamespace(
        get_inputs=lambda: [torch.rand(1), torch.rand(3), torch.rand(0), torch.rand(())]
    )
    shapes = [t.shape for t in make_inputs(tiny, "sparse", 5, "cpu")]
    assert shapes == [(1,), (3,), (0,), ()]


def test_spiked_is_the_original_draw_except_a_few_values_sized_to_the_tensor():
    original = _x("original", seed=5)
    x = _x("spiked", seed=5)
    n = x.numel()
    changed = (x != original).reshape(-1).nonzero().flatten()
    count = _input_fills._sparse_count(n)
    assert len(changed) == count == 16
    values = x.reshape(-1)[changed].double()
    assert (values > 0).all() or (values < 0).all()  # one sign per tensor: they add up, never cancel
    top = float(original.double().pow(2).mean().sqrt()) * n / count
    assert float(values.abs().min()) >= top / 2 * (1 - 1e-6) and float(values.abs().max()) <= top * (1 + 1e-6)
    # about as much of the sum as everything else
    assert 0.5 < float(values.abs().sum()) / float(original.double().abs().sum()) < 2
    sparse_positions = (_x("sparse", seed=5) != original).reshape(-1).nonzero().flatten()
    assert set(changed.tolist()) != set(sparse_positions.tolist())  # a layout of its own
    signs = {float(_x("spiked", seed=seed).reshape(-1).min()) < -1 for seed in range(12)}
    assert signs == {True, False}  # the sign comes from the seed
    # float16: capped so that a fourth power stays finite
    half = types.SimpleNamespace(get_inputs=lambda: [torch.rand(256, 256, dtype=torch.float16)])
    (h,) = make_inputs(half, "spiked", 3, "cpu")
    assert float(h.abs().max()) <= torch.finfo(torch.float16).max ** 0.25
    assert torch.isfinite(h.float() ** 4).all()


def test_spiked_puts_a_strided_sample_of_a_mean_far_outside_the_reduction_floor():
    # A kernel that reads every other element of a mean (element j taken as element j - j % 2) is
    # within 1e-3 of the truth on i.i.d. inputs once the mean covers more than a few million
    # elements, and 1e-3 is where the float32 reduction floor stops (correctness.reduction_floor).
    # spiked's values miss or double some of half the sum, so the sample is O(1/sqrt(count)) off.
    flat = types.SimpleNamespace(get_inputs=lambda: [torch.rand(1 << 20)])
    for seed in range(20):
        (x,) = make_inputs(flat, "spiked", seed, "cpu")
        terms = x.double()
        sampled = terms[0::2].repeat_interleave(2)
        assert abs(float(sampled.mean() / terms.mean()) - 1) > 1e-2, seed
        (iid,) = make_inputs(flat, "original", seed, "cpu")
        iid_sampled = iid.double()[0::2].repeat_interleave(2)
        assert abs(float(iid_sampled.mean() / iid.double().mean()) - 1) < 3e-3  # the floor's blind spot


def test_sparse_is_bitwise_deterministic_per_seed():
    for name in ("sparse", "sparse_positive", "sparse_unit", "spiked", "spiked_positive", "spiked_unit"):
        a = make_inputs(ROWS, name, 21, "cpu")[0]
        assert torch.equal(a, make_inputs(ROWS, name, 21, "cpu")[0]), name
        assert not torch.equal(a, make_inputs(ROWS, name, 22, "cpu")[0]), name


def test_sparse_catches_a_sampler_of_any_fixed_positions_on_most_draws():
    # Per draw a 64-element sampler escapes when it reads a negative altered value (~k*m/(2n)) or when
    # every altered value is positive (2**-k): here k = 16, n = 65536, so ~99% of draws catch it.
    n = 16 * 4096
    windows = [slice(0, 64), slice(n // 2 - 32, n // 2 + 32), slice(n - 64, n), slice(12345, 12409)]
    caught = [0] * len(windows)
    for seed in range(200):
        x = _x("sparse", seed=seed)
        for i, window in enumerate(windows):
            caught[i] += _relu_sampler_caught(x, window)
    assert all(c >= 190 for c in caught), caught


@pytest.mark.parametrize("distribution", ["original", "signed", "wide", "blockwise", "sparse", "spiked"])
@pytest.mark.parametrize("mix_seed", [None, 99])
def test_an_upcast_float32_draw_is_the_float64_draw(distribution: str, mix_seed: int | None) -> None:
    """The reference makes a draw's float64 inputs by upcasting its float32 ones (one generation for
    the truth and the baseline): bitwise what ``make_draw(precision="fp64")`` makes, structure kept."""

    def get_inputs() -> list:
        sym = torch.rand(16, 16)
        return [
            torch.rand(4, 32),
            [torch.rand(3), 7],
            sym + sym.T,
            torch.randint(0, 5, (6,)),
            torch.rand(8).half(),
        ]

    problem = types.SimpleNamespace(get_inputs=get_inputs)
    structure = [None, None, {"symmetric": True}, None, None]
    narrow = inputs.make_draw(problem, distribution, 5, "cpu", structure=structure, mix_seed=mix_seed)
    wide = inputs.make_draw(
        problem, distribution, 5, "cpu", precision="fp64", structure=structure, mix_seed=mix_seed
    )
    flat_up, flat_wide = [], []
    inputs._map_tensors(inputs.upcast_draw(narrow), lambda t: flat_up.append(t) or t)
    inputs._map_tensors(wide, lambda t: flat_wide.append(t) or t)
    assert len(flat_up) == len(flat_wide) == 5
    for a, b in zip(flat_up, flat_wide, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert flat_up[-1].dtype == torch.float64 and flat_up[-2].dtype == torch.int64
    flat_narrow: list = []
    inputs._map_tensors(narrow, lambda t: flat_narrow.append(t) or t)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(flat_up, flat_narrow, strict=True))  # copies
    assert inputs.draw_bytes(narrow) == 4 * 128 + 4 * 3 + 4 * 256 + 8 * 6 + 2 * 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_a_parameter_no_reset_covers_is_permuted_on_its_own_device():
    """The permutation of an uncovered parameter is drawn on the GPU it lives on (on the CPU a
    8192 x 8192 weight's took 1.5-2.6 s), deterministic under the seed."""
    net = _Net().cuda()
    before = net.state_dict()["scale"].clone()
    a = redraw_parameters(net, "original", 1)
    assert a["scale"].device == before.device
    assert torch.equal(a["scale"].sort().values, before.sort().values)
    assert torch.equal(a["scale"], redraw_parameters(net, "original", 1)["scale"])


def _tensors(draw: list) -> list:
    found: list = []
    inputs._map_tensors(draw, lambda t: found.append(t) or t)
    return found


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_a_draw_upcast_from_the_host_is_the_draw_upcast_on_its_device(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """Where the device is short of room the reference makes a draw's float64 copy from a host copy,
    a step at a time: the same values, dtypes, layouts and devices as ``upcast_draw``, every tensor
    a copy, and the draw's other values as they were."""
    monkeypatch.setattr(inputs, "HOST_UPCAST_STEP", 7)  # many steps, the last one partial
    x = torch.rand(5, 13, device=device)
    draw = [
        x,
        [x.t(), 3],  # another layout: converted whole
        (torch.rand(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last),),
        torch.randint(0, 9, (4,), device=device),
        torch.rand(6, device=device).bfloat16(),
        torch.empty(0, device=device),
        1.5,
    ]
    host = inputs.draw_to_host(draw)
    assert all(t.device.type == "cpu" for t in _tensors(host))
    made = inputs.upcast_from_host(host, device)
    expected = inputs.upcast_draw(draw)
    for got, want in zip(_tensors(made), _tensors(expected), strict=True):
        assert got.dtype == want.dtype and got.device == want.device
        assert got.stride() == want.stride() and torch.equal(got, want)
    assert made[1][1] == 3 and made[-1] == 1.5 and isinstance(made[2], tuple)
    originals = {t.data_ptr() for t in _tensors(draw) + _tensors(host)}
    assert not originals & {t.data_ptr() for t in _tensors(made) if t.numel()}  # copies
    assert inputs.draw_bytes(draw, as_float64=True) == 8 * (65 + 65 + 120 + 6 + 0) + 8 * 4


def _mixed_problem() -> types.SimpleNamespace:
    def get_inputs() -> list:
        return [
            torch.rand(40, 30),
            torch.rand(20, 10).T,  # not contiguous: the mix is a contiguous copy, shaped as A's
            [torch.rand(3), 7],  # nested: the mix keeps A's whole
            torch.randint(0, 5, (6,)),  # integer: A's
            torch.rand(0),
        ]

    return types.SimpleNamespace(get_inputs=get_inputs)


@pytest.mark.parametrize("distribution", ["original", "signed", "wide"])
def test_a_mixed_draw_is_b_with_as_ends_and_middle(distribution: str) -> None:
    """The cache probe's mix: draw B everywhere but the first and last 64 elements and the middle
    one of each floating tensor, which are draw A's; every other value A's."""
    problem = _mixed_problem()
    a = inputs.make_draw(problem, distribution, 5, "cpu")
    b = inputs.make_draw(problem, distribution, 9, "cpu")
    mixed = inputs.make_draw(problem, distribution, 5, "cpu", mix_seed=9)
    for k in (0, 1):
        want = b[k].contiguous().clone().view(-1)
        flat_a, n = a[k].reshape(-1), want.numel()
        want[:64], want[n - 64 :], want[n // 2] = flat_a[:64], flat_a[n - 64 :], flat_a[n // 2]
        assert torch.equal(mixed[k], want.view(a[k].shape)) and mixed[k].is_contiguous()
        assert not torch.equal(mixed[k], b[k]) and not torch.equal(mixed[k], a[k])
    assert torch.equal(mixed[2][0], a[2][0]) and mixed[2][1] == 7 and torch.equal(mixed[3], a[3])
    assert mixed[4].numel() == 0


def test_a_mix_lets_draw_as_tensors_go_before_it_draws_b(monkeypatch: pytest.MonkeyPatch) -> None:
    """A, B and their mix held at once were three inputs of the candidate's device limit (64 GiB
    with a cached block for 45_Average_Pooling_2D, whose candidate went past its 64 GiB on an H100
    about the cache probe, 2026-12-07): A's floating tensors are gone when B is drawn, and each B
    tensor once its mix is made."""
    import weakref

    drawn: list[list[weakref.ref]] = []
    alive_at_draw: list[list[bool]] = []
    make = inputs.make_inputs

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        alive_at_draw.append([r() is not None for group in drawn for r in group])
        out = make(*args, **kwargs)
        drawn.append([weakref.ref(t) for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()])
        return out

    monkeypatch.setattr(inputs, "make_inputs", recorded)
    mixed = inputs.make_draw(_mixed_problem(), "signed", 5, "cpu", mix_seed=9)
    assert alive_at_draw == [[], [False, False, False]]  # A's three floating tensors, gone
    assert [r() is not None for r in drawn[1]] == [False, False, False]  # B's too, but its mix
    assert len(mixed) == 5


_CUDA_DEVICE = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", _CUDA_DEVICE])
@pytest.mark.parametrize("positive", [False, True])
def test_a_wide_fill_made_in_chunks_is_the_fill_made_in_one_pass(
    monkeypatch: pytest.MonkeyPatch, positive: bool, device: str
) -> None:
    """The magnitudes of ``wide`` are made a chunk at a time (a third input's worth less on the
    device), bit for bit what one pass made: the same seed draws the same inputs as before."""

    def generator() -> torch.Generator:
        return torch.Generator(device=device).manual_seed(3)

    def one_pass(n: int) -> torch.Tensor:
        y = torch.empty(n, device=device)
        gen = generator()
        if positive:
            return y.uniform_(-4.0, 4.0, generator=gen).mul_(math.log(10.0)).exp_()
        y.uniform_(-1.0, 1.0, generator=gen)
        return y.abs().mul_(8.0).add_(-4.0).mul_(math.log(10.0)).exp_().copysign_(y)

    monkeypatch.setattr(_input_fills, "WIDE_CHUNK", 64)
    for n in (0, 1, 64, 1000, 70_001):
        chunked = torch.empty(n, device=device)
        _input_fills._fill_wide(chunked, generator(), positive)
        assert torch.equal(chunked, one_pass(n)), n
