"""Load on ``kbv serve``: N concurrent clients submit the bundled CPU candidates mixed with every
CPU hack fixture; evaluations per hour, latency, the queue past its bound, and every verdict
against ``kbv run``'s for the same pair.

1. The pairs: each bundled ``honest_cpu``, ``hacks`` and ``broken`` candidate with its bundled
   problem, and each CPU hack fixture of tests/fixtures/candidates/hacks with the problem its
   ``KBV_FIXTURE`` names (``--skip-slow`` leaves out those marked slow). Their problems are copied
   into one tree that the server names them in.
2. ``kbv run``'s verdicts: the pairs through the sequential executor (``kbv.batch.run_batch``, what
   ``kbv run`` runs), in a process of their own that has ended (and let go of the GPU) when it
   does: before the server starts, so that the service finds the builds and the baselines cached
   (the steady state of a service that has seen each problem), or with ``--service-first`` after
   it has stopped, so that on a fresh cache the service builds the CUDA sources on the host's
   cores and measures its baselines itself (``compile_s_total`` says how long it compiled). The
   report is written again with the comparison.
3. The server on 127.0.0.1 (a token, ``--max-queue`` small enough to be reached), and ``--clients``
   threads each submitting its share of the pairs one request at a time, ``--repeat`` times over.
   A 429 is counted and retried after its ``Retry-After``.
4. Each client polls its requests until done: latency is from the 202 to the first poll that sees
   the record. Evaluations per hour are the finished requests over the wall time from the first
   submission to the last record; verdicts per hour count only those that ended in a record (not
   kbv's harness errors). ``rows`` keeps each request's outcome, latency and phases. Each finished
   request prints a line, and the load's figures are written to ``--out`` before the comparison
   (with ``--service-first``, before ``kbv run`` starts: a run cut there keeps them).

    PYTHONPATH=$PWD/src python benchmarks/service_load.py --clients 8 --max-queue 12 --out result.json

With ``--kernelbench DIR`` (a KernelBench level's folder) the pairs are instead its problems, each
with its own ``Model`` as the candidate, mixed with every hack fixture of the device's kind (on a
GPU, ``--device cuda``, the ``gpu_*`` ones). Besides the wall-clock rate the report gives the rate
per hour of evaluation work without compilation: the verdicts (records) over the sum of their
``total`` less ``compile`` phases (evaluations that overlap on the GPU count twice there, which
understates the rate).

    PYTHONPATH=$PWD/src python benchmarks/service_load.py --device cuda --kernelbench KB/level1 \
        --clients 4 --max-queue 8 --out result.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "src" / "kbv" / "suite"
HACKS = ROOT / "tests" / "fixtures" / "candidates" / "hacks"
TOKEN = "service-load-" + os.urandom(12).hex()


def _fixture_spec(path: Path) -> dict[str, Any]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "KBV_FIXTURE" for t in node.targets
        ):
            return dict(ast.literal_eval(node.value))
    return {}


def collect_pairs(skip_slow: bool) -> list[tuple[Path, Path]]:
    """(problem file, candidate file) of every bundled CPU candidate and CPU hack fixture."""
    problems = {p.stem: p for p in (SUITE / "problems").rglob("*.py")}
    pairs = []
    for kind in ("honest_cpu", "hacks", "broken"):
        for candidate in sorted((SUITE / "candidates" / kind).glob("*.py")):
            if candidate.stem in problems:
                pairs.append((problems[candidate.stem], candidate))
    return pairs + hack_fixture_pairs(gpu=False, skip_slow=skip_slow)


def hack_fixture_pairs(gpu: bool, skip_slow: bool) -> list[tuple[Path, Path]]:
    """The hack fixtures of one kind (``gpu_*`` or the others) with the problems they name."""
    pairs = []
    for candidate in sorted(HACKS.glob("*.py")):
        spec = _fixture_spec(candidate)
        if (
            candidate.stem.startswith("gpu_") != gpu
            or not spec.get("problem")
            or (skip_slow and spec.get("slow"))
        ):
            continue
        pairs.append((ROOT / spec["problem"], candidate))
    return pairs


def kernelbench_pairs(level: Path, work: Path) -> list[tuple[Path, Path]]:
    """Each problem of a KernelBench level's folder with its own ``Model`` as the candidate (written
    under ``work``), as benchmarks/reference_as_candidate.py makes it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from reference_as_candidate import candidate_source

    work.mkdir(parents=True, exist_ok=True)
    pairs = []
    for problem in sorted(
        level.glob("*.py"),
        key=lambda p: (int(p.stem.split("_")[0]) if p.stem.split("_")[0].isdigit() else 0, p.stem),
    ):
        candidate = work / problem.name
        candidate.write_text(candidate_source(problem.read_text(), False))
        pairs.append((problem, candidate))
    return pairs


