"""Static checks of reaching outside the kernel: parse failures, threads and processes, harness
tampering, introspection, files and network, and code run from strings."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from kbv.integrity._pyast import Analysis, under
from kbv.integrity._registry import get_check, register_check
from kbv.integrity.static._common import StaticContext, _last, _module_hits, _Report
from kbv.records import Finding


# ---------------------------------------------------------------------------------------- parse
@register_check(
    name="parse_error",
    kind="static",
    default_severity="warn",
    doc="""The candidate's Python source could not be parsed by the evaluating interpreter, so the
    Python-level checks saw nothing; the whole file is still scanned with the C++/CUDA patterns.
    The candidate will most likely fail to import as well.""",
)
def check_parse_error(ctx: StaticContext) -> list[Finding]:
    if ctx.parse_error is None:
        return []
    return [Finding("parse_error", get_check("parse_error").default_severity, ctx.parse_error)]


# ---------------------------------------------------------------------------------------- threads
#: Threads and executors: host parallelism, honest when the call waits for them (a joined pool).
_THREAD_MODULES = (
    "threading",
    "_thread",
    "concurrent.futures",
    "sched",
    "asyncio.to_thread",
    "torch.jit.fork",
    "torch.jit._fork",
)
#: Processes: a kernel needs none of its own (compilers started by load_inline or Triton do not
#: appear in the candidate's source); a helper process is work beside or after the call.
_PROCESS_MODULES = (
    "multiprocessing",
    "subprocess",
    "torch.multiprocessing",
    "pty",
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.popen",
    "os.posix_spawn",
    "os.posix_spawnp",
    "os.register_at_fork",
    "os.spawnl",
    "os.spawnle",
    "os.spawnlp",
    "os.spawnv",
    "os.spawnve",
    "os.spawnvp",
    "os.execv",
    "os.execve",
    "os.execl",
    "os.execlp",
    "os.execvp",
    "asyncio.create_subprocess_exec",
    "asyncio.create_subprocess_shell",
    "joblib",
    "dask",
    "ray",
    "concurrent.futures.ProcessPoolExecutor",
)
_CPP_THREADS = re.compile(
    r"\bstd::(?:thread|jthread|async)\b|\bpthread_create\b"
    r"|\bcudaLaunchHostFunc\b|\bcudaStreamAddCallback\b|\bcuLaunchHostFunc\b"
)
_CPP_PROCESSES = re.compile(
    r"\bfork\s*\(|\bvfork\s*\(|\bpopen\s*\(|\bsystem\s*\(|\bexecv?[lpe]*\s*\(|\bposix_spawnp?\s*\("
)
#: Ending or signalling a process, and signal handlers or timers: nothing a kernel does needs them.
_PROCESS_CONTROL = (
    "os.kill",
    "os.killpg",
    "os._exit",
    "os.abort",
    "os.pidfd_open",
    "signal.signal",
    "signal.alarm",
    "signal.setitimer",
    "signal.pthread_kill",
    "signal.raise_signal",
    "signal.pidfd_send_signal",
)
_CPP_PROCESS_CONTROL = re.compile(
    r"\b(?:kill|killpg|tgkill|_exit|_Exit|quick_exit|sigaction|alarm|setitimer|pidfd_send_signal)\s*\("
    r"|\bsignal\s*\(\s*SIG"
)


@register_check(
    name="threads_processes",
    kind="static",
    default_severity="fail",
    doc="""Threads, executors and host callbacks (Python threading, concurrent.futures thread pools,
    asyncio.to_thread, torch.jit.fork; C++ std::thread/async, pthread_create, cudaLaunchHostFunc)
    are warnings: a pool whose threads are joined before the call returns (a C++ row sum on
    std::threads) is ordinary host parallelism, and the evidence that a thread finishes the work
    after the timer stopped is behaviour, which the dynamic background_work check fails (a thread
    still running when the call returned, outputs that change afterwards). Processes fail
    (multiprocessing, subprocess, process pools, os.fork/system/popen/spawn*/exec*, joblib/dask/ray;
    C++ fork, popen, system, exec*, posix_spawn): a candidate needs no process of its own, the
    compilers that load_inline and Triton start never appear in its source, and a helper process is
    work done beside or after the timed call. Imports are flagged too, through aliases and
    __import__ of folded strings. It cannot see threads or processes created by a third-party
    library the candidate calls; the dynamic thread and process counts cover those.""",
)
def check_threads(ctx: StaticContext) -> list[Finding]:
    rep = _Report("threads_processes", ctx)
    if ctx.analysis is not None:
        for node, qual in _module_hits(ctx, _PROCESS_MODULES):
            rep.py(node, f"uses {qual}: a process of its own, working beside or after the call")
        for node, qual in _module_hits(ctx, _THREAD_MODULES, allowed=_PROCESS_MODULES):
            rep.py(node, f"uses {qual}: fine if the call waits for its threads", "warn")
        for call, _ in ctx.analysis.calls():
            if isinstance(call.func, ast.Attribute) and call.func.attr == "run_in_executor":
                rep.py(call, "runs work in an executor", "warn")
    rep.cpp_pattern(_CPP_PROCESSES, "{match} starts a process")
    rep.cpp_pattern(
        _CPP_THREADS, "{match} runs host work concurrently: fine if joined before returning", "warn"
    )
    return rep.findings


@register_check(
    name="process_control",
    kind="static",
    default_severity="fail",
    doc="""Ending or signalling a process, or installing signal handlers and timers: os.kill/killpg,
    os._exit, os.abort, signal.signal/alarm/setitimer/pthread_kill/raise_signal; in C++ kill, _exit,
    quick_exit, sigaction, signal(SIG...), alarm, setitimer. No kernel needs them: they end the worker
    early after printing a fake result, stop or signal the harness's other processes, or interrupt
    the timer. Reading process facts (os.getpid, os.cpu_count, os.environ) is not flagged. It cannot
    see a signal sent from a precompiled binary; containment of the worker covers those.""",
)
def check_process_control(ctx: StaticContext) -> list[Finding]:
    rep = _Report("process_control", ctx)
    if ctx.analysis is not None:
        for node, qual in _module_hits(ctx, _PROCESS_CONTROL):
            rep.py(node, f"uses {qual}: ends or signals a process, or interrupts one")
    rep.cpp_pattern(_CPP_PROCESS_CONTROL, "{match} ends or signals a process")
    return rep.findings


# ---------------------------------------------------------------------------------------- tampering
_PROTECTED = (
    "torch",
    "time",
    "builtins",
    "kbv",
    "sys",
    "timeit",
    "triton.testing",
    "importlib",
    "os",
    "gc",
    "numpy",
    "math",
)
_SETTINGS_OK = ("torch.backends", "torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
_DICT_MUTATORS = {"update", "__setitem__", "setdefault", "pop", "popitem", "clear", "__delitem__"}


@register_check(
    name="harness_tampering",
    kind="static",
    default_severity="fail",
    doc="""Changes to modules the harness relies on: assignments (also augmented, del, setattr,
    object.__setattr__, __dict__ / vars() / sys.modules writes, mock.patch) to attributes of torch,
    time, builtins, sys, os, kbv and friends (torch.allclose = ..., time.perf_counter = ...,
    torch.cuda.Event = ..., torch.Tensor methods), and any import of kbv. Setting torch.backends and
    compiler config flags is not tampering (precision flags are reported by precision_cast). It
    cannot see tampering done from a compiled extension or through ctypes (flagged by
    introspection); the harness also snapshots its timing functions before loading candidates.""",
)
def check_harness_tampering(ctx: StaticContext) -> list[Finding]:
    rep = _Report("harness_tampering", ctx)
    a = ctx.analysis
    if a is None:
        return []
    for name, node in ctx.imports:
        if under(name, "kbv"):
            rep.py(node, f"imports the harness package {name}")
    for node in ast.walk(a.tree):
        for target in _store_targets(node):
            hit = _tampered(a, target)
            if hit:
                rep.py(target, f"modifies {hit}")
        if isinstance(node, ast.Call):
            hit = _tampering_call(a, node)
            if hit:
                rep.py(node, hit)
    return rep.findings


def _store_targets(node: ast.AST) -> Iterator[ast.expr]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    stack = targets
    while stack:
        target = stack.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            stack.extend(target.elts)
        elif isinstance(target, ast.Starred):
            stack.append(target.value)
        else:
            yield target


def _protected(qual: str | None) -> bool:
    return under(qual, *_PROTECTED) and not under(qual, *_SETTINGS_OK)


def _tampered(a: Analysis, target: ast.expr) -> str | None:
    if isinstance(target, ast.Attribute):
        qual = a.qualname(target)
        return qual if _protected(qual) else None
    if isinstance(target, ast.Subscript):
        container = target.value
        base = a.qualname(container)
        if base == "sys.modules":
            return "sys.modules"
        is_namespace = (
            (isinstance(container, ast.Attribute) and container.attr == "__dict__")
            or (isinstance(container, ast.Call) and a.is_builtin(a.qualname(container.func), "vars"))
            or base == "builtins"
        )
        if is_namespace and _protected(base):
            return f"{base} namespace"
    return None


def _tampering_call(a: Analysis, call: ast.Call) -> str | None:
    func = a.qualname(call.func)
    first = a.qualname(call.args[0]) if call.args else None
    if (a.is_builtin(func, "setattr") or a.is_builtin(func, "delattr")) and _protected(first):
        attr = a.fold(call.args[1]) if len(call.args) > 1 else None
        return f"{_last(func or '')} on {first}.{attr or '<computed>'}"
    if func and _last(func) in ("__setattr__", "__delattr__") and _protected(first):
        return f"{_last(func)} on {first}"
    if isinstance(call.func, ast.Attribute) and call.func.attr in _DICT_MUTATORS:
        holder = call.func.value
        base = a.qualname(holder)
        namespace = (
            base == "sys.modules"
            or (isinstance(holder, ast.Attribute) and holder.attr == "__dict__")
            or (isinstance(holder, ast.Call) and a.is_builtin(a.qualname(holder.func), "vars"))
        )
        if namespace and (base == "sys.modules" or _protected(base)):
            return f"mutates the namespace of {base}"
    if under(func, "unittest.mock.patch", "mock.patch"):
        return "patches objects with mock.patch"
    return None


# ---------------------------------------------------------------------------------------- introspection
_INTROSPECTION = (
    "gc",
    "ctypes",
    "cffi",
    "sys._getframe",
    "sys._current_frames",
    "sys.settrace",
    "sys.setprofile",
    "sys.addaudithook",
    "threading.settrace",
    "threading.setprofile",
    "inspect.currentframe",
    "inspect.stack",
    "inspect.trace",
    "inspect.getouterframes",
    "inspect.getinnerframes",
    "inspect.getframeinfo",
    "traceback.walk_stack",
    "traceback.extract_stack",
    "traceback.walk_tb",
    "torch.cuda.cudart",
    "tracemalloc",
    "objgraph",
)
_GC_HARMLESS = ("gc.collect", "gc.enable", "gc.disable", "gc.isenabled")
_FRAME_ATTRS = {
    "f_back",
    "f_locals",
    "f_globals",
    "f_builtins",
    "f_code",
    "tb_frame",
    "tb_next",
    "gi_frame",
    "cr_frame",
    "ag_frame",
    "__globals__",
    "__subclasses__",
    "__closure__",
    "_getframe",
    "__code__",
}
_CPP_INTROSPECTION = re.compile(
    r"\bdl(?:open|sym|vsym|info)\b|/proc/|\bbacktrace\s*\(|\bPy(?:Eval_Get\w+|Frame_\w+|Thread\w*|GC_\w+"
    r"|Import_\w+|Sys_\w+|Object_SetAttr\w*|Object_GetAttr\w*)\b"
)


@register_check(
    name="introspection",
    kind="static",
    default_severity="fail",
    doc="""Reaching into the interpreter or the process: gc object walks (gc.collect is allowed),
    frames (sys._getframe, inspect.currentframe/stack, f_back/f_locals/f_globals, tracebacks),
    __subclasses__/__globals__ walks, ctypes/cffi, torch.cuda.cudart, trace hooks, reading /proc;
    in C++ dlopen/dlsym, /proc and the CPython frame/import API. These are the tools to find the
    harness's expected outputs or to call the CUDA runtime behind the other checks' backs. It cannot
    see introspection inside a precompiled binary the candidate loads.""",
)
def check_introspection(ctx: StaticContext) -> list[Finding]:
    rep = _Report("introspection", ctx)
    if ctx.analysis is not None:
        for node, qual in _module_hits(ctx, _INTROSPECTION, allowed=_GC_HARMLESS):
            rep.py(node, f"uses {qual}")
        for node in ast.walk(ctx.analysis.tree):
            if isinstance(node, ast.Attribute) and node.attr in _FRAME_ATTRS:
                rep.py(node, f"accesses {node.attr}")
        for node, text in ctx.strings:
            if text in _FRAME_ATTRS or text.startswith(("/proc", "/dev/mem", "/dev/nvidia")):
                rep.py(node, f"names {text!r}")
    rep.cpp_pattern(_CPP_INTROSPECTION, "{match} reaches into the process or interpreter")
    return rep.findings


# ---------------------------------------------------------------------------------------- file / network
_NETWORK = (
    "socket",
    "ssl",
    "urllib",
    "urllib3",
    "requests",
    "http",
    "httpx",
    "aiohttp",
    "ftplib",
    "smtplib",
    "telnetlib",
    "xmlrpc",
    "websocket",
    "websockets",
    "paramiko",
    "pycurl",
    "grpc",
    "asyncio.open_connection",
    "socketserver",
    "poplib",
    "imaplib",
)
_FILE_CALLS = (
    "open",
    "builtins.open",
    "io.open",
    "io.FileIO",
    "os.open",
    "os.fdopen",
    "codecs.open",
    "os.remove",
    "os.unlink",
    "os.rename",
    "os.replace",
    "os.write",
    "os.read",
    "os.dup",
    "os.dup2",
    "os.pipe",
    "os.listdir",
    "os.scandir",
    "os.walk",
    "os.chmod",
    "os.makedirs",
    "os.mkdir",
    "shutil",
    "tempfile",
    "torch.save",
    "torch.load",
    "numpy.save",
    "numpy.load",
    "numpy.fromfile",
    "pickle.dump",
    "pickle.load",
    "glob",
    "pathlib.Path.open",
    "mmap",
)
_PATH_METHODS = {"write_text", "write_bytes", "read_text", "read_bytes", "tofile", "unlink", "rmdir"}
_CPP_NETWORK = re.compile(r"\bsocket\s*\(|<sys/socket\.h>|<netinet/|\bgetaddrinfo\b|\bcurl_easy_\w+")
_CPP_FILES = re.compile(
    r"\bf(?:open|write|read)\s*\(|\bstd::[io]?fstream\b|\bstd::ofstream\b|\bstd::ifstream\b"
)


@register_check(
    name="file_network_access",
    kind="static",
    default_severity="fail",
    doc="""Network access (socket, urllib, requests, http, ...; C++ sockets) fails: a candidate has no
    business talking to the outside world, for example to fetch answers. File reads and writes
    (open, os/shutil/tempfile, torch.save/load, pathlib read/write; C++ fopen/fstream) are reported
    as warnings: load_inline needs none of them, and files can carry state between runs or reach the
    harness. It cannot see file or network access done by a library the candidate calls; the worker
    sandbox limits those.""",
)
def check_file_network(ctx: StaticContext) -> list[Finding]:
    rep = _Report("file_network_access", ctx)
    a = ctx.analysis
    if a is not None:
        for node, qual in _module_hits(ctx, _NETWORK):
            rep.py(node, f"network access through {qual}")
        for call, func in a.calls():
            if under(func, *_FILE_CALLS) and not under(func, "torch.utils"):
                rep.py(call, f"file access through {func}", "warn")
            elif isinstance(call.func, ast.Attribute) and call.func.attr in _PATH_METHODS:
                rep.py(call, f"file access through .{call.func.attr}()", "warn")
    rep.cpp_pattern(_CPP_NETWORK, "{match}: network access")
    rep.cpp_pattern(_CPP_FILES, "{match}: file access", "warn")
    return rep.findings


# ---------------------------------------------------------------------------------------- dynamic code
_EXEC_BUILTINS = ("exec", "eval", "compile")
_DYNAMIC = (
    "marshal.loads",
    "marshal.load",
    "pickle.loads",
    "dill",
    "cloudpickle",
    "types.FunctionType",
    "types.CodeType",
    "types.LambdaType",
    "runpy",
    "code.InteractiveInterpreter",
    "code.InteractiveConsole",
    "code.interact",
    "importlib.util.spec_from_loader",
    "importlib.util.module_from_spec",
    "importlib.machinery.SourceFileLoader",
    "importlib.__import__",
)
_CPP_DYNAMIC = re.compile(r"\bPyRun_\w+|\bPy_CompileString\w*|\bPyEval_EvalCode\w*")


@register_check(
    name="dynamic_code",
    kind="static",
    default_severity="fail",
    doc="""Code that static analysis cannot read: exec/eval/compile of anything but a plain string
    literal (built strings, base64/zlib/codecs-decoded payloads), __import__/import_module of built
    names, marshal/pickle loading, building code or function objects, runpy; in C++ PyRun_*.
    Exec of a plain literal is not flagged by itself; its text is scanned by every static check
    and reported at the exec line. Nothing hidden behind a runtime-computed value is visible.""",
)
def check_dynamic_code(ctx: StaticContext) -> list[Finding]:
    rep = _Report("dynamic_code", ctx)
    a = ctx.analysis
    if a is not None:
        for call, func in a.calls():
            name = _last(func or "")
            is_exec = any(a.is_builtin(func, b) for b in _EXEC_BUILTINS)
            is_import = a.is_builtin(func, "__import__") or func == "importlib.import_module"
            plain = bool(call.args) and isinstance(call.args[0], ast.Constant)
            if (is_exec or is_import) and not plain:
                rep.py(call, f"{name} of a computed value")
            elif under(func, *_DYNAMIC):
                rep.py(call, f"{func} builds or loads code at run time")
        for node in ast.walk(a.tree):
            for target in _store_targets(node):
                if isinstance(target, ast.Attribute) and target.attr == "__code__":
                    rep.py(target, "replaces a function's __code__")
    rep.cpp_pattern(_CPP_DYNAMIC, "{match} runs Python code from C++")
    return rep.findings


def exec_payloads(ctx: StaticContext) -> list[tuple[int, str]]:
    """(line, text) of exec/eval/compile calls whose argument folds to a constant string."""
    a = ctx.analysis
    if a is None:
        return []
    out = []
    for call, func in a.calls():
        if call.args and any(a.is_builtin(func, b) for b in _EXEC_BUILTINS):
            text = a.fold(call.args[0])
            if text is not None:
                out.append((call.lineno, text))
    return out
