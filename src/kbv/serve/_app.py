"""The HTTP API of ``kbv serve`` (FastAPI; the OpenAPI schema is served at ``/openapi.json``).

Every request is checked in full before anything is written: a bad one gets a 4xx whose body is
``{"error": "<one line>"}`` and changes nothing. docs/service.md describes the calls.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kbv.protocol import PRECISIONS, Protocol
from kbv.serve._queue import STATUSES, IdempotencyConflict, NewRequest, RequestQueue

API = "/v1"


@dataclass
class Limits:
    max_body_bytes: int = 8 << 20
    max_source_bytes: int = 256 << 10
    max_batch: int = 256
    max_queue: int = 1000
    max_timeout_s: float = 600.0


@dataclass
class AppState:
    """What the handlers need; built by ``kbv.serve.serve`` (or a test)."""

    requests: RequestQueue
    protocols: dict[str, Protocol]
    default_protocol: str
    problem_known: Callable[[str], str | None]  # name -> None, or why it is unknown
    token: str | None
    limits: Limits = field(default_factory=Limits)
    runner: Any = None  # kbv.serve._runner.Runner, or None (nothing evaluates)
    metrics: Any = None  # kbv.serve._metrics.Metrics
    on_start: Callable[[], None] | None = None
    on_stop: Callable[[], None] | None = None


class BadRequest(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message.splitlines()[0] if message else "bad request"
        self.headers = headers or {}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def make_app(state: AppState) -> FastAPI:
    """The service's app: its error handlers, then its routes in groups (status, submission,
    reading), each group registered by one function over the same ``state``."""
    app = FastAPI(
        title="kbv serve",
        description="Truthful evaluation of GPU kernels as a service (docs/service.md).",
        lifespan=_lifespan(state),
    )
    _add_error_handlers(app, state)
    _add_status_routes(app, state)
    _add_submit_routes(app, state)
    _add_read_routes(app, state)
    return app


def _lifespan(state: AppState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if state.on_start is not None:
            state.on_start()
        yield
        if state.on_stop is not None:  # SIGTERM: uvicorn stops accepting, then this drains
            state.on_stop()

    return lifespan


def _add_error_handlers(app: FastAPI, state: AppState) -> None:
    """Every refusal, ours or FastAPI's own validation, answers ``{"error": "<one line>"}``."""
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        if state.metrics is not None:
            state.metrics.rejected(exc.status)
        return _error(exc.status, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(422, f"{where}: {first.get('msg', 'invalid request')}")


def _add_status_routes(app: FastAPI, state: AppState) -> None:
    """``/health`` (open to all) and ``/metrics`` (Prometheus, behind the token)."""

    @app.get("/health")
    def health() -> dict[str, Any]:
        counts = state.requests.counts()
        return {
            "status": "draining" if state.runner is not None and state.runner.draining else "ok",
            "queued": counts["queued"],
            "running": counts["running"],
            "bound": state.limits.max_queue,
        }

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        _authorize(state, request)
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render() if state.metrics else b"", media_type=CONTENT_TYPE_LATEST)


def _add_submit_routes(app: FastAPI, state: AppState) -> None:
    """``POST /v1/evaluations`` and ``POST /v1/evaluations/batch``: checked in full, then queued."""

    @app.post(f"{API}/evaluations", status_code=202)
    async def submit(request: Request) -> JSONResponse:
        _authorize(state, request)
        item = _parse_item(state, await _body_of(state, request), request.headers.get("idempotency-key"))
        [(request_id, created)] = _enqueue(state, [item])
        return JSONResponse({"id": request_id, "created": created}, status_code=202 if created else 200)

    @app.post(f"{API}/evaluations/batch", status_code=202)
    async def submit_batch(request: Request) -> JSONResponse:
        _authorize(state, request)
        body = await _body_of(state, request)
        items = body.get("evaluations") if isinstance(body, dict) else None
        if not isinstance(items, list) or not items:
            raise BadRequest(422, 'a batch is {"evaluations": [...]} with at least one evaluation')
        if len(items) > state.limits.max_batch:
            raise BadRequest(
                413, f"a batch holds at most {state.limits.max_batch} evaluations, not {len(items)}"
            )
        header_key = request.headers.get("idempotency-key")
        parsed = []
        for index, item in enumerate(items):
            key = (
                f"{header_key}/{index}"
                if header_key and isinstance(item, dict) and "idempotency_key" not in item
                else None
            )
            try:
                parsed.append(_parse_item(state, item, key))
            except BadRequest as exc:
                raise BadRequest(exc.status, f"evaluation {index}: {exc.message}", exc.headers) from None
        added = _enqueue(state, parsed)
        return JSONResponse({"ids": [request_id for request_id, _ in added]}, status_code=202)


