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
import importlib.metadata
import importlib.util
import os
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kbv import channel as _channel
from kbv import handoff as _handoff
from kbv import inputs as kbv_inputs
from kbv import sketch as _sketch
from kbv import telemetry, wire, wire_replies
from kbv.child import construct as _construct_state
from kbv.child import timing as kbv_timing
from kbv.child.forward import (
    NoModelNew,
    _as_outputs,
    _classify,
    _constructor,
    _forward_recording,
    _make_inputs,
    _message,
    _model_for,
    _set_precision_flags,
    _State,
    _Steps,
    _type_names,
)
from kbv.child.timed import _identities, _time
from kbv.child.truth import _expected, _truth_sketches
from kbv.problems._loader import load_source


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    state = _State()
    facts = _environment_facts()
    with contextlib.suppress(ImportError):
        from kbv.child import probes as _probes  # type: ignore[attr-defined,unused-ignore]

        # what booting imported (the profiler may import Triton) is not the candidate's
        _probes.note_boot_modules()
    hello = wire_replies.Hello(pid=os.getpid(), **facts)
    _channel.send(sock, {"op": hello.op, **hello.to_json()})
    while True:
        message = _channel.receive(sock)
        try:
            envelope = wire.Envelope.from_json(message)
        except wire.WireError as exc:  # nothing of a malformed request runs; the parent raises on it
            error = {"kind": wire.MALFORMED, "message": str(exc)}
            _channel.send(sock, {"ok": False, "id": wire.reply_id(message), "error": error})
            continue
        request = envelope.request
        if isinstance(request, wire.Exit):
            _channel.send(sock, {"ok": True, "id": envelope.id, **wire_replies.ExitReply().to_json()})
            break
        started = time.perf_counter()
        _reset_device_peak()
        _handoff.release(state.handed)  # the parent copied what it was handed before this request
        if not isinstance(request, (wire.Time, wire.TruthSketches)):  # the timing phase's keep its sets
            state.timing_inputs = None
        try:
            if state.before_next is not None:
                pending, state.before_next = state.before_next, None
                pending()
            reply: dict[str, Any] = {"ok": True, **_HANDLERS[request.op](state, request).to_json()}
        except BaseException as exc:  # the candidate failed: report it, the parent decides
            reply = {"ok": False, "error": _describe_error(exc, op=request.op)}
        reply["id"] = envelope.id  # the parent checks it: a reply read for another request is refused
        reply["worker_seconds"] = time.perf_counter() - started
        if _gpu_in_use():
            reply["device_reserved_peak"] = int(torch.cuda.max_memory_reserved())
        _release_cached_memory(request.memory)
        if request.steps:  # a profiling run asked where the request's time went
            steps = reply["steps_s"] = reply.get("steps_s") or {}
            steps["release"] = time.perf_counter() - started - reply["worker_seconds"]
        sent = state.handed + state.inbox if isinstance(request, wire.Inbox) else state.handed
        _channel.send(sock, reply, fds=_handoff.fds_to_send(sent))
        if not reply["ok"] and reply["error"]["kind"] == "cuda_error":
            break  # the CUDA context is unusable now; this process must not be reused
    sock.close()


#: The role this process was started for (argv), known before the first request names it, and
#: whether it takes the probes' first-use costs while booting (argv "probes": ``WorkerSpec.warm_probes``).
_ROLE = ""
_WARM_PROBES = False


def _gpu_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _reset_device_peak() -> None:
    """Start the allocator's peak afresh for a request, where this worker uses a GPU (a request that
    is the first to use it starts from nothing): the parent reads the reference's peak to know what
    it held beside a candidate that ran out of memory (its working memory is handed back before the
    reply, so NVML no longer shows it then)."""
    if _gpu_in_use():
        torch.cuda.reset_peak_memory_stats()


def _release_cached_memory(rule: wire.MemoryRule | None) -> None:
    """Hand back what the allocator keeps cached unless the parent's rule (``kbv.worker.MemoryBudget``)
    lets this worker keep it: up to ``cached_bytes_kept``, more only while the device has
    ``room_bytes`` free beside it. Without a rule, everything goes back."""
    if not _gpu_in_use():
        return
    kept = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if kept <= (rule.cached_bytes_kept if rule is not None else 0):
        return
    room = rule.room_bytes if rule is not None else None
    if room is not None and torch.cuda.mem_get_info()[0] >= max(kept, room):
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


def _load(state: _State, request: wire.Load) -> wire_replies.LoadReply:
    state.device = torch.device(request.device)
    state.role = request.role
    state.domain = request.domain
    state.structure = request.structure
    state.precision = request.precision or "fp32"
    if request.handoff in _handoff.TRANSPORTS:
        state.handoff = request.handoff
    label = request.problem_name if request.problem_name is not None else "(its text)"
    state.problem = load_source(request.problem_source, sizes=request.sizes, label=label)
    # Captured before any candidate code runs, so later patching cannot reach these references.
    state.timer = kbv_timing.make_timer(state.device)
    state.identities = kbv_timing.snapshot_identities()
    if state.role == "candidate":
        state.model_cls = _import_candidate(Path(str(request.candidate_path)))
    else:
        state.model_cls = state.problem.Model
    _build(state, wire.Build(init_seed=request.init_seed))
    return wire_replies.LoadReply(parameters=_parameter_shapes(state.model))


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


