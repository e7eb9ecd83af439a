"""Provider clients over the official SDKs, imported only when used.

``openai`` and ``anthropic`` use their own SDKs. Every other provider name goes through the OpenAI
chat-completions route with a known base URL (``deepseek``, ``together``, ...) or the user's
``--base-url`` (``vllm``, ``sglang``, ``local``, or ``openai`` pointed at a gateway).

Keys come from environment variables only. A client holds its key in memory inside the SDK object
and nowhere else: the key is not part of any request description, cache key, record or log line,
and error messages are scrubbed of it before they are stored.

The SDKs' own retries are turned off (``max_retries=0``): the runner retries with its own backoff
so that every attempt is counted against the budget and visible in the sidecar.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

INSTALL_HINT = "pip install 'kernelbench-verified[generate]'"


@dataclass(frozen=True)
class ProviderInfo:
    """How to reach a provider: which SDK, where, and which variable holds the key."""

    sdk: str  # "openai" | "anthropic"
    base_url: str | None
    key_env: str | None  # None: a local server that needs no key


PROVIDERS: dict[str, ProviderInfo] = {
    "openai": ProviderInfo("openai", None, "OPENAI_API_KEY"),
    "anthropic": ProviderInfo("anthropic", None, "ANTHROPIC_API_KEY"),
    # OpenAI-compatible hosted endpoints; check the URLs against the provider's documentation.
    "deepseek": ProviderInfo("openai", "https://api.deepseek.com", "DEEPSEEK_API_KEY"),
    "together": ProviderInfo("openai", "https://api.together.xyz/v1", "TOGETHER_API_KEY"),
    "fireworks": ProviderInfo("openai", "https://api.fireworks.ai/inference/v1", "FIREWORKS_API_KEY"),
    "openrouter": ProviderInfo("openai", "https://openrouter.ai/api/v1", "OPENROUTER_API_KEY"),
    "dashscope": ProviderInfo(
        "openai", "https://dashscope-intl.aliyuncs.com/compatible-mode/v1", "DASHSCOPE_API_KEY"
    ),
    "gemini": ProviderInfo(
        "openai", "https://generativelanguage.googleapis.com/v1beta/openai/", "GEMINI_API_KEY"
    ),
    "xai": ProviderInfo("openai", "https://api.x.ai/v1", "XAI_API_KEY"),
    "mistral": ProviderInfo("openai", "https://api.mistral.ai/v1", "MISTRAL_API_KEY"),
    # Self-hosted OpenAI-compatible servers: --base-url is required, a key is optional.
    "vllm": ProviderInfo("openai", None, None),
    "sglang": ProviderInfo("openai", None, None),
    "local": ProviderInfo("openai", None, None),
}

# Status codes worth another attempt: timeouts, conflicts, rate limits, overload, server errors.
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})


class ProviderError(ValueError):
    """A provider that cannot be set up (unknown name, missing SDK or key); a usage error."""


@dataclass(frozen=True)
class ChatRequest:
    """Everything that determines a response, minus the key. Hashed into the cache key."""

    provider: str
    model: str
    base_url: str | None
    prompt: str
    system: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    reasoning_effort: str | None = None
    thinking_budget: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def cache_fields(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "model": self.model,
            "base_url": self.base_url,
            "system": self.system,
            "prompt": self.prompt,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "reasoning_effort": self.reasoning_effort,
            "thinking_budget": self.thinking_budget,
            "extra_body": self.extra_body,
        }


@dataclass
class Completion:
    """A provider's answer, reduced to what the sidecar and the cache keep."""

    text: str
    reasoning: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    finish_reason: str | None = None
    response_model: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Completion:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


class Client(Protocol):
    """What the runner needs from a provider."""

    def complete(self, request: ChatRequest) -> Completion: ...


def parse_model(spec: str) -> tuple[str, str]:
    """``PROVIDER:MODEL`` split at the first colon (model ids may contain colons)."""
    provider, sep, model = spec.partition(":")
    if not sep or not provider or not model:
        raise ProviderError(f"--model must look like PROVIDER:MODEL (for example openai:gpt-5), got {spec!r}")
    return provider.strip().lower(), model.strip()