def problem_tree(pairs: list[tuple[Path, Path]], root: Path) -> dict[Path, str]:
    """Copy the pairs' problems into ``root`` (kept under their own folder names); name -> each."""
    names = {}
    for problem, _ in pairs:
        if SUITE in problem.parents:
            relative = problem.relative_to(SUITE / "problems")
        elif ROOT in problem.parents:
            relative = problem.relative_to(ROOT)
        else:  # a KernelBench tree outside the repository
            relative = Path("kernelbench") / problem.parent.name / problem.name
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(problem, target)
        names[problem] = str(relative.with_suffix(""))
    return names


def kbv_run_verdicts(
    pairs: list[tuple[Path, Path]], protocol: str, timeout_s: float, device: str
) -> dict[tuple[str, str], str]:
    """``kbv run``'s verdicts, from a process of their own: this one then holds no GPU memory (nor
    a CUDA context) beside the server it measures next."""
    with tempfile.TemporaryDirectory(prefix="kbv-run-verdicts-") as folder:
        ask, answer = Path(folder) / "pairs.json", Path(folder) / "verdicts.json"
        ask.write_text(json.dumps({"pairs": [[str(p), str(c)] for p, c in pairs], "protocol": protocol}))
        subprocess.run(
            [sys.executable, __file__, "--verdicts-of", str(ask), "--verdicts-to", str(answer)]
            + ["--timeout", str(timeout_s), "--device", device],
            check=True,
        )
        return {(p, c): verdict for p, c, verdict in json.loads(answer.read_text())}


