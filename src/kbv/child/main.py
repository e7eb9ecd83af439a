"""The worker's entry point: ``python -m kbv.child.main FD ROLE``.

This process executes; it never decides. It loads a problem (and, in a candidate worker, the
candidate), makes inputs from per-call seeds with kbv's own generator, runs forward calls and timing
loops, and reports raw outputs and samples over the private channel. Comparison, statistics and the
verdict happen in the parent. Everything the candidate could tamper with here is either re-checked
by the parent or measured again with a clock the candidate cannot reach.

Imports are kept to what running a model needs; the timing functions are captured before the
candidate module is imported.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import os
import socket
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import torch

from kbv import channel as _channel
from kbv import handoff as _handoff
from kbv import inputs as kbv_inputs
from kbv import sketch as _sketch
from kbv import telemetry
from kbv.child import construct as _construct_state
from kbv.child import tf32_ops as _tf32_ops
from kbv.child import timing as kbv_timing
from kbv.problems._loader import load_source
from kbv.protocol import timing_settings_from_dict

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


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    state = _State()
    facts = _environment_facts()
    with contextlib.suppress(ImportError):
        from kbv.child import probes as _probes  # type: ignore[attr-defined,unused-ignore]

        # what booting imported (the profiler may import Triton) is not the candidate's
        _probes.note_boot_modules()
    _channel.send(sock, {"op": "hello", "pid": os.getpid(), **facts})
    while True:
        request = _channel.receive(sock)
        op = request.get("op")
        if op == "exit":
            _channel.send(sock, {"ok": True})
            break
        started = time.perf_counter()
        _handoff.release(state.handed)  # the parent copied what it was handed before this request
        if op not in ("time", "truth_sketches"):  # the timing phase's requests keep its sets
            state.timing_inputs = None
        try:
            reply = _HANDLERS[str(op)](state, request)
            reply["ok"] = True
        except BaseException as exc:  # the candidate failed: report it, the parent decides
            reply = {"ok": False, "error": _describe_error(exc, op=str(op))}
        reply["worker_seconds"] = time.perf_counter() - started
        _release_cached_memory(request.get("room_bytes"))
        if request.get("steps"):  # a profiling run asked where the request's time went
            reply.setdefault("steps_s", {})["release"] = (
                time.perf_counter() - started - reply["worker_seconds"]
            )
        sent = state.handed + state.inbox if op == "inbox" else state.handed
        _channel.send(sock, reply, fds=_handoff.fds_to_send(sent))
        if not reply["ok"] and reply["error"]["kind"] == "cuda_error":
            break  # the CUDA context is unusable now; this process must not be reused
    sock.close()


#: A worker whose allocator keeps more than this cached hands it back after the request: three
#: workers each keeping the peak of a billion-element request ran the H200 out of memory.
CACHED_BYTES_KEPT = 8 << 30
#: ... except the trusted reference worker while the device has what it keeps free (room for a
#: peer's request as large as its own) and ``room_bytes``, which the parent sends with every
#: request: the candidate's device limit as it stands (widened to 3/4 of the device where the
#: evaluation holds it alone), or 0 during the correctness draws of an evaluation
#: holding its GPU alone, where each of the reference's requests runs beside the candidate's draw
#: (kbv.evaluation._room_for_candidate); REFERENCE_ROOM_FLOOR where none is sent. What the reference
#: keeps must never make an honest candidate run out of memory below its limit: with a floor of
#: 64 GB alone, a 7.5 GB-input problem's candidate (its limit widened) ran out in its cache probe on
#: the H200 (2026-12-03, benchmarks/results/2026-12-03-h200-verified-cost/). Handing back and
#: allocating again cost the ``expected``
#: requests of a 1e9-element loss 0.02-0.04 s of release and more of allocation per draw there
#: (tens of draws an evaluation; twice what it keeps was not free beside its candidate). A
#: candidate worker always hands it back: what its allocator keeps counts against its device limit,
#: and a cached block of the wrong size is kept beside a new one.
REFERENCE_ROOM_FLOOR = 64 * (1 << 30)  # the protocols' default device limit (GiB, as limits count)


#: The role this process was started for (argv), known before the first request names it, and
#: whether it takes the probes' first-use costs while booting (argv "probes": ``WorkerSpec.warm_probes``).
_ROLE = ""
_WARM_PROBES = False


def _release_cached_memory(room_bytes: Any = None) -> None:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    kept = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if kept <= CACHED_BYTES_KEPT:
        return
    room = float(room_bytes) if isinstance(room_bytes, (int, float)) else REFERENCE_ROOM_FLOOR
    if _ROLE == "reference" and torch.cuda.mem_get_info()[0] >= max(kept, room):
        return
    torch.cuda.empty_cache()


def _environment_facts() -> dict[str, Any]:
    from kbv.child import confine as _confine

    facts: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "intra_op_threads": torch.get_num_threads(),
    }
    confinement = _confine.from_environment()  # applied before this greeting, before any candidate code
    if confinement is not None:
        facts["confinement"] = confinement
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # the CUDA context is made now, while the worker boots
        _sketch.warm(torch.device("cuda"))  # the fused sketch kernel, where it is on, compiled now
        if _WARM_PROBES:
            _warm_profiler()
            if _ROLE == "reference":  # only the trusted reference worker counts FLOPs (on CUDA)
                _warm_flop_counter()
                _warm_error_stats()
        props = torch.cuda.get_device_properties(0)
        facts["device"] = {
            "type": "cuda",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "total_memory_bytes": props.total_memory,
            "l2_cache_bytes": getattr(props, "L2_cache_size", None),
            "sm_count": props.multi_processor_count,
            "cuda_runtime": torch.version.cuda,
            "driver": telemetry.driver_version(),
        }
        # Read without importing Triton: an import would look like the candidate's own Triton code.
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            facts["triton"] = importlib.metadata.version("triton")
    return facts


def _load(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    state.device = torch.device(request["device"])
    state.role = request["role"]
    state.domain = request.get("domain", "any")
    state.structure = request.get("structure")
    state.precision = str(request.get("precision") or "fp32")
    if request.get("handoff") in _handoff.TRANSPORTS:
        state.handoff = request["handoff"]
    label = request.get("problem_name", "(its text)")
    state.problem = load_source(request["problem_source"], sizes=request.get("sizes") or {}, label=label)
    # Captured before any candidate code runs, so later patching cannot reach these references.
    state.timer = kbv_timing.make_timer(state.device)
    state.identities = kbv_timing.snapshot_identities()
    if state.role == "candidate":
        state.model_cls = _import_candidate(Path(request["candidate_path"]))
    else:
        state.model_cls = state.problem.Model
    _build(state, {"init_seed": request["init_seed"]})
    return {"parameters": _parameter_shapes(state.model)}


class NoModelNew(ImportError):
    """The candidate file defines no ``ModelNew``: nothing of it can run, so it is a
    ``compile_error`` (a file that does not build a model), never a ``runtime_error``."""


def _import_candidate(path: Path) -> Any:
    name = f"kbv_candidate_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "ModelNew"):
        raise NoModelNew(f"{path.name} defines no class ModelNew; a candidate must define ModelNew")
    return module.ModelNew


def _build(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    """Construct the model under a seed, with the parameters the parent sends (a file, or the
    inbox on a GPU) given to it while ``__init__`` runs (``kbv.child.construct``)."""
    state.init_seed = int(request["init_seed"])
    state.model = state.model_fp64 = state.model_compiled = None  # its memory free for the new one
    if request.get("state_path"):
        loaded = torch.load(request["state_path"], map_location=state.device, weights_only=True)
        parameters = _construct(state, loaded)
    elif request.get("state_inbox") is not None:
        try:
            given = _handoff.inbox_tensors(state.inbox, request["state_inbox"], state.device)
            parameters = _construct(state, given)
            torch.cuda.synchronize(state.device)  # the copies are done before the inbox goes
        finally:
            _handoff.release(state.inbox)
    else:
        parameters = _construct(state, None)
    return {"parameters": parameters}


def _construct(state: _State, given: dict[str, torch.Tensor] | None) -> str:
    """``state.model`` built under ``state.init_seed``; with ``given``, holding those values from
    the moment ``__init__`` registers them, so what ``__init__`` derives from its parameters (a
    transposed weight, a folded BatchNorm) is derived from them. Returns how the parameters came:
    ``matched_seed`` (the seed's own), ``state_dict`` (given during construction) or
    ``state_dict_after_init`` (this model's construction could not take them: loaded afterwards,
    as a state dict always was before)."""
    torch.manual_seed(state.init_seed)
    init_inputs = state.problem.get_init_inputs()
    torch.manual_seed(state.init_seed)

    def construct() -> Any:
        # Made on the evaluation's device: initialising large layers on the CPU and copying them
        # cost seconds per build (both workers build alike, so their parameters still match).
        with torch.device(state.device):
            return state.model_cls(*init_inputs)

    at_init = False
    if given is None or state.registrations is None:
        model, state.registrations = _construct_state.construct_recording(construct)
    else:
        model, at_init = _construct_state.construct_with_state(construct, state.registrations, given)
    model = model.to(state.device).eval() if isinstance(model, torch.nn.Module) else model
    dtype = kbv_inputs.CAST_DTYPES[state.precision]
    if dtype is not None and isinstance(model, torch.nn.Module):
        model = model.to(dtype)  # floating parameters and buffers only, as KernelBench casts them
    state.model = model
    if given is None:
        return "matched_seed"
    if at_init and _construct_state.holds_state(model, given):
        return "state_dict"
    model.load_state_dict(given, strict=True)
    return "state_dict_after_init"


def _inbox(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    """An empty allocation of ``nbytes`` for the parent to write a model's parameters into (CUDA
    only); the next ``build`` with ``state_inbox`` reads it. The parent never shares its memory."""
    _handoff.release(state.inbox)
    return {"inbox": _handoff.open_inbox(int(request["nbytes"]), state.device, state.handoff, state.inbox)}


def _parameter_shapes(model: Any) -> dict[str, list[int]]:
    """Names and shapes of the model's state, so the parent can tell whether a state dict fits."""
    if not isinstance(model, torch.nn.Module):
        return {}
    return {name: list(value.shape) for name, value in model.state_dict().items()}


