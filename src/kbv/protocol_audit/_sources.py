"""Candidate sources made from a problem's own source: honest controls and mutants.

Everything here is text in, text out (``ast`` only): nothing is imported or run. Every source
renames the problem's classes (``Model`` and its helpers), so the static checks that catch a
candidate reusing the reference (``inherits_reference``) judge the computation, not the names; a
mutant is a disguised wrong kernel, a control a disguised honest one. The device's size constants
are written into the source, so a ``forward`` that reads a module constant sees the sizes the
problem runs with (``kbv.problems.load_module`` overrides them the same way).
"""

from __future__ import annotations

import ast
from typing import Any

#: What the reference ``Model`` is called in a wrapped source (the wrapper is ``ModelNew``).
REFERENCE_NAME = "_KbvReference"

#: Unit roundoff of the formats the precision mutants compute in, and the scaled mutant's factor:
#: the relative perturbation each mutant kind makes (``_report.by_design`` compares it with the
#: tolerance a protocol states).
PERTURBATION = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp8": 2.0**-4, "scaled": 1e-2}

#: The precision mutants of an audit in each evaluation precision: only formats below it. In bf16
#: an fp16 computation is not one (more significand bits), in fp16 a bf16 one is (fewer).
PRECISION_MUTANTS = {"fp32": ("bf16", "fp16"), "bf16": ("fp8",), "fp16": ("bf16", "fp8")}

#: Activations that are the identity on [0, 1) (KernelBench's inputs), so identity passes there.
RELU_LIKE_FUNCTIONS = frozenset(
    {"relu", "relu_", "relu6", "leaky_relu", "leaky_relu_", "hardtanh", "hardtanh_", "elu", "celu"}
)
RELU_LIKE_MODULES = frozenset({"ReLU", "ReLU6", "LeakyReLU", "Hardtanh", "ELU", "CELU"})

#: Reshaping methods: dropping one changes the layout, not the computation.
_SHAPE_METHODS = frozenset(
    {
        "view",
        "reshape",
        "transpose",
        "permute",
        "flatten",
        "unflatten",
        "contiguous",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "size",
        "dim",
        "t",
        "mT",
        "chunk",
        "split",
        "unbind",
        "float",
        "to",
        "type_as",
        "clone",
    }
)
_MODULE_ALIASES = frozenset({"torch", "F", "nn", "math", "np", "super"})


class SourceError(ValueError):
    """A problem source that a generator cannot transform (the generator is skipped, with why)."""


# ------------------------------------------------------------------------------------ renaming
def problem_classes(tree: ast.Module) -> list[str]:
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


class _Rename(ast.NodeTransformer):
    def __init__(self, mapping: dict[str, str]) -> None:
        self.mapping = mapping

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        node.name = self.mapping.get(node.name, node.name)
        self.generic_visit(node)
        return node

    def visit_Name(self, node: ast.Name) -> ast.AST:
        node.id = self.mapping.get(node.id, node.id)
        return node


def renamed_tree(source: str, model_name: str) -> ast.Module:
    """The problem's tree with ``Model`` called ``model_name`` and every helper class ``_Kbv<Name>``."""
    tree = ast.parse(source)
    mapping = {name: f"_Kbv{name}" for name in problem_classes(tree)}
    mapping["Model"] = model_name
    return ast.fix_missing_locations(_Rename(mapping).visit(tree))


def with_sizes(body: str, sizes: dict[str, Any]) -> str:
    """Module constants set to the sizes the problem runs with on the audited device."""
    lines = [f"{name} = {value!r}" for name, value in sorted(sizes.items())]
    return body + ("\n\n# sizes of the audited device\n" + "\n".join(lines) + "\n" if lines else "")


def header(role: str, kind: str, problem: str) -> str:
    return f"# kbv protocol audit: {role} {kind!r} generated from problem {problem}\n"


# ------------------------------------------------------------------------------------ controls
def reference_control(source: str) -> str:
    """The reference itself as ``ModelNew``."""
    return ast.unparse(renamed_tree(source, "ModelNew")) + "\n"