def _build(state: _State, request: wire.Build) -> wire_replies.BuildReply:
    """Construct the model under a seed, with the parameters the parent sends (a file, or the
    inbox on a GPU) given to it while ``__init__`` runs (``kbv.child.construct``)."""
    state.init_seed = request.init_seed
    state.model = state.model_fp64 = state.model_compiled = None  # its memory free for the new one
    if request.state_path:
        loaded = torch.load(request.state_path, map_location=state.device, weights_only=True)
        parameters = _construct(state, loaded)
    elif request.state_inbox is not None:
        try:
            given = _handoff.inbox_tensors(state.inbox, request.state_inbox, state.device)
            parameters = _construct(state, given)
            torch.cuda.synchronize(state.device)  # the copies are done before the inbox goes
        finally:
            _handoff.release(state.inbox)
    else:
        parameters = _construct(state, None)
    return wire_replies.BuildReply(parameters=parameters)


def _construct(state: _State, given: dict[str, torch.Tensor] | None) -> str:
    """``state.model`` built under ``state.init_seed``; with ``given``, holding those values from
    the moment ``__init__`` registers them, so what ``__init__`` derives from its parameters (a
    transposed weight, a folded BatchNorm) is derived from them. Returns how the parameters came:
    ``matched_seed`` (the seed's own), ``state_dict`` (given during construction) or
    ``state_dict_after_init`` (this model's construction could not take them: loaded afterwards,
    as a state dict always was before)."""
    construct = _constructor(state)
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


def _inbox(state: _State, request: wire.Inbox) -> wire_replies.InboxReply:
    """An empty allocation of ``nbytes`` for the parent to write a model's parameters into (CUDA
    only); the next ``build`` with ``state_inbox`` reads it. The parent never shares its memory."""
    _handoff.release(state.inbox)
    inbox = _handoff.open_inbox(request.nbytes, state.device, state.handoff, state.inbox)
    return wire_replies.InboxReply(inbox=inbox)


def _parameter_shapes(model: Any) -> dict[str, list[int]]:
    """Names and shapes of the model's state, so the parent can tell whether a state dict fits."""
    if not isinstance(model, torch.nn.Module):
        return {}
    return {name: list(value.shape) for name, value in model.state_dict().items()}


def _redraw(state: _State, request: wire.Redraw) -> wire_replies.RedrawReply:
    """Reference workers only: new parameter values for a distribution, saved for the candidate, or
    (``hand_over``, on a GPU) handed to the parent on the device with their names."""
    if state.role != "reference":
        raise PermissionError("only a reference worker redraws parameters")
    new_state = kbv_inputs.redraw_parameters(state.model, request.distribution, request.seed)
    # Built again with them, as the candidate is: what the problem's __init__ derives is theirs.
    state.model = state.model_fp64 = state.model_compiled = None
    _construct(state, new_state)
    if request.hand_over:
        named = state.model.state_dict()
        values = [_handoff.plain_copy(v, state.device, copy=False) for v in named.values()]
        return wire_replies.RedrawReply(
            names=list(named),
            outputs=_handoff.hand_over(values, state.device, request.out_path, state.handed, state.handoff),
        )
    full = {k: v.detach().cpu() for k, v in state.model.state_dict().items()}
    torch.save(full, request.out_path)
    return wire_replies.RedrawReply(n_tensors=len(full))


def _run(state: _State, request: wire.Run) -> wire_replies.RunReply:
    precision = request.precision
    _set_precision_flags(precision)
    steps = _Steps(request.steps, state.device.type == "cuda")
    args = _make_inputs(state, request.distribution, request.seed, precision, request.mix_seed)
    steps.mark("inputs")
    model = _model_for(state, precision)
    memory = _memory_before(state) if request.measure_memory else None
    # Only a trusted worker's account of its own operators is asked for (and believed).
    recording = request.record_operators and state.role == "reference"
    with torch.no_grad():
        outputs, operators = _forward_recording(model, args) if recording else (model(*args), None)
    outputs = _as_outputs(outputs)
    if state.device.type == "cuda":
        torch.cuda.synchronize()
    steps.mark("forward")
    if memory is not None:
        memory = _memory_after(state, memory)
    types = _type_names(outputs)
    # A trusted reference's outputs are handed over as they are; a candidate's are copied first,
    # unless the hand-over is itself a copy (exported memory): a clone then export held 3 outputs.
    copy = state.role == "candidate" and not _handoff.hand_over_copies(state.device, state.handoff)
    copies = [_handoff.plain_copy(o, state.device, copy=copy) for o in outputs]
    del args, outputs
    steps.mark("copy")
    handed = _handoff.hand_over(copies, state.device, request.out_path, state.handed, state.handoff)
    steps.mark("hand_over")
    return wire_replies.RunReply(
        types=types, memory=memory, outputs=handed, tf32_operators=operators, steps_s=steps.taken()
    )


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


def _release(state: _State, request: wire.Release) -> wire_replies.ReleaseReply:
    """Nothing beyond what the request loop does around every request (the hand-over let go before
    it, the memory rule after it)."""
    return wire_replies.ReleaseReply()


_HANDLERS: dict[str, Callable[[_State, Any], wire_replies.Reply]] = {
    "release": _release,
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
