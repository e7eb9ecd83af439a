"""The protocol audit (``kbv protocol audit``) on the bundled suite or a fixed KernelBench sample.

CPU, the bundled suite (the figures in docs/protocol-audit.md):

    python benchmarks/protocol_audit.py --device cpu --db kbv-results/audit-cpu.sqlite

GPU, the fixed KernelBench sample below (30 level-1 and 10 level-2 files), in parts that each fit a
10-minute command; every record is stored in ``--db`` as it finishes, so a part cut short resumes
with the same command, and ``--report`` prints the whole sample's figures once every part is done:

    python benchmarks/protocol_audit.py --kernelbench ../shared/kernelbench --device cuda \\
        --db $OUT/audit.sqlite --part 1/20
    python benchmarks/protocol_audit.py --kernelbench ../shared/kernelbench --device cuda \\
        --db $OUT/audit.sqlite --report --json $OUT/audit.jsonl

``--parts K1-K2/N`` runs parts K1 to K2 one after another in one process (the fork server, the
CUDA context and the device probe are then paid once); a finished part costs little there, since
what the trusted run found per problem is kept in the store file (``audit_specs``). On the H200 a
part of two problems took about 2 minutes (``benchmarks/results/2026-12-02-h200-parameter-inbox-cost/``).

CPU rehearsal of that sample: ``--device cpu --cpu-sizes`` shrinks each copy's size constants and
shapes in its source (:func:`shrunk_sizes`), so the whole sample runs on two cores in minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

#: The fixed KernelBench sample: level-1 and level-2 file names of /work/shared/kernelbench.
KERNELBENCH_SAMPLE: tuple[str, ...] = (
    "level1/1_Square_matrix_multiplication_.py",
    "level1/4_Matrix_vector_multiplication_.py",
    "level1/9_Tall_skinny_matrix_multiplication_.py",
    "level1/13_Matmul_for_symmetric_matrices.py",
    "level1/15_Matmul_for_lower_triangular_matrices.py",
    "level1/19_ReLU.py",
    "level1/20_LeakyReLU.py",
    "level1/21_Sigmoid.py",
    "level1/22_Tanh.py",
    "level1/23_Softmax.py",
    "level1/24_LogSoftmax.py",
    "level1/26_GELU_.py",
    "level1/31_ELU.py",
    "level1/32_HardTanh.py",
    "level1/33_BatchNorm.py",
    "level1/36_RMSNorm_.py",
    "level1/37_FrobeniusNorm_.py",
    "level1/40_LayerNorm.py",
    "level1/42_Max_Pooling_2D.py",
    "level1/47_Sum_reduction_over_a_dimension.py",
    "level1/48_Mean_reduction_over_a_dimension.py",
    "level1/51_Argmax_over_a_dimension.py",
    "level1/63_conv_standard_2D__square_input__square_kernel.py",
    "level1/89_cumsum.py",
    "level1/90_cumprod.py",
    "level1/94_MSELoss.py",
    "level1/95_CrossEntropyLoss.py",
    "level1/96_HuberLoss.py",
    "level1/98_KLDivLoss.py",
    "level1/100_HingeLoss.py",
    "level2/1_Conv2D_ReLU_BiasAdd.py",
    "level2/9_Matmul_Subtract_Multiply_ReLU.py",
    "level2/12_Gemm_Multiply_LeakyReLU.py",
    "level2/14_Gemm_Divide_Sum_Scaling.py",
    "level2/17_Conv2d_InstanceNorm_Divide.py",
    "level2/29_Matmul_Mish_Mish.py",
    "level2/30_Gemm_GroupNorm_Hardtanh.py",
    "level2/33_Gemm_Scale_BatchNorm.py",
    "level2/40_Matmul_Scaling_ResidualAdd.py",
    "level2/45_Gemm_Sigmoid_LogSumExp.py",
)


def parse_part(text: str) -> tuple[int, int]:
    k, n = (int(x) for x in text.split("/"))
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--part K/N needs 1 <= K <= N, not {text}")
    return k, n


def parse_parts(text: str) -> list[tuple[int, int]]:
    """``K1-K2/N``: parts K1 to K2 of N, in order (one process for all: the fork server, the CUDA
    context and the device probe are paid once, not once a part)."""
    span, _, n = text.partition("/")
    first, _, last = span.partition("-")
    try:
        parts = [(k, int(n)) for k in range(int(first), int(last or first) + 1)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--parts needs K1-K2/N, not {text}") from None
    if not parts or not all(1 <= k <= n <= 100 for k, n in parts):
        raise argparse.ArgumentTypeError(f"--parts K1-K2/N needs 1 <= K1 <= K2 <= N <= 100, not {text}")
    return parts


def sample_dir(root: Path, work: Path, part: tuple[int, int], cpu_sizes: bool = False) -> Path:
    """The part's problems copied into ``work`` with their level directories (same sources, so
    the same store keys whichever part they are evaluated in). ``cpu_sizes`` shrinks each copy for
    a CPU rehearsal (:func:`shrunk_sizes`, written into the source by :func:`with_constants`)."""
    k, n = part
    chosen = [name for i, name in enumerate(KERNELBENCH_SAMPLE) if i % n == k - 1]
    missing = [name for name in chosen if not (root / name).is_file()]
    if missing:
        raise SystemExit(
            f"not in {root}: {', '.join(missing)}; give --kernelbench the KernelBench tree (level1/, level2/)"
        )
    target = work / f"part-{k}-of-{n}"
    shutil.rmtree(target, ignore_errors=True)
    for name in chosen:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        source = (root / name).read_text()
        if cpu_sizes:
            sizes = shrunk_sizes(source)
            note = f"# kbv: shrunk for a CPU rehearsal of the GPU sample: {sizes}\n"
            source = note + with_constants(source, sizes)
        (target / name).write_text(source)
    return target


#: Elements (inputs, outputs and parameters) a problem of the CPU rehearsal may hold.
CPU_REHEARSAL_ELEMENTS = 1 << 19


def shrunk_sizes(source: str) -> dict[str, Any]:
    """Size constants that make a KernelBench problem small enough for a CPU rehearsal: every
    top-level integer above 4, alone or in a tuple of integers, halved together until its inputs,
    outputs and parameters hold at most CPU_REHEARSAL_ELEMENTS elements (counted on the meta
    device, so nothing is allocated). Only the constants that changed are returned.

    A rehearsal, not the measurement: reduction lengths shrink with the sizes, so the GPU run at
    KernelBench's sizes is still the one that counts. What it finds early is a generator or a
    protocol that fails on KernelBench-style code at all."""
    original = {k: v for k, v in _constants(source).items() if max(_ints(v)) > 4}
    sizes = dict(original)
    for _ in range(40):
        if _elements(with_constants(source, sizes)) <= CPU_REHEARSAL_ELEMENTS:
            break
        halved = {k: _halved(v) for k, v in sizes.items()}
        if halved == sizes:
            break
        sizes = halved
    return {k: v for k, v in sizes.items() if v != original[k]}


def _constants(source: str) -> dict[str, Any]:
    """Top-level ``NAME = <expression>`` assignments whose value is an int, or a tuple of ints (a
    shape), once the file has run. Shapes shrink with the integers: ``100_HingeLoss`` broadcasts
    its (batch,) targets along ``input_shape``'s dimension, which must stay equal to ``batch_size``."""
    import ast

    names = [
        node.targets[0].id
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    ]
    module = _load(source)
    values = {n: getattr(module, n, None) for n in names}
    return {n: v for n, v in values.items() if _ints(v)}


