"""Controls and mutants of one problem, written as candidate files and checked on the trusted side.

Every generated source is run here, in the parent, against the reference (it is made from the
problem's own source only, so it is as trusted as the problem): a control that fails to run or
changes the output's structure is a generator defect (reported, not evaluated); a mutant that does
not run or changes the output's shape or dtype is not viable (every protocol rejects it by shape);
a mutant whose outputs equal the reference's on the problem's own declared domain and structure is
equivalent and left out. The domain inputs are the same for every protocol audited: kbv's six input
families under ``KBV["domain"]`` and the structure of ``kbv.problems.structure``, two seeds each,
never the distributions of the protocol under test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import sqlite3
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kbv import inputs as kbv_inputs
from kbv.error_stats import error_stats
from kbv.problems import Problem
from kbv.problems.structure import input_structure
from kbv.protocol_audit import _sources as src

SHORT_REDUCTION = src.SHORT_REDUCTION  # the longest reduction a sequential control may sum
#: Kept AST mutants per problem and kind (a long chain would otherwise dominate the counts).
MAX_SITES = 3
EQUIVALENCE_SEEDS = (1, 2)
EQUIVALENCE_RTOL = 1e-6


class NotJudgedHere(LookupError):
    """A report from the store found no trusted run of a problem (it runs none itself)."""


class JudgeOutOfMemory(RuntimeError):
    """The trusted run of a problem's controls and mutants needed more device memory than was free."""


@dataclass(frozen=True)
class Spec:
    """One generated candidate and what the trusted run made of it."""

    problem: str
    role: str  # "control" or "mutant"
    kind: str
    variant: str  # e.g. the dropped operation
    source: str
    status: str  # "evaluate", "equivalent", "not_viable", "generator_error", "skipped"
    note: str = ""
    path: str = ""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            "problem": self.problem,
            "role": self.role,
            "kind": self.kind,
            "variant": self.variant,
            "status": self.status,
            "note": self.note,
            "path": self.path,
            "source_sha256": self.sha256,
        }


class SpecCache:
    """What :func:`problem_specs` found per problem, kept in a table of the audit's own store file
    (``audit_specs``), so that an audit resumed, or only reported (``evaluate=False``), does not run
    every control and mutant of a finished problem again at its full size: at KernelBench sizes that
    is 12 draws of every generated source and of the reference, tens of seconds a problem on the
    H200. The key holds everything the result depends on: the problem's source and sizes, the kind
    of device, the torch version and the source of the modules that generate, draw and judge."""

    VERSION = 1
    _MODULES = (
        "kbv.protocol_audit._generate",
        "kbv.protocol_audit._sources",
        "kbv.inputs",
        "kbv.problems.structure",
    )

    def __init__(self, db: str | Path) -> None:
        self.db = Path(db)

    def key(
        self, problem: Problem, device: str, torch_version: str | None = None, precision: str = "fp32"
    ) -> str:
        """``torch_version``: the one the trusted run used (default: this process's); a report made
        elsewhere from the store names the version its records carry."""
        kind = torch.device(device).type
        parts = [
            f"audit-specs/{self.VERSION}",
            kind,
            torch_version or torch.__version__,
            json.dumps(problem.sizes_for(kind), sort_keys=True, default=str),
            problem.source,
            *(Path(str(sys.modules[name].__file__)).read_text() for name in self._MODULES),
        ]
        if precision != "fp32":  # (fp32 keys as before)
            parts.append(f"precision={precision}")
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def get(self, key: str) -> list[dict[str, Any]] | None:
        if not self.db.is_file():
            return None
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            if not conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'audit_specs'"
            ).fetchone():
                return None
            row = conn.execute("SELECT specs FROM audit_specs WHERE key = ?", (key,)).fetchone()
        return None if row is None else list(json.loads(row[0]))

    def put(self, key: str, specs: list[Spec]) -> None:
        items = [
            {**dataclasses.asdict(spec), "path": Path(spec.path).name if spec.path else ""} for spec in specs
        ]
        from kbv.store import Store

        self.db.parent.mkdir(parents=True, exist_ok=True)
        Store(self.db).close()  # a kbv store first: its table lives beside the store's own
        with contextlib.closing(sqlite3.connect(self.db)) as conn, conn:
            conn.execute("CREATE TABLE IF NOT EXISTS audit_specs (key TEXT PRIMARY KEY, specs TEXT NOT NULL)")
            conn.execute("INSERT OR REPLACE INTO audit_specs VALUES (?, ?)", (key, json.dumps(items)))


