"""Generation settings, presets (named sets of models) and the price table."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A preset, price table or setting that cannot be used; the message says how to fix it."""


@dataclass(frozen=True)
class GenerationConfig:
    """Everything about one model's generation run except the problems and the output directory.

    ``temperature=None`` leaves the provider's default (reasoning models reject a temperature).
    ``cache_dir=None`` keeps the response cache in ``RUN_DIR/.cache``.
    """

    provider: str
    model: str
    base_url: str | None = None
    api_key_env: str | None = None
    samples: int = 1
    temperature: float | None = 0.0
    max_tokens: int | None = 8192
    reasoning_effort: str | None = None
    thinking_budget: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    backend: str = "cuda"
    template: str = "kernelbench-v1"
    input_blind: bool = False
    precision: str = "fp32"  # the precision the kernels will be judged in, said in the prompt
    concurrency: int = 4
    max_requests: int | None = None
    max_tokens_total: int | None = None
    use_cache: bool = True
    cache_dir: str | None = None
    retries: int = 6
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    timeout: float = 600.0
    prices: str | None = None  # a user's price table, merged over the bundled one

    def public(self) -> dict[str, Any]:
        """The settings as written into the run directory (names of key variables, never keys)."""
        return dataclasses.asdict(self)


_PRESET_FIELDS = {
    "provider",
    "model",
    "base_url",
    "api_key_env",
    "samples",
    "temperature",
    "max_tokens",
    "reasoning_effort",
    "thinking_budget",
    "extra_body",
    "system",
    "backend",
    "template",
    "input_blind",
    "precision",
}


@dataclass(frozen=True)
class Preset:
    """A named, versioned list of models with their settings."""

    name: str
    version: int
    path: Path
    models: list[tuple[str, dict[str, Any]]]  # (slug, GenerationConfig fields)

    def configs(self, **overrides: Any) -> list[tuple[str, GenerationConfig]]:
        """One config per model; ``overrides`` (the user's explicit flags) win over the preset."""
        out = []
        for slug, fields_ in self.models:
            merged = {**fields_, **{k: v for k, v in overrides.items() if v is not None}}
            out.append((slug, GenerationConfig(**merged)))
        return out


def bundled_presets_dir() -> Path:
    return Path(str(resources.files("kbv.generate") / "presets"))


def user_presets_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kbv" / "presets"


def available_presets() -> list[str]:
    names = {
        p.stem for d in (bundled_presets_dir(), user_presets_dir()) if d.is_dir() for p in d.glob("*.toml")
    }
    return sorted(names)


def find_preset(name_or_path: str) -> Path:
    """A preset file: a path, else the user's presets directory, else the bundled ones."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        return path
    for directory in (user_presets_dir(), bundled_presets_dir()):
        candidate = directory / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"preset {name_or_path!r} not found: pass a .toml path or one of "
        f"{', '.join(available_presets()) or 'none'}"
    )


def load_preset(name_or_path: str) -> Preset:
    """Read and check a preset file."""
    path = find_preset(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"preset {path} is not valid TOML: {exc}") from exc
    defaults = data.get("defaults", {})
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise ConfigError(f"preset {path} names no [[models]]")
    entries: list[tuple[str, dict[str, Any]]] = []
    for index, entry in enumerate(models):
        merged = {**defaults, **entry}
        slug = str(merged.pop("slug", "") or slugify(str(merged.get("model", index))))
        unknown = set(merged) - _PRESET_FIELDS
        if unknown:
            raise ConfigError(f"preset {path}, model {slug!r}: unknown settings {', '.join(sorted(unknown))}")
        if "provider" not in merged or "model" not in merged:
            raise ConfigError(f"preset {path}, model {slug!r}: needs provider and model")
        if merged.get("temperature") is False:  # TOML has no null: false means "leave unset"
            merged["temperature"] = None
        if slug in {s for s, _ in entries}:
            raise ConfigError(f"preset {path}: slug {slug!r} appears twice")
        entries.append((slug, merged))
    return Preset(
        name=str(data.get("name", path.stem)), version=int(data.get("version", 1)), path=path, models=entries
    )


def slugify(text: str) -> str:
    """A directory name for a model id."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"


@dataclass(frozen=True)
class PriceTable:
    """US dollars per million input and output tokens, by model id (or ``provider:model``)."""

    prices: dict[str, tuple[float, float]]

    def cost(self, provider: str, model: str, input_tokens: int, output_tokens: int) -> float | None:
        price = self.prices.get(f"{provider}:{model}") or self.prices.get(model)
        if price is None:
            return None
        return (input_tokens * price[0] + output_tokens * price[1]) / 1e6


def _read_prices(path: Path) -> dict[str, tuple[float, float]]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"price table {path} cannot be read: {exc}") from exc
    out: dict[str, tuple[float, float]] = {}
    for model, entry in data.get("models", {}).items():
        try:
            out[model] = (float(entry["input"]), float(entry["output"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"price table {path}: model {model!r} needs numeric input and output") from exc
    return out


def load_prices(user_file: str | None = None) -> PriceTable:
    """The bundled price table with the user's file merged over it."""
    bundled = Path(str(resources.files("kbv.generate") / "prices.toml"))
    prices = _read_prices(bundled) if bundled.is_file() else {}
    if user_file:
        prices.update(_read_prices(Path(user_file)))
    return PriceTable(prices)
