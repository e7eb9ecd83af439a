"""Which problems run an operator that the TF32 flags change (``kbv.child.tf32_ops``)?

Each problem's ``Model`` runs once on the meta device (no memory, no GPU) under the same operator
recorder that the trusted reference worker uses on the GPU; the list says, per problem, the
TF32-sensitive operators seen. A problem with none has ``eager_tf32`` left out of its timing.

    python benchmarks/tf32_sensitive_problems.py ../shared/kernelbench/level1 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kbv.child.tf32_ops import recorder, summary
from kbv.problems import discover
from kbv.problems._loader import load_module


def sensitive_operators(path: Path) -> dict:
    module = load_module(str(path), sizes={})
    with torch.device("meta"):
        model = module.Model(*module.get_init_inputs())
        args = module.get_inputs()
    operators = recorder()
    with torch.no_grad(), operators:
        model(*args)
    return summary(operators.names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problems", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = {}
    for path in discover(args.problems):
        try:
            rows[path.stem] = sensitive_operators(path)
        except Exception as exc:  # a model that cannot run on meta tensors: say so, go on
            rows[path.stem] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        print(path.stem, rows[path.stem].get("sensitive", rows[path.stem].get("error")))
    insensitive = [name for name, row in rows.items() if row.get("sensitive") == [] and row.get("operators")]
    print(f"{len(insensitive)} of {len(rows)} problems run no TF32-sensitive operator")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
