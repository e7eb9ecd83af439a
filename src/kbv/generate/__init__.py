"""Single-turn kernel generation from LLMs.

The facade::

    from kbv.generate import GenerationConfig, generate
    summary = generate("problems/", GenerationConfig(provider="openai", model="gpt-5"), "runs/gpt-5")

writes ``level_{L}_problem_{P}_sample_{S}_kernel.py`` candidates plus ``generation.jsonl`` (prompt,
raw response, usage, latency, cost and status per request) into the run directory. Provider SDKs
are imported only when a provider is used (``pip install 'kernelbench-verified[generate]'``).
"""

from __future__ import annotations

from kbv.generate._cache import ResponseCache, cache_key, default_cache_dir
from kbv.generate._config import (
    ConfigError,
    GenerationConfig,
    Preset,
    PriceTable,
    available_presets,
    load_preset,
    load_prices,
)
from kbv.generate._extract import code_blocks, extract_code
from kbv.generate._prompts import (
    BACKENDS,
    DEFAULT_TEMPLATE,
    Prompt,
    PromptError,
    Template,
    available_templates,
    blind_inputs,
    build_prompt,
    load_template,
)
from kbv.generate._providers import (
    PROVIDERS,
    ChatRequest,
    Client,
    Completion,
    ProviderError,
    make_client,
    parse_model,
)
from kbv.generate._runner import (
    MANIFEST,
    SIDECAR,
    GenerationSummary,
    NumberedProblem,
    generate,
    kernel_filename,
    number_problems,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_TEMPLATE",
    "MANIFEST",
    "PROVIDERS",
    "SIDECAR",
    "ChatRequest",
    "Client",
    "Completion",
    "ConfigError",
    "GenerationConfig",
    "GenerationSummary",
    "NumberedProblem",
    "Preset",
    "PriceTable",
    "Prompt",
    "PromptError",
    "ProviderError",
    "ResponseCache",
    "Template",
    "available_presets",
    "available_templates",
    "blind_inputs",
    "build_prompt",
    "cache_key",
    "code_blocks",
    "default_cache_dir",
    "extract_code",
    "generate",
    "kernel_filename",
    "load_preset",
    "load_prices",
    "load_template",
    "make_client",
    "number_problems",
    "parse_model",
]
