"""What one worker holds between requests and what every forward request shares: the inputs
of a draw, the model for a precision, the precision flags, the steps of a profiled request and how
an exception is classified for the parent."""

from __future__ import annotations

import contextlib
import copy
import functools
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from kbv import inputs as kbv_inputs
from kbv.child import tf32_ops as _tf32_ops

_CUDA_ERROR_MARKERS = ("CUDA error", "illegal memory access", "cudaError", "CUBLAS_STATUS", "CUDNN_STATUS")


class _State:
    """What one worker holds between requests."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.problem: Any = None
        self.model_cls: Any = None
        self.model: Any = None
        self.model_fp64: Any = None
        self.model_compiled: Any = None
        self.init_seed = 0  # the last build's
        # The state-dict name of each parameter and buffer registration of the model's __init__,
        # in order (``kbv.child.construct``), noted at the first build.
        self.registrations: list[str | None] | None = None
        self.role = "reference"
        self.domain = "any"
        self.structure: list[Any] | None = None  # input invariants, one per positional input
        # The evaluation's precision (kbv.inputs.CAST_DTYPES): inputs and parameters cast to it.
        self.precision = "fp32"
        self.timer: Any = None
        self.identities: dict[str, int] = {}
        # What was handed to the parent on the GPU (shared tensors, exported allocations), alive
        # until the parent's next request; and how (``kbv.handoff.TRANSPORTS``, the parent says).
        self.handed: list[Any] = []
        self.handoff = "cuda_ipc"
        # An empty allocation the parent fills (a model's parameters), kept until the build reads it.
        self.inbox: list[Any] = []
        # The timing phase's input sets, (key, sets), kept from one ``time`` request to the next of
        # the same phase (rounds, baselines); dropped by any other request.
        self.timing_inputs: tuple[Any, list[Any]] | None = None
        # Work a request left for the start of the next one, before that one runs anything (a
        # deferred observation's late look, kbv.child.probes), and what that look saw.
        self.before_next: Any = None
        self.late_look: dict[str, Any] | None = None


class NoModelNew(ImportError):
    """The candidate file defines no ``ModelNew``: nothing of it can run, so it is a
    ``compile_error`` (a file that does not build a model), never a ``runtime_error``."""


def _message(exc: BaseException, op: str) -> str:
    """``str(exc)``, except where that says nothing: ``sys.exit(0)`` would read ``0``."""
    if isinstance(exc, SystemExit):
        where = "while being imported" if op == "load" else f"during {op!r}"
        return f"the code called sys.exit({exc.code!r}) {where}; a module must not exit the interpreter"
    return str(exc) or type(exc).__name__


def _classify(exc: BaseException, op: str) -> str:
    module = type(exc).__module__ or ""
    message = str(exc)
    if (
        isinstance(exc, (SyntaxError, NoModelNew))
        or "Error building extension" in message
        or module.startswith("triton.compiler")
    ):
        return "compile_error"
    if any(marker in message for marker in _CUDA_ERROR_MARKERS) or type(exc).__name__ == "AcceleratorError":
        return "cuda_error"
    if op == "load":
        return "import_error"
    return "runtime_error"


def _model_for(state: _State, precision: str) -> Any:
    if precision == "compile":
        if state.role != "reference":
            raise PermissionError("only a reference worker compiles the baseline")
        if state.model_compiled is None:
            state.model_compiled = torch.compile(state.model)
        return state.model_compiled
    if precision != "fp64":
        return state.model
    if state.model_fp64 is None:
        state.model_fp64 = _float64_twin(state)
    return state.model_fp64


def _float64_twin(state: _State) -> Any:
    """The model for the float64 truth: a deep copy cast to float64, or, where the model keeps
    functions of its own (:func:`_keeps_functions`), the model built again as ``state.model`` was
    (its init seed, its current parameter and buffer values given to ``__init__``,
    ``kbv.child.construct``) and cast. A deep copy shares those functions and what they captured:
    44_MiniGPTBlock keeps ``self.mlpf = lambda x: m.c_proj(...)`` over its ``self.mlp``, so a copy
    cast to float64 called the original float32 layers and the reference failed its own truth.
    Building again costs a construction per build, which a copy does not (1-1.5 ms for a 262k-
    parameter CPU problem, 2026-12-06), so it is done only where a copy would be wrong."""
    model, registrations = state.model, state.registrations  # (noted by every build)
    if registrations is None or not isinstance(model, torch.nn.Module) or not _keeps_functions(model):
        return copy.deepcopy(model).double()
    from kbv.child import construct as _construct_state

    values = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    twin, at_init = _construct_state.construct_with_state(_constructor(state), registrations, values)
    twin = twin.to(state.device).eval()  # the class that built ``model``: a module too
    if not at_init:
        twin.load_state_dict(values, strict=True)
    return twin.double()


def _constructor(state: _State) -> Callable[[], Any]:
    """``state.model_cls`` built under ``state.init_seed`` on the evaluation's device, ready to call:
    the init inputs are drawn under the seed, and the seed is set again for ``__init__``."""
    kbv_inputs.seed_torch(state.init_seed, state.device)
    init_inputs = state.problem.get_init_inputs()
    kbv_inputs.seed_torch(state.init_seed, state.device)

    def construct() -> Any:
        # Made on the evaluation's device: initialising large layers on the CPU and copying them
        # cost seconds per build (both workers build alike, so their parameters still match).
        with torch.device(state.device):
            return state.model_cls(*init_inputs)

    return construct


def _keeps_functions(model: torch.nn.Module) -> bool:
    """Whether a function one of the model's modules holds (an attribute, a hook, or inside a list,
    tuple, set or dict of them) reaches a module or a tensor: through its closure, its default
    arguments, the object a method is bound to or a partial's arguments. A deep copy shares
    functions, so what they reach stays the original's. ``F.silu`` or ``torch.relu`` reach none."""
    pending: list[tuple[Any, bool]] = [(v, False) for m in model.modules() for v in vars(m).values()]
    seen: set[int] = set()
    while pending:
        value, from_function = pending.pop()
        if isinstance(value, (torch.Tensor, torch.nn.Module)):
            if from_function:
                return True
            continue
        if id(value) in seen or isinstance(value, (str, bytes)):
            continue
        seen.add(id(value))
        pending.extend((inner, True) for inner in _reached_by_function(value))
        if isinstance(value, dict):
            pending.extend((inner, from_function) for inner in value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            pending.extend((inner, from_function) for inner in value)
    return False


def _reached_by_function(value: Any) -> list[Any]:
    """What a function, bound method or partial holds of its own (empty for anything else)."""
    if isinstance(value, types.MethodType):
        return [value.__self__, value.__func__]
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values()]
    if not isinstance(value, types.FunctionType):
        return []
    held = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
    for cell in value.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            held.append(cell.cell_contents)
    return held


