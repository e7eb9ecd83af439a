"""``kbv serve``: bad requests refused with one line and nothing changed; the token rules; the
queue's bound; and the acceptance run (50 candidates, honest and hostile, the server SIGKILLed
midway and started again: every request finished exactly once, each verdict ``kbv run``'s).

Servers listen on 127.0.0.1 only."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="kbv serve needs the serve extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from kbv.serve import ServeError, read_token  # noqa: E402
from kbv.serve._app import AppState, Limits, make_app  # noqa: E402
from kbv.serve._queue import RequestQueue  # noqa: E402
from kbv.store import Store  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "src/kbv/suite"
FIXTURES = ROOT / "tests/fixtures/candidates"
TOKEN = "test-token-0123456789abcdef"
HONEST = (FIXTURES / "honest/relu_clamp.py").read_text()


@pytest.fixture
def app_state(tmp_path: Path) -> AppState:
    from kbv.protocol import BUILTIN

    db = tmp_path / "serve.sqlite"
    Store(db).close()
    known = {"level1/1_ReLU"}
    return AppState(
        requests=RequestQueue(db),
        protocols=dict(BUILTIN),
        default_protocol="verified",
        problem_known=lambda name: None if name in known else f"no problem {name!r}",
        token=TOKEN,
        limits=Limits(max_body_bytes=4096, max_source_bytes=1024, max_batch=4, max_queue=3),
    )


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def test_bad_requests_get_one_line_and_change_nothing(app_state: AppState) -> None:
    client = TestClient(make_app(app_state))
    url = "/v1/evaluations"
    good = {"problem": "level1/1_ReLU", "source": "class ModelNew: pass\n"}
    cases = [
        ("missing token", {}, b'{"problem": "level1/1_ReLU", "source": "x"}', 401),
        ("wrong token", {"Authorization": "Bearer nope"}, b"{}", 403),
        ("malformed JSON", _auth(), b'{"problem": ', 400),
        ("body not UTF-8", _auth(), b'{"problem": "\xff\xfe"}', 400),
        ("source a lone surrogate", _auth(), b'{"problem": "level1/1_ReLU", "source": "\\ud800"}', 400),
        ("unknown problem", _auth(), b'{"problem": "level1/999_None", "source": "x"}', 404),
        (
            "unknown protocol",
            _auth(),
            b'{"problem": "level1/1_ReLU", "source": "x", "protocol": "fast"}',
            400,
        ),
        (
            "unknown precision",
            _auth(),
            b'{"problem": "level1/1_ReLU", "source": "x", "precision": "fp8"}',
            400,
        ),
        (
            "oversized source",
            _auth(),
            ('{"problem": "level1/1_ReLU", "source": "' + "x" * 2000 + '"}').encode(),
            413,
        ),
        ("oversized body", _auth(), b'{"problem": "level1/1_ReLU", "source": "' + b"y" * 5000 + b'"}', 413),
        ("bad timeout", _auth(), b'{"problem": "level1/1_ReLU", "source": "x", "timeout_s": -1}', 422),
        ("unknown field", _auth(), b'{"problem": "level1/1_ReLU", "source": "x", "path": "/etc"}', 422),
    ]
    for what, headers, body, status in cases:
        response = client.post(url, content=body, headers={**headers, "Content-Type": "application/json"})
        assert response.status_code == status, (what, response.text)
        reason = response.json()["error"]
        assert reason and "\n" not in reason, what
    assert app_state.requests.counts() == {"queued": 0, "running": 0, "done": 0, "error": 0}
    # A batch with one bad item is refused whole, naming the item.
    batch = {"evaluations": [good, {**good, "problem": "nope"}]}
    response = client.post(f"{url}/batch", json=batch, headers=_auth())
    assert response.status_code == 404 and response.json()["error"].startswith("evaluation 1:")
    assert app_state.requests.counts()["queued"] == 0
    # The accepted control: the same request with the token is queued.
    response = client.post(url, json=good, headers=_auth())
    assert response.status_code == 202 and app_state.requests.counts()["queued"] == 1
    assert client.get("/metrics").status_code == 401 and client.get("/health").status_code == 200


def test_idempotency_and_the_queue_bound(app_state: AppState) -> None:
    client = TestClient(make_app(app_state))
    item = {"problem": "level1/1_ReLU", "source": "class ModelNew: pass\n"}
    first = client.post("/v1/evaluations", json=item, headers={**_auth(), "Idempotency-Key": "k1"})
    again = client.post("/v1/evaluations", json=item, headers={**_auth(), "Idempotency-Key": "k1"})
    assert first.status_code == 202 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    other = client.post(
        "/v1/evaluations", json={**item, "source": "y\n"}, headers={**_auth(), "Idempotency-Key": "k1"}
    )
    assert other.status_code == 409
    batch = {"evaluations": [item, item, item]}  # 1 queued + 3 > the bound of 3: none is taken
    full = client.post("/v1/evaluations/batch", json=batch, headers=_auth())
    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
    assert app_state.requests.counts()["queued"] == 1
    fits = client.post("/v1/evaluations/batch", json={"evaluations": [item, item]}, headers=_auth())
    assert fits.status_code == 202 and len(fits.json()["ids"]) == 2
    listed = client.get("/v1/evaluations", params={"status": "queued"}, headers=_auth()).json()
    assert len(listed["evaluations"]) == 3


def test_a_record_with_nan_is_served(app_state: AppState) -> None:
    """Records hold NaN (an error that could not be measured): served as the contract writes them."""
    from kbv.protocol import VERIFIED
    from kbv.records import Outcome, Record, protocol_section
    from kbv.serve._queue import NewRequest

    [(request_id, _)] = app_state.requests.add(
        [NewRequest("level1/1_ReLU", "x\n", "verified", None, None, "")], 10
    )
    app_state.requests.claim(1)
    record = Record(
        problem={"name": "1_ReLU", "source_sha256": "p"},
        candidate={"path": "c.py", "source_sha256": "c", "label": "t", "sample": None},
        protocol=protocol_section(VERIFIED),
        device={"name": "cpu"},
        outcome=Outcome.INCORRECT,
        correct=False,
        speedup={"best": float("nan")},
    )
    with Store(app_state.requests.db) as store:
        store.add_record(
            record, also=lambda conn, rid: RequestQueue.mark_done(conn, request_id, rid, "incorrect")
        )
    response = TestClient(make_app(app_state)).get(f"/v1/evaluations/{request_id}", headers=_auth())
    assert response.status_code == 200, response.text
    assert response.json()["record"]["speedup"]["best"] == "nan" and response.json()["status"] == "done"


def test_async_client(app_state: AppState) -> None:
    """kbv.client.AsyncClient against the app in process: submit, get, list, a refusal as ServiceError."""
    import asyncio

    from kbv.client import AsyncClient, ServiceError, evaluation

    app = make_app(app_state)  # (the blocking Client runs against a real server in the acceptance test)

    async def use() -> None:
        async with AsyncClient("http://kbv", TOKEN, transport=httpx.ASGITransport(app=app)) as client:
            request_id = await client.submit("level1/1_ReLU", "class ModelNew: pass\n", idempotency_key="a")
            assert (await client.get(request_id))["status"] == "queued"
            ids = await client.submit_batch([evaluation("level1/1_ReLU", "y\n")])
            assert len(ids) == 1 and len(await client.list_evaluations(status="queued")) == 2
            try:
                await client.submit("level1/999_None", "x\n")
            except ServiceError as exc:
                assert exc.status == 404 and "no problem" in exc.reason
            else:
                raise AssertionError("an unknown problem was accepted")
            assert (await client.health())["queued"] == 2

    asyncio.run(use())


def test_token_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KBV_SERVE_TOKEN", raising=False)
    with pytest.raises(ServeError, match="no bearer token"):
        read_token(None, False, "127.0.0.1")
    with pytest.raises(ServeError, match="loopback"):
        read_token(None, True, "0.0.0.0")
    assert read_token(None, True, "127.0.0.1") is None
    with pytest.raises(ServeError, match="shorter"):
        read_token(str(_write(tmp_path / "t", "short")), False, "0.0.0.0")
    assert read_token(str(_write(tmp_path / "t", TOKEN + "\n")), False, "0.0.0.0") == TOKEN
    monkeypatch.setenv("KBV_SERVE_TOKEN", TOKEN)
    assert read_token(None, False, "127.0.0.1") == TOKEN
    assert "KBV_SERVE_TOKEN" not in os.environ  # nothing started later inherits it


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- the acceptance run ---------------------------------------------------------------------------

#: (problem name, candidate file): honest, hostile and broken; cheap on the CPU.
#: The honest ones are plain PyTorch: nothing to compile in CI's fresh build cache.
PAIRS = [
    ("1_ReLU", FIXTURES / "honest/relu_clamp.py"),
    ("9_Softmax", FIXTURES / "honest/softmax_stable.py"),
    ("1_ReLU", FIXTURES / "hacks/identity_relu.py"),
    ("1_ReLU", FIXTURES / "hacks/constant_zeros.py"),
    ("1_ReLU", FIXTURES / "hacks/read_secrets.py"),
    ("1_ReLU", FIXTURES / "hacks/os_exit.py"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(db: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KBV_SERVE_TOKEN": TOKEN}
    command = [sys.executable, "-m", "kbv.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--device", "cpu", "--db", str(db), "--timeout", "120"]
    server = subprocess.Popen(command, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.3)
        assert server.poll() is None, log.read_text()[-3000:]
    raise AssertionError("kbv serve did not answer /health in 120 s:\n" + log.read_text()[-3000:])


def _kbv_run_outcomes(tmp_path: Path) -> dict[tuple[str, str], str]:
    """``kbv run`` of the distinct pairs: the verdicts every service record must equal."""
    problems, candidates = tmp_path / "problems" / "level1", tmp_path / "candidates"
    problems.mkdir(parents=True)
    candidates.mkdir()
    for name in {p for p, _ in PAIRS}:
        (problems / f"{name}.py").write_text((SUITE / "problems/level1" / f"{name}.py").read_text())
    for sample, (name, file) in enumerate(PAIRS):
        problem_id = name.split("_")[0]
        (candidates / f"level_1_problem_{problem_id}_sample_{sample}_kernel.py").write_text(file.read_text())
    db = tmp_path / "run.sqlite"
    command = [sys.executable, "-m", "kbv.cli", "run", "--problems", str(problems.parent)]
    command += ["--candidates", str(candidates), "--device", "cpu", "--db", str(db), "--timeout", "120"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    with Store(db) as store:
        return {
            (str(r.problem["name"]), r.candidate["source_sha256"]): str(r.outcome) for r in store.records()
        }


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fifty_candidates_survive_a_sigkill(tmp_path: Path) -> None:
    from kbv.client import Client, evaluation
    from kbv.rewards import make_trl_reward

    expected = _kbv_run_outcomes(tmp_path)
    db, log, port = tmp_path / "serve.sqlite", tmp_path / "serve.log", _free_port()
    server = _start_server(db, port, log)
    url = f"http://127.0.0.1:{port}"
    items = [PAIRS[i % len(PAIRS)] for i in range(50)]
    try:
        with Client(url, TOKEN) as client, ThreadPoolExecutor(16) as pool:
            submitted = list(
                pool.map(lambda pair: client.submit(f"level1/{pair[0]}", pair[1].read_text()), items)
            )
            assert len(set(submitted)) == 50
            while client.health()["queued"] + client.health()["running"] > 35:  # midway
                time.sleep(0.5)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        done_before = _count(db, "SELECT count(*) FROM serve_requests WHERE status = 'done'")
        assert 0 < done_before < 50
        server = _start_server(db, port, log)
        with Client(url, TOKEN) as client:
            results = client.wait(submitted, timeout_s=1500)
            # The adapters, with their real signatures, against the same server.
            trl = make_trl_reward(client)
            completions = [f"Here it is:\n```python\n{HONEST}```", "no code at all"]
            rewards = trl(["p1", "p2"], completions, problem=["level1/1_ReLU", "level1/1_ReLU"])
            assert rewards[0] >= 0.0 and rewards[1] == 0.0
            assert trl.last_results[0]["record"]["outcome"] == "passed"
            again = client.evaluate_many([evaluation("level1/1_ReLU", HONEST)])
            assert again[0]["status"] == "done"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
    # uvicorn ends a graceful shutdown by re-raising the SIGTERM it caught.
    assert server.returncode in (0, -signal.SIGTERM), log.read_text()[-3000:]
    assert "kbv.serve drained" in log.read_text()
    assert [r["status"] for r in results] == ["done"] * 50
    record_ids = [r["record_id"] for r in results]
    assert len(set(record_ids)) == 50  # one record each
    # Exactly once: no record without its request (the killed evaluations left none behind).
    assert _count(db, "SELECT count(*) FROM records") == 50 + 1 + 1  # the adapter's and the batch's
    for (name, file), result in zip(items, results):
        record = result["record"]
        sha = hashlib.sha256(file.read_bytes()).hexdigest()
        assert record["candidate"]["source_sha256"] == sha
        assert record["outcome"] == expected[(name, sha)], (name, file.name, record["outcome"])
    outcomes = {r["record"]["outcome"] for r in results}
    assert "passed" in outcomes and outcomes & {"hack_detected", "incorrect", "crashed"}


def _count(db: Path, sql: str) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute(sql).fetchone()[0])