def resolve_provider(provider: str, base_url: str | None) -> ProviderInfo:
    """The provider's settings with the user's base URL applied; unknown names need a base URL."""
    info = PROVIDERS.get(provider)
    if info is None:
        if not base_url:
            raise ProviderError(
                f"unknown provider {provider!r}: use one of {', '.join(sorted(PROVIDERS))}, or pass "
                "--base-url for an OpenAI-compatible server"
            )
        return ProviderInfo("openai", base_url, None)
    if info.key_env is None and not (base_url or info.base_url):
        raise ProviderError(
            f"provider {provider!r} is a self-hosted server: pass --base-url http://HOST:PORT/v1"
        )
    return ProviderInfo(info.sdk, base_url or info.base_url, info.key_env)


def key_env_name(provider: str, base_url: str | None, api_key_env: str | None) -> str | None:
    """The environment variable that holds the key, or None when no key is needed."""
    if api_key_env:
        return api_key_env
    return resolve_provider(provider, base_url).key_env


def read_key(provider: str, base_url: str | None, api_key_env: str | None) -> str | None:
    """The key from the environment. A missing key is an error unless a custom server is named."""
    name = key_env_name(provider, base_url, api_key_env)
    if name is None:
        return None
    value = os.environ.get(name)
    if value:
        return value
    if base_url and not api_key_env:
        return None  # a gateway or local server reached through a known provider name, no key set
    raise ProviderError(
        f"the API key variable {name} is not set; export it (keys are read from the environment only)"
    )


def make_client(
    provider: str,
    base_url: str | None = None,
    api_key_env: str | None = None,
    timeout: float = 600.0,
) -> Client:
    """A client for the provider, with the SDK imported now and the key read from the environment."""
    info = resolve_provider(provider, base_url)
    key = read_key(provider, base_url, api_key_env)
    if info.sdk == "anthropic":
        return AnthropicClient(info.base_url, key, timeout)
    return OpenAIClient(info.base_url, key, timeout, official=provider == "openai" and base_url is None)


