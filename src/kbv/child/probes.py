"""Integrity probes: extra worker requests that report raw observations, never verdicts.

``kbv.child.main`` merges :data:`HANDLERS` into its request table at start-up, before any
candidate code is imported. Each probe runs the loaded model in a controlled way and reports what it
saw (checksums, storage ranges, thread and process counts, numeric flags, outputs handed over).
The trusted parent (``kbv.integrity.dynamic``) compares those observations with the reference
worker's and decides. A hostile candidate shares this process and could falsify any of it; that is
why every verdict that matters re-checks outputs against the reference in the parent, and why the
functions this module depends on are bound here, at import time, before the candidate exists.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from typing import Any

import torch

from kbv import handoff as _handoff
from kbv import inputs as kbv_inputs
from kbv import wire, wire_replies
from kbv._staged_handoff import Staged
from kbv.child import timing as kbv_timing
from kbv.child.poison import poison_freed_memory

# Bound before the candidate is imported, so a later monkey-patch of these names does not reach us.
_active_count = threading.active_count
_settrace_threads = threading.setprofile
_listdir = os.listdir
_getpid = os.getpid
_sleep = time.sleep
_monotonic = time.monotonic
_make_draw = kbv_inputs.make_draw
_verify_identities = kbv_timing.verify_identities
_plain_copy = _handoff.plain_copy
_hand_over = _handoff.hand_over
_spin_kernel = getattr(torch.cuda, "_sleep", None)
#: Elements per chunk of the on-device input digest (bounds its temporary memory).
_DIGEST_CHUNK = 1 << 25


def numeric_flags() -> dict[str, Any]:
    """The global switches that change numerics (TF32, cuDNN autotuning, determinism, default dtype)."""
    return {
        "cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cuda.matmul.allow_fp16_reduced_precision_reduction": bool(
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "cudnn.benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn.deterministic": bool(torch.backends.cudnn.deterministic),
        "float32_matmul_precision": str(torch.get_float32_matmul_precision()),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
    }


#: Taken when the worker starts, before the problem or the candidate is imported.
FLAGS_AT_START = numeric_flags()


def _str_attr(obj: Any, name: str) -> str:
    """``obj.<name>`` when it is a string, else "": a class may hold anything there (seen on the H200:
    a descriptor object as a type's ``__module__`` made this probe raise on an honest kernel, and the
    candidate was failed for kbv's own error)."""
    try:
        value = getattr(obj, name, "")
    except Exception:  # a property of the candidate's that raises is not the harness's failure
        return ""
    return value if isinstance(value, str) else ""


def _harness_functions() -> dict[str, Any]:
    """Every function and class of the kbv modules loaded in this worker (and of its __main__)."""
    found: dict[str, Any] = {}
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == "kbv" or mod_name.startswith("kbv.") or mod_name == "__main__"):
            continue
        if mod_name == "__main__" and "kbv" not in str(getattr(module, "__file__", "")):
            continue
        for name, obj in list(vars(module).items()):
            if callable(obj) and _str_attr(obj, "__module__").startswith(("kbv", "__main__")):
                found[f"{mod_name}.{name}"] = obj
    return found


_HARNESS_AT_START = {name: id(obj) for name, obj in _harness_functions().items()}
_HARNESS_PINNED = list(_harness_functions().values())  # keeps ids from being reused


def harness_changes() -> list[str]:
    """kbv functions replaced or removed since the worker started (before the candidate existed)."""
    now = {name: id(obj) for name, obj in _harness_functions().items()}
    return sorted(name for name, ident in _HARNESS_AT_START.items() if now.get(name) != ident)


# ------------------------------------------------------------------------------------------------
# Small helpers


def _probe_inputs(state: Any, spec: dict[str, Any], precision: str = "fp32") -> list[Any]:
    """Inputs for a probe: one seeded draw, or a mix of two draws (``mix_seed``).

    The mix keeps draw A at the positions a value-sample cache key most likely reads (the first and
    last 64 elements and the middle one of every tensor) and draw B everywhere else.
    """
    mix = spec.get("mix_seed")
    return _make_draw(
        state.problem,
        spec["distribution"],
        int(spec["seed"]),
        state.device,
        precision="fp64" if precision == "fp64" else "fp32",
        domain=state.domain,
        structure=getattr(state, "structure", None),
        mix_seed=None if mix is None else int(mix),
        cast=getattr(state, "precision", "fp32"),
    )


