"""The ``kbv generate`` and ``kbv pipeline`` subcommands, registered on the lead's argparse parser.

Wiring in ``kbv/cli.py``::

    from kbv.generate import _cli as generate_cli
    generate_cli.register(subparsers)
    generate_cli.register_pipeline(subparsers, evaluate_batch, add_eval_arguments=add_run_flags)

Exit status: 0 when the run went through (generation failures are data in generation.jsonl);
2 for a usage error with one line on stderr; 1 when every request of a model failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kbv.generate._config import ConfigError, GenerationConfig, load_preset
from kbv.generate._prompts import BACKENDS, PromptError
from kbv.generate._providers import PROVIDERS, ProviderError, key_env_name, parse_model, read_key
from kbv.generate._runner import STATUS_OK, GenerationSummary, generate

EvaluateBatch = Callable[[str, str, argparse.Namespace], int]


class UsageError(ValueError):
    """A bad flag or setting: exit 2 with one line on stderr."""


def _temperature(text: str) -> float | str:
    if text.lower() in {"none", "default"}:
        return "none"
    try:
        return float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--temperature must be a number or 'none', got {text!r}") from exc


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kbv generate`` (also used by ``kbv pipeline``)."""
    parser.add_argument("--problems", required=True, help="problem file, directory or KernelBench tree")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--model", help="PROVIDER:MODEL, e.g. openai:gpt-5, anthropic:claude-sonnet-4-5, vllm:Qwen/Qwen3-8B"
    )
    which.add_argument(
        "--preset", help="a preset name (e.g. study-2026) or .toml path; each model goes to OUT/<slug>/"
    )
    parser.add_argument("--out", required=True, help="run directory for the candidates and generation.jsonl")
    parser.add_argument("--samples", type=int, help="candidates per problem (default 1)")
    parser.add_argument(
        "--temperature",
        type=_temperature,
        help="sampling temperature, or 'none' for the provider default (default 0, or none with reasoning)",
    )
    parser.add_argument("--max-tokens", type=int, help="output token limit per request (default 8192)")
    parser.add_argument(
        "--reasoning-effort", help="reasoning effort for models that take one (low|medium|high)"
    )
    parser.add_argument(
        "--thinking-budget", type=int, help="thinking token budget (Anthropic extended thinking)"
    )
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    parser.add_argument("--base-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 for vLLM")
    parser.add_argument(
        "--api-key-env", help="environment variable holding the key (keys are never read from flags)"
    )
    parser.add_argument("--backend", choices=BACKENDS, help="kernel language asked for (default cuda)")
    parser.add_argument(
        "--input-blind",
        action="store_true",
        default=None,
        help="hide concrete input sizes and values from the prompt",
    )
    parser.add_argument("--template", help="prompt template name or file (default kernelbench-v1)")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="the precision the kernels will be judged in, said in the prompt (default fp32)",
    )
    parser.add_argument("--max-requests", type=int, help="budget: requests to send at most in this run")
    parser.add_argument("--max-tokens-total", type=int, help="budget: input+output tokens to spend at most")
    parser.add_argument("--cache-dir", help="response cache directory (default OUT/.cache/responses)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the response cache")
    parser.add_argument("--retries", type=int, default=6, help="retries on rate limits and transient errors")
    parser.add_argument(
        "--backoff-base", type=float, default=1.0, help="first retry delay in seconds (doubles)"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (default 600)"
    )
    parser.add_argument("--prices", help="price table TOML merged over the bundled one")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``kbv generate`` to the lead's subparsers."""
    parser = subparsers.add_parser(
        "generate",
        help="generate candidate kernels with an LLM (single turn)",
        description="Ask a model for one candidate per problem and sample; writes KernelBench-named files.",
    )
    add_generate_arguments(parser)
    parser.set_defaults(handler=run_generate)
    return parser


