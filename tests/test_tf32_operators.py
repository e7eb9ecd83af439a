"""``eager_tf32`` is left out only where the trusted reference ran no operator the TF32 flags change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import RELU, SUITE

from kbv import performance, wire, wire_replies
from kbv.child import tf32_ops
from kbv.worker import Worker, WorkerSpec

MATMUL = SUITE / "level1" / "25_Matmul_Square.py"
BOTH = ("eager_fp32", "eager_tf32")
FOUNDATION = Path(__file__).parent / "fixtures" / "candidates" / "foundation"


@pytest.mark.parametrize(
    "name",
    [
        "aten::mm",
        "aten::addmm",
        "aten::baddbmm",
        "aten::_scaled_mm",
        "aten::convolution",
        "aten::cudnn_convolution_transpose",
        "aten::_cudnn_rnn",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_cdist_forward",
        "aten::_trilinear",
        "aten::linalg_solve_ex",
        "aten::mv",
        "aten::dot",
        "aten::_linalg_svd",
        "mylib::fused_gemm",  # a custom op: what it runs is unknown
        "torchvision::deform_conv2d",
    ],
)
def test_operators_that_may_reach_cublas_or_cudnn_are_sensitive(name: str) -> None:
    assert tf32_ops.tf32_sensitive(name)


@pytest.mark.parametrize(
    "name",
    [
        "aten::relu",
        "aten::gelu",
        "aten::elu",
        "aten::sum",
        "aten::cumsum",
        "aten::_softmax",
        "aten::native_layer_norm",
        "aten::native_batch_norm",
        "aten::cudnn_batch_norm",
        "aten::linalg_vector_norm",
        "aten::upsample_bilinear2d",
        "aten::mse_loss",
        "aten::nll_loss_forward",
        "aten::hardtanh",
        "prims::convert_element_type",
    ],
)
def test_elementwise_and_reduction_operators_are_not(name: str) -> None:
    assert not tf32_ops.tf32_sensitive(name)


def _recorded(fn, *args) -> dict:
    recorder = tf32_ops.recorder()
    with torch.no_grad(), recorder:
        fn(*args)
    return tf32_ops.summary(recorder.names)


def test_the_recorder_sees_the_gemm_under_a_linear_layer_and_none_under_relu() -> None:
    x = torch.randn(4, 8)
    assert _recorded(torch.nn.Linear(8, 3), x)["sensitive"] == ["aten::addmm"]
    attention = torch.nn.functional.scaled_dot_product_attention
    assert _recorded(lambda t: attention(t, t, t), x[None])["sensitive"]
    assert _recorded(torch.nn.Conv1d(1, 2, 3), x[:, None])["sensitive"] == ["aten::convolution"]
    assert _recorded(torch.relu, x) == {"sensitive": [], "operators": 1}
    assert _recorded(torch.nn.BatchNorm1d(8).eval(), x)["sensitive"] == []


def test_eager_tf32_is_skipped_on_the_gpu_only_when_no_sensitive_operator_ran() -> None:
    none_ran = {"sensitive": [], "operators": 3}
    names, skipped = performance.measured_baselines(BOTH, "cuda:0", none_ran)
    assert names == ["eager_fp32"] and "3 operators" in skipped["eager_tf32"]
    # A GEMM ran, nothing was recorded, or the dispatcher saw nothing at all: both are timed.
    for account in ({"sensitive": ["aten::mm"], "operators": 2}, None, {"sensitive": [], "operators": 0}):
        assert performance.measured_baselines(BOTH, "cuda:0", account) == (list(BOTH), {})
    # Alone, eager_tf32 is the protocol's baseline and stays.
    assert performance.measured_baselines(("eager_tf32",), "cuda:0", none_ran) == (["eager_tf32"], {})


def _run_recording(role: str, problem, sizes: dict) -> wire_replies.RunReply:
    spec = WorkerSpec(build_key=f"test-tf32-ops-{role}", device="cpu", role=role, budget_s=60)
    with Worker(spec) as worker:
        worker.start()
        load = {
            "role": role,
            "device": "cpu",
            "problem_source": problem.read_text(),
            "sizes": sizes,
            "init_seed": 1,
        }
        if role == "candidate":
            load["candidate_path"] = str(FOUNDATION / "relu_plain.py")
        worker.request(wire.Load(**load))
        reply = worker.request(
            wire.Run(
                distribution="original",
                seed=3,
                precision="fp32",
                out_path=worker.new_path("out"),
                record_operators=True,
            )
        )
        worker.receive_outputs(reply.outputs)
        return reply


def test_a_reference_worker_reports_its_operators_when_asked() -> None:
    relu = _run_recording("reference", RELU, {"batch_size": 2, "dim": 8}).tf32_operators
    assert relu["sensitive"] == [] and relu["operators"] >= 1
    matmul = _run_recording("reference", MATMUL, {"N": 16}).tf32_operators
    assert matmul["sensitive"] == ["aten::mm"]


def test_a_candidate_worker_is_never_asked_and_does_not_answer() -> None:
    # Only the trusted reference's account decides which baselines are timed.
    reply = _run_recording("candidate", RELU, {"batch_size": 2, "dim": 8})
    assert reply.tf32_operators is None and reply.types == ["torch.Tensor"]


MODE_SHY = """
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


