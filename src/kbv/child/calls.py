"""The call probe: what of the candidate's own code ran during one forward, on any device.

A candidate may build or name a kernel and still return PyTorch's result: a try/except that falls
back when its kernel fails or does not exist, a branch never taken, a custom op never called. The
device profiler sees that on CUDA only; this probe watches the Python level instead, with a profile
hook (``sys.setprofile``: calls into Python and into C functions) and a trace hook limited to the
candidate's own frames (``sys.settrace``: exceptions raised there and caught there). It reports
observations; ``kbv.integrity.dynamic`` (``ghost_kernel``) decides.

Blind spots (docs/integrity-dynamic.md): kernels reached through ctypes or another FFI are not
seen as calls, work on other threads is not traced, and a candidate that inspects
``sys.gettrace()`` can tell that it is being watched (it then has to run its kernel to pass here).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from kbv import inputs as kbv_inputs
from kbv import wire, wire_replies

# Bound before the candidate is imported.
_setprofile = sys.setprofile
_settrace = sys.settrace
_make_inputs = kbv_inputs.make_inputs

#: Operator namespaces that belong to PyTorch itself: a call there is not the candidate's kernel.
BUILTIN_OP_NAMESPACES = frozenset(
    {
        "aten",
        "prims",
        "prim",
        "quantized",
        "_quantized",
        "profiler",
        "c10d",
        "_c10d_functional",
        "_c10d_functional_autograd",
        "inductor",
        "_inductor",
        "mkldnn",
        "mkl",
        "onednn",
        "_caffe2",
        "debugprims",
        "_dtensor",
        "rngprims",
        "higher_order",
        "torchvision",
        "xformers_ops_unused",
    }
)
#: Most entries kept per list in a reply.
_KEEP = 50


def candidate_files() -> set[str]:
    """Source files of the candidate module(s) loaded in this worker (``kbv.child.main`` names them)."""
    files: set[str] = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) if name.startswith("kbv_candidate_") else None
        if path:
            files.update((path, os.path.realpath(path)))
    return files


def extension_modules() -> dict[str, str]:
    """Compiled modules loaded from this worker's private build directory: name -> file."""
    ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR", "")
    found = {}
    for name, module in list(sys.modules.items()):
        path = str(getattr(module, "__file__", "") or "")
        if ext_dir and path.endswith(".so") and path.startswith(ext_dir):
            found[name] = path
    for path in getattr(torch.ops, "loaded_libraries", ()):  # load_inline(is_python_module=False)
        if ext_dir and str(path).startswith(ext_dir):
            found[os.path.basename(str(path))] = str(path)
    return found


def triton_kernels() -> list[str]:
    """Triton kernels (``@triton.jit``, autotuned or not) defined by the candidate's modules."""
    names = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("kbv_candidate_"):
            continue
        for attr, value in list(vars(module).items()):
            if (
                type(value).__name__ in ("JITFunction", "Autotuner", "Heuristics")
                and "triton" in type(value).__module__
            ):
                names.append(attr)
    return names


class CallRecorder:
    """Profile and trace hooks for one call; the lists are what it saw, in first-seen order."""

    def __init__(self, files: set[str], extensions: set[str]) -> None:
        self.files = files
        self.extensions = extensions
        self.functions: list[str] = []
        self.extension_calls: list[str] = []
        self.custom_ops: list[str] = []
        self.triton_launches: list[str] = []
        self.caught: list[dict[str, Any]] = []
        self._raised: dict[int, dict[str, Any]] = {}

    def __enter__(self) -> CallRecorder:
        _settrace(self._trace)
        _setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        _setprofile(None)
        _settrace(None)

    def summary(self) -> dict[str, Any]:
        return {
            "functions": self.functions[:_KEEP],
            "extension_calls": self.extension_calls[:_KEEP],
            "custom_ops": self.custom_ops[:_KEEP],
            "triton_launches": self.triton_launches[:_KEEP],
            "caught": self.caught[:_KEEP],
        }

    @staticmethod
    def _add(target: list[str], name: str) -> None:
        if name not in target:
            target.append(name)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            module = str(getattr(arg, "__module__", "") or "")
            if module.split(".")[0] in self.extensions:
                self._add(self.extension_calls, f"{module}.{getattr(arg, '__name__', '?')}")
        elif event == "call":
            self._python_call(frame)

    def _python_call(self, frame: Any) -> None:
        code = frame.f_code
        path = code.co_filename
        if path in self.files:
            self._add(self.functions, getattr(code, "co_qualname", code.co_name))
        elif code.co_name == "__call__" and path.endswith(os.path.join("torch", "_ops.py")):
            op = frame.f_locals.get("self")
            name = str(getattr(op, "_qualified_op_name", None) or getattr(op, "_name", None) or "")
            if "::" in name and name.split("::")[0] not in BUILTIN_OP_NAMESPACES:
                self._add(self.custom_ops, name)
        elif code.co_name == "run" and path.endswith(os.path.join("triton", "runtime", "jit.py")):
            fn = getattr(frame.f_locals.get("self"), "fn", None)
            self._add(self.triton_launches, str(getattr(fn, "__name__", "?")))

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        """Global trace hook: trace only the candidate's own frames, where a fallback is written."""
        if event == "call" and frame.f_code.co_filename in self.files:
            return self._local
        return None

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        key = id(frame)
        if event == "exception":
            exc_type, exc, _ = arg
            self._raised[key] = {
                "type": getattr(exc_type, "__name__", "?"),
                "message": str(exc)[:200],
                "line": frame.f_lineno,
                "function": getattr(frame.f_code, "co_qualname", frame.f_code.co_name),
            }
        elif event == "line" and key in self._raised:
            self.caught.append(self._raised.pop(key))  # execution went on in this frame: it was caught here
        elif event == "return":
            self._raised.pop(key, None)
        return self._local


def probe_calls(state: Any, request: wire.ProbeCalls) -> wire_replies.ProbeCallsReply:
    """One forward on a fresh draw with the call recorder on: what ran, what was built, what was caught."""
    spec = request.inputs
    args = _make_inputs(
        state.problem,
        spec["distribution"],
        int(spec["seed"]),
        state.device,
        precision="fp32",
        domain=state.domain,
        cast=getattr(state, "precision", "fp32"),
    )
    extensions = extension_modules()
    recorder = CallRecorder(candidate_files(), set(extensions))
    with torch.no_grad(), recorder:
        state.model(*args)
    if state.device.type == "cuda":
        torch.cuda.synchronize()
    return wire_replies.ProbeCallsReply(
        built={"extensions": sorted(extensions), "triton_kernels": triton_kernels()},
        ran=recorder.summary(),
    )


HANDLERS = {"probe_calls": probe_calls}
