"""Compile once: an ahead-of-time build is what the evaluation worker imports, and a second run
of the same batch builds nothing.

    python benchmarks/compile_once.py --out DIR          # on a CUDA machine

For each bundled CUDA candidate (or those named with ``--candidates``): build it the way
``gpu_acceptance.py`` and ``kbv run`` do (``compile_candidate`` in a process that sees no GPU,
``TORCH_CUDA_ARCH_LIST`` from the device), keep a copy of the generated ``build.ninja`` and the
built library's modification time, evaluate the pair under ``standard`` twice, and report the
worker's compile phase each time, whether the library was rebuilt, and the ``build.ninja`` lines
that differ between the ahead-of-time build and the worker's import (the flags that disagree).
Writes ``compile-once.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def _snapshot(directory: Path) -> dict[str, Any]:
    ninja = sorted(directory.glob("torch_extensions/*/build.ninja"))
    libraries = sorted(directory.glob("torch_extensions/*/*.so"))
    return {
        "ninja": ninja[0].read_text() if ninja else "",
        "libraries": {str(p.name): p.stat().st_mtime_ns for p in libraries},
        # Which files each build wrote and when (ninja's own log) and every file's mtime: why a rebuild
        # happened.
        "ninja_log": [line for n in ninja for line in (n.parent / ".ninja_log").read_text().splitlines()]
        if ninja
        else [],
        "files": {
            str(f.relative_to(directory)): f.stat().st_mtime_ns
            for f in sorted(directory.rglob("*"))
            if f.is_file()
        },
    }


def check(candidate_path: Path, problem_path: Path, protocol_name: str = "standard") -> dict[str, Any]:
    import torch

    from kbv.candidates import load_candidate
    from kbv.evaluation import evaluate
    from kbv.problems import load_problem
    from kbv.protocol import load_protocol
    from kbv.worker.builds import arch_list_for, build_dir, compile_candidate

    candidate, problem = load_candidate(candidate_path, label="compile_once"), load_problem(problem_path)
    arch = arch_list_for("{}.{}".format(*torch.cuda.get_device_capability(0)))
    started = time.monotonic()
    built = compile_candidate(candidate, arch_list=arch)
    row: dict[str, Any] = {
        "candidate": candidate_path.name,
        "arch_list": arch,
        "prebuild": built.to_dict(),
        "prebuild_s": time.monotonic() - started,
    }
    directory = build_dir(candidate.source_sha256)
    before = _snapshot(directory)
    for run in ("first", "second"):
        record = evaluate(problem, candidate, load_protocol(protocol_name), "cuda", timeout_s=600)
        after = _snapshot(directory)
        row[run] = {
            "outcome": record.outcome,
            "compile_phase_s": record.phases_s.get("compile"),
            "rebuilt": after["libraries"] != before["libraries"],
            "ninja_log_after": after["ninja_log"],
            "files_before": before["files"],
            "files_after": after["files"],
            "ninja_diff": list(
                difflib.unified_diff(
                    before["ninja"].splitlines(),
                    after["ninja"].splitlines(),
                    "prebuild",
                    run,
                    lineterm="",
                    n=0,
                )
            )[:40],
        }
        before = after
    return row


def main() -> int:
    from kbv.problems import bundled_candidates_dir, bundled_suite_dir

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--candidates", nargs="*", type=Path, default=None)
    parser.add_argument(
        "--protocol",
        default="standard",
        help="the protocol of the two evaluations (standard, verified or a TOML file)",
    )
    args = parser.parse_args()
    os.environ.setdefault("KBV_CACHE_DIR", tempfile.mkdtemp(prefix="kbv-compile-once-"))
    candidates = args.candidates or sorted((bundled_candidates_dir() / "honest_cuda").glob("*.py"))[:1]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in candidates:
        problem = next(bundled_suite_dir().rglob(f"{path.stem}.py"))
        rows.append(check(path, problem, args.protocol))
        print(
            json.dumps(
                {k: rows[-1][k] for k in ("candidate", "prebuild_s")}
                | {
                    r: {
                        k: v for k, v in rows[-1][r].items() if k in ("outcome", "compile_phase_s", "rebuilt")
                    }
                    for r in ("first", "second")
                }
            ),
            flush=True,
        )
        for line in rows[-1]["first"]["ninja_diff"]:
            print("   ", line, flush=True)
        (args.out / "compile-once.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
