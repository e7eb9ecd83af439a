"""How far is a mean computed from every other element, at a KernelBench problem's full size, under
each hidden distribution? The audit found 96_HuberLoss's `stride` mutant (element j taken as
element j - j % 2) passing every distribution of `verified` v2 on the H200; this measures why, on
the CPU, without a worker: the mutant's relative error in float64 next to the reduction floor.

    python benchmarks/strided_mean_at_scale.py --problem PATH/level1/96_HuberLoss.py \
        --distributions original sparse spiked --seeds 3 [--rows 32768] [--json OUT]

The problem's own `Model` must return the mean of per-element terms of its inputs (96_HuberLoss,
94_MSELoss): it is run in float64 on chunks of them, whole and every other element. --rows shrinks
its batch. 1.07e9 elements need about 13 GB and 60-80 s a draw.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kbv import inputs
from kbv.correctness import reduction_floor
from kbv.problems import load_module
from kbv.protocol import VERIFIED

CHUNK = 1 << 26  # elements of each input per float64 call (even, so a chunk's strides are the whole's)


def strided_error(model: torch.nn.Module, inputs_: list[torch.Tensor]) -> float:
    """(mutant - truth) / truth, where the mutant's mean is the mean over the even elements."""
    flats = [t.reshape(-1) for t in inputs_]
    n = flats[0].numel()
    total = even = 0.0
    for start in range(0, n, CHUNK):
        chunk = [f[start : start + CHUNK].double() for f in flats]
        total += float(model(*chunk)) * chunk[0].numel()
        even += float(model(*[c[0::2] for c in chunk])) * chunk[0][0::2].numel()
    return (even / ((n + 1) // 2)) / (total / n) - 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", type=Path, required=True)
    ap.add_argument("--distributions", nargs="+", default=list(inputs.BASE_DISTRIBUTIONS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=None, help="override the problem's batch_size")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    module = load_module(args.problem)
    if args.rows:
        module.batch_size = args.rows
    model = module.Model(*module.get_init_inputs()).double()
    rows = []
    for distribution in args.distributions:
        for seed in range(args.seeds):
            started = time.perf_counter()
            drawn = inputs.make_inputs(module, distribution, 1000 + seed, "cpu")
            n = drawn[0].numel()
            with torch.no_grad():
                error = strided_error(model, drawn)
            del drawn
            floor = reduction_floor(n, VERIFIED.correctness)
            row = {"distribution": distribution, "seed": seed, "n": n, "rel_err": error, "floor": floor}
            rows.append(row)
            seconds = time.perf_counter() - started
            verdict = "outside" if abs(error) > floor else "inside"
            print(
                f"{distribution:10} seed {seed}  n {n:.3g}  rel err {error:+.2e}  "
                f"{verdict} the floor {floor:.1e}  ({seconds:.0f} s)",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
