"""Static checks of reusing the reference: what counts as a kernel, falling back to PyTorch
operators, inheriting the reference model, calling its operator, PyTorch only."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from kbv.integrity._pyast import Analysis, under
from kbv.integrity._registry import register_check
from kbv.integrity.static._common import StaticContext, _last, _Report, _short
from kbv.records import Finding

# ---------------------------------------------------------------------------------------- kernels
_LOADERS = {"load_inline", "load"}
_TRITON_DECORATORS = ("triton.jit", "triton.autotune", "triton.heuristics", "triton.language.jit")
_OTHER_KERNELS = (
    "cupy.RawKernel",
    "cupy.RawModule",
    "cupy.ElementwiseKernel",
    "cupy.ReductionKernel",
    "cupy.fuse",
    "numba.cuda.jit",
    "pycuda.compiler.SourceModule",
    "tilelang",
    "cuda.core",
    "cutlass",
    "tvm",
    "torch.cuda.jiterator",
    "warp.kernel",
    "cuda.bindings",
    "helion.kernel",
    "thunderkittens",
)


@dataclass
class _Kernels:
    modules: set[str]  # names ("ext", "self.ext") bound to a compiled extension or raw kernel
    triton: set[str]  # names of @triton.jit functions
    launchers: set[str]  # local functions / methods that (transitively) launch a custom kernel
    defined: bool  # the candidate defines any custom kernel at all


def _kernels(ctx: StaticContext) -> _Kernels:
    cached = ctx.__dict__.get("_kernels")
    if isinstance(cached, _Kernels):
        return cached
    a = ctx.analysis
    assert a is not None
    builders = {
        f.name
        for f in ast.walk(a.tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        and any(_last(q or "") in _LOADERS and _is_loader(q) for _, q in a.calls(f))
    }
    modules: set[str] = set()
    defined = False
    for node in ast.walk(a.tree):
        if isinstance(node, ast.Call):
            q = a.qualname(node.func)
            if (_last(q or "") in _LOADERS and _is_loader(q)) or under(q, *_OTHER_KERNELS):
                defined = True
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
            value_q = a.qualname(node.value.func) or ""
            inner = node.value.func.value if isinstance(node.value.func, ast.Attribute) else None
            inner_q = a.qualname(inner.func) if isinstance(inner, ast.Call) else None
            if (
                _is_loader(value_q)
                or _last(value_q) in builders
                or under(value_q, *_OTHER_KERNELS)
                or under(inner_q, *_OTHER_KERNELS)
            ):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    name = _dotted(target)
                    if name:
                        modules.add(name)
    triton = set()
    for node in ast.walk(a.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                q = a.qualname(dec.func if isinstance(dec, ast.Call) else dec)
                if under(q, *_TRITON_DECORATORS):
                    triton.add(node.name)
                    defined = True
    kernels = _Kernels(modules, triton, set(), defined)
    functions = [f for f in ast.walk(a.tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for _ in range(5):  # helpers calling helpers that launch kernels
        for f in functions:
            if f.name in kernels.launchers or f.name in triton:
                continue
            if any(_launches(a, kernels, c) for c in ast.walk(f) if isinstance(c, ast.Call)):
                kernels.launchers.add(f.name)
    ctx.__dict__["_kernels"] = kernels
    return kernels


def _is_loader(qual: str | None) -> bool:
    return _last(qual or "") in _LOADERS and (under(qual, "torch.utils.cpp_extension") or qual in _LOADERS)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


_BUILTIN_OP_NAMESPACES = {"aten", "prim", "prims", "quantized", "_c10d_functional", "c10d"}


def _launches(a: Analysis, kernels: _Kernels, call: ast.Call) -> bool:
    """Does this call launch a custom kernel (directly or through a local helper)?"""
    func = call.func
    parts = (a.qualname(func) or "").split(".")
    if parts[:2] == ["torch", "ops"] and len(parts) > 3 and parts[2] not in _BUILTIN_OP_NAMESPACES:
        return True  # a custom operator registered under its own namespace: torch.ops.<ns>.<op>
    if isinstance(func, ast.Subscript):
        return _dotted(func.value) in kernels.triton or _last(_dotted(func.value) or "") in kernels.triton
    name = _dotted(func)
    if name is None:
        return False
    if (
        name in kernels.modules
        or name in kernels.launchers
        or _last(name) in kernels.launchers
        and (name.startswith("self.") or "." not in name)
    ):
        return True
    return isinstance(func, ast.Attribute) and _dotted(func.value) in kernels.modules


# ---------------------------------------------------------------------------------------- fallback
_NOT_COMPUTE = {
    "empty",
    "empty_like",
    "empty_strided",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "tensor",
    "as_tensor",
    "from_numpy",
    "device",
    "dtype",
    "is_tensor",
    "Size",
    "no_grad",
    "inference_mode",
    "set_grad_enabled",
    "manual_seed",
    "get_default_dtype",
    "is_floating_point",
    "result_type",
    "promote_types",
    "finfo",
    "iinfo",
    "Module",
    "Parameter",
    "ModuleList",
    "ParameterList",
    "ModuleDict",
    "is_grad_enabled",
    "numel",
    "broadcast_shapes",
    "empty_cache",
    "Tensor",
    "rand",
    "randn",
    "randint",
    "rand_like",
    "randn_like",
    "randint_like",
    "randperm",
    "normal",
    "arange",
    "linspace",
    "Generator",
}
_NOT_COMPUTE_MODULES = (
    "torch.cuda",
    "torch.utils",
    "torch.backends",
    "torch.testing",
    "torch.library",
    "torch.jit",
    "torch.compiler",
    "torch._dynamo",
    "torch.version",
    "torch.distributed",
    "torch.autograd.profiler",
    "torch.profiler",
    "torch.ops",
    "torch.nn.init",
)
_SHAPE_METHODS = {
    "view",
    "reshape",
    "contiguous",
    "size",
    "dim",
    "numel",
    "permute",
    "transpose",
    "flatten",
    "unsqueeze",
    "squeeze",
    "expand",
    "expand_as",
    "to",
    "cuda",
    "cpu",
    "float",
    "double",
    "type",
    "is_contiguous",
    "data_ptr",
    "stride",
    "item",
    "tolist",
    "clone",
    "detach",
    "new_empty",
    "new_zeros",
    "new_ones",
    "new_full",
    "fill_",
    "zero_",
    "copy_",
    "view_as",
    "reshape_as",
    "t",
    "element_size",
    "get_device",
    "is_cuda",
    "numpy",
    "requires_grad_",
    "chunk",
    "split",
    "narrow",
    "select",
    "unbind",
    "append",
    "format",
    "join",
    "get",
    "items",
    "keys",
    "values",
    "update",
    "extend",
    "pop",
    "register_buffer",
    "register_parameter",
    "parameters",
    "named_parameters",
    "modules",
    "children",
    "apply",
    "eval",
    "train",
    "half",
    "bfloat16",
    "storage_offset",
    "untyped_storage",
    "empty_like",
    "__init__",
    "forward",
    "load_inline",
    "startswith",
    "endswith",
    "replace",
    "strip",
    "lower",
    "upper",
    "encode",
    "decode",
}


def _torch_compute(a: Analysis, call: ast.Call) -> str | None:
    """The operator name when ``call`` is a PyTorch compute operator (not allocation or utilities)."""
    qual = a.qualname(call.func)
    if (
        under(qual, "torch")
        and qual
        and not under(qual, *_NOT_COMPUTE_MODULES)
        and _last(qual) not in _NOT_COMPUTE
    ):
        return qual
    return None


def _fallback_op(a: Analysis, ctx_modules: set[str], node: ast.AST) -> str | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return "the @ operator"
    if not isinstance(node, ast.Call):
        return None
    op = _torch_compute(a, node)
    if op:
        return op
    func = node.func
    qual = a.qualname(func) or ""
    if _last(qual) == "Model" or qual.endswith("Model.forward"):
        return qual
    if (
        isinstance(func, ast.Attribute)
        and func.attr == "forward"
        and isinstance(func.value, ast.Call)
        and a.qualname(func.value.func) == "super"
    ):
        return "super().forward"
    name = _dotted(func)
    if name in ctx_modules:
        return f"{name} (a torch.nn module)"
    if isinstance(func, ast.Attribute) and func.attr not in _SHAPE_METHODS and not under(qual, "torch"):
        receiver = _dotted(func.value)
        if receiver and not receiver.startswith("self.") and receiver.split(".")[0] not in a.aliases:
            return f".{func.attr}() on a tensor"
    return None


def _nn_module_attrs(a: Analysis, cls: ast.ClassDef | None) -> dict[str, str]:
    """``self.X`` attributes a class binds to torch.nn modules, with the module class's name."""
    found: dict[str, str] = {}
    if cls is None:
        return found
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            qual = a.qualname(node.value.func)
            if (
                under(qual, "torch.nn")
                and qual
                and _last(qual)[:1].isupper()
                and _last(qual) not in _NOT_COMPUTE
            ):
                for target in node.targets:
                    name = _dotted(target)
                    if name and name.startswith("self."):
                        found[name] = _last(qual)
    return found