def _verdicts_in_this_process(
    pairs: list[tuple[Path, Path]], protocol: str, timeout_s: float, device: str
) -> list[tuple[str, str, str]]:
    from rich.console import Console

    from kbv.batch import run_batch
    from kbv.candidates import load_candidate
    from kbv.problems import load_problem
    from kbv.protocol import load_protocol

    loaded = [(load_problem(p), load_candidate(c)) for p, c in pairs]
    result = run_batch(
        loaded, load_protocol(protocol), device=device, timeout_s=timeout_s, console=Console(quiet=True)
    )
    return [
        (
            r.problem["source_sha256"],
            r.candidate["source_sha256"],
            str(getattr(r.outcome, "value", r.outcome)),
        )
        for r in result.records
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    args: argparse.Namespace, tree: Path, db: Path, port: int, log: Path
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kbv.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += [
        "--device",
        args.device,
        "--db",
        str(db),
        "--problems",
        str(tree),
        "--protocol",
        args.protocol,
    ]
    command += ["--max-queue", str(args.max_queue), "--timeout", str(args.timeout)]
    if args.workers:
        command += ["--executor", "local", "--workers", str(args.workers)]
    server = subprocess.Popen(
        command, env={**os.environ, "KBV_SERVE_TOKEN": TOKEN}, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.2)
        if server.poll() is not None:
            raise SystemExit("kbv serve exited:\n" + log.read_text()[-3000:])
    raise SystemExit("kbv serve did not answer /health")


class Load:
    """The clients' shared tallies."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rejected_429 = 0
        self.retry_after: list[float] = []
        self.max_queued_seen = 0
        self.max_unfinished_seen = 0
        self.errors: list[str] = []
        self.results: list[dict[str, Any]] = []


def client_thread(url: str, jobs: list[tuple[str, Path, Path]], load: Load, poll_s: float) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        pending = []
        for name, problem, candidate in jobs:
            while True:
                response = http.post(
                    "/v1/evaluations", json={"problem": name, "source": candidate.read_text()}
                )
                if response.status_code == 429:
                    wait = float(response.headers.get("retry-after", "1"))
                    with load.lock:
                        load.rejected_429 += 1
                        load.retry_after.append(wait)
                    time.sleep(min(wait, 5.0))
                    continue
                if response.status_code >= 400:
                    with load.lock:
                        load.errors.append(f"POST {response.status_code}: {response.text[:200]}")
                    break
                pending.append((response.json()["id"], time.monotonic(), problem, candidate))
                break
        while pending:
            still = []
            for request_id, sent, problem, candidate in pending:
                response = http.get(f"/v1/evaluations/{request_id}")
                if response.status_code != 200:
                    with load.lock:
                        load.errors.append(f"GET {response.status_code}: {response.text[:200]}")
                    still.append((request_id, sent, problem, candidate))
                    continue
                found = response.json()
                if found["status"] in ("done", "error"):
                    with load.lock:
                        load.results.append(
                            {
                                **found,
                                "latency_s": time.monotonic() - sent,
                                "finished": time.monotonic(),
                                "pair": (problem, candidate),
                            }
                        )
                        done = len(load.results)
                    outcome = found.get("outcome") or found["status"]
                    print(f"finished {done}: {outcome} {_shown(candidate)}", flush=True)
                else:
                    still.append((request_id, sent, problem, candidate))
            pending = still
            time.sleep(poll_s)


def work_without_compile(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluations per hour of evaluation work less compilation: the evaluations that ended in
    a record (a verdict) over the sum of their ``total`` minus ``compile`` phases (with the compile
    seconds, for the reader). A harness error has no record and so no phases: counting it would add
    an evaluation and none of its time (four did so on an H100, 2026-12-07)."""
    phases = [r["record"].get("phases_s") or {} for r in results if r.get("record")]
    compile_s = sum(float(p.get("compile", 0.0)) for p in phases)
    work_s = sum(max(0.0, float(p.get("total", 0.0)) - float(p.get("compile", 0.0))) for p in phases)
    return {
        "verdicts": len(phases),
        "compile_s_total": round(compile_s, 1),
        "evaluation_s_without_compile": round(work_s, 1),
        "evaluations_per_hour_without_compile": round(len(phases) / work_s * 3600, 1) if work_s > 0 else None,
    }


def result_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per finished request, in the order they finished: the raw figures the report's
    statistics come from."""
    rows = []
    for r in sorted(results, key=lambda r: r["finished"]):
        record = r.get("record") or {}
        error = record.get("error") or r.get("error")
        rows.append(
            {
                "candidate": _shown(r["pair"][1]),
                "outcome": r.get("outcome") or r["status"],
                "latency_s": round(r["latency_s"], 2),
                "phases_s": {k: round(float(v), 3) for k, v in (record.get("phases_s") or {}).items()},
                "error": str(error.get("summary", error) if isinstance(error, dict) else error or "")[:1200],
            }
        )
    return rows


def gpu_memory_held(device: str) -> dict[str, float] | None:
    """GiB each process holds on ``device`` now (NVML, no CUDA context made here), or None."""
    if not device.startswith("cuda"):
        return None
    from kbv import telemetry

    usage = telemetry.device_process_bytes(device)
    return {str(pid): round(held / (1 << 30), 2) for pid, held in (usage or {}).items()}


def _shown(candidate: Path) -> str:
    """A candidate's path for the report: relative to the repository where it lies there."""
    return str(candidate.relative_to(ROOT)) if ROOT in candidate.parents else candidate.name


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def _load_report(
    args: argparse.Namespace,
    commit: str,
    pairs: list[tuple[Path, Path]],
    jobs: list[Any],
    load: Load,
    wall: float,
    metrics: str,
    held_before: dict[str, float] | None,
) -> dict[str, Any]:
    """The service's figures: what the load measured, before any comparison with ``kbv run``."""
    latencies = [r["latency_s"] for r in load.results]
    outcomes: dict[str, int] = {}
    for r in load.results:
        outcomes[str(r.get("outcome") or r["status"])] = (
            outcomes.get(str(r.get("outcome") or r["status"]), 0) + 1
        )
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
        "device": args.device,
        "kernelbench": str(args.kernelbench) if args.kernelbench else None,
        "commit": commit,
        "pairs": len(pairs),
        "requests": len(jobs),
        "clients": args.clients,
        "protocol": args.protocol,
        "executor": f"local, {args.workers} CPU slots" if args.workers else "sequential",
        "order": "the service, then kbv run" if args.service_first else "kbv run, then the service",
        "finished": len(load.results),
        "wall_s": round(wall, 1),
        "evaluations_per_hour": round(len(load.results) / wall * 3600, 1),
        "verdicts_per_hour": round(sum(1 for r in load.results if r.get("record")) / wall * 3600, 1),
        **work_without_compile(load.results),
        "latency_p50_s": round(percentile(latencies, 0.5), 1),
        "latency_p95_s": round(percentile(latencies, 0.95), 1),
        "latency_mean_s": round(statistics.fmean(latencies), 1) if latencies else None,
        "queue_bound": args.max_queue,
        "max_queued_seen": load.max_queued_seen,
        "max_unfinished_seen": load.max_unfinished_seen,
        "http_errors": load.errors[:20],
        "answers_429": load.rejected_429,
        "retry_after_s": sorted(set(load.retry_after)),
        "outcomes": outcomes,
        "gpu_memory_gib_held_before_the_server": held_before,
        "rows": result_rows(load.results),
        "metrics_excerpt": [
            line
            for line in metrics.splitlines()
            if line.startswith("kbv_serve_") and "_created" not in line and "_bucket" not in line
        ],
    }


def _kbv_run(args: argparse.Namespace, pairs: list[tuple[Path, Path]]) -> tuple[dict[Any, str], float]:
    """``kbv run``'s verdicts on the pairs, and the seconds they took."""
    started = time.monotonic()
    expected = kbv_run_verdicts(pairs, args.protocol, args.timeout, args.device)
    return expected, time.monotonic() - started


