"""Where an evaluation's extra microseconds come from: the same call timed in and out of kbv's workers.

    python benchmarks/worker_gap.py --out OUT [--classes elementwise normalization] [--calls 100]

In the twelfth session's fidelity runs the honest CUDA ReLU and LayerNorm read 23-29 us more inside
an evaluation than the same call timed by kbv's own recipe in a plain process; the thirteenth
session's launch check ruled out the recipe and the rotation of input sets (``recipe_1set_ms`` and
``recipe_3sets_ms`` within 5 us of the synced call). What is left is the evaluation's setting. Per
class this times, one after another:

- ``plain``: the candidate and the problem's ``Model`` through kbv's recipe (one input set, L2
  flush) in a process of their own that loads the prebuilt extension (no build);
- ``plain_polled``: the same while another process asks NVML for the GPU's per-process memory
  every 100 ms, as the parent does while a limited candidate worker runs;
- ``evaluation``: an evaluation under ``fidelity.py``'s protocol (default limits);
- ``evaluation_unlimited``: the same with every limit off, so the parent asks NVML nothing.

Each gives the median of the per-round medians of the candidate and of the eager baseline. Lines go
to ``OUT/worker_gap.jsonl`` as they are measured.

The thirteenth session's first run put the gap in every kbv worker (the reference's eager baseline
too) and not in the parent's NVML polling. ``--stages`` bisects the worker's setting instead, in one
plain process, each stage added to the ones before and the same two calls timed after each:
``plain``; ``peer`` (another process holds a CUDA context and 8 GiB, idle, as the parent and the
other worker do); ``startup`` (what a worker does while it boots: guard thread, non-dumpable, the
probes registered, the CPU kernels and the fused sketch kernel warmed); ``draws`` (the inputs drawn
by ``kbv.inputs.make_draw``, as the worker draws them, in place of ``get_inputs``). A last process
times ``plain`` under the worker's scrubbed environment (``scrubbed_env``).

The stages reproduced none of it (within 8 us of ``plain``), which leaves the worker's birth and its
history. ``--direct`` times, per class: ``worker_time_only`` (a kbv worker of each role, forked
from the fork server as in an evaluation, sent ``load`` and then at once the same ``time`` request
an evaluation sends: no correctness draws before it), ``worker_time_only_fresh`` (the same from a
fresh interpreter, ``KBV_FORK_SERVER=0``) and ``evaluation_fresh`` (a whole evaluation with every
worker a fresh interpreter).

The fourteenth session's ``--direct`` run: the birth does not matter (forked and fresh within
0.2 us) and a worker timed at once carries no offset, but an evaluation's workers do (+11.7 us for
the candidate, +8.0 us for the eager baseline). ``--history`` bisects what an evaluation does before
and in its timing requests (the sketch of every timed call among them): both workers started and
loaded, then timed after each stage, cumulative
(:data:`HISTORY_STAGES`, lines in ``OUT/worker_history.jsonl``, a ``plain`` line first).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CLASS_NAMES = ("elementwise", "normalization", "softmax-wide")


def _poller() -> subprocess.Popen:
    code = (
        "import os, time\n"
        "from kbv import telemetry\n"
        "while True:\n"
        "    telemetry.process_memory_bytes('cuda:0', os.getppid())\n"
        "    time.sleep(0.1)\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def plain(problem_path: str, candidate_path: str, calls: int, polled: bool) -> dict[str, float]:
    """In this process: the candidate and the reference through kbv's recipe, one input set."""
    import torch
    from _ncu_target import _load, through_recipe

    poller = _poller() if polled else None
    try:
        problem, model, _ = _load(problem_path, candidate_path)
        reference = problem.Model(*problem.get_init_inputs()).cuda().eval()
        return {
            "candidate_ms": through_recipe(model, problem, 1, calls),
            "eager_ms": through_recipe(reference, problem, 1, calls),
            "gpu": torch.cuda.get_device_name(0),
        }
    finally:
        if poller is not None:
            poller.kill()