def register_pipeline(
    subparsers: Any,
    evaluate_batch: EvaluateBatch,
    add_eval_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.ArgumentParser:
    """Add ``kbv pipeline``: generate, then ``evaluate_batch(problems, candidates_dir, args)`` per model."""
    parser = subparsers.add_parser(
        "pipeline",
        help="generate candidates with an LLM, then evaluate them",
        description="kbv generate followed by the batch evaluation of each model's run directory.",
    )
    add_generate_arguments(parser)
    if add_eval_arguments is not None:
        add_eval_arguments(parser)

    def handler(args: argparse.Namespace) -> int:
        return run_pipeline(args, evaluate_batch)

    parser.set_defaults(handler=handler)
    return parser


def _usage(message: str) -> int:
    print(f"kbv: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def build_configs(args: argparse.Namespace) -> list[tuple[Path, GenerationConfig]]:
    """(run directory, config) per model named by ``--model`` or ``--preset``."""
    out = Path(args.out)
    for flag in ("samples", "concurrency", "max_tokens", "max_requests", "max_tokens_total"):
        value = getattr(args, flag, None)
        if value is not None and value < (0 if flag == "max_requests" else 1):
            raise UsageError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if not Path(args.problems).exists():
        raise UsageError(f"--problems {args.problems} does not exist")
    temperature = args.temperature
    overrides: dict[str, Any] = {
        "samples": args.samples,
        "temperature": None if temperature == "none" else temperature,
        "max_tokens": args.max_tokens,
        "reasoning_effort": args.reasoning_effort,
        "thinking_budget": args.thinking_budget,
        "base_url": args.base_url,
        "api_key_env": args.api_key_env,
        "backend": args.backend,
        "input_blind": args.input_blind,
        "template": args.template,
        "precision": args.precision,
    }
    common = {
        "concurrency": args.concurrency,
        "max_requests": args.max_requests,
        "max_tokens_total": args.max_tokens_total,
        "use_cache": not args.no_cache,
        "cache_dir": args.cache_dir,
        "retries": args.retries,
        "backoff_base": args.backoff_base,
        "timeout": args.request_timeout,
        "prices": args.prices,
    }
    if args.preset:
        preset = load_preset(args.preset)
        pairs = preset.configs(**overrides, **common)
        if temperature == "none":  # an explicit 'none' must win over the preset's value
            pairs = [(slug, _replace(cfg, temperature=None)) for slug, cfg in pairs]
        return [(out / slug, cfg) for slug, cfg in pairs]
    provider, model = parse_model(args.model)
    fields = {k: v for k, v in overrides.items() if v is not None}
    if temperature is None and (args.reasoning_effort or args.thinking_budget):
        fields["temperature"] = None  # reasoning models reject a set temperature
    elif temperature == "none":
        fields["temperature"] = None
    return [(out, GenerationConfig(provider=provider, model=model, **fields, **common))]


def _replace(config: GenerationConfig, **changes: Any) -> GenerationConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


def _check_keys(configs: list[tuple[Path, GenerationConfig]]) -> None:
    # Fail on a missing key before the first model spends anything.
    for _, cfg in configs:
        read_key(cfg.provider, cfg.base_url, cfg.api_key_env)


def _print_summary(summary: GenerationSummary, config: GenerationConfig) -> None:
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(summary.statuses.items()))
    cost = f"${summary.cost_usd:.4f}" if summary.cost_known else "unknown (model not in the price table)"
    print(
        f"{config.provider}:{config.model}: {summary.statuses.get(STATUS_OK, 0)}/{summary.jobs} candidates "
        f"written to {summary.run_dir} ({statuses}); {summary.requests} requests, "
        f"{summary.cache_hits} cached, {summary.input_tokens}+{summary.output_tokens} tokens, cost {cost}"
    )
    for path, error in summary.problem_errors:
        print(f"  skipped problem {path}: {error}", file=sys.stderr)


def generate_from_args(args: argparse.Namespace) -> tuple[int, list[Path]]:
    """Run generation for the parsed flags: (exit status, run directories)."""
    try:
        configs = build_configs(args)
        _check_keys(configs)
    except (UsageError, ConfigError, ProviderError, PromptError) as exc:
        return _usage(str(exc)), []
    status = 0
    for run_dir, config in configs:
        try:
            summary = generate(args.problems, config, run_dir, progress=not args.no_progress)
        except (ConfigError, ProviderError, PromptError, TypeError) as exc:
            return _usage(str(exc)), []
        _print_summary(summary, config)
        if summary.jobs == 0:
            return _usage(f"no loadable problems under {args.problems}"), []
        if summary.all_failed:
            status = 1
    return status, [run_dir for run_dir, _ in configs]


def run_generate(args: argparse.Namespace) -> int:
    """Handler of ``kbv generate``."""
    return generate_from_args(args)[0]


def run_pipeline(args: argparse.Namespace, evaluate_batch: EvaluateBatch) -> int:
    """Handler of ``kbv pipeline``: generation, then evaluation of each run directory."""
    status, run_dirs = generate_from_args(args)
    if status != 0:
        return status
    _drop_keys(args)
    worst = 0
    for run_dir in run_dirs:
        worst = max(worst, evaluate_batch(str(args.problems), str(run_dir), args))
    return worst


def _drop_keys(args: argparse.Namespace) -> None:
    """Remove provider keys from this process's environment before evaluation workers are spawned."""
    names = {info.key_env for info in PROVIDERS.values() if info.key_env}
    if args.api_key_env:
        names.add(args.api_key_env)
    if getattr(args, "model", None):
        try:
            provider, _ = parse_model(args.model)
            name = key_env_name(provider, args.base_url, args.api_key_env)
        except ProviderError:
            name = None
        if name:
            names.add(name)
    for name in names:
        os.environ.pop(name, None)