def _add_read_routes(app: FastAPI, state: AppState) -> None:
    """``GET /v1/evaluations/{id}`` and the paged list ``GET /v1/evaluations``."""

    @app.get(f"{API}/evaluations/{{request_id}}")
    def get(request_id: str, request: Request) -> JSONResponse:
        _authorize(state, request)
        found = state.requests.get(request_id)
        if found is None:
            raise BadRequest(404, f"no evaluation {request_id!r}")
        return JSONResponse(found)

    @app.get(f"{API}/evaluations")
    def list_(
        request: Request, status: str | None = None, limit: int = 100, after: str | None = None
    ) -> JSONResponse:
        _authorize(state, request)
        if status is not None and status not in STATUSES:
            raise BadRequest(400, f"unknown status {status!r}: use one of {', '.join(STATUSES)}")
        if not 0 < limit <= 1000:
            raise BadRequest(400, "limit must be in 1..1000")
        return JSONResponse({"evaluations": state.requests.list(status, limit, after)})


def _authorize(state: AppState, request: Request) -> None:
    if state.token is None:
        return
    header = request.headers.get("authorization", "")
    if not header:
        raise BadRequest(
            401,
            "missing bearer token: send Authorization: Bearer <token>",
            {"WWW-Authenticate": "Bearer"},
        )
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), state.token.encode()):
        raise BadRequest(403, "wrong bearer token", {"WWW-Authenticate": "Bearer"})


async def _body_of(state: AppState, request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.limits.max_body_bytes:
        raise BadRequest(413, f"request body over {state.limits.max_body_bytes} bytes")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > state.limits.max_body_bytes:
            raise BadRequest(413, f"request body over {state.limits.max_body_bytes} bytes")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(400, f"malformed JSON: {str(exc).splitlines()[0]}") from None


def _parse_item(state: AppState, item: Any, header_key: str | None) -> NewRequest:
    if not isinstance(item, dict):
        raise BadRequest(422, "each evaluation must be a JSON object with problem and source")
    unknown = set(item) - {
        "problem",
        "source",
        "protocol",
        "precision",
        "timeout_s",
        "label",
        "idempotency_key",
    }
    if unknown:
        raise BadRequest(422, f"unknown field {sorted(unknown)[0]!r}")
    problem, source = item.get("problem"), item.get("source")
    if not isinstance(problem, str) or not problem:
        raise BadRequest(422, "problem must be a problem name like level1/19_ReLU")
    if not isinstance(source, str) or not source:
        raise BadRequest(422, "source must be the candidate's Python source as a string")
    try:
        encoded = source.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(400, "source is not valid UTF-8 (it holds a lone surrogate)") from None
    if len(encoded) > state.limits.max_source_bytes:
        raise BadRequest(
            413, f"source is {len(encoded)} bytes, over the limit of {state.limits.max_source_bytes}"
        )
    protocol = item.get("protocol", state.default_protocol)
    if protocol not in state.protocols:
        raise BadRequest(400, f"unknown protocol {protocol!r}: use one of {', '.join(state.protocols)}")
    precision = item.get("precision")
    if precision is not None and precision not in PRECISIONS:
        raise BadRequest(400, f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    timeout_s = item.get("timeout_s")
    if timeout_s is not None and (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or not 0 < timeout_s <= state.limits.max_timeout_s
    ):
        raise BadRequest(422, f"timeout_s must be a number of seconds in (0, {state.limits.max_timeout_s:g}]")
    label = item.get("label", "")
    if not isinstance(label, str) or len(label) > 200:
        raise BadRequest(422, "label must be a string of at most 200 characters")
    key = item.get("idempotency_key", header_key)
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= 200):
        raise BadRequest(422, "idempotency_key must be a string of 1 to 200 characters")
    why = state.problem_known(problem)
    if why is not None:
        raise BadRequest(404, why)
    return NewRequest(
        problem=problem,
        source=source,
        protocol=str(protocol),
        precision=precision,
        timeout_s=float(timeout_s) if timeout_s is not None else None,
        label=label,
        idempotency_key=key,
    )


def _enqueue(state: AppState, items: list[NewRequest]) -> list[tuple[str, bool]]:
    if state.runner is not None and state.runner.draining:
        raise BadRequest(
            503, "the server is draining; submit to it again after its restart", {"Retry-After": "30"}
        )
    try:
        added = state.requests.add(items, state.limits.max_queue)
    except IdempotencyConflict as exc:
        raise BadRequest(409, str(exc)) from None
    if added is None:
        raise BadRequest(
            429,
            f"the queue holds its bound of {state.limits.max_queue} unfinished requests; retry later",
            {"Retry-After": str(_retry_after(state))},
        )
    if state.runner is not None:
        state.runner.wake()
    if state.metrics is not None:
        state.metrics.accepted(sum(1 for _, created in added if created))
    return added


def _retry_after(state: AppState) -> int:
    rate = state.runner.throughput.per_second() if state.runner is not None else 0.0
    backlog = state.requests.counts()["queued"]
    return int(min(600, max(1, backlog / rate))) if rate > 0 else 10
