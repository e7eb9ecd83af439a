"""What drawing a problem's hidden inputs costs, step by step (issue 11: the ``inputs`` step is most
of a large problem's correctness draw on the H200, in both workers).

Per problem and per distribution of the ``verified`` protocol (and ``spiked``), the median seconds
of: the problem's own ``get_inputs()`` (the original draw); the whole fp32 draw
(``kbv.inputs.make_draw``); its float64 upcast (``upcast_draw``, the reference's truth); the
observation probe's checksum of every input (``kbv.child.probes._checksum``); and the same draw
when the allocator has to map its memory again (``torch.cuda.empty_cache`` before it, as a worker
that hands its cache back pays).

    python benchmarks/input_cost.py --kernelbench ../shared/kernelbench --device cuda \\
        --problems 94_MSELoss 47_Sum_reduction_over_a_dimension --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from verified_cost import KERNELBENCH_SAMPLE  # noqa: E402

from kbv import inputs  # noqa: E402
from kbv.child.probes import _checksum  # noqa: E402
from kbv.problems._loader import load_module, load_problem  # noqa: E402
from kbv.problems.structure import input_structure  # noqa: E402
from kbv.protocol import VERIFIED  # noqa: E402

DISTRIBUTIONS = (*VERIFIED.correctness.distributions, "spiked")


def _seconds(fn: Any, device: torch.device, repeats: int, before: Any = None) -> float:
    samples = []
    for k in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn(k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _kernel_table(fn: Any, top: int = 8) -> list[list[Any]]:
    """The draw's most expensive device kernels: [name, calls, total ms], from torch's profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return [[e.key[:90], e.count, round(e.device_time_total / 1e3, 3)] for e in events[:top]]


def profile(path: Path, device: torch.device, repeats: int, kernels: bool = False) -> dict[str, Any]:
    problem = load_problem(path)
    module = load_module(path, sizes=problem.sizes_for(device.type))
    structure = input_structure(problem, str(device)).invariants or None
    row: dict[str, Any] = {"problem": path.stem, "distributions": {}}

    def draw(distribution: str, seed: int) -> list[Any]:
        return inputs.make_draw(module, distribution, seed, device, structure=structure)

    first = draw("original", 1)
    row["input_bytes"] = inputs.draw_bytes(first)
    del first
    torch.manual_seed(0)
    with torch.device(device):
        row["get_inputs_s"] = _seconds(lambda k: module.get_inputs(), device, repeats)
    for distribution in DISTRIBUTIONS:
        entry: dict[str, float] = {}
        entry["draw_s"] = _seconds(lambda k, d=distribution: draw(d, 100 + k), device, repeats)
        entry["draw_unmapped_s"] = _seconds(
            lambda k, d=distribution: draw(d, 200 + k),
            device,
            repeats,
            before=torch.cuda.empty_cache if device.type == "cuda" else None,
        )
        held = draw(distribution, 7)
        entry["upcast_s"] = _seconds(lambda k, h=held: inputs.upcast_draw(h), device, repeats)
        entry["checksums_s"] = _seconds(lambda k, h=held: [_checksum(a) for a in h], device, repeats)
        held = None
        if kernels and device.type == "cuda":
            entry_kernels = _kernel_table(lambda d=distribution: draw(d, 300))
            row.setdefault("kernels", {})[distribution] = entry_kernels
        row["distributions"][distribution] = {k: round(v, 4) for k, v in entry.items()}
        print(path.stem, distribution, row["distributions"][distribution], flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernelbench", required=True, type=Path, help="KernelBench's problems (level1/...)")
    parser.add_argument("--problems", nargs="+", required=True, help="problem names of the cost sample")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", action="store_true", help="also each draw's top device kernels")
    parser.add_argument("--json", type=Path, help="append one JSON row per problem here")
    args = parser.parse_args()
    device = torch.device(args.device)
    known = {stem: f"level{level}/{stem}.py" for level, stem in KERNELBENCH_SAMPLE}
    for name in args.problems:
        if name not in known:
            parser.error(f"{name} is not in verified_cost.py's sample; known: {', '.join(sorted(known))}")
        row = profile(args.kernelbench / known[name], device, args.repeats, args.kernels)
        if args.json:
            with args.json.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
