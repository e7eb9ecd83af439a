"""``kbv demo``: the bundled suite's candidates under both protocols, compared, stored and reported.

On a CPU-only machine the demo uses the candidate sets that run there (C++ ``load_inline``, plain
PyTorch and the CPU hacks) and a subset chosen to finish in a few minutes on two cores; on a GPU it
adds the CUDA and Triton sets and the GPU-only hacks.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from kbv.batch import collect_pairs, run_both_protocols
from kbv.evaluation import default_device
from kbv.problems import bundled_candidates_dir, bundled_suite_dir

CPU_SETS = ("honest_cpu", "hacks", "broken")
GPU_SETS = ("honest_cuda", "honest_triton", "hacks", "hacks_gpu", "broken")  # honest_cpu kernels are CPU-only
# Two cores compile a C++ extension in ~30 s: the CPU demo keeps the compiled candidates few.
CPU_DEMO_MAX_COMPILED = 3
# Extensions are built before the evaluations start, so these limits are for running, not compiling;
# each is what the bundled hanging candidate costs, twice. On the H200 the slowest other demo
# candidate's evaluation took 10 s (2026-12-02); the protocol's own 300 s made the hanging one cost
# ten minutes of a demo whose other 54 evaluations took two and a quarter.
CPU_TIMEOUT_S = 20.0
GPU_TIMEOUT_S = 60.0


def demo_pairs(device: str) -> list:
    sets = GPU_SETS if device.startswith("cuda") else CPU_SETS
    pairs = []
    compiled = 0
    for name in sets:
        directory = bundled_candidates_dir() / name
        if not directory.is_dir():
            continue
        found, _ = collect_pairs(bundled_suite_dir(), directory, label=name)
        for problem, candidate in found:
            uses_cpp = "load_inline" in candidate.source
            if not device.startswith("cuda") and uses_cpp and name != "broken":
                if compiled >= CPU_DEMO_MAX_COMPILED:
                    continue
                compiled += 1
            pairs.append((problem, candidate))
    return pairs


def run_demo(
    device: str | None = None,
    db: str | None = None,
    html: str | None = None,
    timeout_s: float | None = None,
    precision: str | None = None,
) -> int:
    from kbv.report import write_html_report
    from kbv.report.terminal import render_comparison, render_record_ids, render_summary
    from kbv.store import Store

    device = device or default_device()
    db_path = Path(db or "kbv-results/demo.sqlite")
    html_path = Path(html or "kbv-results/demo-report.html")
    db_path.parent.mkdir(parents=True, exist_ok=True)
    console = Console()
    pairs = demo_pairs(device)
    timeout = timeout_s or (GPU_TIMEOUT_S if device.startswith("cuda") else CPU_TIMEOUT_S)
    console.print(f"kbv demo: {len(pairs)} bundled candidates x 2 protocols on {device}")
    with Store(db_path) as store:
        both = run_both_protocols(
            store,
            pairs,
            command="demo",
            run_args={"device": device},
            device=device,
            timeout_s=timeout,
            console=Console(stderr=True),
            precision=precision,
        )
        for _, result in both.results:
            for what, message in result.errors:
                console.print(f"[red]harness error[/red] {what}: {message}")
        mine = [(i, r) for i, r in store.records_with_ids(latest=True) if both.is_mine(r)]
        standard = [r for _, r in mine if r.protocol.get("name") == "standard"]
        verified = [r for _, r in mine if r.protocol.get("name") == "verified"]
        # The same tables as `kbv report` on this database: both protocols, each row or column named.
        render_summary(standard + verified, console)
        render_comparison(standard, verified, console)
        write_html_report(standard + verified, html_path, title="kbv demo: standard versus verified")
        render_record_ids(
            [(i, r) for i, r in mine if r.protocol.get("name") in ("standard", "verified")], db_path, console
        )
    # Paths are printed whole (soft wrap): a folded path cannot be copied back.
    console.print(f"results database: {db_path.resolve()}", highlight=False, soft_wrap=True)
    console.print(f"HTML report:      {html_path.resolve()}", highlight=False, soft_wrap=True)
    return 0