TF32_WRAPPER = """

import torch as _kbv_torch

_kbv_reference_forward = ModelNew.forward


def _kbv_forward_with_tf32(self, *args, **kwargs):
    # TF32 on for this forward only, restored before returning (global_flags must stay quiet).
    saved = _kbv_torch.backends.cuda.matmul.allow_tf32, _kbv_torch.backends.cudnn.allow_tf32
    _kbv_torch.backends.cuda.matmul.allow_tf32 = True
    _kbv_torch.backends.cudnn.allow_tf32 = True
    try:
        return _kbv_reference_forward(self, *args, **kwargs)
    finally:
        _kbv_torch.backends.cuda.matmul.allow_tf32, _kbv_torch.backends.cudnn.allow_tf32 = saved


ModelNew.forward = _kbv_forward_with_tf32
"""

#: Operators whose realistic GPU baseline runs in TF32 (cuBLAS/cuDNN with allow_tf32).
_TF32_OPS = frozenset(
    {
        "matmul",
        "mm",
        "bmm",
        "baddbmm",
        "addmm",
        "linear",
        "einsum",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "Linear",
        "Bilinear",
        "Conv1d",
        "Conv2d",
        "Conv3d",
        "ConvTranspose1d",
        "ConvTranspose2d",
        "ConvTranspose3d",
        "MultiheadAttention",
        "TransformerEncoderLayer",
        "TransformerDecoderLayer",
        "Transformer",
        "LSTM",
        "GRU",
        "RNN",
        "scaled_dot_product_attention",
    }
)


def uses_tf32_ops(source: str) -> bool:
    """Whether the problem calls a matmul or convolution (``@`` included)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            return True
        if isinstance(node, ast.Call) and _call_name(node) in _TF32_OPS:
            return True
    return False


def tf32_control(source: str) -> str:
    return reference_control(source) + TF32_WRAPPER


#: A reduction this long or shorter may also be summed sequentially in float32 by a control (the
#: error model's reduction floor assumes one block of 256 reduced by a tree, partials added after).
SHORT_REDUCTION = 256
#: What the helper raises for a longer sequential sum: no honest control, and a Python loop as
#: long as the reduction (1e9 steps for a KernelBench loss) before the audit could say so.
LONG_REDUCTION_ERROR = "KbvLongReduction"

# The blocked order sums views of the input along the reduced dimension. It used to pad the
# reduction to a multiple of 256 after a permuted copy: 36_RMSNorm_'s 64-long reduction of a 7 GiB
# input then needed 28 GiB more, and on the H200 that honest control ran out of memory under
# `verified`'s caching probe (2026-12-02,
# benchmarks/results/2026-12-02-h200-audit-all-40/). A control must not cost more than an honest
# kernel would.
REDUCE_HELPER = f'''

import math as _kbv_math


class {LONG_REDUCTION_ERROR}(Exception):
    """A sequential float32 sum longer than {SHORT_REDUCTION}: refused before it starts."""


def _kbv_reduce(x, dim=None, keepdim=False, *, op, order):
    """torch.sum / torch.mean over ``dim`` in another honest float32 order."""
    dims = tuple(range(x.dim())) if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
    dims = tuple(d % max(x.dim(), 1) for d in dims)
    if len(dims) == 1 and order == "blocked" and x.dim():
        y, axis = x, dims[0]  # blocks are views along the dimension itself: no copy of the input
    else:
        rest = [d for d in range(x.dim()) if d not in dims]
        y = x.permute(*rest, *dims).reshape(*[x.shape[d] for d in rest], -1) if x.dim() else x.reshape(1)
        axis = y.dim() - 1
    length = y.shape[axis]
    if order == "reversed":
        total = y.flip(-1).sum(-1)
    elif order == "blocked":
        total = _kbv_blocked_sum(y, axis)
    else:  # sequential: one float32 accumulator, element after element
        if length > {SHORT_REDUCTION}:
            raise {LONG_REDUCTION_ERROR}(int(length))
        total = y[..., 0].clone()
        for i in range(1, length):
            total = total + y[..., i]
    if op == "mean":
        total = total / length
    if keepdim:
        for d in sorted(dims):
            total = total.unsqueeze(d)
    return total


def _kbv_blocked_sum(y, axis):
    """One float32 partial per block along ``axis`` (views: nothing is copied or padded), then
    the partials, then what is left over. Blocks of {SHORT_REDUCTION}; a shorter reduction is cut
    into about sqrt(length) blocks, so its order still differs from one plain sum."""
    length = y.shape[axis]
    size = {SHORT_REDUCTION} if length > {SHORT_REDUCTION} else _kbv_math.isqrt(max(length - 1, 0)) + 1
    whole = length // size
    total = y.narrow(axis, 0, whole * size).unflatten(axis, (whole, size)).sum(axis + 1).sum(axis)
    if whole * size < length:
        total = total + y.narrow(axis, whole * size, length - whole * size).sum(axis)
    return total
'''

_REDUCTIONS = frozenset({"sum", "mean"})


class _Reorder(ast.NodeTransformer):
    """``torch.sum(x, dim, keepdim)`` and ``x.sum(dim, keepdim=...)`` (and mean) to ``_kbv_reduce``."""

    def __init__(self, order: str) -> None:
        self.order = order
        self.count = 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        name = _call_name(node)
        if name not in _REDUCTIONS or any(k.arg not in ("dim", "keepdim") for k in node.keywords):
            return node
        func = node.func
        if isinstance(func, ast.Attribute) and _dotted(func.value) == "torch":
            args = list(node.args)
        elif isinstance(func, ast.Attribute) and _dotted(func.value) not in _MODULE_ALIASES:
            args = [func.value, *node.args]
        else:
            return node
        if not 1 <= len(args) <= 3 or any(isinstance(a, ast.Starred) for a in args):
            return node
        self.count += 1
        keywords = [
            *node.keywords,
            ast.keyword("op", ast.Constant(name)),
            ast.keyword("order", ast.Constant(self.order)),
        ]
        return ast.Call(ast.Name("_kbv_reduce", ast.Load()), args, keywords)


#: In a bf16 or fp16 audit a reordered control accumulates in float32 (its 16-bit inputs upcast,
#: the sum rounded once to their dtype), as an honest half-precision kernel does.
REDUCE_HELPER_HALF = """

