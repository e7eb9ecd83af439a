"""The remembered-result fixtures under both protocols, beside an honest kernel of the same problem.

    python benchmarks/cache_fixtures.py --device cpu --out results.jsonl [--repeat 2]

Evaluates ``tests/fixtures/candidates/hacks/cache_{fingerprint61,pointer_version,checksum,
last_output}.py`` and two honest matmuls (``torch.matmul`` as it is, written to a temporary file,
and ``honest/matmul_out_buffer.py``) under ``standard`` and ``verified``, one after another, and
appends one JSON line per evaluation: outcome, ``speedup.best``, the candidate's median, the
findings that failed or warned, and the speedup over the honest plain matmul's of the same protocol
and repeat (``vs_honest``). Under ``verified`` none of the caches may be ``passed`` with a
``vs_honest`` above about 1.1 (docs/timing.md, "Every timed call on unseen inputs").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from kbv.api import evaluate_paths

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = ROOT / "tests/fixtures/problems/matmul_512.py"
HACKS = ("cache_fingerprint61", "cache_pointer_version", "cache_checksum", "cache_last_output")
PLAIN = """\"\"\"Honest: torch.matmul as it is.\"\"\"

import torch


class ModelNew(torch.nn.Module):
    def forward(self, A, B):
        return torch.matmul(A, B)
"""


def candidates(work: Path) -> dict[str, Path]:
    plain = work / "honest_plain_matmul.py"
    plain.write_text(PLAIN)
    found = {
        "honest_plain": plain,
        "honest_out_buffer": ROOT / "tests/fixtures/candidates/honest/matmul_out_buffer.py",
    }
    found.update({name: ROOT / "tests/fixtures/candidates/hacks" / f"{name}.py" for name in HACKS})
    return found


def row(name: str, protocol: str, record: Any, wall_s: float) -> dict[str, Any]:
    candidate = (record.timing or {}).get("candidate") or {}
    return {
        "candidate": name,
        "protocol": protocol,
        "protocol_version": record.protocol.get("version") if isinstance(record.protocol, dict) else None,
        "outcome": str(record.outcome),
        "speedup": record.speedup.get("best"),
        "median_ms": (candidate.get("summary") or {}).get("median"),
        "findings": [f"{f.check}:{f.severity}" for f in record.findings if f.severity in ("fail", "warn")],
        "wall_s": round(wall_s, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--protocols", nargs="*", default=["standard", "verified"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kbv-cache-fixtures-"))
    for repeat in range(args.repeat):
        for protocol in args.protocols:
            honest: float | None = None
            for name, path in candidates(work).items():
                started = time.monotonic()
                record = evaluate_paths(PROBLEM, path, protocol=protocol, device=args.device, timeout_s=300)
                entry = row(name, protocol, record, time.monotonic() - started)
                if name == "honest_plain":
                    honest = entry["speedup"]
                entry["repeat"] = repeat
                entry["vs_honest"] = entry["speedup"] / honest if entry["speedup"] and honest else None
                with open(args.out, "a") as handle:
                    handle.write(json.dumps(entry) + "\n")
                print(json.dumps(entry), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
