"""Clients of ``kbv serve`` over httpx: :class:`Client` (blocking) and :class:`AsyncClient`.

::

    from kbv.client import Client
    with Client("http://127.0.0.1:8000") as kbv_service:       # token from $KBV_SERVE_TOKEN
        result = kbv_service.evaluate("level1/19_ReLU", source)   # submit and wait
        print(result["outcome"], result["record"]["speedup"]["best"], result["record_id"])

A request the queue cannot take yet (429) is sent again after the server's ``Retry-After``, up to
``retry_for_s``; any other refusal raises :class:`ServiceError` with the server's one-line reason.
Needs the ``serve`` extra (httpx).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import httpx

FINISHED = ("done", "error")


class ServiceError(RuntimeError):
    """The service refused a request (4xx/5xx); ``status`` and the server's one-line ``reason``."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"kbv serve answered {status}: {reason}")
        self.status = status
        self.reason = reason


def _headers(token: str | None) -> dict[str, str]:
    token = token if token is not None else os.environ.get("KBV_SERVE_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def evaluation(
    problem: str,
    source: str,
    *,
    protocol: str | None = None,
    precision: str | None = None,
    timeout_s: float | None = None,
    label: str | None = None,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    """One evaluation as the API takes it (fields left out take the server's defaults)."""
    item: dict[str, Any] = {"problem": problem, "source": source}
    optional = {
        "protocol": protocol,
        "precision": precision,
        "timeout_s": timeout_s,
        "label": label,
        "idempotency_key": idempotency_key,
    }
    item.update({k: v for k, v in optional.items() if v is not None})
    return item


def _reason(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error") or response.text)
    except ValueError:
        return response.text.strip().splitlines()[0] if response.text.strip() else response.reason_phrase


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.5, float(response.headers.get("retry-after", "1")))
    except ValueError:
        return 1.0


class Client:
    """Blocking client. ``token``: the bearer token (default ``$KBV_SERVE_TOKEN``); ``transport``:
    httpx's (tests pass one that calls the app in process)."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        token: str | None = None,
        *,
        timeout_s: float = 60.0,
        retry_for_s: float = 600.0,
        poll_s: float = 0.5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=url, headers=_headers(token), timeout=timeout_s, transport=transport
        )
        self.retry_for_s = retry_for_s
        self.poll_s = poll_s

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.retry_for_s
        while True:
            response = self._http.request(method, path, **kwargs)
            if response.status_code == 429 and time.monotonic() < deadline:
                time.sleep(_retry_after(response))
                continue
            if response.status_code >= 400:
                raise ServiceError(response.status_code, _reason(response))
            return response.json()

    def health(self) -> dict[str, Any]:
        return dict(self._request("GET", "/health"))

    def submit(self, problem: str, source: str, **fields: Any) -> str:
        """Queue one evaluation; its id."""
        return str(self._request("POST", "/v1/evaluations", json=evaluation(problem, source, **fields))["id"])

    def submit_batch(self, items: Sequence[dict[str, Any]], idempotency_key: str | None = None) -> list[str]:
        """Queue evaluations (each from :func:`evaluation`) all or none; their ids in order."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body = {"evaluations": list(items)}
        return [
            str(i) for i in self._request("POST", "/v1/evaluations/batch", json=body, headers=headers)["ids"]
        ]

    def get(self, request_id: str) -> dict[str, Any]:
        """The request: ``status`` (queued, running, done, error), ``outcome``, ``record_id`` and,
        once done, the ``record``."""
        return dict(self._request("GET", f"/v1/evaluations/{request_id}"))

    def list_evaluations(self, status: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit, **({"status": status} if status else {})}
        return list(self._request("GET", "/v1/evaluations", params=params)["evaluations"])

    def wait(self, ids: Iterable[str], timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Each request once finished, in order; TimeoutError after ``timeout_s``."""
        ids = list(ids)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: dict[str, dict[str, Any]] = {}
        while True:
            for request_id in ids:
                if request_id not in results:
                    found = self.get(request_id)
                    if found["status"] in FINISHED:
                        results[request_id] = found
            if len(results) == len(ids):
                return [results[i] for i in ids]
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(ids) - len(results)} of {len(ids)} evaluations not finished")
            time.sleep(self.poll_s)

    def evaluate(self, problem: str, source: str, **fields: Any) -> dict[str, Any]:
        """Submit one evaluation and wait for it."""
        return self.wait([self.submit(problem, source, **fields)])[0]

    def evaluate_many(
        self, items: Sequence[dict[str, Any]], timeout_s: float | None = None
    ) -> list[dict[str, Any]]:
        """Submit evaluations as one batch and wait for all of them."""
        return self.wait(self.submit_batch(items), timeout_s=timeout_s)


class AsyncClient:
    """The asyncio twin of :class:`Client`."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        token: str | None = None,
        *,
        timeout_s: float = 60.0,
        retry_for_s: float = 600.0,
        poll_s: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=url, headers=_headers(token), timeout=timeout_s, transport=transport
        )
        self.retry_for_s = retry_for_s
        self.poll_s = poll_s

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.retry_for_s
        while True:
            response = await self._http.request(method, path, **kwargs)
            if response.status_code == 429 and time.monotonic() < deadline:
                await asyncio.sleep(_retry_after(response))
                continue
            if response.status_code >= 400:
                raise ServiceError(response.status_code, _reason(response))
            return response.json()

    async def health(self) -> dict[str, Any]:
        return dict(await self._request("GET", "/health"))

    async def submit(self, problem: str, source: str, **fields: Any) -> str:
        body = evaluation(problem, source, **fields)
        return str((await self._request("POST", "/v1/evaluations", json=body))["id"])

    async def submit_batch(
        self, items: Sequence[dict[str, Any]], idempotency_key: str | None = None
    ) -> list[str]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body = {"evaluations": list(items)}
        answer = await self._request("POST", "/v1/evaluations/batch", json=body, headers=headers)
        return [str(i) for i in answer["ids"]]

    async def get(self, request_id: str) -> dict[str, Any]:
        return dict(await self._request("GET", f"/v1/evaluations/{request_id}"))

    async def list_evaluations(self, status: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit, **({"status": status} if status else {})}
        return list((await self._request("GET", "/v1/evaluations", params=params))["evaluations"])

    async def wait(self, ids: Iterable[str], timeout_s: float | None = None) -> list[dict[str, Any]]:
        ids = list(ids)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: dict[str, dict[str, Any]] = {}
        while True:
            for request_id in ids:
                if request_id not in results:
                    found = await self.get(request_id)
                    if found["status"] in FINISHED:
                        results[request_id] = found
            if len(results) == len(ids):
                return [results[i] for i in ids]
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(ids) - len(results)} of {len(ids)} evaluations not finished")
            await asyncio.sleep(self.poll_s)

    async def evaluate(self, problem: str, source: str, **fields: Any) -> dict[str, Any]:
        return (await self.wait([await self.submit(problem, source, **fields)]))[0]

    async def evaluate_many(
        self, items: Sequence[dict[str, Any]], timeout_s: float | None = None
    ) -> list[dict[str, Any]]:
        return await self.wait(await self.submit_batch(items), timeout_s=timeout_s)
