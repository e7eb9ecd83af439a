"""Static checks of what the output is: tensor subclasses, lowered precision, cached results."""

from __future__ import annotations

import ast
import re

from kbv.integrity._pyast import Analysis, under
from kbv.integrity._registry import register_check
from kbv.integrity.static._common import StaticContext, _last, _Report
from kbv.records import Finding

# ---------------------------------------------------------------------------------------- subclass
_TENSOR_BASES = {
    "torch.Tensor",
    "torch._C.TensorBase",
    "torch._C._TensorBase",
    "torch.nn.Parameter",
    "torch.nn.parameter.Parameter",
    "torch.nn.Buffer",
    "torch.nn.parameter.Buffer",
}
_SUBCLASS_NAMES = {
    "__torch_function__",
    "__torch_dispatch__",
    "_make_subclass",
    "as_subclass",
    "_make_wrapper_subclass",
    "TorchFunctionMode",
    "TorchDispatchMode",
}


@register_check(
    name="tensor_subclass",
    kind="static",
    default_severity="fail",
    doc="""Tensor subclasses and dispatch hooks: classes deriving from torch.Tensor (also via
    type(...)), __torch_function__/__torch_dispatch__, _make_subclass, as_subclass, torch.overrides
    and dispatch modes, assignments to __class__. A lazy output runs its work only when the checker
    touches it, after the timer stopped. It cannot see subclasses created inside a compiled
    extension; the dynamic output-type check covers those.""",
)
def check_tensor_subclass(ctx: StaticContext) -> list[Finding]:
    rep = _Report("tensor_subclass", ctx)
    a = ctx.analysis
    if a is None:
        return []
    for node in ast.walk(a.tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if a.qualname(base) in _TENSOR_BASES:
                    rep.py(node, f"class derives from {a.qualname(base)}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in _SUBCLASS_NAMES:
            rep.py(node, f"defines {node.name}")
        elif isinstance(node, ast.Attribute) and node.attr == "__class__" and isinstance(node.ctx, ast.Store):
            rep.py(node, "reassigns an object's __class__")
        elif (
            isinstance(node, ast.Call) and a.is_builtin(a.qualname(node.func), "type") and len(node.args) == 3
        ):
            bases = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else []
            if any(a.qualname(b) in _TENSOR_BASES for b in bases):
                rep.py(node, "builds a torch.Tensor subclass with type()")
    for qual, node in [*((q, n) for n, q in ctx.references), *ctx.imports]:
        if _last(qual) in _SUBCLASS_NAMES or under(qual, "torch.overrides", "torch.utils._python_dispatch"):
            rep.py(node, f"uses {qual}")
    for node, text in ctx.strings:
        if text in _SUBCLASS_NAMES:
            rep.py(node, f"names {text} in a string")
    return rep.findings


# ---------------------------------------------------------------------------------------- precision
_LOW_DTYPE = re.compile(r"^(?:float16|half|bfloat16|float8\w*|fp8\w*|complex32|chalf)$")
_PRECISION_FLAGS = {
    "allow_tf32",
    "allow_fp16_reduced_precision_reduction",
    "allow_bf16_reduced_precision_reduction",
}
_FAST_MATH = re.compile(
    r"use_fast_math|fast-math|ftz=true|prec-div=false|prec-sqrt=false|-ffast-math|fmad=true"
)
_CPP_PRECISION = re.compile(
    r"\b(?:__half2?|half2|__nv_bfloat162?|__nv_fp8\w*|__float2half\w*|__half2float|__float2bfloat16\w*"
    r"|__bfloat162float|__float22half2\w*|at::kHalf|at::kBFloat16|torch::kHalf|torch::kFloat16|torch::kBFloat16"
    r"|at::Half|at::BFloat16|c10::Half|c10::BFloat16|CUDA_R_16F|CUDA_R_16BF|CUDA_R_8F\w*"
    r"|CUBLAS_COMPUTE_32F_FAST_\w+|CUBLAS_TF32_TENSOR_OP_MATH|CUBLAS_TENSOR_OP_MATH|wmma::\w+"
    r"|__expf|__logf|__powf|__fdividef|__sinf|__cosf|__tanf|__exp10f|__log2f)\b"
    r"|mma\.sync[^\"\n]*\.(?:f16|bf16|tf32|e4m3|e5m2)|\.half\(\)"
)


@register_check(
    name="precision_cast",
    kind="static",
    default_severity="warn",
    doc="""Reduced precision inside an fp32 problem: .half()/.bfloat16(), torch.float16/bfloat16/float8
    dtypes, autocast, allow_tf32 = True, set_float32_matmul_precision other than "highest", Triton
    tl.dot without input_precision="ieee" (TF32 by default), fast-math compiler flags; in C++ half
    and bf16 types and conversions, wmma/mma on 16-bit or TF32 types, cuBLAS fast compute modes and
    approximate intrinsics such as __expf. Such kernels can pass a loose tolerance while computing
    a different function. Only reported for fp32 problems; the error-model tolerance decides
    whether the numbers are acceptable. It cannot see precision chosen inside a library call.""",
)
def check_precision_cast(ctx: StaticContext) -> list[Finding]:
    rep = _Report("precision_cast", ctx)
    if not ctx.problem_dtype_fp32:
        return []
    a = ctx.analysis
    if a is not None:
        _python_precision(ctx, a, rep)
    rep.cpp_pattern(_CPP_PRECISION, "{match}: reduced precision in C++/CUDA")
    return rep.findings


def _python_precision(ctx: StaticContext, a: Analysis, rep: _Report) -> None:
    for node, qual in ctx.references:
        if under(qual, "torch", "triton.language", "numpy") and _LOW_DTYPE.match(_last(qual)):
            rep.py(node, f"uses {qual}")
        elif under(qual, "torch") and _last(qual) == "autocast":
            rep.py(node, "autocast lowers matmul/conv precision")
    for call, func in a.calls():
        if isinstance(call.func, ast.Attribute) and call.func.attr in ("half", "bfloat16") and not call.args:
            rep.py(call, f".{call.func.attr}() casts to 16-bit")
        if func == "torch.set_float32_matmul_precision":
            value = a.fold(call.args[0]) if call.args else None
            if value != "highest":
                rep.py(call, f"float32 matmul precision set to {value or 'a computed value'}")
        if under(func, "triton.language") and _last(func or "") == "dot":
            kw = {k.arg: k.value for k in call.keywords}
            precision = a.fold(kw["input_precision"]) if "input_precision" in kw else None
            allow = kw.get("allow_tf32")
            tf32_off = isinstance(allow, ast.Constant) and allow.value is False
            if precision != "ieee" and not tf32_off:
                rep.py(call, "tl.dot uses TF32 on fp32 inputs unless input_precision='ieee'")
    for node in ast.walk(a.tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr in _PRECISION_FLAGS:
                    if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                        rep.py(node, f"enables {target.attr}")
                elif (
                    isinstance(target, ast.Attribute)
                    and target.attr == "fp32_precision"
                    and a.fold(node.value) != "ieee"
                ):
                    rep.py(node, "sets fp32_precision below ieee")
    for node, text in ctx.strings:
        if len(text) < 80 and _FAST_MATH.search(text):
            rep.py(node, f"fast-math compiler flag {text!r}")


# ---------------------------------------------------------------------------------------- caching
_CACHE_DECORATORS = ("functools.lru_cache", "functools.cache", "functools.cached_property")
_KEY_CONTEXTS = (ast.Subscript, ast.Compare, ast.Dict)
_CPP_STATIC = re.compile(
    r"\bstatic\s+(?:thread_local\s+)?(?!const\b|constexpr\b|inline\b|__)"
    r"(?:(?:at|torch|c10)::Tensor\b|std::(?:unordered_)?(?:map|set|multimap)\b|std::vector\b|std::optional\b"
    r"|std::shared_ptr\b|(?:int|long|int64_t|uint64_t|size_t|float|double|bool|unsigned|uintptr_t|void|char)"
    r"\s*\**\s*\w+\s*(?:=|;|\[))"
)


@register_check(
    name="caching",
    kind="static",
    default_severity="warn",
    doc="""Memoisation that can replay old results: data_ptr()/id() values used as dictionary keys,
    compared, or stored on self; functools.lru_cache/cache/cached_property; C++ static tensors, maps,
    vectors and static scalar state (call counters). A result cached on an input's address survives
    new data written to the same memory. Caching a compiled module is harmless but reported too.
    Caches keyed on shapes or on sampled values are not recognised; the dynamic same-pointer/new-data
    probes catch their effect.""",
)
def check_caching(ctx: StaticContext) -> list[Finding]:
    rep = _Report("caching", ctx)
    a = ctx.analysis
    if a is not None:
        key_names = set()
        for node in ast.walk(a.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for dec in node.decorator_list:
                    q = a.qualname(dec.func if isinstance(dec, ast.Call) else dec)
                    if under(q, *_CACHE_DECORATORS):
                        rep.py(dec, f"{q} memoises results")
            if isinstance(node, ast.Assign) and _has_identity_call(a, node.value):
                for target in node.targets:
                    if isinstance(target, ast.Attribute):
                        rep.py(node, "stores an input's address or id() across calls")
                    elif isinstance(target, ast.Name):
                        key_names.add(target.id)
        for call, _ in a.calls():
            if _is_identity_call(a, call) and _used_as_key(a, call):
                rep.py(call, "uses an input's address or id() as a cache key")
        for node in ast.walk(a.tree):
            if isinstance(node, ast.Name) and node.id in key_names and _used_as_key(a, node):
                rep.py(node, f"uses {node.id} (an address or id()) as a cache key")
    rep.cpp_pattern(_CPP_STATIC, "{match}: state kept across calls")
    return rep.findings


def _is_identity_call(a: Analysis, call: ast.Call) -> bool:
    if isinstance(call.func, ast.Attribute) and call.func.attr in (
        "data_ptr",
        "_cdata",
        "storage_offset_ptr",
    ):
        return True
    return a.is_builtin(a.qualname(call.func), "id")


def _has_identity_call(a: Analysis, node: ast.AST) -> bool:
    return any(isinstance(c, ast.Call) and _is_identity_call(a, c) for c in ast.walk(node))


def _used_as_key(a: Analysis, node: ast.AST) -> bool:
    child, parent = node, a.parents.get(node)
    while parent is not None and not isinstance(parent, ast.stmt):
        if isinstance(parent, ast.Subscript) and child is parent.slice:
            return True
        if isinstance(parent, ast.Compare) or (isinstance(parent, ast.Dict) and child in parent.keys):
            return True
        if (
            isinstance(parent, ast.Call)
            and isinstance(parent.func, ast.Attribute)
            and child in parent.args
            and parent.func.attr in ("get", "setdefault", "pop", "__contains__", "__getitem__", "add")
        ):
            return True
        child, parent = parent, a.parents.get(parent)
    return False
