"""How far is a mean computed from every other element, at a KernelBench problem's full size, under
each hidden distribution? The audit found 96_HuberLoss's `stride` mutant (element j taken as
element j - j % 2) passing every distribution of `verified` v2 on the H200; this measures why, on
the CPU, without a worker: the mutant's relative error in float64 next to the reduction floor.

    python benchmarks/strided_mean_at_scale.py --problem PATH/level1/96_HuberLoss.py \
        --distributions original sparse spiked --seeds 3 [--rows 32768] [--json OUT]

The problem must take two inputs and return a mean of per-element terms (96_HuberLoss,
94_MSELoss); --rows shrinks its batch. 1.07e9 elements need about 13 GB and 80 s a draw.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kbv import inputs
from kbv.correctness import reduction_floor
from kbv.problems import load_module
from kbv.protocol import VERIFIED

CHUNK = 1 << 26

TERMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "96_HuberLoss": lambda d: torch.where(d.abs() < 1, 0.5 * d * d, d.abs() - 0.5),
    "94_MSELoss": lambda d: d * d,
}


def strided_error(x: torch.Tensor, y: torch.Tensor, terms: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """(mutant - truth) / truth: the mutant's mean is twice the sum of the even terms over n."""
    xf, yf = x.reshape(-1), y.reshape(-1)
    total = difference = 0.0
    for start in range(0, xf.numel(), CHUNK):
        t = terms(xf[start : start + CHUNK].double() - yf[start : start + CHUNK].double())
        total += float(t.sum())
        difference += float((t[0::2] - t[1::2]).sum())
    return difference / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", type=Path, required=True)
    ap.add_argument("--distributions", nargs="+", default=list(inputs.BASE_DISTRIBUTIONS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=None, help="override the problem's batch_size")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    terms = TERMS.get(args.problem.stem)
    if terms is None:
        known = ", ".join(TERMS)
        raise SystemExit(f"{args.problem.stem}: its per-element terms are not known here (known: {known})")
    module = load_module(args.problem)
    if args.rows:
        module.batch_size = args.rows
    rows = []
    for distribution in args.distributions:
        for seed in range(args.seeds):
            started = time.perf_counter()
            x, y = inputs.make_inputs(module, distribution, 1000 + seed, "cpu")
            n = x.numel()
            error = strided_error(x, y, terms)
            del x, y
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