def _as_outputs(result: Any) -> list[Any]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _snapshot(state: Any, value: Any) -> Any:
    """A plain copy of an output on the worker's device, safe to hand to the parent (a subclass is
    stripped)."""
    return _plain_copy(value, state.device)


def _hand(state: Any, out_path: str | None, groups: list[list[Any]]) -> dict[str, Any]:
    """Hand several output lists to the parent at once: ``sizes`` says how to split them again."""
    flat = [value for group in groups for value in group]
    return {
        "sizes": [len(g) for g in groups],
        "outputs": _hand_over(flat, state.device, str(out_path), state.handed, state.handoff),
    }


def _staged(state: Any, out_path: str | None) -> Staged:
    """Output lists handed over call by call (:class:`kbv._staged_handoff.Staged`), in one reply."""
    return Staged(state.device, str(out_path), state.handed, state.handoff)


def _sync(state: Any) -> None:
    if state.device.type == "cuda":
        torch.cuda.synchronize()


def _forward(state: Any, args: list[Any]) -> list[Any]:
    with torch.no_grad():
        outputs = _as_outputs(state.model(*args))
    _sync(state)
    return outputs


def _checksum(value: Any) -> dict[str, Any] | None:
    """Sum (float64) and a digest of every bit of an input, computed where the input lives (no host
    copy of a multi-gigabyte input): 32-bit words weighted by position and summed in int64, which
    wraps; any change of a word changes the digest unless it cancels another exactly."""
    if not isinstance(value, torch.Tensor):
        return None
    data = value.detach()
    if type(data) is not torch.Tensor:
        data = data.as_subclass(torch.Tensor)
    data = data.contiguous().reshape(-1)
    if not data.numel():
        return {"sum": 0.0, "sha": "0"}
    total = _sum_in_float64(data) if data.dtype != torch.bool else float(data.sum())
    raw = data.view(torch.uint8)
    try:
        words = raw.view(torch.int32)
    except RuntimeError:  # a size or offset that is not a whole number of words
        words = raw
    return {"sum": total, "sha": f"{_digest(words) & _WORD64:016x}"}


def _sum_in_float64(data: torch.Tensor) -> float:
    """The sum of a flat tensor accumulated in float64, a chunk of :data:`_DIGEST_CHUNK` elements
    at a time. ``sum(dtype=torch.float64)`` of a float32 tensor converts the whole input first:
    45_Average_Pooling_2D's candidate held a 32 GiB copy of its 16 GiB input for each checksum of
    the observation probe, and its worker went past its 64 GiB on an H100 (2026-12-07)."""
    total = torch.zeros((), dtype=torch.float64, device=data.device)
    for start in range(0, data.numel(), _DIGEST_CHUNK):
        total += data[start : start + _DIGEST_CHUNK].sum(dtype=torch.float64)
    return float(total)


_WORD64 = (1 << 64) - 1
_DIGEST_SALT = 0x9E3779B1
_DIGEST_STRIDE = 2654435761


