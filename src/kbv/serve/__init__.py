"""``kbv serve``: kbv as a self-hosted evaluation service (FastAPI on uvicorn).

Requests are queued in the results database (:mod:`kbv.serve._queue`), evaluated by a
:class:`kbv.Evaluator` on the executor the flags name (:mod:`kbv.serve._runner`), and answered
from the store. docs/service.md has the API, the guarantees and how to call it from TRL or verl.
Needs the ``serve`` extra: ``pip install 'kernelbench-verified[serve]'``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import Any

TOKEN_ENV = "KBV_SERVE_TOKEN"
DEFAULT_DB = Path("kbv-results") / "serve.sqlite"


class ServeError(ValueError):
    """``kbv serve`` cannot start (no token, a public address without one, a bad flag)."""


def register(sub: Any) -> None:
    from kbv.execute import EXECUTORS

    p = sub.add_parser(
        "serve",
        help="an HTTP evaluation service: submit candidates, get records (docs/service.md)",
        description=(
            "Serve evaluations over HTTP. Requests are queued in the results database and survive a "
            f"restart. Authentication: a bearer token from ${TOKEN_ENV} or --token-file."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--db", default=None, help=f"results database and request queue (default {DEFAULT_DB})")
    p.add_argument(
        "--protocol", default="verified", help="default protocol of requests: standard, verified or a .toml"
    )
    p.add_argument(
        "--problems",
        default=None,
        help="the problem tree requests name problems in (default: the bundled suite)",
    )
    p.add_argument(
        "--executor",
        choices=EXECUTORS,
        default=None,
        help="local (every GPU of this host) or ray; default: one evaluation at a time",
    )
    p.add_argument(
        "--gpus", default=None, metavar="all|0,1,...", help="local executor: which GPUs (default all)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="local executor on the CPU: concurrent evaluations",
    )
    p.add_argument("--address", default=None, metavar="RAY_ADDRESS", help="ray executor: the cluster to join")
    p.add_argument("--token-file", default=None, help=f"file holding the bearer token (else ${TOKEN_ENV})")
    p.add_argument("--no-auth", action="store_true", help="no token; allowed only on a loopback address")
    p.add_argument(
        "--max-queue", type=int, default=1000, help="unfinished requests accepted before 429 (default 1000)"
    )
    p.add_argument("--max-batch", type=int, default=256, help="evaluations per batch request (default 256)")
    p.add_argument(
        "--max-source-bytes", type=int, default=256 << 10, help="candidate source limit (default 256 KiB)"
    )
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="request body limit (default 8 MiB)")
    p.add_argument(
        "--max-timeout", type=float, default=600.0, help="largest per-request timeout_s (default 600)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="timeout_s of requests that give none (default: the protocol's)",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        default=None,
        help="requests handed to the evaluator at once (default: 4 per slot, at least 8)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=600.0,
        help="on SIGTERM, wait this long for evaluations in flight (default 600 s)",
    )
    p.set_defaults(handler=serve_command)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(token_file: str | None, no_auth: bool, host: str) -> str | None:
    """The bearer token (from ``--token-file`` or the environment, which then forgets it), or None
    for ``--no-auth`` on loopback. Never logged, never stored."""
    token = None
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ServeError(f"--token-file {token_file} cannot be read ({exc.strerror or exc})") from exc
    elif os.environ.get(TOKEN_ENV):
        token = os.environ.pop(TOKEN_ENV).strip()  # not inherited by anything this process starts
    if no_auth:
        if token:
            raise ServeError("--no-auth with a token given: drop one of them")
        if not is_loopback(host):
            raise ServeError(f"--no-auth only on a loopback address (127.0.0.1, ::1), not {host}")
        return None
    if not token:
        raise ServeError(
            f"no bearer token: set ${TOKEN_ENV} or pass --token-file PATH (or --no-auth on 127.0.0.1)"
        )
    if len(token) < 16:
        raise ServeError("the bearer token is shorter than 16 characters; use a long random one")
    return token


def build(args: argparse.Namespace, token: str | None) -> tuple[Any, Any]:
    """The app and its state, with the Evaluator started (returns ``(app, state)``)."""
    from kbv._evaluator import Evaluator, UnknownProblem
    from kbv.protocol import BUILTIN, load_protocol
    from kbv.serve._app import AppState, Limits, make_app
    from kbv.serve._metrics import Metrics
    from kbv.serve._queue import RequestQueue
    from kbv.serve._runner import Runner
    from kbv.store import Store

    db = Path(args.db or DEFAULT_DB)
    Store(db).close()  # creates or migrates the store before the queue's table joins it
    requests = RequestQueue(db)
    requeued = requests.requeue_unfinished()
    default = load_protocol(args.protocol)
    protocols = {**BUILTIN, default.name: default}
    evaluator = Evaluator(
        device=args.device,
        gpus=args.gpus,
        protocol=default,
        problems=args.problems,
        executor=args.executor,
        workers=args.workers,
        address=args.address,
        timeout_s=args.timeout,
    )
    slots = max(1, len(evaluator.health().get("slots", {})))
    runner = Runner(
        evaluator, requests, db, in_flight=args.in_flight or max(8, 4 * slots), protocols=protocols
    )
    metrics = Metrics(requests, runner)
    runner.on_finished = lambda row, outcome: metrics.finished(
        outcome, max(0.0, __import__("time").monotonic() - float(row.get("claimed_at", 0.0)))
    )

    def problem_known(name: str) -> str | None:
        try:
            evaluator.problem_path(name)
        except UnknownProblem as exc:
            return str(exc)
        return None

    def on_stop() -> None:
        log = logging.getLogger("kbv.serve")
        log.info("draining: no new evaluations; waiting for %d in flight", len(runner.in_flight))
        finished = runner.drain(args.drain_timeout)
        evaluator.close(cancel_pending=True)
        log.info(
            "drained" if finished else "drain timed out; unfinished requests run again at the next start"
        )

    state = AppState(
        requests=requests,
        protocols=protocols,
        default_protocol=default.name,
        problem_known=problem_known,
        token=token,
        limits=Limits(
            max_body_bytes=args.max_body_bytes,
            max_source_bytes=args.max_source_bytes,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            max_timeout_s=args.max_timeout,
        ),
        runner=runner,
        metrics=metrics,
        on_start=runner.start,
        on_stop=on_stop,
    )
    if requeued:
        logging.getLogger("kbv.serve").info("%d requests of an earlier run queued again", requeued)
    return make_app(state), state


def serve_command(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        sys.stderr.write(
            "kbv: error: kbv serve needs the serve extra: pip install 'kernelbench-verified[serve]'\n"
        )
        return 2
    try:
        token = read_token(args.token_file, args.no_auth, args.host)
    except ServeError as exc:
        sys.stderr.write(f"kbv: error: {exc}\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app, _ = build(args, token)
    sys.stderr.write(
        f"kbv serve: http://{args.host}:{args.port} (auth: {'bearer token' if token else 'none'})\n"
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=None)
    return 0