def _set_precision_flags(precision: str) -> None:
    """Baseline configurations. A candidate runs with PyTorch's defaults (``precision='native'``);
    ``default`` puts PyTorch's default flags back in a trusted worker (TF32 off for matmuls, on for cuDNN)."""
    if precision == "native":
        return
    if precision == "default":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True
        return
    tf32 = precision in ("tf32", "compile")  # the compiled baseline runs with TF32, as practitioners do
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


class InputsFailedAfterCandidate(RuntimeError):
    """The problem's inputs could not be drawn in a candidate's process once its code had run there."""


def _make_inputs(
    state: _State, distribution: str, seed: int, precision: str, mix_seed: int | None = None
) -> list[Any]:
    try:
        return kbv_inputs.make_draw(
            state.problem,
            distribution,
            seed,
            state.device,
            precision="fp64" if precision == "fp64" else "fp32",
            domain=state.domain,
            structure=state.structure,
            mix_seed=mix_seed,
            cast=state.precision,
        )
    except Exception as exc:
        if state.role != "candidate" or _classify(exc, "run") == "cuda_error":
            raise  # a CUDA error keeps its kind: it ends this worker (main's loop)
        # Without this the traceback names only kbv's input code and the problem file, and a broken
        # candidate reads as a harness failure (two third-party kernels on the H200 whose failed CUDA
        # graph capture, swallowed, left the process's random generator unusable).
        raise InputsFailedAfterCandidate(
            f"drawing the hidden inputs (the problem's get_inputs) failed in the candidate's process, "
            f"after the candidate's code had run there: {exc}. The problem is not at fault: a "
            "get_inputs that fails by itself fails in the trusted reference worker too, which makes "
            "the pair a problem_error. Look for process-wide state the candidate changed (a CUDA graph "
            "capture that failed and was swallowed, a patched torch function, a changed default device)."
        ) from exc


def _as_outputs(result: Any) -> list[Any]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _type_names(outputs: list[Any]) -> list[str]:
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in outputs]


def _device_bytes(state: _State) -> float:
    if state.device.type != "cuda":
        return float("inf")  # host memory is the candidate's limit's business, not this choice's
    return float(torch.cuda.get_device_properties(state.device).total_memory)


def _shape_and_dtype(value: Any) -> list[Any] | None:
    """A handed-over output's shape and dtype name (``torch.float32`` -> ``"float32"``), or None."""
    if not isinstance(value, torch.Tensor):
        return None
    return [list(value.shape), str(value.dtype).removeprefix("torch.")]


class _Steps:
    """Seconds per step of one request, when a profiling run asks (``steps``): each mark waits for
    the device, so a step's queued GPU work is its own. Off, it costs nothing and waits for nothing."""

    def __init__(self, on: bool, cuda: bool) -> None:
        self.on, self._cuda = on, cuda
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def taken(self) -> dict[str, float] | None:
        """The seconds per step, where a profiling run asked for them (a reply's ``steps_s``)."""
        return self.seconds if self.on else None

    def mark(self, name: str) -> None:
        if not self.on:
            return
        if self._cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now


def _forward_recording(model: Any, args: list[Any]) -> tuple[Any, dict[str, Any] | None]:
    """One forward under the operator recorder (``kbv.child.tf32_ops``), and its account. The
    recorder must never fail a trusted forward (a compiled region may refuse a Python dispatch
    mode): a forward that raises under it runs again without it, and no account is given, so both
    baselines are timed. A CUDA error is the forward's own and is raised."""
    recorder = _tf32_ops.recorder()
    try:
        with recorder:
            outputs = model(*args)
    except Exception as exc:
        if any(marker in str(exc) for marker in _CUDA_ERROR_MARKERS):
            raise
        return model(*args), None
    return outputs, _tf32_ops.summary(recorder.names)