def _signed64(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64 (what a device int64 holds after wrapping)."""
    x &= _WORD64
    return x - (1 << 64) if x >= 1 << 63 else x


def _digest(words: torch.Tensor) -> int:
    """``sum((w[p] + SALT) * (p * STRIDE + 1))`` over positions ``p``, modulo 2**64.

    Per chunk starting at ``s`` the sum splits into ``sum((w + SALT) * (i * STRIDE + 1))`` over the
    chunk's own positions ``i`` plus ``s * STRIDE * sum(w + SALT)``, so the position weights are made
    once per call and each chunk costs a conversion, a product and two sums (the digest of every
    word made the weights again and added the salt per chunk: 84 ms for a 1e9-element loss's two
    inputs on the H200, twice per observation, in each worker)."""
    n = words.numel()
    length = min(n, _DIGEST_CHUNK)
    weights = torch.arange(length, dtype=torch.int64, device=words.device).mul_(_DIGEST_STRIDE).add_(1)
    digest = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, n, _DIGEST_CHUNK):
        chunk = words[start : start + _DIGEST_CHUNK].to(torch.int64)
        m = chunk.numel()
        # sum(w + SALT) and sum((w + SALT) * weight), the salt's share added as host integers
        plain = chunk.sum() + _signed64(_DIGEST_SALT * m)
        salt_share = _DIGEST_SALT * (m * (m - 1) // 2 * _DIGEST_STRIDE + m)
        weighted = chunk.mul_(weights[:m]).sum() + _signed64(salt_share)
        digest += weighted + plain * _signed64(start * _DIGEST_STRIDE)
    return int(digest)


def _storage_range(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = t.untyped_storage()
        start = storage.data_ptr()
        return (start, start + storage.nbytes()) if storage.nbytes() else None
    except Exception:  # a tensor without real storage (meta, a subclass with no data)
        return None


def _aliasing(outputs: list[Any], args: list[Any]) -> list[list[int]]:
    """Pairs [output index, input index] whose storages overlap."""
    pairs = []
    for i, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            continue
        r_out = _storage_range(out)
        for j, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor) or r_out is None:
                continue
            r_in = _storage_range(arg)
            if r_in is not None and r_out[0] < r_in[1] and r_in[0] < r_out[1]:
                pairs.append([i, j])
    return pairs


def _os_threads() -> int:
    try:
        return len(_listdir("/proc/self/task"))
    except OSError:
        return -1


def _descendants() -> int:
    """Live descendant processes of this worker, from /proc (zombies are not counted)."""
    try:
        entries = [e for e in _listdir("/proc") if e.isdigit()]
    except OSError:
        return -1
    parents: dict[int, int] = {}
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    me, found, frontier = _getpid(), 0, {_getpid()}
    while frontier:
        children = {pid for pid, ppid in parents.items() if ppid in frontier and pid != me}
        found += len(children)
        frontier = children
        for pid in children:
            parents.pop(pid, None)
    return found


def _activity() -> dict[str, int]:
    return {"python_threads": _active_count(), "os_threads": _os_threads(), "processes": _descendants()}


#: Interval between the thread counts that must agree before the observed call's ``before``, and
#: the longest the wait may last (the fixed settle ``verified`` v8 and earlier waited).
SETTLE_STEP_S = 0.005
SETTLE_MAX_S = 0.02


def _settle() -> None:
    """Wait until the thread counts agree across two reads :data:`SETTLE_STEP_S` apart, at most
    :data:`SETTLE_MAX_S`: a thread the warm-up call started may start others after it returned (a
    pool's manager thread), and they belong in ``before``. A thread or native pool started by the call
    itself is counted at once (``Thread.start`` and ``pthread_create`` return once it exists). Each
    sleep releases the GIL, so such a thread gets to run. What fails a call is not taken from this
    count alone: a Python thread the observed call leaves alive is seen at its return
    (``threads_alive_at_return``), and processes are counted from before the warm-up call too. On
    the CPU sample the fixed 20 ms was most of this probe's time in each worker."""
    deadline = _monotonic() + SETTLE_MAX_S
    last = (_active_count(), _os_threads())
    while _monotonic() < deadline:
        _sleep(SETTLE_STEP_S)
        now = (_active_count(), _os_threads())
        if now == last:
            return
        last = now


#: How long a thread started during an observed call is held at its first Python event.
THREAD_HOLD_S = 0.05
_current_thread = threading.current_thread


class _ThreadStarts:
    """Python threads started while installed (``threading.setprofile`` runs in each new thread).

    Each is held for :data:`THREAD_HOLD_S` before its target runs. A call that waits for its threads
    (a pool joined before it returns) then returns after they finished, whatever the scheduler does;
    one that returns without waiting returns while they are still alive, even when its thread would
    otherwise have won the race (``hacks/late_write_thread.py``)."""

    def __init__(self) -> None:
        self.started = 0
        self.threads: list[threading.Thread] = []

    def alive(self) -> int:
        return sum(1 for thread in self.threads if thread.is_alive())

    def __enter__(self) -> _ThreadStarts:
        def hook(frame: Any, event: str, arg: Any) -> None:
            sys.setprofile(None)
            self.started += 1
            self.threads.append(_current_thread())
            _sleep(THREAD_HOLD_S)

        _settrace_threads(hook)
        return self

    def __exit__(self, *exc: object) -> None:
        _settrace_threads(None)


# ------------------------------------------------------------------------------------------------
# Probes


def probe_observe(state: Any, request: wire.ProbeObserve) -> wire_replies.ProbeObserveReply:
    """One forward on a fresh draw, watched: checksums, aliasing, threads, processes, flags.

    Outputs are handed over as two lists: ``[immediately, after delay_s]`` (unless ``hand_outputs`` is
    false: the reference's observation needs none). ``deferred``: only the first list comes back now;
    the look after ``delay_s`` (counted from the same moment) is taken when the next request arrives,
    before it runs anything, and ``probe_observe_late`` hands it over (:func:`probe_observe_late`).
    """
    spec = request.inputs
    args = _probe_inputs(state, spec, request.precision)
    before_first = _activity()  # a process the first call leaves running is not lazy set-up
    _forward(
        state, [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    )  # lazy set-up (a thread pool kept for later calls) is not growth
    _settle()
    before = _activity()
    sums_before = [_checksum(a) for a in args]
    flags_before_call = numeric_flags()
    with _ThreadStarts() as starts:
        with torch.no_grad():
            outputs = _as_outputs(state.model(*args))
        alive_at_return = starts.alive()
        right_after = _activity()
        _sync(state)
        # Copies only where they are handed over: the reference's observation hands none, and its
        # two copies were two outputs more beside the candidate's observation (16 GiB at 8 GiB).
        first = [_snapshot(state, o) for o in outputs] if request.hand_outputs else []
    sums_after = [_checksum(a) for a in args]
    aliasing = _aliasing(outputs, args)
    since = _monotonic()

    def look() -> dict[str, Any]:
        _sleep(max(0.0, float(request.delay_s) - (_monotonic() - since)))
        _sync(state)
        late = [_snapshot(state, o) for o in outputs] if request.hand_outputs else []
        return {"after_delay": _activity(), "late": late}

    def look_for_later() -> None:
        state.late_look = look()

    activity = {"before_first_call": before_first, "before": before, "after": right_after}
    if request.deferred:
        # No request runs before the look (kbv.child.main runs it first): the candidate's next call
        # could otherwise overwrite these very outputs (an honest reuse of its output buffer).
        state.before_next, groups = look_for_later, [first]
    else:
        taken = look()
        activity["after_delay"] = taken["after_delay"]
        groups = [first, taken["late"]]
    return wire_replies.ProbeObserveReply(
        outputs=_hand(state, request.out_path, groups) if request.hand_outputs else None,
        types=[_type_name(o) for o in outputs],
        input_checksums_before=sums_before,
        input_checksums_after=sums_after,
        aliasing=aliasing,
        activity=activity,
        threads_started=starts.started,
        threads_alive_at_return=alive_at_return,
        flags={"start": FLAGS_AT_START, "before_call": flags_before_call, "after_call": numeric_flags()},
        identities_changed=_verify_identities(state.identities) if state.identities else [],
        harness_changed=harness_changes(),
    )


def probe_observe_late(state: Any, request: wire.ProbeObserveLate) -> wire_replies.ProbeObserveLateReply:
    """The look a deferred ``probe_observe`` left for this request (taken before it, at least
    ``delay_s`` after the observed call returned): the outputs then and the activity counts."""
    look, state.late_look = state.late_look, None
    if look is None:
        raise RuntimeError("probe_observe_late: no deferred observation is waiting")
    return wire_replies.ProbeObserveLateReply(
        outputs=_hand(state, request.out_path, [look["late"]]), after_delay=look["after_delay"]
    )


def probe_cache(state: Any, request: wire.ProbeCache) -> wire_replies.ProbeCacheReply:
    """Four calls that a cache keyed on pointers, ids, shapes or value samples answers wrongly.

    0. draw A on fresh buffers; 1. draw B's values copied into A's buffers (same pointers and
    objects, new contents); 2. B's values in new buffers; 3. the A/B mix on fresh buffers (the same
    sampled values as A, different data). ``request.calls`` says which run (1 only beside 0), each
    call's outputs handed over as a list. A candidate's cache meets every request of its process.
    """
    dist, seed_a, seed_b = request.distribution, request.seed_a, request.seed_b
    asked = set(request.calls)
    # Each call's outputs are handed over (copied) as soon as it returns: kept as copies until the
    # fourth call and then exported beside them, they were eight outputs at once.
    staged = _staged(state, request.out_path)
    if 0 in asked:
        args = _probe_inputs(state, {"distribution": dist, "seed": seed_a})
        staged.add(_forward(state, args))
        if 1 in asked:
            _copy_values(_probe_inputs(state, {"distribution": dist, "seed": seed_b}), into=args)
            staged.add(_forward(state, args))
        # Each draw is let go once its calls are done: A, B and the mix held together were 3 inputs
        # more of the candidate's limit (37_FrobeniusNorm_'s 7 GiB input ran out on an 80 GB H100,
        # 2026-12-06). A later draw may reuse A's memory: a pointer-keyed cache is then caught.
        del args
    if 2 in asked:
        # B's own buffers are new to the model (it was only given A's): no clone, which on a problem
        # with a 7 GiB input was 7 GiB more held while the model ran (the H200's 36_RMSNorm_).
        new_values = _probe_inputs(state, {"distribution": dist, "seed": seed_b})
        staged.add(_forward(state, new_values))
        del new_values
    if 3 in asked:
        mixed = _probe_inputs(state, {"distribution": dist, "seed": seed_a, "mix_seed": seed_b})
        staged.add(_forward(state, mixed))
        del mixed
    return wire_replies.ProbeCacheReply(calls=len(staged.sizes), outputs=staged.handed())


def _copy_values(values: list[Any], into: list[Any]) -> None:
    """Each tensor of ``values`` copied into the same place's tensor of ``into`` (same buffers)."""
    with torch.no_grad():
        for target, value in zip(into, values):
            if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
                target.copy_(value)


def probe_poison(state: Any, request: wire.ProbePoison) -> wire_replies.ProbePoisonReply:
    """The same draw twice, each on fresh input buffers after freed memory was poisoned with NaN.

    The outputs are handed over as ``[run 1, run 2]``. Differences between the runs and NaN where the truth is
    finite are for the parent to judge.
    """
    staged = _staged(state, request.out_path)
    for _ in range(2):
        args = _probe_inputs(state, request.inputs)
        poison_freed_memory(state.device, request.output_nbytes or ())
        _sync(state)
        staged.add(_forward(state, args))
        del args
    return wire_replies.ProbePoisonReply(runs=len(staged.sizes), outputs=staged.handed())


def probe_flops(state: Any, request: wire.ProbeFlops) -> wire_replies.ProbeFlopsReply:
    """Reference side: FLOPs of one fp32 forward (FlopCounterMode) and the bytes of inputs and outputs."""
    from torch.utils.flop_counter import FlopCounterMode

    args = _probe_inputs(state, request.inputs)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        outputs = _as_outputs(state.model(*args))
    _sync(state)

    def nbytes(values: list[Any]) -> int:
        return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))

    return wire_replies.ProbeFlopsReply(
        flops=int(counter.get_total_flops()), input_bytes=nbytes(args), output_bytes=nbytes(outputs)
    )


_LIBRARY_MARKERS = (
    "at::",
    "aten",
    "cublas",
    "cutlass",
    "cudnn",
    "gemm",
    "gemv",
    "xmma",
    "nvjet",
    "cub::",
    "Memcpy",
    "Memset",
    "memcpy",
    "memset",
    "splitK",
    "sgemm",
    "void native::",
    "pytorch",
)


#: Cycles of the marker kernel queued on the caller's stream just before the profiled forward
#: (about half a microsecond): the profiler's id of that stream is the marker's.
STREAM_MARK_CYCLES = 1000
#: The marker's kernel name (``torch.cuda._sleep``'s kernel in ATen).
STREAM_MARK_KERNEL = "spin_kernel"


def probe_kernels(state: Any, request: wire.ProbeKernels) -> wire_replies.ProbeKernelsReply:
    """CUDA only: names of the device kernels one forward launched (torch.profiler), the profiler's
    stream id of each and of the stream the forward was called on, and custom code loaded."""
    custom = _custom_code()
    if state.device.type != "cuda":
        return wire_replies.ProbeKernelsReply(available=False, kernels=[], custom_code=custom)
    from torch.profiler import ProfilerActivity, profile

    args = _probe_inputs(state, request.inputs)
    _forward(state, args)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        marked = _mark_stream()
        _forward(state, args)
    kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    current_stream, kernels = _stream_mark(kernels) if marked else (None, kernels)
    names: list[str] = []
    streams: list[list[Any]] = []
    for event in kernels:
        if event.name not in names:
            names.append(event.name)
        entry = [event.name, getattr(event, "device_resource_id", None)]
        if entry not in streams:
            streams.append(entry)
    library = [n for n in names if any(m in n for m in _LIBRARY_MARKERS)]
    return wire_replies.ProbeKernelsReply(
        available=True,
        kernels=names[:200],
        library_kernels=library[:200],
        custom_code=custom,
        current_stream=current_stream,
        kernel_streams=streams[:200],
    )


def _mark_stream() -> bool:
    """Queue the marker kernel on the current stream; False when this torch cannot (the stream
    check then gives no verdict, and the probe's other observations stand)."""
    if _spin_kernel is None:
        return False
    try:
        _spin_kernel(STREAM_MARK_CYCLES)
    except RuntimeError:
        return False
    return True


def _stream_mark(kernels: list[Any]) -> tuple[Any, list[Any]]:
    """The profiler's id of the stream the forward was called on (the earliest marker kernel's;
    None without one, or when the events carry no start time), and the forward's kernels without
    that marker."""
    marks = [e for e in kernels if STREAM_MARK_KERNEL in str(getattr(e, "name", ""))]
    try:
        mark = min(marks, key=lambda e: e.time_range.start) if marks else None
    except (AttributeError, TypeError):  # a profiler without start times: no verdict
        mark = None
    if mark is None:
        return None, kernels
    return getattr(mark, "device_resource_id", None), [e for e in kernels if e is not mark]


#: The modules the worker had loaded when it finished booting (:func:`note_boot_modules`). The
#: boot's profiler warm-up imports Triton in some torch builds; that import is not the candidate's.
_BOOT: dict[str, frozenset[str]] = {}


def note_boot_modules() -> None:
    """Called once, when the worker has booted and before any problem or candidate is loaded."""
    _BOOT["modules"] = frozenset(sys.modules)


def _custom_code() -> list[str]:
    """Modules that look like compiled extensions or Triton kernels loaded into this worker."""
    found = []
    ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR", "")
    for name, module in list(sys.modules.items()):
        path = str(getattr(module, "__file__", "") or "")
        if path.endswith(".so") and ext_dir and path.startswith(ext_dir):
            found.append(name)
    if "triton" in sys.modules and (_imported_since_boot("triton") or _uses_triton_since_boot()):
        found.append("triton")
    return found


def _imported_since_boot(name: str) -> bool:
    return name not in _BOOT.get("modules", frozenset())


def _uses_triton_since_boot() -> bool:
    """A module loaded after boot (the candidate's, or one it imported) holds Triton: the module
    itself, ``triton.language``, or a kernel (a ``JITFunction``, an autotuner)."""
    for name, module in list(sys.modules.items()):
        if not _imported_since_boot(name) or name.startswith("triton"):
            continue
        for value in list(getattr(module, "__dict__", {}).values()):
            owner = _str_attr(value, "__name__") if isinstance(value, types.ModuleType) else ""
            owner = owner or _str_attr(type(value), "__module__")
            if owner == "triton" or owner.startswith("triton."):
                return True
    return False


def _frozen(handlers: dict[str, Any]) -> dict[str, Any]:
    """Copies of the probes whose global names resolve in a private copy of this module's namespace.

    A candidate that rebinds ``kbv.child.probes._checksum`` (or any helper here) after import
    changes the module, not the copies the worker calls. It could still reach the copies through
    ``gc``; nothing in-process is safe from a determined candidate, which is why verdicts on outputs
    are made in the parent.
    """
    namespace = dict(globals())
    for name, obj in list(namespace.items()):
        if isinstance(obj, types.FunctionType) and obj.__module__ == __name__:
            namespace[name] = types.FunctionType(
                obj.__code__, namespace, obj.__name__, obj.__defaults__, obj.__closure__
            )
    return {op: namespace[fn.__name__] for op, fn in handlers.items()}


HANDLERS = _frozen(
    {
        "probe_observe": probe_observe,
        "probe_observe_late": probe_observe_late,
        "probe_cache": probe_cache,
        "probe_poison": probe_poison,
        "probe_flops": probe_flops,
        "probe_kernels": probe_kernels,
    }
)