def _peer() -> subprocess.Popen:
    code = (
        "import sys, time, torch\n"
        "held = torch.empty(8 << 30, dtype=torch.uint8, device='cuda')\n"
        "torch.cuda.synchronize(); print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    peer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert peer.stdout is not None
    peer.stdout.readline()
    return peer


def _worker_startup() -> None:
    """What ``kbv.child.main.run`` and ``_environment_facts`` do before the first request."""
    import torch

    from kbv import sketch
    from kbv.child import guard
    from kbv.child import main as child_main
    from kbv.processes import harden_process

    guard.install()
    harden_process()
    child_main._register_probes()
    child_main._warm_cpu_kernels()
    sketch.warm(torch.device("cuda"))


def _drawn_sets(problem, n_sets: int) -> list:
    from kbv import inputs as kbv_inputs

    return [kbv_inputs.make_draw(problem, "original", 1000 + k, "cuda") for k in range(n_sets)]


def stages(problem_path: str, candidate_path: str, calls: int) -> None:
    """Cumulative stages of a worker's setting, one JSON line each (see the module docstring)."""
    from _ncu_target import _load, through_recipe

    problem, model, _ = _load(problem_path, candidate_path)
    reference = problem.Model(*problem.get_init_inputs()).cuda().eval()

    def timed(stage: str, sets=None) -> None:
        line = {
            "stage": stage,
            "candidate_ms": through_recipe(model, problem, 1, calls, input_sets=sets),
            "eager_ms": through_recipe(reference, problem, 1, calls, input_sets=sets),
        }
        print(json.dumps(line), flush=True)

    timed("plain")
    peer = _peer()
    try:
        timed("peer")
        _worker_startup()
        timed("startup")
        timed("draws", _drawn_sets(problem, 1))
    finally:
        peer.kill()


def _stages_in_subprocess(problem, candidate, calls: int, scrubbed: bool) -> list[dict]:
    from fidelity import prebuilt_env

    from kbv.worker._env import scrubbed_env
    from kbv.worker.builds import build_dir

    env = prebuilt_env(candidate)
    if scrubbed:  # the worker's allowlist, with the same build directories and arch list
        builds = build_dir(candidate.source_sha256)
        home = Path(tempfile.mkdtemp())
        allowed = scrubbed_env(
            env, home=home, extensions_dir=builds / "torch_extensions", triton_dir=builds / "triton"
        )
        env = {**allowed, "TORCH_CUDA_ARCH_LIST": env.get("TORCH_CUDA_ARCH_LIST", "")}
    mode = (
        ["--plain", str(problem.path), str(candidate.path), str(calls)]
        if scrubbed
        else ["--stages", str(problem.path), str(candidate.path), str(calls)]
    )
    done = subprocess.run(
        [sys.executable, __file__, *mode], capture_output=True, text=True, timeout=240, env=env
    )
    if done.returncode != 0:
        print(done.stderr[-2000:], flush=True)
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    if scrubbed:
        for line in lines:
            line["stage"] = "plain_scrubbed_env"
    return lines


def _plain_in_subprocess(problem, candidate, calls: int, polled: bool) -> dict | None:
    """``plain`` in a fresh process that finds the extension where kbv's worker would."""
    from fidelity import prebuilt_env

    env = prebuilt_env(candidate)
    command = [sys.executable, __file__, "--plain", str(problem.path), str(candidate.path), str(calls)]
    if polled:
        command.append("--polled")
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    if done.returncode != 0:
        print(done.stderr[-2000:], flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _load_worker(worker, role: str, problem, candidate, device: str) -> None:
    """The ``load`` request an evaluation sends a worker of ``role`` (init seed 1, no structure)."""
    fields = {
        "role": role,
        "device": device,
        "problem_path": str(problem.path),
        "sizes": problem.sizes_for(device),
        "domain": problem.extras.get("domain", "any"),
        "init_seed": 1,
        "structure": None,
    }
    if role == "candidate":
        fields["candidate_path"] = str(candidate.path)
    worker.request("load", **fields)


def _worker_time_only(problem, candidate, protocol, calls: int, device: str = "cuda") -> dict:
    """Each role's worker sent ``load`` and then one ``time`` request, nothing between."""
    from kbv.evaluation import worker_specs
    from kbv.performance import _settings_dict  # the request's form of the settings
    from kbv.worker import Worker

    specs = dict(
        zip(("reference", "candidate"), worker_specs(problem, candidate, protocol, "cuda"), strict=True)
    )
    settings = _settings_dict(dataclasses.replace(protocol.timing, repeats=calls, input_sets=1))
    result: dict = {}
    for role, spec in specs.items():
        with Worker(dataclasses.replace(spec, limits=None)) as worker:
            worker.start()
            _load_worker(worker, role, problem, candidate, device)
            reply = worker.request(
                "time", distribution="original", seeds=[7], precision="native", settings=settings
            )
            samples = reply["measurement"]["device_ms"]
            result["candidate_ms" if role == "candidate" else "eager_ms"] = statistics.median(samples)
            result[f"{role}_started_as"] = worker.started_as
    return result


#: ``--history``'s stages, in order, each added to those before it in the same two workers.
HISTORY_STAGES = (
    "both_alive",
    "others_paused",
    "evaluation_settings",
    "sketched",
    "after_one_draw",
    "after_six_draws",
    "after_build",
)


def _worker_history(problem, candidate, protocol, calls: int, device: str = "cuda") -> list[dict]:
    """Both roles' workers alive together, as in an evaluation, timed after each of
    :data:`HISTORY_STAGES`: nothing yet; the other worker stopped while one is timed (as
    ``performance`` does); the evaluation's own timing settings and input sets; every timed call
    sketched right after it, as an evaluation's timed calls are (``kbv.sketch``); one correctness
    draw each, handed over to this process; five more; both models built again (as the timing
    phase does first). Each line: the stage, the candidate's and the eager baseline's median."""
    from kbv.evaluation import timing_input_sets, worker_specs
    from kbv.performance import _others_paused, _settings_dict
    from kbv.sketch import omega_for
    from kbv.worker import Worker

    specs = worker_specs(problem, candidate, protocol, device)
    plain_settings = _settings_dict(dataclasses.replace(protocol.timing, repeats=calls, input_sets=1))
    own_settings = _settings_dict(dataclasses.replace(protocol.timing, repeats=calls))
    own_seeds = [7 + k for k in range(timing_input_sets(protocol.timing.input_sets, []))]
    with (
        Worker(dataclasses.replace(specs[0], limits=None)) as reference,
        Worker(dataclasses.replace(specs[1], limits=None)) as subject,
    ):
        reference.start()
        subject.start()
        for role, worker in (("reference", reference), ("candidate", subject)):
            _load_worker(worker, role, problem, candidate, device)

        def timed(stage: str, pause: bool, settings: dict, seeds: list[int], sketch=None) -> dict:
            line: dict = {"stage": stage}
            extra = {"sketch": sketch} if sketch is not None else {}
            for key, worker in (("candidate_ms", subject), ("eager_ms", reference)):
                with _others_paused(worker, reference, subject) if pause else contextlib.nullcontext():
                    reply = worker.request(
                        "time",
                        distribution="original",
                        seeds=seeds,
                        precision="native",
                        settings=settings,
                        **extra,
                    )
                line[key] = statistics.median(reply["measurement"]["device_ms"])
            return line

        def draws(n: int) -> None:
            for k in range(n):
                for worker in (reference, subject):
                    reply = worker.request(
                        "run",
                        distribution="original",
                        seed=100 + k,
                        precision="native",
                        out_path=worker.new_path("out"),
                    )
                    worker.receive_outputs(reply["outputs"])

        lines = [timed("both_alive", False, plain_settings, [7])]
        lines.append(timed("others_paused", True, plain_settings, [7]))
        lines.append(timed("evaluation_settings", True, own_settings, own_seeds))
        sketch = {"seed": 99, "omega": [omega_for(0.5)] * 4}  # a round's spec (one omega an output)
        lines.append(timed("sketched", True, own_settings, own_seeds, sketch))
        draws(1)
        lines.append(timed("after_one_draw", True, plain_settings, [7]))
        draws(5)
        lines.append(timed("after_six_draws", True, plain_settings, [7]))
        for worker in (reference, subject):
            worker.request("build", init_seed=2)
        lines.append(timed("after_build", True, plain_settings, [7]))
    return lines


def _fork_server_off(measure):
    def run():
        os.environ["KBV_FORK_SERVER"] = "0"
        try:
            return measure()
        finally:
            os.environ.pop("KBV_FORK_SERVER", None)

    return run


def _round_medians(side: dict) -> float | None:
    medians = [statistics.median(r["device_ms"]) for r in side.get("rounds", []) if r.get("device_ms")]
    return statistics.median(medians) if medians else None


def _evaluated(problem, candidate, protocol) -> dict:
    from kbv.evaluation import evaluate

    started = time.monotonic()
    record = evaluate(problem, candidate, protocol, "cuda")
    timing = record.timing or {}
    return {
        "outcome": record.outcome,
        "candidate_ms": _round_medians(timing.get("candidate") or {}),
        "eager_ms": _round_medians((timing.get("baselines") or {}).get("eager_fp32") or {}),
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--classes", nargs="+", choices=CLASS_NAMES, default=["elementwise", "normalization"])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--stages", action="store_true", help="bisect the worker's setting (see above)")
    parser.add_argument("--direct", action="store_true", help="a worker's birth and history (see above)")
    parser.add_argument(
        "--history", action="store_true", help="two workers timed after each stage (see above)"
    )
    args = parser.parse_args()

    from fidelity import CLASSES, _pair, _prebuild, fidelity_protocol

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    limited = fidelity_protocol()
    unlimited = dataclasses.replace(
        limited,
        limits=dataclasses.replace(
            limited.limits,
            host_memory_gb=0,
            device_memory_gb=0,
            device_memory_alone_share=0,
            processes=0,
            open_files=0,
        ),
    )
    chosen = [c for c in CLASSES if c[0] in args.classes]
    pairs = [_pair(candidate_set, stem) for _, candidate_set, stem in chosen]
    _prebuild(pairs)
    if args.stages:
        return _run_stages(chosen, pairs, args.calls, out)
    if args.history:
        return _run_history(chosen, pairs, limited, args.calls, out)
    for (klass, _, _), (problem, candidate) in zip(chosen, pairs, strict=True):
        ways = {
            "plain": lambda p=problem, c=candidate: _plain_in_subprocess(p, c, args.calls, False),
            "plain_polled": lambda p=problem, c=candidate: _plain_in_subprocess(p, c, args.calls, True),
            "evaluation": lambda p=problem, c=candidate: _evaluated(p, c, limited),
            "evaluation_unlimited": lambda p=problem, c=candidate: _evaluated(p, c, unlimited),
        }
        if args.direct:
            time_only = lambda p=problem, c=candidate: _worker_time_only(p, c, limited, args.calls)  # noqa: E731
            ways = {
                "plain": ways["plain"],
                "worker_time_only": time_only,
                "worker_time_only_fresh": _fork_server_off(time_only),
                "evaluation": ways["evaluation"],
                "evaluation_fresh": _fork_server_off(ways["evaluation"]),
            }
        for way, measure in ways.items():
            line = {"class": klass, "way": way, **(measure() or {"error": "see the log"})}
            print(json.dumps(line), flush=True)
            with (out / "worker_gap.jsonl").open("a") as stream:
                stream.write(json.dumps(line) + "\n")
    return 0


def _run_history(chosen: list, pairs: list, protocol, calls: int, out: Path) -> int:
    for (klass, _, _), (problem, candidate) in zip(chosen, pairs, strict=True):
        plain_line = {"stage": "plain", **(_plain_in_subprocess(problem, candidate, calls, False) or {})}
        for line in [plain_line, *_worker_history(problem, candidate, protocol, calls)]:
            line = {"class": klass, **line}
            print(json.dumps(line), flush=True)
            with (out / "worker_history.jsonl").open("a") as stream:
                stream.write(json.dumps(line) + "\n")
    return 0


def _run_stages(chosen: list, pairs: list, calls: int, out: Path) -> int:
    for (klass, _, _), (problem, candidate) in zip(chosen, pairs, strict=True):
        for scrubbed in (False, True):
            for line in _stages_in_subprocess(problem, candidate, calls, scrubbed):
                line = {"class": klass, **line}
                print(json.dumps(line), flush=True)
                with (out / "worker_stages.jsonl").open("a") as stream:
                    stream.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "--stages":
        stages(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        raise SystemExit(0)
    if len(sys.argv) >= 5 and sys.argv[1] == "--plain":
        result = plain(sys.argv[2], sys.argv[3], int(sys.argv[4]), polled="--polled" in sys.argv)
        print(json.dumps(result), flush=True)
        raise SystemExit(0)
    raise SystemExit(main())