def _class(a: Analysis | None, name: str) -> ast.ClassDef | None:
    if a is None:
        return None
    for node in ast.walk(a.tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


@register_check(
    name="reference_fallback",
    kind="static",
    default_severity="fail",
    doc="""A try/except whose try body launches the custom kernel (a function of a load_inline module,
    a Triton launch kernel[grid](...), a raw kernel, a local helper that does one of these, or a
    name the module defines nowhere, so that the call can only raise NameError) and
    whose except body computes with PyTorch (torch.* / F.* operators, @, a torch.nn module, the
    reference Model, super().forward, tensor methods). When the kernel fails to build or launch, the
    candidate silently reports PyTorch's numbers and time as its own. It does not follow fallbacks
    written as if/else on a flag set elsewhere.""",
)
def check_reference_fallback(ctx: StaticContext) -> list[Finding]:
    rep = _Report("reference_fallback", ctx)
    a = ctx.analysis
    if a is None:
        return []
    kernels = _kernels(ctx)
    nn_attrs = set(_nn_module_attrs(a, _class(a, "ModelNew")))
    unbound = _unbound_names(a.tree)
    for node in ast.walk(a.tree):
        if not isinstance(node, ast.Try) or not node.handlers:
            continue
        calls = [c for s in node.body for c in ast.walk(s) if isinstance(c, ast.Call)]
        launch = next((c for c in calls if _launches(a, kernels, c)), None)
        missing = next((c for c in calls if _root_name(c.func) in unbound), None)
        if launch is None and missing is None:
            continue
        if launch is not None:
            what = f"the custom kernel at line {launch.lineno} raises"
        else:
            assert missing is not None
            what = (
                f"{_root_name(missing.func)} (called at line {missing.lineno}, defined nowhere) raises "
                "NameError"
            )
        for handler in node.handlers:
            for inner in (n for s in handler.body for n in ast.walk(s)):
                op = _fallback_op(a, nn_attrs, inner)
                if op:
                    line, text = a.quote(inner)
                    rep.py(handler, f"when {what}, falls back to {op} (line {line}: {_short(text, 100)})")
                    break
    return rep.findings


def _root_name(func: ast.AST) -> str | None:
    """``f`` for ``f(...)``, ``f.g(...)`` and ``f[grid](...)``."""
    while isinstance(func, (ast.Attribute, ast.Subscript)):
        func = func.value
    return func.id if isinstance(func, ast.Name) else None


#: Names every module can use without binding them.
_ALWAYS_BOUND = frozenset(dir(__import__("builtins"))) | {
    "__file__",
    "__name__",
    "__doc__",
    "__spec__",
    "__builtins__",
    "__loader__",
    "__package__",
}


def _unbound_names(tree: ast.AST) -> set[str]:
    """Names the module reads but binds nowhere (an assignment, def, class, import, argument, ...).

    Empty when the module can bind names the parser cannot see (``from x import *``, ``globals()``,
    ``exec``, ``setattr``, a module ``__getattr__``), so an undefined name is never guessed."""
    bound: set[str] = set(_ALWAYS_BOUND)
    loaded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
            if node.id in ("globals", "exec", "eval", "setattr", "vars", "locals") and isinstance(
                node.ctx, ast.Load
            ):
                return set()
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            if node.name == "__getattr__":
                return set()
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return set()
                bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
    return loaded - bound


# ---------------------------------------------------------------------------------------- inheritance
@register_check(
    name="inherits_reference",
    kind="static",
    default_severity="fail",
    doc="""ModelNew deriving from the reference Model (or from any class the problem defines,
    directly or through local intermediate classes), or instantiating / calling the reference Model
    or another class of the problem. The candidate then runs the reference computation and claims it
    as its own. A class the candidate defines itself under the name of one of the problem's helper
    classes (a level-3 network's ``InceptionModule``, rewritten or copied) is the candidate's own: it
    is followed, not flagged, where a ``class`` statement at module level is the name's only binding.
    ``Model`` is always the reference's name: a candidate's entry point is ``ModelNew``, and a copy
    of ``Model`` that ``ModelNew`` derives from is the reference under its own name. It cannot tell
    whether a class of the same name imported from elsewhere is the reference.""",
)
def check_inherits_reference(ctx: StaticContext) -> list[Finding]:
    rep = _Report("inherits_reference", ctx)
    a = ctx.analysis
    if a is None:
        return []
    problem_classes = {"Model"}
    if ctx.problem is not None:
        problem_classes |= {n.name for n in ast.walk(ctx.problem.tree) if isinstance(n, ast.ClassDef)}
    local = {n.name: n for n in ast.walk(a.tree) if isinstance(n, ast.ClassDef)}
    own = _own_classes(a)
    new = local.get("ModelNew")
    if new is None:
        return rep.findings
    seen: set[str] = {"ModelNew"}
    stack = [new]
    while stack:
        cls = stack.pop()
        for base in cls.bases:
            qual = a.qualname(base) or ""
            name = _last(qual)
            if under(qual, "torch") or name in seen:
                continue
            seen.add(name)
            if qual in own or (name in local and name not in problem_classes):
                stack.append(local[name])
            elif name in problem_classes:
                rep.py(base, f"{_subject(cls)} inherits from the problem's class {name}")
        for call, func in a.calls(cls):
            if not func or under(func, "torch"):
                continue
            if func in own:
                if func not in seen:
                    seen.add(func)
                    stack.append(own[func])
            elif _last(func) in problem_classes or func.endswith("Model.forward"):
                rep.py(call, f"{_subject(cls)} calls the reference {func}")
    return rep.findings


def _subject(cls: ast.ClassDef) -> str:
    return "ModelNew" if cls.name == "ModelNew" else f"ModelNew (through its class {cls.name})"


def _own_classes(a: Analysis) -> dict[str, ast.ClassDef]:
    """The classes the candidate defines itself, ``Model`` aside (the reference's name, whatever
    the body): a ``class`` statement at module level that is the name's only binding in the file
    (an import, an assignment, a ``def`` or a second ``class`` of the same name could make the name
    the problem's class when it runs)."""
    bindings: dict[str, int] = {}

    def bind(name: str) -> None:
        bindings[name] = bindings.get(name, 0) + 1

    for node in ast.walk(a.tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            bind(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bind(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bind(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                bind(name)
    top = [n for n in a.tree.body if isinstance(n, ast.ClassDef)]  # type: ignore[attr-defined]
    return {
        n.name: n for n in top if n.name != "Model" and bindings.get(n.name) == 1 and n.name not in a.aliases
    }


# ---------------------------------------------------------------------------------------- reference ops
def _op_key(name: str) -> str:
    return name.lower().lstrip("_")


def _ops_used(
    a: Analysis, root: ast.AST, nn_attrs: dict[str, str], count_ctor: bool, kernel_modules: set[str]
) -> Iterator[tuple[ast.AST, str]]:
    """(node, operator key) for every PyTorch operator used under ``root``.

    Calls into the candidate's own kernel modules (``ext.relu(x)``) are not PyTorch operators.
    """
    for node in ast.walk(root):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            yield node, "matmul"
        if not isinstance(node, ast.Call):
            continue
        qual = _torch_compute(a, node)
        if qual:
            is_ctor = under(qual, "torch.nn") and _last(qual)[:1].isupper()
            if count_ctor or not is_ctor:
                yield node, _op_key(_last(qual))
            continue
        name = _dotted(node.func)
        if name in nn_attrs:
            yield node, _op_key(nn_attrs[name])
        elif isinstance(node.func, ast.Attribute) and node.func.attr not in _SHAPE_METHODS:
            receiver = _dotted(node.func.value)
            if (
                receiver
                and receiver not in kernel_modules
                and receiver.split(".")[0] not in a.aliases
                and not receiver.startswith("self.")
            ):
                yield node, _op_key(node.func.attr)


def _reachable_functions(a: Analysis, cls: ast.ClassDef) -> list[ast.AST]:
    """ModelNew's methods plus the module-level functions they call (transitively)."""
    module_funcs = {f.name: f for f in a.tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    kernels_roots: list[ast.AST] = [cls]
    seen: set[str] = set()
    frontier: list[ast.AST] = [cls]
    while frontier:
        node = frontier.pop()
        for call, _ in a.calls(node):
            name = _dotted(call.func)
            if name in module_funcs and name not in seen:
                seen.add(name)
                kernels_roots.append(module_funcs[name])
                frontier.append(module_funcs[name])
    return kernels_roots


@register_check(
    name="reference_operator",
    kind="static",
    default_severity="warn",
    doc="""ModelNew (and the module functions it calls) uses a main operator of the problem's reference
    Model: the torch.* / F.* calls, tensor methods, @ and torch.nn modules of the reference's
    __init__ and forward (torch.matmul, F.conv2d, softmax, an nn.Linear that is called, ...). Legal,
    but the speedup then belongs to PyTorch, not to a custom kernel. Needs the problem source;
    without it nothing is reported. Operators reached through another library are not recognised.""",
)
def check_reference_operator(ctx: StaticContext) -> list[Finding]:
    rep = _Report("reference_operator", ctx)
    a, p = ctx.analysis, ctx.problem
    if a is None or p is None:
        return []
    model = _class(p, "Model")
    new = _class(a, "ModelNew")
    if model is None or new is None:
        return []
    ref_ops = {op for _, op in _ops_used(p, model, _nn_module_attrs(p, model), True, set())}
    nn_attrs = _nn_module_attrs(a, new)
    modules = _kernels(ctx).modules
    for root in _reachable_functions(a, new):
        for node, op in _ops_used(a, root, nn_attrs, False, modules):
            if op in ref_ops:
                rep.py(node, f"calls {op}, an operator of the reference Model")
    return rep.findings


@register_check(
    name="pytorch_only",
    kind="static",
    default_severity="info",
    doc="""The candidate defines no custom kernel at all: no load_inline/load, no @triton.jit, no
    CuPy/Numba/PyCUDA/other kernel source. Legal, and reported as such so that results can separate
    kernel work from PyTorch re-arrangement. It does not check that a defined kernel is actually
    launched (a "ghost kernel"); dynamic checks do.""",
)
def check_pytorch_only(ctx: StaticContext) -> list[Finding]:
    if ctx.analysis is None or _kernels(ctx).defined or ctx.cpp:
        return []
    new = _class(ctx.analysis, "ModelNew")
    rep = _Report("pytorch_only", ctx)
    rep.py(new if new is not None else 1, "defines no custom kernel (no load_inline, Triton, CuPy or Numba)")
    return rep.findings