def _redraw(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    """Reference workers only: new parameter values for a distribution, saved for the candidate, or
    (``hand_over``, on a GPU) handed to the parent on the device with their names."""
    if state.role != "reference":
        raise PermissionError("only a reference worker redraws parameters")
    new_state = kbv_inputs.redraw_parameters(state.model, request["distribution"], int(request["seed"]))
    # Built again with them, as the candidate is: what the problem's __init__ derives is theirs.
    state.model = state.model_fp64 = state.model_compiled = None
    _construct(state, new_state)
    if request.get("hand_over"):
        named = state.model.state_dict()
        values = [_handoff.plain_copy(v, state.device, copy=False) for v in named.values()]
        return {
            "names": list(named),
            "outputs": _handoff.hand_over(
                values, state.device, request["out_path"], state.handed, state.handoff
            ),
        }
    full = {k: v.detach().cpu() for k, v in state.model.state_dict().items()}
    torch.save(full, request["out_path"])
    return {"n_tensors": len(full)}


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
        state.model_fp64 = copy.deepcopy(state.model).double()
    return state.model_fp64


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


def _run(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    precision = request.get("precision", "native")
    _set_precision_flags(precision)
    mix = request.get("mix_seed")
    steps = _Steps(bool(request.get("steps")), state.device.type == "cuda")
    args = _make_inputs(
        state, request["distribution"], int(request["seed"]), precision, None if mix is None else int(mix)
    )
    steps.mark("inputs")
    model = _model_for(state, precision)
    memory = _memory_before(state) if request.get("measure_memory") else None
    # Only a trusted worker's account of its own operators is asked for (and believed).
    recording = request.get("record_operators") and state.role == "reference"
    with torch.no_grad():
        outputs, operators = _forward_recording(model, args) if recording else (model(*args), None)
    outputs = _as_outputs(outputs)
    if state.device.type == "cuda":
        torch.cuda.synchronize()
    steps.mark("forward")
    if memory is not None:
        memory = _memory_after(state, memory)
    types = _type_names(outputs)
    # A trusted reference's outputs are handed over as they are; a candidate's are copied first.
    copies = [_handoff.plain_copy(o, state.device, copy=state.role == "candidate") for o in outputs]
    del args, outputs
    steps.mark("copy")
    reply = {
        "types": types,
        "memory": memory,
        "outputs": _handoff.hand_over(copies, state.device, request["out_path"], state.handed, state.handoff),
    }
    return _finished(reply, steps, operators)


#: Input bytes up to which the reference keeps a draw's float32 inputs while its float64 forward
#: runs, so the draw is generated once for both forwards; above it, as a share of the device's
#: memory, the inputs are generated again for the baseline (the 7.5 GB-input problems' reference
#: already needed 72 GB of the H200 for its float64 forward alone).
SHARED_DRAW_SHARE = 1 / 16


def _expected(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    """What judging one draw needs, from the trusted reference alone: the float64 truth and the
    realistic baseline (``precision``: TF32 on a GPU, fp32 on the CPU) on the same inputs, the
    baseline's error against the truth computed here (``kbv.error_stats.baseline_error``), and only
    the truth handed over; the baseline's outputs never leave this process (their shapes and dtypes
    do). The float64 inputs are an upcast copy of the float32 draw, made before either forward runs,
    so a forward that writes into its inputs cannot change the other's."""
    if state.role != "reference":
        raise PermissionError("only the trusted reference worker computes a draw's truth")
    from kbv.error_stats import baseline_error  # numbers, not a verdict (the reference worker only)

    mix = request.get("mix_seed")
    draw = (request["distribution"], int(request["seed"]), None if mix is None else int(mix))
    steps = _Steps(bool(request.get("steps")), state.device.type == "cuda")
    narrow = _make_inputs(state, draw[0], draw[1], "fp32", draw[2])
    wide = kbv_inputs.upcast_draw(narrow)
    args: list[Any] | None = narrow
    if kbv_inputs.draw_bytes(narrow) > SHARED_DRAW_SHARE * _device_bytes(state):
        args = None  # freed for the float64 forward, drawn again for the baseline
    del narrow
    steps.mark("inputs")
    _set_precision_flags("fp64")
    try:
        with torch.no_grad():
            truth = _as_outputs(_model_for(state, "fp64")(*wide))
    except Exception as exc:  # e.g. a forward that makes float32 tensors of its own
        if _classify(exc, "expected") == "cuda_error":
            raise  # keeps its kind: it ends this worker
        raise RuntimeError(
            f"in float64 (the verified protocol's truth): {_message(exc, 'expected')}"
        ) from exc
    del wide
    steps.mark("forward_fp64")
    if args is None:
        args = _make_inputs(state, draw[0], draw[1], "fp32", draw[2])
    precision = str(request["precision"])
    _set_precision_flags(precision)
    recording = bool(request.get("record_operators"))
    with torch.no_grad():
        baseline, operators = (
            _forward_recording(state.model, args) if recording else (state.model(*args), None)
        )
    del args
    baseline = _as_outputs(baseline)
    steps.mark("forward")
    kept_truth = [_handoff.plain_copy(o, state.device, copy=False) for o in truth]
    kept_baseline = [_handoff.plain_copy(o, state.device, copy=False) for o in baseline]
    try:
        error: dict[str, Any] = baseline_error(kept_baseline, kept_truth)
    except ValueError as exc:  # the problem's fault: the parent says so
        error = {"structure_error": str(exc)}
    steps.mark("baseline_error")
    reply = {
        "types": _type_names(baseline),
        "truth_types": _type_names(truth),
        "baseline_outputs": [_shape_and_dtype(o) for o in kept_baseline],
        "baseline_error": error,
        "outputs": _handoff.hand_over(
            kept_truth, state.device, request["out_path"], state.handed, state.handoff
        ),
    }
    return _finished(reply, steps, operators)


def _finished(reply: dict[str, Any], steps: _Steps, operators: dict[str, Any] | None) -> dict[str, Any]:
    """A forward's reply once its outputs are handed over: with the trusted reference's account of
    its operators when it was asked for, and the request's steps when a profiling run asked."""
    steps.mark("hand_over")
    if operators is not None:
        reply["tf32_operators"] = operators
    if steps.on:
        reply["steps_s"] = steps.seconds
    return reply


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


def _memory_before(state: _State) -> dict[str, Any]:
    if state.device.type != "cuda":
        return {}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated_before": torch.cuda.memory_allocated(),
        "reserved_before": torch.cuda.memory_reserved(),
        "device_used_before": total - free,
    }


def _memory_after(state: _State, before: dict[str, Any]) -> dict[str, Any]:
    if state.device.type != "cuda":
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return {
        **before,
        "allocator_peak": torch.cuda.max_memory_allocated(),
        "device_used_after": total - free,
        "reserved_peak": torch.cuda.max_memory_reserved(),
        "reserved_now": reserved,
        "reserved_growth": reserved - before["reserved_before"],
    }


def _time(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    """One timed batch. With ``sketch`` (a seed and a map frequency per output, the same in every
    worker's request of a round) every timed call's outputs are sketched (``kbv.sketch``) right after
    the call returned and was synchronised and timed, outside the timed region: the same work for
    every call, so nothing tells one call from another; the sketches come back with the samples.
    With ``unseen_seeds`` (``timing.unseen_inputs``) timed call ``i`` runs on the draw of the i-th
    seed, made just before it outside the timed region and dropped once its outputs are sketched;
    the kept sets of ``seeds`` serve the warm-up only."""
    precision = request.get("precision", "native")
    _set_precision_flags(precision)
    settings = timing_settings_from_dict(request["settings"])
    seeds = [int(s) for s in request["seeds"]]
    unseen_seeds = [int(s) for s in request.get("unseen_seeds") or []]
    steps = _Steps(bool(request.get("steps")), state.device.type == "cuda")
    input_sets = _timing_inputs(state, request["distribution"], seeds, precision)
    steps.mark("inputs")
    model = _model_for(state, precision)
    last: list[Any] = [None] * len(input_sets)
    spec = request.get("sketch")
    sketches: list[list[dict[str, Any]]] = []
    sketch_s = [0.0]
    unseen_out: list[Any] = [None]

    def call(k: int) -> None:
        last[k] = model(*input_sets[k])

    def unseen(i: int) -> Any:
        if i >= len(unseen_seeds):
            raise RuntimeError(f"timed call {i} has no unseen input set ({len(unseen_seeds)} sent)")
        unseen_out[0] = None  # the previous call's set and outputs go before the next is drawn
        args = _make_inputs(state, request["distribution"], unseen_seeds[i], precision)

        def run() -> None:
            unseen_out[0] = model(*args)

        return run

    def outputs_of(i: int) -> Any:
        return unseen_out[0] if unseen_seeds else last[i % len(input_sets)]

    def on_sample(i: int, device_ms: float, wall_ms: float) -> None:
        assert spec is not None  # passed to the recipe only with a spec
        started = time.perf_counter()
        sketches.append(_sketch.sketch_outputs(_as_outputs(outputs_of(i)), spec, state.device))
        if steps.on:
            if state.device.type == "cuda":
                torch.cuda.synchronize()
            sketch_s[0] += time.perf_counter() - started

    flush = kbv_timing.make_l2_flush(state.device) if settings.l2_flush else None
    with torch.no_grad():
        measurement = kbv_timing.measure(
            call,
            settings=settings,
            n_input_sets=len(input_sets),
            timer=state.timer,
            flush=flush,
            on_sample=on_sample if spec is not None else None,
            unseen=unseen if unseen_seeds else None,
        )
    unseen_out[0] = None
    reply: dict[str, Any] = {"measurement": measurement.to_dict()}
    if spec is not None:
        reply["sketches"] = sketches
    if steps.on:
        steps.mark("measure")
        timed_s = sum(measurement.wall_ms) / 1e3
        # the recipe's seconds split: the timed calls, their sketches, and the rest (warm-up, the
        # unseen sets' draws, the L2 flushes, the synchronisations around each call)
        steps.seconds["timed_calls"] = timed_s
        steps.seconds["sketches"] = sketch_s[0]
        steps.seconds["warmup_flush_sync"] = steps.seconds.pop("measure") - timed_s - sketch_s[0]
        reply["steps_s"] = steps.seconds
    return reply


def _truth_sketches(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    """The trusted reference's side of judging timed calls on unseen inputs (``timing.unseen_inputs``):
    for each of ``seeds`` (one per timed call of a round) the float64 truth of its draw, reduced
    here to what judging a sketch needs (``kbv.error_stats.truth_summary``: the sketch under
    ``sketch``, the sum of squares of its finite values), and never handed over. Without ``omega`` in the spec
    (the phase's first request) the map's frequency per output comes from the first draw's RMS and
    is returned. With ``baseline`` (a precision) the first draw also runs the realistic baseline, whose
    error against the truth (``kbv.error_stats``) sets the norm tolerance of every timed call, and
    whose outputs' shapes and dtypes are what a candidate's must have."""
    if state.role != "reference":
        raise PermissionError("only the trusted reference worker computes a draw's truth")
    from kbv.error_stats import baseline_error, finite_rms, truth_summary  # numbers, not a verdict

    spec = dict(request["sketch"])
    baseline_precision = request.get("baseline")
    sets: list[list[dict[str, Any] | None]] = []
    reply: dict[str, Any] = {}
    for k, seed in enumerate(int(s) for s in request["seeds"]):
        narrow = _make_inputs(state, request["distribution"], seed, "fp32")
        wide = kbv_inputs.upcast_draw(narrow)
        _set_precision_flags("fp64")
        with torch.no_grad():
            outputs = _as_outputs(_model_for(state, "fp64")(*wide))
        truth = [_handoff.plain_copy(o, state.device, copy=False) for o in outputs]
        del wide, outputs
        if spec.get("omega") is None:
            spec["omega"] = [_sketch.omega_for(finite_rms(t)) for t in truth]
            reply["omega"] = spec["omega"]
        if k == 0 and baseline_precision is not None:
            _set_precision_flags(str(baseline_precision))
            with torch.no_grad():
                outputs = _as_outputs(state.model(*narrow))
            base = [_handoff.plain_copy(o, state.device, copy=False) for o in outputs]
            del outputs
            reply["baseline_outputs"] = [_shape_and_dtype(o) for o in base]
            reply["types"] = _type_names(base)
            try:
                reply["baseline_error"] = baseline_error(base, truth)
            except ValueError as exc:  # the problem's fault: the parent says so
                reply["baseline_error"] = {"structure_error": str(exc)}
            del base
        del narrow
        sets.append(truth_summary(truth, int(spec["seed"]), [float(w) for w in spec["omega"]]))
        del truth
    reply["sets"] = sets
    return reply


#: Bytes of timing input sets a worker keeps between the timing phase's requests, as a share of the
#: device's memory (on the CPU, :data:`KEPT_TIMING_INPUTS_CPU`): each round and each baseline then
#: times the sets the first request drew instead of drawing them again (on the H200 a draw of a
#: median problem's inputs costs 10-50 ms, and ``verified`` asks for 3 sets in up to 9 requests).
KEPT_TIMING_INPUTS_SHARE = 1 / 32
KEPT_TIMING_INPUTS_CPU = 1 << 30


def _timing_inputs(state: _State, distribution: str, seeds: list[int], precision: str) -> list[Any]:
    """The input sets of a timed batch: the ones kept from the phase's previous request when it
    named the same draws (the values are the same: a draw is a function of its seed), else drawn
    now and kept when they are small. Reusing them tells the worker nothing it did not know: every
    round times the same seeds, and within a round each set is called ten times already."""
    kind = "fp64" if precision == "fp64" else "fp32"
    key = (distribution, tuple(seeds), kind)
    if state.timing_inputs is not None and state.timing_inputs[0] == key:
        return state.timing_inputs[1]
    state.timing_inputs = None
    sets = [_make_inputs(state, distribution, s, precision) for s in seeds]
    limit = (
        KEPT_TIMING_INPUTS_SHARE * _device_bytes(state)
        if state.device.type == "cuda"
        else KEPT_TIMING_INPUTS_CPU
    )
    if kbv_inputs.draw_bytes(sets) <= limit:
        state.timing_inputs = (key, sets)
    return sets


def _identities(state: _State, request: dict[str, Any]) -> dict[str, Any]:
    return {"changed": kbv_timing.verify_identities(state.identities)}


_HANDLERS = {
    "load": _load,
    "build": _build,
    "redraw": _redraw,
    "inbox": _inbox,
    "run": _run,
    "expected": _expected,
    "time": _time,
    "truth_sketches": _truth_sketches,
    "identities": _identities,
}


def _register_probes() -> None:
    """Integrity probes (kbv.child.probes) add their own requests to this worker."""
    try:
        from kbv.child import probes as _probes  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return
    _HANDLERS.update(_probes.HANDLERS)
    from kbv.child import calls as _calls

    _HANDLERS.update(_calls.HANDLERS)


def _describe_error(exc: BaseException, op: str) -> dict[str, Any]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "kind": _classify(exc, op),
        "type": type(exc).__name__,
        "message": _message(exc, op)[-4000:],
        "traceback": text[-8000:],
    }


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


def _warm_profiler() -> None:
    """Start and stop the profiler once while the worker boots. Its first session in a process
    starts Kineto and CUPTI, which took 4-5 s of every ``verified`` evaluation on the H200 (the
    kernel-name probe); a later one costs a fraction of a second. Both roles take it, so the
    reference's and the candidate's timed calls run in processes prepared alike."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        torch.ones(8, device="cuda").add_(1)
        torch.cuda.synchronize()


def _warm_flop_counter() -> None:
    """Count one small matmul: the FLOP counter's first use registers its tables (seconds)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False):
        torch.ones(4, 4) @ torch.ones(4, 4)


def _warm_error_stats() -> None:
    """Measure one small baseline's error against a float64 truth on the GPU while the reference
    boots. Its first use in a process starts cuBLAS (a float64 dot) and loads the reductions'
    kernels: 0.08-0.11 s of the first ``expected`` request on the H200 for every problem whose
    forward runs no matmul (a loss, a convolution), where 0.005 s is what a later draw pays."""
    from kbv.error_stats import baseline_error

    truth = torch.linspace(-4.0, 4.0, 1 << 16, dtype=torch.float64, device="cuda")
    baseline_error([truth.float().exp()], [truth.exp()])
    torch.cuda.synchronize()


def _warm_cpu_kernels() -> None:
    """Run PyTorch's vectorised float kernels once across the thread pool before any model does.

    On some CPUs the first float32 ``exp`` of a fresh process came back wrong (~1e-4 relative) from
    the second OpenMP thread (docs/correctness.md); taking that first call here keeps it out of
    both the reference's and the candidate's outputs."""
    x = torch.linspace(-4.0, 4.0, 1 << 16).reshape(64, -1)
    for op in (torch.exp, torch.log1p, torch.tanh, torch.sigmoid, torch.erf, torch.sin, torch.cos):
        op(x.abs() if op is torch.log1p else x)
    x.sum(dim=-1)
    x.amax(dim=-1)


def run(fd: int, role: str, warm_probes: bool) -> None:
    """Boot and serve: what ``python -m kbv.child.main FD ROLE [probes]`` does, and what a process
    forked from kbv's fork server (``kbv.child.zygote``) does once it has become a worker."""
    global _ROLE, _WARM_PROBES
    from kbv.child import confine as _confine
    from kbv.child import guard as _guard
    from kbv.processes import harden_process

    _confine.from_environment()  # a candidate's Landlock and seccomp (already on where forked), first
    _guard.install()  # subreaper for the candidate's orphans; exit at once when the parent dies
    harden_process()  # another worker (a candidate) must not read this one's memory or files
    _register_probes()
    _warm_cpu_kernels()
    _ROLE, _WARM_PROBES = role, warm_probes
    main(fd)


if __name__ == "__main__":
    run(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "", sys.argv[3:4] == ["probes"])