_kbv_reduce_in_dtype = _kbv_reduce


def _kbv_reduce(x, dim=None, keepdim=False, *, op, order):
    if x.dtype in (_kbv_torch_half.float16, _kbv_torch_half.bfloat16):
        return _kbv_reduce_in_dtype(x.float(), dim, keepdim, op=op, order=order).to(x.dtype)
    return _kbv_reduce_in_dtype(x, dim, keepdim, op=op, order=order)


import torch as _kbv_torch_half
"""


def reordered_control(source: str, order: str, precision: str = "fp32") -> str:
    """The reference with every explicit sum/mean of its ``forward`` in another order (float32
    accumulation in a half ``precision``); SourceError when ``forward`` has none."""
    tree = renamed_tree(source, "ModelNew")
    transformer = _Reorder(order)
    for fn in _methods(tree, "ModelNew", "forward"):
        transformer.visit(fn)
    if not transformer.count:
        raise SourceError("forward has no explicit torch.sum/torch.mean to reorder")
    helper = REDUCE_HELPER + (REDUCE_HELPER_HALF if precision != "fp32" else "")
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n" + helper


# ------------------------------------------------------------------------------------ wrapped mutants
_WRAP_COMMON = f'''

import copy as _kbv_copy

import torch as _kbv_torch


def _kbv_map(value, fn):
    if isinstance(value, _kbv_torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_kbv_map(v, fn) for v in value)
    return value


def _kbv_sample(t, how):
    """The tensor rebuilt from a sampled subset of its own elements (the rest never read). Built from
    slices: an int64 index of every element took more device memory than a candidate may hold on a
    2.1e9-element input, and a mutant must be rejected for what it computes, not for its sampling."""
    if not (isinstance(t, _kbv_torch.Tensor) and t.is_floating_point() and t.numel() > 1):
        return t
    n = t.numel()
    flat = t.reshape(-1)
    if how == "stride":  # element j is element j - j % 2
        kept = flat[0::2]
        return kept.unsqueeze(1).expand(-1, 2).reshape(-1)[:n].reshape(t.shape)
    if how == "first_rows" and t.dim() >= 2 and t.shape[0] >= 4:  # row i is row i % (rows // 4)
        rows = _kbv_torch.arange(t.shape[0], device=t.device) % (t.shape[0] // 4)
        return t.index_select(0, rows).reshape(t.shape)
    if how == "first_rows":  # element j is element j % (n // 4)
        m = max(1, n // 4)
        return flat[:m].repeat(-(-n // m))[:n].reshape(t.shape)
    # head_tail: the first and last eighth kept, the two repeated in turn over the middle
    k = max(1, n // 8)
    head, tail = flat[:k], flat[n - k :]
    middle = _kbv_torch.cat([head, tail]).repeat(max(1, -(-(n - 2 * k) // (2 * k))))[: n - 2 * k]
    return _kbv_torch.cat([head, middle, tail]).reshape(t.shape)


_KBV_STATE = {{}}  # kept for the worker's life: across calls and rebuilds


class ModelNew({REFERENCE_NAME}):
'''

_WRAP_FORWARDS: dict[str, str] = {
    "zeros": """
    def forward(self, *args):
        return _kbv_map(super().forward(*args), _kbv_torch.zeros_like)
