"""What sketching every timed call costs (kbv.sketch, ``timed_call_outputs``): per bundled problem, the
median time of one forward call of the reference Model and of the sketch of its outputs, at the
sizes the problem runs with on the device (the suite's ``cpu_sizes`` on the CPU), and what 30 timed
calls add to a batch. The sketch runs outside the timed region, so it never enters a sample; it
lengthens every batch's bracket, the candidate's and the baselines' alike.

    python benchmarks/sketch_cost.py                               # CPU, a few level-1/2 problems
    python benchmarks/sketch_cost.py --device cuda --all --json benchmarks/results/sketch-cost-cuda.json
    python benchmarks/sketch_cost.py --device cuda --elements 1610612736 --chunk-log2 20 22 24 25

``--elements`` times the sketch of one float32 tensor of that many elements (KernelBench's
elementwise problems return 1.6e9) with the chunk size (``kbv.sketch.CHUNK_ELEMENTS``,
``CUDA_CHUNK_ELEMENTS``) set to each ``--chunk-log2``,
next to a ReLU over the same tensor (what one timed call of such a problem costs);
``--fused-rows 64 256 1024`` times the fused Triton kernel too (``kbv._sketch_kernel``, at each
number of rows a program takes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kbv import sketch
from kbv.problems import bundled_suite_dir
from kbv.problems._loader import load_module, load_problem

DEFAULT = [
    "level1/1_ReLU.py",
    "level1/9_Softmax.py",
    "level1/20_MSELoss.py",
    "level1/25_Matmul_Square.py",
    "level1/28_Conv2d.py",
    "level2/1_Linear_GELU_LayerNorm.py",
    "level3/1_MLP.py",
]


def _median_s(fn, device: torch.device, repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(path: Path, device: torch.device, repeats: int) -> dict:
    problem = load_problem(path)
    module = load_module(path, sizes=problem.sizes_for(device.type))
    torch.manual_seed(0)
    with torch.device(device):
        model = module.Model(*module.get_init_inputs()).eval()
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in module.get_inputs()]
    with torch.no_grad():
        result = model(*args)
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        spec = {"seed": 1, "omega": [1.0] * len(outputs)}
        call = _median_s(lambda: model(*args), device, repeats)
        sketched = _median_s(lambda: sketch.sketch_outputs(outputs, spec, device), device, repeats)
    elements = sum(o.numel() for o in outputs if isinstance(o, torch.Tensor))
    return {
        "problem": f"{path.parent.name}/{path.name}",
        "output_elements": elements,
        "call_ms": call * 1e3,
        "sketch_ms": sketched * 1e3,
        "sketch_per_call": sketched / call if call else None,
        "per_batch_of_30_ms": 30 * sketched * 1e3,
    }


def measure_size(elements: int, chunk_log2: list[int], device: torch.device, repeats: int) -> list[dict]:
    """The sketch of one float32 tensor of ``elements`` at several chunk sizes, and a ReLU over it."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(elements, device=device, generator=generator)
    relu_ms = _median_s(lambda: torch.relu(x), device, repeats) * 1e3
    rows, kept = [], (sketch.CHUNK_ELEMENTS, sketch.CUDA_CHUNK_ELEMENTS)
    try:
        for log2 in chunk_log2:
            sketch.CHUNK_ELEMENTS = sketch.CUDA_CHUNK_ELEMENTS = 1 << log2
            ms = _median_s(lambda: sketch.sketch_tensor(x, 1, 0, 1.0), device, repeats) * 1e3
            rows.append({"elements": elements, "chunk_log2": log2, "sketch_ms": ms, "relu_ms": relu_ms})
            print(f"elements {elements} chunk 2^{log2}: sketch {ms:.2f} ms, relu {relu_ms:.3f} ms")
    finally:
        sketch.CHUNK_ELEMENTS, sketch.CUDA_CHUNK_ELEMENTS = kept
    return rows


def measure_fused(elements: int, rows_per_program: list[int], device: torch.device, repeats: int) -> list:
    """The same sketch through the fused Triton kernel (``kbv._sketch_kernel``), at several numbers
    of rows per program, with its largest difference from the torch path."""
    from kbv import _sketch_kernel

    x = torch.randn(elements, device=device, generator=torch.Generator(device=device).manual_seed(0))
    plain = sketch.sketch_tensor(x, 1, 0, 1.0)
    rows, kept = [], (sketch._FUSED, _sketch_kernel.ROWS_PER_PROGRAM)
    try:
        sketch._FUSED = _sketch_kernel
        for count in rows_per_program:
            _sketch_kernel.ROWS_PER_PROGRAM = count
            fused = sketch.sketch_tensor(x, 1, 0, 1.0)
            ms = _median_s(lambda: sketch.sketch_tensor(x, 1, 0, 1.0), device, repeats) * 1e3
            gap = max(abs(a - b) for key in ("re", "im") for a, b in zip(fused[key], plain[key]))
            row = {"elements": elements, "fused_rows_per_program": count, "sketch_ms": ms, "max_gap": gap}
            rows.append(row)
            print(f"elements {elements} fused, {count} rows a program: {ms:.2f} ms, gap {gap:.3g}")
    finally:
        sketch._FUSED, _sketch_kernel.ROWS_PER_PROGRAM = kept
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--all", action="store_true", help="every bundled problem, not the default few")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--elements", type=int, default=None, help="time one tensor of this size instead")
    parser.add_argument("--chunk-log2", type=int, nargs="+", default=[22])
    parser.add_argument(
        "--fused-rows", type=int, nargs="*", default=[], help="with --elements: the Triton kernel too"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.elements:
        rows = measure_size(args.elements, args.chunk_log2, device, min(args.repeats, 10))
        if args.fused_rows:
            rows += measure_fused(args.elements, args.fused_rows, device, min(args.repeats, 10))
        if args.json:
            info = {"device": str(device), "torch": torch.__version__}
            args.json.write_text(json.dumps({**info, "rows": rows}))
        return
    suite = bundled_suite_dir()
    paths = sorted(suite.glob("level*/*.py")) if args.all else [suite / p for p in DEFAULT]
    rows = [measure(p, device, args.repeats) for p in paths]
    print(
        f"{'problem':40s} {'elements':>10s} {'call ms':>9s} {'sketch ms':>9s} {'ratio':>6s} {'+batch ms':>9s}"
    )
    for r in rows:
        print(
            f"{r['problem']:40s} {r['output_elements']:10d} {r['call_ms']:9.3f} {r['sketch_ms']:9.3f} "
            f"{r['sketch_per_call']:6.2f} {r['per_batch_of_30_ms']:9.1f}"
        )
    if args.json:
        info = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads()}
        args.json.write_text(json.dumps({"environment": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
