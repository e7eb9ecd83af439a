"""How far do honest float32 summation orders land from the float64 truth? Measures a mean-squared
error (the loss reductions of issue 12) under kbv's six hidden distributions, for several lengths,
in four orders: PyTorch's own ``mean``, block partial sums with a second pass, and block sums added
one after another into one float32 value (the order of atomics), with 256- and 1024-element blocks.
Prints the worst relative error per order and length next to the reduction floor of ``verified``.

    python benchmarks/summation_orders.py [--lengths 65536 1048576 4194304] [--seeds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import types

import numpy as np
import torch

from kbv import inputs
from kbv.correctness import reduction_floor
from kbv.protocol import VERIFIED


def _problem(n: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(get_inputs=lambda: [torch.rand(n), torch.rand(n)])


def _orders(d2: torch.Tensor) -> dict[str, float]:
    n = d2.numel()
    out = {"torch_mean": float(d2.mean())}
    for block in (256, 1024):
        partial = d2.reshape(-1, block).sum(dim=1)
        out[f"blocks{block}_second_pass"] = float(partial.sum() / n)
        seq = np.add.accumulate(partial.numpy().astype(np.float32), dtype=np.float32)[-1]
        out[f"blocks{block}_atomics"] = float(np.float32(seq) / np.float32(n))
    return out


def measure(lengths: list[int], seeds: int) -> dict[str, dict[str, float]]:
    worst: dict[str, dict[str, float]] = {}
    for n in lengths:
        row: dict[str, float] = {}
        for dist in inputs.BASE_DISTRIBUTIONS:
            for s in range(seeds):
                p, t = inputs.make_inputs(_problem(n), dist, 1000 * s + 7, "cpu")
                truth = float(((p.double() - t.double()) ** 2).mean())
                for name, value in _orders((p - t) ** 2).items():
                    err = abs(value - truth) / abs(truth)
                    row[name] = max(row.get(name, 0.0), err)
                    row[f"{name}@{dist}"] = max(row.get(f"{name}@{dist}", 0.0), err)
        row["floor"] = reduction_floor(n, VERIFIED.correctness)
        row["u_sqrt_n"] = 2.0**-24 * math.sqrt(n)
        worst[str(n)] = row
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1 << 16, 1 << 20, 1 << 22])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    worst = measure(args.lengths, args.seeds)
    orders = [k for k in next(iter(worst.values())) if "@" not in k and k not in ("floor", "u_sqrt_n")]
    print("length     " + " ".join(f"{o:>24}" for o in orders) + f" {'floor':>10}")
    for n, row in worst.items():
        print(f"{n:>10} " + " ".join(f"{row[o]:24.3g}" for o in orders) + f" {row['floor']:10.3g}")
        for o in orders:
            by = {k.split("@")[1]: v for k, v in row.items() if k.startswith(o + "@")}
            print(f"    {o}: " + ", ".join(f"{d} {v:.2g}" for d, v in by.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(worst, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