def _import(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError as exc:
        raise ProviderError(f"the {name} SDK is not installed: {INSTALL_HINT}") from exc


class OpenAIClient:
    """Chat completions through the ``openai`` SDK (OpenAI itself or any compatible server)."""

    def __init__(self, base_url: str | None, key: str | None, timeout: float, official: bool) -> None:
        openai = _import("openai")
        # Local servers accept any key; the SDK insists on one.
        self._client = openai.OpenAI(
            api_key=key or "EMPTY", base_url=base_url, timeout=timeout, max_retries=0
        )
        self._official = official

    def complete(self, request: ChatRequest) -> Completion:
        messages = []
        if request.system:
            messages.append({"role": "system", "content": request.system})
        messages.append({"role": "user", "content": request.prompt})
        kwargs: dict[str, Any] = {"model": request.model, "messages": messages}
        if request.max_tokens is not None:
            # OpenAI's reasoning models take max_completion_tokens; compatible servers know max_tokens.
            kwargs["max_completion_tokens" if self._official else "max_tokens"] = request.max_tokens
        if request.temperature is not None:
            kwargs["temperature"] = request.temperature
        if request.reasoning_effort is not None:
            kwargs["reasoning_effort"] = request.reasoning_effort
        extra = dict(request.extra_body)
        if request.thinking_budget is not None:
            extra.setdefault("thinking_budget", request.thinking_budget)
        if extra:
            kwargs["extra_body"] = extra
        response = self._client.chat.completions.create(**kwargs)
        return _openai_completion(response)


def _openai_completion(response: Any) -> Completion:
    choice = response.choices[0] if response.choices else None
    message = getattr(choice, "message", None)
    text = (getattr(message, "content", None) or "") if message is not None else ""
    # vLLM, SGLang and DeepSeek return the reasoning separately under one of these names.
    reasoning = ""
    if message is not None:
        extra = getattr(message, "model_extra", None) or {}
        reasoning = extra.get("reasoning_content") or extra.get("reasoning") or ""
    usage = getattr(response, "usage", None)
    details = getattr(usage, "completion_tokens_details", None)
    return Completion(
        text=text,
        reasoning=reasoning if isinstance(reasoning, str) else str(reasoning),
        input_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
        output_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
        reasoning_tokens=int(getattr(details, "reasoning_tokens", 0) or 0),
        finish_reason=getattr(choice, "finish_reason", None),
        response_model=getattr(response, "model", None),
    )


class AnthropicClient:
    """Messages through the ``anthropic`` SDK, with extended thinking when a budget is set."""

    def __init__(self, base_url: str | None, key: str | None, timeout: float) -> None:
        anthropic = _import("anthropic")
        self._client = anthropic.Anthropic(
            api_key=key or "EMPTY", base_url=base_url, timeout=timeout, max_retries=0
        )

    def complete(self, request: ChatRequest) -> Completion:
        kwargs: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens or 8192,
            "messages": [{"role": "user", "content": request.prompt}],
        }
        if request.system:
            kwargs["system"] = request.system
        if request.thinking_budget is not None:
            # Extended thinking requires the default temperature, so a set temperature is dropped.
            kwargs["thinking"] = {"type": "enabled", "budget_tokens": request.thinking_budget}
        extra = dict(request.extra_body)
        if request.thinking_budget is None and request.temperature is not None:
            # Sent in the body: recent SDK releases no longer list temperature as a keyword.
            extra.setdefault("temperature", request.temperature)
        if request.reasoning_effort is not None:
            extra.setdefault("output_config", {"effort": request.reasoning_effort})
        if extra:
            kwargs["extra_body"] = extra
        response = self._client.messages.create(**kwargs)
        texts, thoughts = [], []
        for block in response.content or []:
            kind = getattr(block, "type", None)
            if kind == "text":
                texts.append(block.text)
            elif kind == "thinking":
                thoughts.append(getattr(block, "thinking", "") or "")
        usage = getattr(response, "usage", None)
        return Completion(
            text="".join(texts),
            reasoning="\n".join(thoughts),
            input_tokens=int(getattr(usage, "input_tokens", 0) or 0),
            output_tokens=int(getattr(usage, "output_tokens", 0) or 0),
            finish_reason=getattr(response, "stop_reason", None),
            response_model=getattr(response, "model", None),
        )


def is_retryable(exc: BaseException) -> bool:
    """Rate limits, overload, server errors, timeouts and dropped connections."""
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return status in RETRYABLE_STATUS
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"APIConnectionError", "APITimeoutError", "ConnectionError", "TimeoutError"})


def retry_after(exc: BaseException) -> float | None:
    """The server's Retry-After hint in seconds, when it gave one."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    for name in ("retry-after-ms", "retry-after"):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value)
        except ValueError:
            continue
        return seconds / 1000 if name.endswith("-ms") else seconds
    return None


_KEY_LIKE = re.compile(r"\b(sk|sk-ant|sk-proj|key)[-_][A-Za-z0-9_\-\*\.]{4,}")


def redact(text: str, secrets: list[str]) -> str:
    """Text with every secret, and anything that looks like a key, removed."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[redacted]")
    return _KEY_LIKE.sub("[redacted]", text)


def describe_error(exc: BaseException, secrets: list[str]) -> str:
    """A one-line, key-free description of a failed request."""
    status = getattr(exc, "status_code", None)
    head = f"{type(exc).__name__}" + (f" (HTTP {status})" if status else "")
    message = " ".join(str(exc).split())[:300]
    return redact(f"{head}: {message}", secrets)


def known_secrets(api_key_env: str | None = None) -> list[str]:
    """Values of every key variable kbv knows about, for scrubbing text before it is stored."""
    names = {info.key_env for info in PROVIDERS.values() if info.key_env}
    if api_key_env:
        names.add(api_key_env)
    # A placeholder such as "EMPTY" or "x" for a local server is no secret, and scrubbing it would
    # corrupt the generated code; real keys are far longer.
    return [value for name in sorted(names) if len(value := os.environ.get(name, "")) >= 16]
