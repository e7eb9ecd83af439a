"""Static checks of work hidden from the timer: side streams, streams assembled by C++ token
pasting, and CUDA graphs."""

from __future__ import annotations

import re

from kbv.integrity import _cpp
from kbv.integrity._pyast import under
from kbv.integrity._registry import register_check
from kbv.integrity.static._common import StaticContext, _last, _Report
from kbv.records import Finding

# ---------------------------------------------------------------------------------------- streams
_STREAM_CLASSES = {"Stream", "ExternalStream", "StreamContext"}
_TORCH_STREAM_FUNCS = {"stream", "set_stream", "_set_stream_by_id", "get_stream_from_external"}
_CPP_STREAM = re.compile(
    r"\b(?:cudaStreamCreate\w*|cuStreamCreate\w*|hipStreamCreate\w*|getStreamFromPool|getStreamFromExternal"
    r"|setCurrentCUDAStream|cudaStreamNonBlocking|cudaStreamPerThread|CU_STREAM_NON_BLOCKING"
    r"|cudaStreamCreateWithPriority)\b"
)
_CPP_CUBLAS_STREAM = re.compile(r"\bcublas(?:Lt)?SetStream(?:_v2)?\s*\(([^;]*)\)")
_CURRENT_STREAM = re.compile(r"getCurrentCUDAStream|getCurrentStream|getDefaultCUDAStream|current_stream")


@register_check(
    name="side_stream",
    kind="static",
    default_severity="fail",
    doc="""Work placed on a CUDA stream other than the current one: torch.cuda.Stream/ExternalStream,
    torch.cuda.stream(...) contexts, torch.cuda.set_stream, other libraries' Stream objects; in
    C++ cudaStreamCreate*, getStreamFromPool, cudaStreamNonBlocking, cudaStreamPerThread, and
    cublasSetStream with anything but the current stream. The harness's end event is recorded on the
    current stream, so work on a side stream is not timed. It cannot see a stream obtained through
    an opaque library or raw driver calls (ctypes is flagged by introspection); the parent's
    device-wide wall clock catches those.""",
)
def check_side_stream(ctx: StaticContext) -> list[Finding]:
    rep = _Report("side_stream", ctx)
    for qual, node in [*((q, n) for n, q in ctx.references), *ctx.imports]:
        last = _last(qual)
        if ("." in qual and last in _STREAM_CLASSES) or (
            under(qual, "torch") and last in _TORCH_STREAM_FUNCS
        ):
            rep.py(node, f"{qual} puts work on a stream the harness does not time")
    rep.cpp_pattern(_CPP_STREAM, "{match} creates or selects a non-current stream")
    for source in ctx.cpp:
        for line, text, match in _cpp.search(source, _CPP_CUBLAS_STREAM):
            if not _CURRENT_STREAM.search(match.group(1)):
                rep.cpp(source, line, text, "cuBLAS bound to a stream that is not the current one")
    return rep.findings


# Names whose assembly by token pasting is an evasion (the pieces are searched for separately).
_PASTE_TARGETS = (
    "cudaStreamCreate",
    "cudaStreamCreateWithFlags",
    "cudaStreamCreateWithPriority",
    "cuStreamCreate",
    "getStreamFromPool",
    "getStreamFromExternal",
    "setCurrentCUDAStream",
    "cudaStreamNonBlocking",
    "cudaStreamPerThread",
    "cublasSetStream",
    "cublasSetStream_v2",
    "cudaGraphLaunch",
    "cudaLaunchHostFunc",
    "cudaStreamBeginCapture",
    "pthread_create",
    "dlopen",
    "dlsym",
    "popen",
    "system",
    "fork",
    "thread",
    "PyRun_SimpleString",
    "PyEval_GetFrame",
    "fopen",
    "socket",
)
_IDENT = re.compile(r"[A-Za-z_]\w*")
_PASTE = re.compile(r"##")


@register_check(
    name="cpp_token_pasting",
    kind="static",
    default_severity="fail",
    doc="""Preprocessor token pasting (##) in embedded C++/CUDA whose pieces can assemble a name that
    other checks look for (cudaSt ## reamCreate, dl ## sym, ...): fail. Token pasting whose pieces
    assemble no such name is reported as info. The check reasons about identifier pieces present in
    the source; names assembled through several macro layers from single characters are not
    reconstructed.""",
)
def check_token_pasting(ctx: StaticContext) -> list[Finding]:
    rep = _Report("cpp_token_pasting", ctx)
    for source in ctx.cpp:
        hits = list(_cpp.search(source, _PASTE))
        if not hits:
            continue
        pieces = set(_IDENT.findall(_cpp.strip_comments(source.text)))
        assembled = sorted(
            name for name in _PASTE_TARGETS if name not in pieces and _assemblable(name, pieces)
        )
        for line, text, _ in hits:
            if assembled:
                rep.cpp(source, line, text, f"token pasting can assemble {', '.join(assembled)}")
            else:
                rep.cpp(source, line, text, "token pasting (assembles no known dangerous name)", "info")
    return rep.findings


def _assemblable(name: str, pieces: set[str]) -> bool:
    n = len(name)
    for i in range(2, n - 1):
        if name[:i] in pieces and name[i:] in pieces:
            return True
        for j in range(i + 2, n - 1):
            if name[:i] in pieces and name[i:j] in pieces and name[j:] in pieces:
                return True
    return False


# ---------------------------------------------------------------------------------------- graphs
_CPP_GRAPH = re.compile(
    r"\b(?:cudaGraph\w*|cuGraph\w*|cudaStreamBeginCapture\w*|cudaStreamEndCapture|CUDAGraph)\b"
)


@register_check(
    name="cuda_graph",
    kind="static",
    default_severity="warn",
    doc="""CUDA graph capture and replay: torch.cuda.graph, CUDAGraph, make_graphed_callables,
    torch.compile with mode reduce-overhead/max-autotune; in C++ cudaGraph*/cudaStreamBeginCapture.
    Replaying a captured graph removes launch overhead the baseline pays and can replay stale inputs
    captured once. Reported so timings can be compared fairly. It cannot see graphs captured by a
    library on the candidate's behalf.""",
)
def check_cuda_graph(ctx: StaticContext) -> list[Finding]:
    rep = _Report("cuda_graph", ctx)
    a = ctx.analysis
    if a is not None:
        for qual, node in [*((q, n) for n, q in ctx.references), *ctx.imports]:
            if under(qual, "torch.cuda") and _last(qual) in {
                "graph",
                "CUDAGraph",
                "make_graphed_callables",
                "graph_pool_handle",
                "graphs",
            }:
                rep.py(node, f"uses {qual}")
        for call, func in a.calls():
            if func == "torch.compile":
                mode = next((a.fold(k.value) for k in call.keywords if k.arg == "mode"), None)
                if mode in ("reduce-overhead", "max-autotune"):
                    rep.py(call, f"torch.compile mode {mode!r} replays CUDA graphs")
    rep.cpp_pattern(_CPP_GRAPH, "{match}: CUDA graph capture or replay")
    return rep.findings