def _restored(item: dict[str, Any], out_dir: Path) -> Spec:
    """A cached spec, its source written under this audit's ``out_dir`` where it is not already."""
    name = item.get("path") or ""
    path = out_dir / item["problem"] / name if name else None
    if path is not None and (not path.is_file() or path.read_text() != item["source"]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(item["source"])
    return Spec(**{**item, "path": str(path) if path is not None else ""})


@dataclass
class _Draft:
    role: str
    kind: str
    variant: str
    make: Callable[[], str]
    extra: dict[str, Any] = field(default_factory=dict)


def problem_specs(
    problem: Problem,
    device: str,
    out_dir: Path,
    cache: SpecCache | None = None,
    *,
    recorded_torch: str | None = None,
    precision: str = "fp32",
) -> list[Spec]:
    """Every control and mutant of ``problem``, written under ``out_dir/<problem>/`` and checked.
    With ``cache``, a problem already checked by the same code on the same kind of device is not
    run again: its specs are read back and their files written where they are missing.
    ``recorded_torch`` (a report from the store, which runs nothing): only what the cache holds for
    that torch version, else :class:`NotJudgedHere`. ``precision``: the evaluation precision the
    audit judges in (its controls and precision mutants differ; see :func:`_drafts`)."""
    if cache is None:
        return _problem_specs(problem, device, out_dir, precision)
    key = cache.key(problem, device, recorded_torch, precision)
    known = cache.get(key)
    if known is not None:
        return [_restored(item, out_dir) for item in known]
    if recorded_torch is not None:
        raise NotJudgedHere(
            f"the store holds no trusted run of it on {torch.device(device).type} with torch "
            f"{recorded_torch} by this version of the audit's judge: run the audit (not --report-only) "
            "on that machine"
        )
    specs = _problem_specs(problem, device, out_dir, precision)
    cache.put(key, specs)
    return specs


def _problem_specs(problem: Problem, device: str, out_dir: Path, precision: str = "fp32") -> list[Spec]:
    sizes = problem.sizes_for(torch.device(device).type)
    reference = problem.load(sizes)
    draws = _domain_draws(problem, reference, device)
    # Only which input an ``input`` mutant returns is kept, not the tensors: at KernelBench sizes
    # an output and an input held through the whole problem are 13 GB of the GPU.
    input_index = _same_shape_input(next(_calls(reference, "Model", draws[:1], device)), draws[0]())
    specs: list[Spec] = []
    for index, draft in enumerate(_drafts(problem, input_index, precision)):
        kept = sum(1 for s in specs if s.kind == draft.kind and s.status == "evaluate")
        if draft.kind in ("drop_op", "relu_identity") and kept >= MAX_SITES:
            specs.append(
                Spec(
                    problem.name,
                    draft.role,
                    draft.kind,
                    draft.variant,
                    "",
                    "skipped",
                    f"{MAX_SITES} {draft.kind} mutants already kept",
                )
            )
            continue
        specs.append(_check(problem, draft, sizes, reference, draws, out_dir, index, device))
    return specs


def _drafts(problem: Problem, input_index: int | None, precision: str = "fp32") -> Iterator[_Draft]:
    """The controls and mutants of ``problem``. In bf16 or fp16 the TF32 control is left out (TF32
    is fp32's alone), the reordered controls accumulate in float32, and the precision mutants are
    the formats below the evaluated one (:data:`kbv.protocol_audit._sources.PRECISION_MUTANTS`)."""
    text = problem.source
    yield _Draft("control", "reference", "", lambda: src.reference_control(text))
    if precision == "fp32" and src.uses_tf32_ops(text):
        yield _Draft("control", "tf32", "", lambda: src.tf32_control(text))
    for order in ("blocked", "reversed", "sequential"):
        yield _Draft(
            "control",
            "reordered",
            order,
            partial(src.reordered_control, text, order, precision),
            {"order": order},
        )
    lower = src.PRECISION_MUTANTS[precision]
    for kind in ("zeros", "constant", "cached", "scaled", *lower, *src.SAMPLINGS):
        yield _Draft("mutant", kind, "", partial(src.wrapped_mutant, text, kind))
    if input_index is not None:
        yield _Draft(
            "mutant",
            "input",
            f"input {input_index}",
            lambda: src.wrapped_mutant(text, "input", input_index=input_index),
        )
    for site, what in enumerate(src.drop_sites(text)):
        yield _Draft("mutant", "drop_op", what, partial(src.drop_op_mutant, text, site))
    for site, what in enumerate(src.relu_sites(text)):
        yield _Draft("mutant", "relu_identity", what, partial(src.relu_identity_mutant, text, site))


def _same_shape_input(outputs: list[Any], inputs: list[Any]) -> int | None:
    """The first input an ``input`` mutant can return: same shape and dtype as the only output."""
    if len(outputs) != 1 or not isinstance(outputs[0], torch.Tensor):
        return None
    out = outputs[0]
    for i, value in enumerate(inputs):
        if isinstance(value, torch.Tensor) and value.shape == out.shape and value.dtype == out.dtype:
            return i
    return None


def _check(
    problem: Problem,
    draft: _Draft,
    sizes: dict[str, Any],
    reference: ModuleType,
    draws: list[Draw],
    out_dir: Path,
    index: int,
    device: str,
) -> Spec:
    base = {"problem": problem.name, "role": draft.role, "kind": draft.kind, "variant": draft.variant}
    try:
        body = draft.make()
    except src.SourceError as exc:
        return Spec(**base, source="", status="skipped", note=str(exc))
    source = src.header(
        draft.role, draft.kind + (f" ({draft.variant})" if draft.variant else ""), problem.name
    ) + src.with_sizes(body, sizes)
    path = out_dir / problem.name / f"{index:02d}_{draft.role}_{draft.kind}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text() != source:
        path.write_text(source)
    status, note = _judge(draft, path, reference, draws, device)
    return Spec(**base, source=source, status=status, note=note, path=str(path))


def _judge(
    draft: _Draft, path: Path, reference: ModuleType, draws: list[Draw], device: str
) -> tuple[str, str]:
    """The generated source against the reference, one draw at a time: at KernelBench sizes (6.4 GB
    inputs) every draw's inputs and outputs held at once would not fit a GPU."""
    failed = "generator_error" if draft.role == "control" else "not_viable"
    same = draft.role == "mutant"  # equivalence is asked of mutants only
    module = None
    try:
        module = _import(path)
        calls = zip(
            _calls(module, "ModelNew", draws, device, reference), _calls(reference, "Model", draws, device)
        )
        for got, expected in calls:
            shape_note = _structure_difference(got, expected)  # on every draw: a shape may vary
            if shape_note:
                return failed, shape_note
            same = same and _same_outputs(got, expected)
            del got, expected  # not held while the next draw's calls run
    except torch.OutOfMemoryError as exc:
        # The trusted run's own limit, not a property of the generated source: calling it not viable
        # would leave a live mutant out of the counts (on the H200, identity-for-ReLU was).
        raise JudgeOutOfMemory(
            f"the audit's trusted run of the {draft.role} {draft.kind!r} ran out of device memory "
            f"({str(exc).splitlines()[0] if str(exc) else 'out of memory'}). Nothing of this problem "
            "was kept, so the next audit call checks it again; free the device, or audit the "
            "problem in a part of its own"
        ) from exc
    except Exception as exc:  # a generated source that cannot run here would only crash a worker
        if type(exc).__name__ == src.LONG_REDUCTION_ERROR:
            return (
                "skipped",
                f"a reduction of length {exc.args[0]} is not short (> {SHORT_REDUCTION}): no "
                "sequential float32 control",
            )
        return (
            failed,
            f"raises on the trusted run ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})",
        )
    finally:
        if module is not None:
            _forget(module)
    if same:
        return "equivalent", "equals the reference on the problem's domain and structure"
    return "evaluate", ""


#: A draw of inputs, made when it is called (seeded: the same inputs every time).
Draw = Callable[[], list[Any]]


def _domain_draws(problem: Problem, module: ModuleType, device: str) -> list[Draw]:
    """Inputs that cover the problem's declared domain (the same for every protocol audited), each
    made afresh when called, so that no more than one draw is alive at a time."""
    domain = problem.extras.get("domain", "any")
    structure = input_structure(problem, device).applied()
    return [
        partial(kbv_inputs.make_inputs, module, name, seed, device, domain=domain, structure=structure)
        for name in kbv_inputs.BASE_DISTRIBUTIONS
        for seed in EQUIVALENCE_SEEDS
    ]


def _calls(
    module: ModuleType, cls: str, draws: list[Draw], device: str, reference: ModuleType | None = None
) -> Iterator[list[Any]]:
    """One model instance called on every draw in turn (a cache across calls shows), each on inputs
    of its own (a model that writes its inputs changes nobody else's); the outputs one draw at a time.
    The model is made on the draws' ``device``, as a worker makes it (on the H200 a convolution's
    weights were left on the CPU and the problem was left out of the audit)."""
    init = (reference or module).get_init_inputs()
    with torch.device(device):
        torch.manual_seed(0)
        model = getattr(module, cls)(*init)
        if reference is not None and isinstance(model, torch.nn.Module):
            torch.manual_seed(0)
            model.load_state_dict(reference.Model(*init).state_dict(), strict=True)
    model = model.to(device).eval() if isinstance(model, torch.nn.Module) else model
    for make in draws:
        with torch.no_grad():
            out = model(*make())
        outputs = [
            t.clone() if isinstance(t, torch.Tensor) else t
            for t in (out if isinstance(out, (tuple, list)) else [out])
        ]
        del out  # the copy is what is compared: the call's own output is not held beside it
        yield outputs


def _import(path: Path) -> ModuleType:
    name = f"kbv_audit_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _forget(module: ModuleType) -> None:
    """Drop a judged source's module and what it holds: left in ``sys.modules``, a ``cached``
    mutant's first output (6.4 GB for a KernelBench ReLU) stayed on the GPU for the rest of the
    audit process, one more for every problem, beside the workers of every later evaluation."""
    sys.modules.pop(module.__name__, None)
    module.__dict__.clear()  # its functions refer to this dict: clearing frees it now, not at a gc


def _structure_difference(got: list[Any], expected: list[Any]) -> str:
    """One draw's outputs against the reference's: type, shape, dtype and count."""
    for a, b in zip(got, expected, strict=False):
        if type(a) is not type(b) or (
            isinstance(b, torch.Tensor) and (a.shape != b.shape or a.dtype != b.dtype)
        ):
            return (
                f"changes the output's structure ({_describe(a)} instead of {_describe(b)}): rejected "
                "by shape alone"
            )
    if len(got) != len(expected):
        return f"returns {len(got)} outputs instead of {len(expected)}: rejected by structure alone"
    return ""


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return type(value).__name__


def _same_outputs(got: list[Any], expected: list[Any]) -> bool:
    return all(_same(a, b) for a, b in zip(got, expected, strict=True))


def _same(a: Any, b: Any) -> bool:
    """Equal within ``EQUIVALENCE_RTOL`` of the output's scale, NaN and inf positions alike. Judged on
    the correctness check's own statistics (:func:`kbv.error_stats.error_stats`, float64 chunk by
    chunk): a whole KernelBench output in float64, with its masks and their indices, once asked for
    a 64 GiB allocation on the H200."""
    if not isinstance(b, torch.Tensor):
        return bool(a == b)
    if not b.is_floating_point():
        return torch.equal(a, b)
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    stats = error_stats(a, b)
    return stats["mismatch"] == 0 and stats["max_abs"] <= EQUIVALENCE_RTOL * stats["peak"]