""",
    "constant": """
    def forward(self, *args):
        out = super().forward(*args)
        if "constants" not in _KBV_STATE:  # the first output's mean, returned ever after
            means = []
            _kbv_map(out, lambda t: means.append(t.double().mean().item()))
            _KBV_STATE["constants"] = means
        values = iter(_KBV_STATE["constants"])
        return _kbv_map(out, lambda t: _kbv_torch.full_like(t, next(values)))
""",
    "input": """
    def forward(self, *args):
        super().forward(*args)
        return args[INPUT_INDEX]
""",
    "cached": """
    def forward(self, *args):
        if "outputs" not in _KBV_STATE:
            _KBV_STATE["outputs"] = super().forward(*args)
        return _kbv_map(_KBV_STATE["outputs"], lambda t: t.clone())
""",
    "scaled": """
    def forward(self, *args):
        return _kbv_map(super().forward(*args), lambda t: t * (1 + 1e-2) if t.is_floating_point() else t)
""",
    "sampled": """
    def forward(self, *args):
        return super().forward(*[_kbv_sample(a, HOW) for a in args])
""",
    "rounded": """
    _kbv_plain = False

    def forward(self, *args):
        if self._kbv_plain:
            return super().forward(*args)
        low = _kbv_copy.deepcopy(self)
        low._kbv_plain = True
        with _kbv_torch.no_grad():
            for t in [*low.parameters(), *low.buffers()]:
                if t.is_floating_point():
                    t.copy_(t.to(LOW).to(t.dtype))
        low_args = [a.to(LOW).to(a.dtype) if isinstance(a, _kbv_torch.Tensor) and a.is_floating_point() else a for a in args]
        return low(*low_args)
""",  # noqa: E501 (inputs and parameters rounded to fp8, computed in the evaluated dtype: fp8 GEMMs
    # have no CPU kernels, and rounding the operands is what an fp8 kernel's error comes from)
    "precision": """
    _kbv_plain = False

    def forward(self, *args):
        if self._kbv_plain:
            return super().forward(*args)
        dtype = next((a.dtype for a in args if isinstance(a, _kbv_torch.Tensor) and a.is_floating_point()), _kbv_torch.float32)
        low = _kbv_copy.deepcopy(self).to(LOW)
        low._kbv_plain = True
        low_args = [a.to(LOW) if isinstance(a, _kbv_torch.Tensor) and a.is_floating_point() else a for a in args]
        return _kbv_map(low(*low_args), lambda t: t.to(dtype) if t.is_floating_point() else t)