def _write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1, help="times each pair is submitted")
    parser.add_argument("--max-queue", type=int, default=12, help="the server's bound (small, to reach it)")
    parser.add_argument("--protocol", default="verified")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--workers", type=int, default=0, help="local executor CPU slots (0: sequential)")
    parser.add_argument("--skip-slow", action="store_true", help="leave out fixtures marked slow")
    parser.add_argument("--limit", type=int, default=0, help="at most this many pairs (0: all)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (on cuda, the gpu_* hack fixtures)")
    parser.add_argument(
        "--kernelbench",
        type=Path,
        default=None,
        help="a KernelBench level's folder: its references as candidates",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--service-first",
        action="store_true",
        help="serve before kbv run: on a fresh cache the service builds and measures its baselines "
        "itself (the cold rate); by default kbv run comes first and leaves both cached",
    )
    # kbv run's verdicts are computed by this script in a process of its own (kbv_run_verdicts)
    parser.add_argument("--verdicts-of", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--verdicts-to", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.verdicts_of is not None:
        asked = json.loads(args.verdicts_of.read_text())
        pairs = [(Path(p), Path(c)) for p, c in asked["pairs"]]
        verdicts = _verdicts_in_this_process(pairs, asked["protocol"], args.timeout, args.device)
        args.verdicts_to.write_text(json.dumps(verdicts))
        return
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()  # the code that runs (read before any rebase)

    work = Path(tempfile.mkdtemp(prefix="kbv-service-load-"))
    if args.kernelbench is not None:
        pairs = kernelbench_pairs(args.kernelbench, work / "candidates")[: args.limit or None]
        pairs += hack_fixture_pairs(gpu=args.device.startswith("cuda"), skip_slow=args.skip_slow)
    else:
        pairs = collect_pairs(args.skip_slow)[: args.limit or None]
    names = problem_tree(pairs, work / "problems")
    expected, kbv_run_s = ({}, 0.0) if args.service_first else _kbv_run(args, pairs)
    held_before = gpu_memory_held(args.device)  # what else holds the GPU the server will use
    port = free_port()
    server = start_server(args, work / "problems", work / "serve.sqlite", port, work / "serve.log")
    url = f"http://127.0.0.1:{port}"
    jobs = [(names[p], p, c) for _ in range(args.repeat) for p, c in pairs]
    load = Load()
    threads = [
        threading.Thread(target=client_thread, args=(url, jobs[i :: args.clients], load, 0.5))
        for i in range(args.clients)
    ]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    with httpx.Client(base_url=url) as http:
        while any(t.is_alive() for t in threads):
            health = http.get("/health").json()
            load.max_queued_seen = max(load.max_queued_seen, int(health["queued"]))
            load.max_unfinished_seen = max(
                load.max_unfinished_seen, int(health["queued"]) + int(health["running"])
            )
            time.sleep(0.5)
        metrics = http.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    wall = max(r["finished"] for r in load.results) - started
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=300)
    report = _load_report(args, commit, pairs, jobs, load, wall, metrics, held_before)
    _write(args, report)  # the load's figures, before kbv run's verdicts: a cut run keeps them
    if args.service_first:
        expected, kbv_run_s = _kbv_run(args, pairs)

    from kbv.candidates import load_candidate
    from kbv.problems import load_problem

    # Every evaluation draws secret seeds of its own, so a hack may fail one way under kbv run and
    # another (say incorrect, then hack_detected) under the service; a pair that passes under one and
    # not the other is what fails the run.
    mismatches, pass_mismatches = [], []
    for result in load.results:
        problem, candidate = result["pair"]
        key = (load_problem(problem).source_sha256, load_candidate(candidate).source_sha256)
        if result.get("outcome") != expected.get(key):
            line = f"{_shown(candidate)}: service {result.get('outcome')}, kbv run {expected.get(key)}"
            error = (result.get("record") or {}).get("error") or result.get("error")
            if error:  # why the service's evaluation ended as it did: the log stays on the machine
                line += f" ({str(error)[:300]})"
            mismatches.append(line)
            if (result.get("outcome") == "passed") != (expected.get(key) == "passed"):
                pass_mismatches.append(line)
    report.update(
        {
            "verdicts_equal_to_kbv_run": not mismatches,
            "passed_equal_to_kbv_run": not pass_mismatches,
            "mismatches": mismatches,
            "kbv_run_s": round(kbv_run_s, 1),
        }
    )
    print(json.dumps(report, indent=2))
    _write(args, report)
    if pass_mismatches or load.errors or len(load.results) != len(jobs):
        if args.out:  # beside the report, so it comes back from a device call with it
            shutil.copy(work / "serve.log", Path(args.out).with_suffix(".serve.log"))
        raise SystemExit(f"verdicts or requests went wrong; the server's log is in {work}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
