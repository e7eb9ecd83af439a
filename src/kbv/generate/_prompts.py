"""Single-turn prompts: versioned templates, one-shot examples per backend, input-blind sources.

A template is a text file under ``templates/`` named ``<name>.txt`` (or any file a user names) with
``string.Template`` placeholders; ``$`` in the inserted problem source is never re-expanded. The
template's name and the sha256 of its text go into every sidecar line, so a changed template is
visible in the results.

The prompt never shows the problem's ``KBV`` extras (they may describe the hidden input
distributions and sizes used by the verified protocol).
"""

from __future__ import annotations

import ast
import hashlib
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DEFAULT_TEMPLATE = "kernelbench-v1"
BACKENDS = ("cuda", "triton")

_BACKEND_NAMES = {"cuda": "CUDA", "triton": "Triton"}
_BACKEND_RULES = {
    "cuda": (
        "Write the kernels in CUDA C++ and compile them inline with torch.utils.cpp_extension.load_inline."
    ),
    "triton": "Write the kernels in Triton (@triton.jit functions launched from Python).",
}
_BLIND_NOTE = (
    "\nThe concrete sizes and values of the inputs are deliberately not given (shown as `...`). "
    "The evaluation uses sizes and values that you do not know, so the code must be correct for any "
    "valid size, not specialised to one.\n"
)
_BLIND_MARK = "  # not given: chosen at evaluation time"
_PRECISION_NAMES = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


def precision_note(precision: str) -> str:
    """What the prompt says of a bf16 or fp16 evaluation ("" in fp32: KernelBench's own prompt)."""
    if precision == "fp32":
        return ""
    if precision not in _PRECISION_NAMES:
        raise PromptError(f"unknown precision {precision!r}; choose one of fp32, bf16, fp16")
    dtype = _PRECISION_NAMES[precision]
    return (
        f"\nThe kernel will be judged in {precision}: the model's floating-point parameters and inputs "
        f"are cast to {dtype} before forward is called, and its floating outputs must be {dtype}. "
        f"Computing in {precision} with float32 accumulation is expected; computing below {precision} "
        "(fp8, or long reductions accumulated in 16 bits) makes errors the evaluation rejects.\n"
    )


class PromptError(ValueError):
    """A template that cannot be found or rendered; the message says which and why."""


@dataclass(frozen=True)
class Template:
    """A prompt template: its name (the version), text and the sha256 of the text."""

    name: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt and what produced it."""

    text: str
    template: str
    template_sha256: str
    backend: str
    input_blind: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def _templates_dir() -> Path:
    return Path(str(resources.files("kbv.generate") / "templates"))


def available_templates() -> list[str]:
    """Names of the bundled templates."""
    return sorted(p.stem for p in _templates_dir().glob("*.txt") if not p.name.endswith(".py.txt"))


def load_template(name_or_path: str = DEFAULT_TEMPLATE) -> Template:
    """A bundled template by name, or a user's template file by path."""
    path = Path(name_or_path)
    if path.suffix and path.is_file():
        return Template(name=path.stem, text=path.read_text())
    bundled = _templates_dir() / f"{name_or_path}.txt"
    if bundled.is_file() and not name_or_path.endswith(".py"):
        return Template(name=name_or_path, text=bundled.read_text())
    raise PromptError(
        f"prompt template {name_or_path!r} is neither a file nor a bundled template "
        f"(bundled: {', '.join(available_templates())})"
    )


def _example(name: str) -> str:
    return (_templates_dir() / f"{name}.py.txt").read_text().rstrip("\n")


def build_prompt(
    source: str,
    backend: str = "cuda",
    template: Template | None = None,
    input_blind: bool = False,
    precision: str = "fp32",
) -> Prompt:
    """The single-turn prompt for one problem's source; ``precision`` (bf16, fp16) is said in it."""
    if backend not in BACKENDS:
        raise PromptError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    template = template or load_template()
    shown = strip_kbv_extras(source)
    if input_blind:
        shown = blind_inputs(shown)
    values = {
        "backend": backend,
        "backend_name": _BACKEND_NAMES[backend],
        "backend_rule": _BACKEND_RULES[backend],
        "example_problem": _example("example_problem"),
        "example_solution": _example(f"example_{backend}"),
        "problem_source": shown.rstrip("\n"),
        # (after the blind note: an fp32 prompt is KernelBench's, byte for byte as before)
        "input_note": (_BLIND_NOTE if input_blind else "") + precision_note(precision),
    }
    try:
        text = string.Template(template.text).substitute(values)
    except (KeyError, ValueError) as exc:
        raise PromptError(f"prompt template {template.name!r} cannot be rendered: {exc!r}") from exc
    return Prompt(
        text=text,
        template=template.name,
        template_sha256=template.sha256,
        backend=backend,
        input_blind=input_blind,
    )


def strip_kbv_extras(source: str) -> str:
    """The source without its module-level ``KBV = {...}`` assignment."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    lines = source.splitlines(keepends=True)
    spans = [
        (node.lineno, node.end_lineno or node.lineno)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "KBV" for t in node.targets)
    ]
    for start, end in sorted(spans, reverse=True):
        del lines[start - 1 : end]
    return "".join(lines)


def blind_inputs(source: str) -> str:
    """Replace concrete input sizes and values with ``...``.

    Module-level constants that are literal numbers (or tuples/lists of them) and that ``get_inputs``
    reads become ``...``, and so do the numeric literals inside ``get_inputs``. Constants read only
    by ``get_init_inputs`` stay: they define the model, not its inputs.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    input_names = {
        sub.id
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "get_inputs"
        for sub in ast.walk(node)
        if isinstance(sub, ast.Name)
    }
    edits: list[tuple[int, int, int, int, str]] = []  # (line, col, end_line, end_col, text)
    for node in tree.body:
        if (
            isinstance(node, (ast.Assign, ast.AnnAssign))
            and node.value is not None
            and _is_numeric_literal(node.value)
            and _assigned_names(node) & input_names
        ):
            value = node.value
            edits.append(
                (
                    value.lineno,
                    value.col_offset,
                    value.end_lineno or value.lineno,
                    value.end_col_offset or 0,
                    "..." + _BLIND_MARK,
                )
            )
        elif isinstance(node, ast.FunctionDef) and node.name == "get_inputs":
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and _is_number(sub.value):
                    edits.append(
                        (
                            sub.lineno,
                            sub.col_offset,
                            sub.end_lineno or sub.lineno,
                            sub.end_col_offset or 0,
                            "...",
                        )
                    )
    lines = source.splitlines(keepends=True)
    for line, col, end_line, end_col, text in sorted(edits, reverse=True):
        # ast offsets are in UTF-8 bytes; sources here are ASCII in practice, but stay exact.
        first = lines[line - 1].encode()
        last = lines[end_line - 1].encode()
        merged = first[:col].decode() + text + last[end_col:].decode()
        if text.endswith(_BLIND_MARK):
            merged = _drop_trailing_comment_dup(merged)
        lines[line - 1 : end_line] = [merged]
    return "".join(lines)


def _drop_trailing_comment_dup(line: str) -> str:
    # "x = ...  # not given ...  # original comment" would keep a comment that may state the size.
    head, mark, _rest = line.partition(_BLIND_MARK)
    return head + mark + ("\n" if line.endswith("\n") else "")


def _assigned_names(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, complex)) and not isinstance(value, bool)


def _is_numeric_literal(node: ast.expr) -> bool:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    if isinstance(value, (tuple, list)):
        return len(value) > 0 and all(_is_number(v) for v in value)
    return _is_number(value)