def _ints(value: Any) -> tuple[int, ...]:
    """The integers of a size constant (empty for anything else)."""
    if type(value) is int:
        return (value,)
    if isinstance(value, tuple) and value and all(type(v) is int for v in value):
        return value
    return ()


def _halved(value: Any) -> Any:
    """Half of each integer above 4, never below 4 (a kernel size of 3 or a dim of 1 stays)."""
    if type(value) is int:
        return max(4, value // 2) if value > 4 else value
    return tuple(_halved(v) for v in value)


def with_constants(source: str, sizes: dict[str, Any]) -> str:
    """``source`` with the right-hand side of each top-level ``NAME = ...`` in ``sizes`` replaced by
    its new value. In the source, not as a size override after import: a shape computed at import
    from a constant (a bias shape from ``out_channels``) then follows it."""
    import ast

    lines = source.splitlines(keepends=True)
    nodes = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id in sizes
    ]
    for node in sorted(nodes, key=lambda n: n.lineno, reverse=True):  # later spans first
        value = node.value
        assert value.end_lineno is not None and value.end_col_offset is not None
        head = lines[value.lineno - 1][: value.col_offset]
        tail = lines[value.end_lineno - 1][value.end_col_offset :]
        lines[value.lineno - 1 : value.end_lineno] = [f"{head}{sizes[node.targets[0].id]!r}{tail}"]
    return "".join(lines)


