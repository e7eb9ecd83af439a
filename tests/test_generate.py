"""kbv.generate against real HTTP servers on 127.0.0.1 speaking the OpenAI and Anthropic protocols.

The official SDKs talk to these servers, so the tests cover the wire format, retries, the cache,
key hygiene and the command line end to end, with no network beyond the loopback interface.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai")
pytest.importorskip("anthropic")

from kbv.generate import GenerationConfig, generate  # noqa: E402
from kbv.generate import _cli as generate_cli  # noqa: E402

SECRET = "sk-test-THIS-KEY-MUST-NEVER-BE-WRITTEN-0123456789"

PROBLEM_TEMPLATE = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)  # {marker}


batch_size = 16
dim = 64


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
"""

ANSWER = (
    "import torch\n\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n"
    "        return torch.relu(x)\n"
)


def answer_for(prompt: str) -> str:
    """The fake model: no code when the problem says NOCODE, a ModelNew block otherwise."""
    if "NOCODE" in prompt:
        return "I would rather not write a kernel for this one."
    return f"<think>let me think</think>\nSure.\n```python\n{ANSWER}```\nThis fuses nothing."


class FakeServer:
    """A threaded HTTP server with scripted failures and a log of what it received."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.failures: list[int] = []  # status codes to return, in order, before answering normally
        self.reject_key = False  # answer 401 and echo the key back, as some gateways do
        self.answer: Callable[[str], str] = answer_for
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                auth = self.headers.get("Authorization") or self.headers.get("x-api-key") or ""
                with server._lock:
                    server.requests.append({"path": self.path, "body": body})
                    failure = server.failures.pop(0) if server.failures else None
                if server.reject_key:
                    self._send(
                        401,
                        {
                            "error": {
                                "message": f"Incorrect API key provided: {auth}",
                                "type": "invalid_request_error",
                            }
                        },
                    )
                elif failure is not None:
                    self._send(
                        failure,
                        {"error": {"message": "slow down", "type": "rate_limit_error"}},
                        {"retry-after": "0"},
                    )
                elif self.path.endswith("/chat/completions"):
                    self._send(200, server.chat(body))
                elif self.path.endswith("/messages"):
                    self._send(200, server.messages(body))
                else:
                    self._send(404, {"error": {"message": "no such route"}})

            def _send(
                self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None
            ) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["messages"][-1]["content"]
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {
                        "role": "assistant",
                        "content": self.answer(prompt),
                        "reasoning_content": "thinking about tiles",
                    },
                }
            ],
            "usage": {"prompt_tokens": 100, "completion_tokens": 50, "total_tokens": 150},
        }

    def messages(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["messages"][-1]["content"]
        return {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [
                {"type": "thinking", "thinking": "tiles first", "signature": "sig"},
                {"type": "text", "text": self.answer(prompt)},
            ],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 120, "output_tokens": 60},
        }

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    yield fake
    fake.close()


@pytest.fixture
def problems(tmp_path: Path) -> Path:
    folder = tmp_path / "problems"
    folder.mkdir()
    for name in ("alpha", "beta", "gamma"):
        (folder / f"{name}.py").write_text(PROBLEM_TEMPLATE.format(marker=name))
    return folder


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET + "-anthropic")


def openai_config(server: FakeServer, **changes: Any) -> GenerationConfig:
    settings: dict[str, Any] = {
        "provider": "openai",
        "model": "fake-coder",
        "base_url": server.url + "/v1",
        "backoff_base": 0.01,
        "backoff_max": 0.05,
        "concurrency": 3,
    }
    settings.update(changes)
    return GenerationConfig(**settings)


def sidecar(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "generation.jsonl").read_text().splitlines()]


def all_text_under(*folders: Path) -> str:
    return "".join(
        p.read_text(errors="replace") for folder in folders for p in folder.rglob("*") if p.is_file()
    )


def test_generation_writes_candidates_sidecar_and_manifest(server, problems, tmp_path):
    run_dir = tmp_path / "run"
    summary = generate(problems, openai_config(server, samples=2), run_dir, progress=False)
    assert summary.statuses == {"ok": 6}
    names = sorted(p.name for p in run_dir.glob("*_kernel.py"))
    assert names == [f"level_1_problem_{p}_sample_{s}_kernel.py" for p in (1, 2, 3) for s in (0, 1)]
    assert (run_dir / "level_1_problem_1_sample_0_kernel.py").read_text() == ANSWER
    lines = sidecar(run_dir)
    assert len(lines) == 6
    line = lines[0]
    for key in (
        "prompt",
        "prompt_sha256",
        "response",
        "usage",
        "latency_s",
        "cost_usd",
        "status",
        "cache_hit",
        "template",
    ):
        assert key in line
    assert line["usage"]["input_tokens"] == 100 and line["reasoning"] == "thinking about tiles"
    manifest = [json.loads(x) for x in (run_dir / "manifest.jsonl").read_text().splitlines()]
    assert [(m["name"], m["level"], m["problem_id"]) for m in manifest] == [
        ("alpha", 1, 1),
        ("beta", 1, 2),
        ("gamma", 1, 3),
    ]
    # The request carried the prompt and the sampling settings, and the problem's source.
    body = server.requests[0]["body"]
    assert body["model"] == "fake-coder" and body["temperature"] == 0.0 and "max_tokens" in body
    assert "class Model(nn.Module)" in body["messages"][0]["content"]


def test_repeated_run_sends_no_new_requests(server, problems, tmp_path):
    run_dir = tmp_path / "run"
    generate(problems, openai_config(server), run_dir, progress=False)
    sent = len(server.requests)
    assert sent == 3
    summary = generate(problems, openai_config(server), run_dir, progress=False)
    assert len(server.requests) == sent
    assert summary.cache_hits == 3 and summary.requests == 0 and summary.statuses == {"ok": 3}
    assert all(line["cache_hit"] for line in sidecar(run_dir))
    # A shared user cache serves another run directory too.
    shared = tmp_path / "shared-cache"
    generate(problems, openai_config(server, cache_dir=str(shared)), tmp_path / "a", progress=False)
    generate(problems, openai_config(server, cache_dir=str(shared)), tmp_path / "b", progress=False)
    assert len(server.requests) == sent + 3


def test_rate_limit_is_retried_with_backoff(server, problems, tmp_path):
    server.failures = [429, 503]
    delays: list[float] = []
    summary = generate(
        problems, openai_config(server, concurrency=1), tmp_path / "run", progress=False, sleep=delays.append
    )
    assert summary.statuses == {"ok": 3}
    assert len(server.requests) == 5 and len(delays) == 2
    assert all(0 <= d <= 0.05 for d in delays)
    assert sidecar(tmp_path / "run")[0]["attempts"] == 3


def test_persistent_failure_is_recorded_and_run_goes_on(server, problems, tmp_path):
    server.failures = [429] * 3 + [400]
    summary = generate(
        problems,
        openai_config(server, concurrency=1, retries=2),
        tmp_path / "run",
        progress=False,
        sleep=lambda _: None,
    )
    statuses = [line["status"] for line in sidecar(tmp_path / "run")]
    assert statuses[0].startswith("error: RateLimitError (HTTP 429)")
    assert statuses[1].startswith("error: BadRequestError (HTTP 400)")
    assert statuses[2] == "ok" and summary.statuses == {"error": 2, "ok": 1}


def test_key_appears_in_no_file(server, problems, tmp_path):
    run_dir, user_cache = tmp_path / "run", tmp_path / "user-cache"
    server.answer = lambda prompt: f"your key is {SECRET}\n```python\n{ANSWER}```"
    generate(problems, openai_config(server, cache_dir=str(user_cache)), run_dir, progress=False)
    server.reject_key = True
    generate(problems, openai_config(server, use_cache=False), tmp_path / "rejected", progress=False)
    assert any(
        line["status"].startswith("error: AuthenticationError") for line in sidecar(tmp_path / "rejected")
    )
    text = all_text_under(run_dir, user_cache, tmp_path / "rejected")
    assert "THIS-KEY-MUST-NEVER" not in text and "0123456789" not in text
    assert "[redacted]" in text


def test_response_without_code_is_a_failure_and_run_goes_on(server, problems, tmp_path):
    (problems / "delta.py").write_text(PROBLEM_TEMPLATE.format(marker="NOCODE"))
    run_dir = tmp_path / "run"
    summary = generate(problems, openai_config(server), run_dir, progress=False)
    assert summary.statuses == {"ok": 3, "no_code_block": 1}
    by_name = {line["problem"]["name"]: line for line in sidecar(run_dir)}
    assert by_name["delta"]["status"] == "no_code_block" and by_name["delta"]["kernel"] is None
    assert "rather not" in by_name["delta"]["response"]
    assert len(list(run_dir.glob("*_kernel.py"))) == 3


def test_budget_stops_new_requests(server, problems, tmp_path):
    summary = generate(
        problems, openai_config(server, concurrency=1, max_requests=1), tmp_path / "run", progress=False
    )
    assert summary.statuses == {"ok": 1, "skipped: budget": 2} and len(server.requests) == 1
    tokens = generate(
        problems,
        openai_config(server, concurrency=1, max_tokens_total=200, use_cache=False),
        tmp_path / "run2",
        progress=False,
    )
    assert tokens.statuses == {"ok": 2, "skipped: budget": 1}  # 150 tokens each: the third is over


def test_cost_accounting_from_user_price_table(server, problems, tmp_path):
    prices = tmp_path / "prices.toml"
    prices.write_text('[models."fake-coder"]\ninput = 10.0\noutput = 20.0\n')
    summary = generate(problems, openai_config(server, prices=str(prices)), tmp_path / "run", progress=False)
    assert summary.cost_usd == pytest.approx(3 * (100 * 10 + 50 * 20) / 1e6)
    assert sidecar(tmp_path / "run")[0]["cost_usd"] == pytest.approx((100 * 10 + 50 * 20) / 1e6)


def test_anthropic_messages_protocol(server, problems, tmp_path):
    config = GenerationConfig(
        provider="anthropic",
        model="claude-fake",
        base_url=server.url,
        thinking_budget=2000,
        max_tokens=4000,
        backoff_base=0.01,
    )
    summary = generate(problems, config, tmp_path / "run", progress=False)
    assert summary.statuses == {"ok": 3}
    body = server.requests[0]["body"]
    assert server.requests[0]["path"] == "/v1/messages"
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2000} and "temperature" not in body
    line = sidecar(tmp_path / "run")[0]
    assert line["reasoning"] == "tiles first" and line["usage"]["output_tokens"] == 60
    assert SECRET not in all_text_under(tmp_path / "run")


def test_anthropic_rate_limit_retried(server, problems, tmp_path):
    server.failures = [429]
    config = GenerationConfig(
        provider="anthropic", model="claude-fake", base_url=server.url, backoff_base=0.01, concurrency=1
    )
    summary = generate(problems, config, tmp_path / "run", progress=False, sleep=lambda _: None)
    assert summary.statuses == {"ok": 3} and len(server.requests) == 4
    assert server.requests[-1]["body"]["temperature"] == 0.0


# --- command line ------------------------------------------------------------------------------


def eval_flags(parser: argparse.ArgumentParser) -> None:
    """The evaluation flags the lead's ``kbv run`` uses; they must not clash with generation's."""
    parser.add_argument("--protocol", default="verified")
    parser.add_argument("--device", default=None)
    parser.add_argument("--timeout", type=float, default=None)


def parser_with(evaluate: Any = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kbv")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cli.register(sub)
    if evaluate is not None:
        generate_cli.register_pipeline(sub, evaluate, add_eval_arguments=eval_flags)
    return parser


def run_cli(argv: list[str], evaluate: Any = None) -> int:
    args = parser_with(evaluate).parse_args(argv)
    return int(args.handler(args))


def test_cli_generate(server, problems, tmp_path, capsys):
    out = tmp_path / "run"
    code = run_cli(
        [
            "generate",
            "--problems",
            str(problems),
            "--model",
            "openai:fake-coder",
            "--base-url",
            server.url + "/v1",
            "--out",
            str(out),
            "--samples",
            "2",
            "--backend",
            "triton",
            "--input-blind",
            "--no-progress",
            "--backoff-base",
            "0.01",
        ]
    )
    assert code == 0
    assert len(list(out.glob("*_kernel.py"))) == 6
    assert "6/6 candidates" in capsys.readouterr().out
    prompt = server.requests[0]["body"]["messages"][0]["content"]
    assert "@triton.jit" in prompt and "batch_size = ...  #" in prompt and "= 16" not in prompt


def test_cli_usage_errors_exit_2_with_one_line(server, problems, tmp_path, capsys, monkeypatch):
    base = ["generate", "--problems", str(problems), "--out", str(tmp_path / "o"), "--no-progress"]
    cases = [
        base + ["--model", "gpt-5"],
        base + ["--model", "nonesuch:m"],
        base + ["--model", "vllm:m"],
        base + ["--preset", "no-such-preset"],
        base + ["--model", "openai:m", "--samples", "0"],
        [
            "generate",
            "--problems",
            str(tmp_path / "missing"),
            "--model",
            "openai:m",
            "--out",
            str(tmp_path / "o"),
        ],
    ]
    for argv in cases:
        assert run_cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("kbv: error:"), err
    monkeypatch.delenv("OPENAI_API_KEY")
    assert run_cli(base + ["--model", "openai:m"]) == 2
    assert "OPENAI_API_KEY is not set" in capsys.readouterr().err
    assert not server.requests


def test_cli_preset_runs_each_model_into_its_folder(server, problems, tmp_path):
    preset = tmp_path / "local.toml"
    preset.write_text(
        f'name = "local"\nversion = 1\n[defaults]\nbase_url = "{server.url}/v1"\nmax_tokens = 1000\n'
        '[[models]]\nslug = "one"\nprovider = "openai"\nmodel = "m1"\n'
        f'[[models]]\nslug = "two"\nprovider = "anthropic"\nmodel = "m2"\nbase_url = "{server.url}"\n'
        "thinking_budget = 500\n"
    )
    out = tmp_path / "run"
    code = run_cli(
        [
            "generate",
            "--problems",
            str(problems),
            "--preset",
            str(preset),
            "--out",
            str(out),
            "--no-progress",
            "--backoff-base",
            "0.01",
        ]
    )
    assert code == 0
    assert len(list((out / "one").glob("*_kernel.py"))) == 3
    assert len(list((out / "two").glob("*_kernel.py"))) == 3
    assert {r["path"] for r in server.requests} == {"/v1/chat/completions", "/v1/messages"}


def test_cli_pipeline_generates_then_evaluates(server, problems, tmp_path, monkeypatch):
    calls: list[tuple[str, str, Any, str | None]] = []

    def evaluate_batch(problems_path: str, candidates_dir: str, args: argparse.Namespace) -> int:
        import os

        calls.append((problems_path, candidates_dir, args.device, os.environ.get("OPENAI_API_KEY")))
        return 0

    out = tmp_path / "run"
    code = run_cli(
        [
            "pipeline",
            "--problems",
            str(problems),
            "--model",
            "openai:fake-coder",
            "--base-url",
            server.url + "/v1",
            "--out",
            str(out),
            "--no-progress",
            "--device",
            "cpu",
        ],
        evaluate_batch,
    )
    assert code == 0
    assert calls == [(str(problems), str(out), "cpu", None)]  # the key is gone before evaluation
    assert len(list(out.glob("*_kernel.py"))) == 3


def test_cli_all_requests_failing_exits_1(server, problems, tmp_path):
    server.reject_key = True
    code = run_cli(
        [
            "generate",
            "--problems",
            str(problems),
            "--model",
            "openai:fake-coder",
            "--base-url",
            server.url + "/v1",
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
            "--no-cache",
        ]
    )
    assert code == 1


def test_pipeline_stores_evaluated_records_and_never_the_key(server, problems, tmp_path):
    """`kbv pipeline` end to end: real generation, real evaluation into a real store, and the
    provider key in no file that the run or the store wrote."""
    from kbv.cli import main
    from kbv.store import Store

    out, db = tmp_path / "run", tmp_path / "results.sqlite"
    code = main(
        [
            "pipeline",
            "--problems",
            str(problems),
            "--model",
            "openai:fake-coder",
            "--base-url",
            server.url + "/v1",
            "--out",
            str(out),
            "--no-progress",
            "--device",
            "cpu",
            "--protocol",
            "standard",
            "--db",
            str(db),
        ]
    )
    assert code == 0
    with Store(db) as store:
        records = store.records()
    assert sorted(r.problem["name"] for r in records) == ["alpha", "beta", "gamma"]
    assert {r.outcome for r in records} == {"passed"}
    files = [p for p in [*out.rglob("*"), *tmp_path.glob("results.sqlite*")] if p.is_file()]
    assert files and not [p for p in files if SECRET.encode() in p.read_bytes()]