""",  # noqa: E501 (a generated candidate's source: its bytes are hashed into the stored pair)
}

SAMPLINGS = ("first_rows", "stride", "head_tail")

#: Every kind of control and mutant the audit generates (``kbv.protocol_audit._generate._drafts``).
KINDS = (
    *("reference", "tf32", "reordered"),
    *("zeros", "constant", "cached", "scaled", "bf16", "fp16", "fp8", *SAMPLINGS),
    *("input", "drop_op", "relu_identity"),
)


def wrapped_mutant(source: str, kind: str, *, input_index: int = 0) -> str:
    """The reference wrapped in a ``ModelNew`` whose ``forward`` post-processes its outputs (exact:
    the reference runs unchanged inside)."""
    template = (
        "sampled"
        if kind in SAMPLINGS
        else "precision"
        if kind in ("bf16", "fp16")
        else "rounded"
        if kind == "fp8"
        else kind
    )
    forward = _WRAP_FORWARDS[template]
    forward = forward.replace("HOW", repr(kind)).replace("INPUT_INDEX", str(input_index))
    low = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}.get(kind, "float16")
    forward = forward.replace("LOW", f"_kbv_torch.{low}")
    return ast.unparse(renamed_tree(source, REFERENCE_NAME)) + "\n" + _WRAP_COMMON + forward


# ------------------------------------------------------------------------------------ AST mutants
def drop_sites(source: str) -> list[str]:
    """One description per operation of ``forward`` that :func:`drop_op_mutant` can drop, in order."""
    tree = renamed_tree(source, "ModelNew")
    return [_describe(node) for node in _droppable(tree)]


def drop_op_mutant(source: str, site: int) -> str:
    """The reference with operation ``site`` of its forward replaced by its (first) operand."""
    tree = renamed_tree(source, "ModelNew")
    target = _droppable(tree)[site]
    replacement = _operand(target)
    _replace(tree, target, replacement)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def relu_sites(source: str) -> list[str]:
    tree = renamed_tree(source, "ModelNew")
    return [_describe(node) for node in _relu_like(tree)]


def relu_identity_mutant(source: str, site: int) -> str:
    """ReLU-like activation ``site`` replaced by the identity (a call by its input, a module
    constructor by ``nn.Identity()``)."""
    tree = renamed_tree(source, "ModelNew")
    target = _relu_like(tree)[site]
    if _call_name(target) in RELU_LIKE_MODULES:
        replacement: ast.expr = ast.Call(
            ast.Attribute(ast.Name("_kbv_nn", ast.Load()), "Identity", ast.Load()), [], []
        )
    else:
        replacement = _operand(target)
    _replace(tree, target, replacement)
    return "import torch.nn as _kbv_nn\n" + ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def _droppable(tree: ast.Module) -> list[ast.expr]:
    found: list[ast.expr] = []
    for fn in _methods(tree, "ModelNew", "forward"):
        # Dropping the only operation of ``return op(x)`` returns an input: the ``input`` mutant.
        params = {a.arg for a in fn.args.args}
        returned = {id(n.value) for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None}
        for node in ast.walk(fn):
            if id(node) in returned and isinstance(node, (ast.Call, ast.BinOp)):
                operand = _operand_or_none(node) if isinstance(node, ast.Call) else node.left
                if isinstance(operand, ast.Name) and operand.id in params:
                    continue
            if isinstance(node, (ast.Call, ast.BinOp)) and _is_operation(node):
                found.append(node)
    return found


def _is_operation(node: ast.AST) -> bool:
    """A call that transforms a tensor (not a reshape), or arithmetic other than a matmul."""
    if isinstance(node, ast.Call):
        return _operand_or_none(node) is not None and _call_name(node) not in _SHAPE_METHODS
    return (
        isinstance(node, ast.BinOp)
        and not isinstance(node.op, ast.MatMult)
        and not isinstance(node.left, ast.Constant)
    )


def _relu_like(tree: ast.Module) -> list[ast.Call]:
    found: list[ast.Call] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        if name in RELU_LIKE_MODULES or (name in RELU_LIKE_FUNCTIONS and _operand_or_none(node) is not None):
            found.append(node)
    return found


def _operand_or_none(node: ast.Call) -> ast.expr | None:
    """The tensor a call transforms: its first positional argument, a method's receiver, or None."""
    func = node.func
    root = _dotted(func.value).split(".")[0].removesuffix("()") if isinstance(func, ast.Attribute) else ""
    if isinstance(func, ast.Attribute) and root not in _MODULE_ALIASES and root != "self":
        return func.value
    if node.args and not isinstance(node.args[0], (ast.Starred, ast.Constant)):
        return node.args[0]
    return None


def _operand(node: ast.expr) -> ast.expr:
    if isinstance(node, ast.BinOp):
        return node.left
    assert isinstance(node, ast.Call)
    operand = _operand_or_none(node)
    if operand is None:
        raise SourceError(f"{_describe(node)} has no operand to keep")
    return operand


def _replace(tree: ast.AST, target: ast.AST, replacement: ast.expr) -> None:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, replacement)
                return
            if isinstance(value, list) and any(v is target for v in value):
                setattr(parent, field, [replacement if v is target else v for v in value])
                return
    raise SourceError("operation not found in the tree")


def _describe(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _methods(tree: ast.Module, cls: str, name: str) -> list[ast.FunctionDef]:
    return [
        fn
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == cls
        for fn in node.body
        if isinstance(fn, ast.FunctionDef) and fn.name == name
    ]


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func) + "()"
    return ""