def _load(source: str):
    import tempfile

    from kbv.problems import load_module

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as handle:
        handle.write(source)
    try:
        return load_module(handle.name)
    finally:
        Path(handle.name).unlink()


def _elements(source: str) -> int:
    import torch

    module = _load(source)
    with torch.device("meta"):
        inputs = module.get_inputs()
        model = module.Model(*module.get_init_inputs())
        try:  # the outputs count too: a tall-skinny matmul's is M x M from two thin inputs
            outputs = model(*inputs)
        except Exception:  # an operator without a meta kernel: inputs and parameters only
            outputs = ()
    tensors = [*inputs, *(outputs if isinstance(outputs, (tuple, list)) else [outputs])]
    count = sum(t.numel() for t in tensors if isinstance(t, torch.Tensor))
    return count + sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--kernelbench", type=Path, default=None, help="a KernelBench tree; default: kbv's bundled suite"
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--db", type=Path, default=Path("kbv-results/audit.sqlite"))
    ap.add_argument(
        "--part",
        type=parse_part,
        default=(1, 1),
        metavar="K/N",
        help="every N-th sample problem from the K-th",
    )
    ap.add_argument(
        "--parts",
        type=parse_parts,
        default=None,
        metavar="K1-K2/N",
        help="parts K1 to K2 of N, one after another in this process (instead of --part)",
    )
    ap.add_argument(
        "--report",
        action="store_true",
        help="evaluate nothing: the whole sample's figures from what --db holds",
    )
    ap.add_argument(
        "--cpu-sizes",
        action="store_true",
        help="shrink the sample's copies for a CPU rehearsal (see shrunk_sizes); use with --device cpu",
    )
    ap.add_argument("--protocol", action="append", default=None)
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    ap.add_argument(
        "--kinds",
        type=lambda text: tuple(k for k in text.split(",") if k),
        default=None,
        metavar="K1,K2",
        help="audit only these control and mutant kinds, e.g. zeros,constant,first_rows,stride,head_tail",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write one JSON summary per protocol here")
    ap.add_argument(
        "--html", type=Path, default=None, help="also write the HTML report with the audit's section here"
    )
    args = ap.parse_args(argv)
    if args.report or args.kernelbench is None:
        _audit_part(args, (1, 1))
        return 0
    for part in args.parts or [args.part]:
        try:
            _audit_part(args, part)
        except Exception as exc:
            # A part's trusted runs happen in this process: one that broke its CUDA context would
            # break every part after it. So stop, and say which part (PART_FAILED + K): the caller
            # goes on from part K + 1 in a fresh process (benchmarks/gpu_steps.sh, step audit).
            print(f"part {part[0]}/{part[1]} stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
            return PART_FAILED + part[0]
    return 0


#: The exit status of ``--parts`` when part K raised is PART_FAILED + K (K <= 100).
PART_FAILED = 100


def _audit_part(args: argparse.Namespace, part: tuple[int, int]) -> None:
    from rich.console import Console

    from kbv.problems import bundled_suite_dir
    from kbv.protocol_audit import audit_protocols
    from kbv.protocol_audit._cli import render

    if args.kernelbench is None:
        problems = bundled_suite_dir()
    else:
        problems = sample_dir(
            args.kernelbench, args.db.parent / "audit-sample", part, cpu_sizes=args.cpu_sizes
        )
    result = audit_protocols(
        problems,
        args.protocol or ["standard", "verified"],
        device=args.device,
        db=args.db,
        console=Console(stderr=True),
        evaluate=not args.report,
        precision=args.precision,
        kinds=args.kinds,
    )
    render(result.summaries, Console())
    for what, message in result.errors:
        print(f"left out: {what}: {message}", file=sys.stderr)
    if args.json:
        args.json.write_text("".join(json.dumps(s, default=list) + "\n" for s in result.summaries))
    if args.html:
        from kbv.protocol_audit._html import write_audit_html

        write_audit_html(result, args.html)


if __name__ == "__main__":
    raise SystemExit(main())