class Model(torch.nn.Module):
    def forward(self, x):
        if _get_current_dispatch_mode() is not None:  # as a compiled region may refuse a Python mode
            raise RuntimeError("no Python dispatch mode here")
        return torch.relu(x)


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return []
"""


def test_a_forward_that_refuses_the_recorder_still_runs_and_gives_no_account(tmp_path: Path) -> None:
    problem = tmp_path / "mode_shy.py"
    problem.write_text(MODE_SHY)
    reply = _run_recording("reference", problem, {})
    assert reply.types == ["torch.Tensor"] and reply.tf32_operators is None


class _FakeReference:
    """A reference worker's side of ``expected`` requests (a draw's baseline and truth), recorded:
    what the parent asked for."""

    def __init__(self, account: dict | None) -> None:
        self.account = account
        self.asked: list[tuple[str, str, bool]] = []
        self.replies: dict[int, wire_replies.ExpectedReply] = {}

    def new_path(self, what: str) -> str:
        return f"/nonexistent/{what}"

    def send_request(self, request: wire.Expected) -> int:
        self.asked.append((request.op, request.precision, request.record_operators))
        self.replies[len(self.asked)] = self._reply(request)
        return len(self.asked)

    def receive_reply(self, request_id: int) -> wire_replies.ExpectedReply:
        return self.replies.pop(request_id)

    def _reply(self, request: wire.Expected) -> wire_replies.ExpectedReply:
        return wire_replies.ExpectedReply(
            types=["torch.Tensor"],
            truth_types=["torch.Tensor"],
            baseline_outputs=[[[4], "float32"]],
            baseline_error={"outputs": [], "elementwise": 0.0, "norm": 0.0, "finite_match": True},
            outputs={"truth": True},
            tf32_operators=self.account if request.record_operators else None,
        )

    def receive_outputs(self, described: str) -> list:
        return [torch.ones(4, dtype=torch.float64)]


@pytest.mark.parametrize("account", [{"sensitive": [], "operators": 1}, None])
def test_the_parent_asks_for_the_account_once_per_evaluation_on_the_gpu(account: dict | None) -> None:
    # None: the forward refused the recorder; asking again would run every baseline forward twice.
    from types import SimpleNamespace

    from kbv import evaluation
    from kbv.protocol import VERIFIED

    ctx = evaluation._Context(
        problem=SimpleNamespace(source="import torch\n"),  # type: ignore[arg-type]
        candidate=None,  # type: ignore[arg-type]
        protocol=VERIFIED,
        device="cuda:0",
        seeds=None,  # type: ignore[arg-type]
    )
    ctx.cache.expected = evaluation.ExpectedCache(1 << 20)
    reference = _FakeReference(account)
    for seed in (1, 2, 3):
        evaluation._reference_outputs(ctx, reference, "original", seed)  # type: ignore[arg-type]
    assert reference.asked == [("expected", "tf32", True)] + [("expected", "tf32", False)] * 2
    assert ctx.cache.tf32_operators == account and ctx.cache.tf32_operators_asked
