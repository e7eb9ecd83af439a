"""Unit tests of kbv.generate without a server: extraction, prompts, numbering, presets, prices."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kbv.generate import (
    build_prompt,
    cache_key,
    extract_code,
    kernel_filename,
    load_preset,
    load_prices,
    load_template,
    number_problems,
    parse_model,
)
from kbv.generate._providers import ChatRequest, ProviderError, describe_error, is_retryable, resolve_provider
from kbv.problems import load_problem

MODEL_NEW = "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x\n"

PROBLEM = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha

    def forward(self, x):
        return torch.relu(x) * self.alpha


batch_size = 4096  # a very particular size
dim = 393
alpha = 0.5
KBV = {"cpu_sizes": {"batch_size": 8}, "distributions": ["secret_heavy_tail"]}


def get_inputs():
    return [torch.rand(batch_size, dim, 17)]


def get_init_inputs():
    return [alpha]
"""


# --- extraction -------------------------------------------------------------------------------


def test_extract_single_block():
    assert extract_code(f"Here you go:\n```python\n{MODEL_NEW}```\nDone.") == MODEL_NEW


def test_extract_picks_block_defining_model_new_among_several():
    text = (
        "First the kernel:\n```cpp\n__global__ void k() {}\n```\n"
        "A helper:\n```python\ndef helper():\n    return 1\n```\n"
        f"The answer:\n```python\n{MODEL_NEW}```\nAnd a test:\n```python\nprint(ModelNew())\n```\n"
    )
    assert extract_code(text) == MODEL_NEW


def test_extract_ignores_reasoning_drafts():
    draft = "class ModelNew:\n    draft = True\n"
    text = f"<think>\nMaybe:\n```python\n{draft}```\n</think>\nFinal:\n```py\n{MODEL_NEW}```"
    assert extract_code(text) == MODEL_NEW


def test_extract_prefers_last_parsing_block():
    broken = "class ModelNew(torch.nn.Module:\n    pass\n"
    text = f"```python\n{MODEL_NEW}```\n\n```python\n{broken}```"
    assert extract_code(text) == MODEL_NEW


def test_extract_unterminated_fence_and_tilde_fence():
    assert extract_code(f"```python\n{MODEL_NEW}") == MODEL_NEW
    assert extract_code(f"~~~python\n{MODEL_NEW}~~~\n") == MODEL_NEW


def test_extract_bare_code_without_fence():
    assert extract_code(MODEL_NEW) == MODEL_NEW


def test_no_code_block_is_none():
    assert extract_code("I cannot help with that.") is None
    assert extract_code("```python\ndef f():\n    return 1\n```") is None
    assert extract_code("<think>```python\n" + MODEL_NEW + "```</think> sorry, no answer") is None


# --- prompts ----------------------------------------------------------------------------------


def test_prompt_has_source_example_and_format():
    prompt = build_prompt(PROBLEM, "cuda")
    assert "class Model(nn.Module)" in prompt.text
    assert "load_inline" in prompt.text and "ModelNew" in prompt.text
    assert "```python" in prompt.text
    assert prompt.template == "kernelbench-v1" and len(prompt.template_sha256) == 64
    triton = build_prompt(PROBLEM, "triton")
    assert "@triton.jit" in triton.text and "load_inline(" not in triton.text


def test_prompt_never_shows_kbv_extras():
    for blind in (False, True):
        text = build_prompt(PROBLEM, "cuda", input_blind=blind).text
        assert "KBV" not in text and "secret_heavy_tail" not in text


def test_input_blind_removes_sizes_and_values():
    plain = build_prompt(PROBLEM, "cuda").text
    blind = build_prompt(PROBLEM, "cuda", input_blind=True).text
    assert "4096" in plain and "393" in plain and "17)" in plain
    for value in ("4096", "393", "17", "a very particular size"):
        assert value not in blind
    assert "alpha = 0.5" in blind  # a constructor argument, not an input
    assert "torch.rand(batch_size, dim, ...)" in blind
    assert build_prompt(PROBLEM, "cuda", input_blind=True).input_blind


def test_user_template_file(tmp_path):
    path = tmp_path / "mine-v2.txt"
    path.write_text("Optimise with $backend_name:\n$problem_source\n")
    prompt = build_prompt(PROBLEM, "triton", load_template(str(path)))
    assert prompt.text.startswith("Optimise with Triton:") and prompt.template == "mine-v2"


# --- numbering, names, providers ---------------------------------------------------------------


def test_numbering_keeps_kernelbench_ids_and_numbers_the_rest(tmp_path):
    level = tmp_path / "level2"
    level.mkdir()
    (level / "7_Thing.py").write_text(PROBLEM)
    (tmp_path / "plain.py").write_text(PROBLEM)
    (tmp_path / "other.py").write_text(PROBLEM)
    problems = [
        load_problem(level / "7_Thing.py"),
        load_problem(tmp_path / "plain.py"),
        load_problem(tmp_path / "other.py"),
    ]
    numbered = number_problems(problems)
    assert [(n.level, n.problem_id, n.assigned) for n in numbered] == [
        (2, 7, False),
        (1, 1, True),
        (1, 2, True),
    ]
    assert kernel_filename(2, 7, 0) == "level_2_problem_7_sample_0_kernel.py"


def test_parse_model_and_providers():
    assert parse_model("openai:gpt-5") == ("openai", "gpt-5")
    assert parse_model("vllm:qwen2.5:7b") == ("vllm", "qwen2.5:7b")
    with pytest.raises(ProviderError):
        parse_model("gpt-5")
    with pytest.raises(ProviderError):
        resolve_provider("vllm", None)  # a self-hosted server needs --base-url
    with pytest.raises(ProviderError):
        resolve_provider("nonesuch", None)
    assert resolve_provider("nonesuch", "http://127.0.0.1:1/v1").sdk == "openai"


def test_cache_key_ignores_nothing_but_the_key():
    request = ChatRequest(provider="openai", model="m", base_url=None, prompt="p", temperature=0.0)
    assert cache_key(request, 0) != cache_key(request, 1)
    other = ChatRequest(provider="openai", model="m", base_url=None, prompt="p", temperature=0.5)
    assert cache_key(request, 0) != cache_key(other, 0)


def test_error_descriptions_are_scrubbed():
    class Boom(Exception):
        status_code = 401

    text = describe_error(
        Boom("Incorrect API key provided: sk-proj-abc***wxyz and sk-secret123456"), ["sk-secret123456"]
    )
    assert "abc" not in text and "secret123456" not in text and "HTTP 401" in text
    assert not is_retryable(Boom())

    class Limited(Exception):
        status_code = 429

    assert is_retryable(Limited())


# --- presets and prices -----------------------------------------------------------------------


def test_bundled_study_preset_has_seven_models():
    preset = load_preset("study-2026")
    configs = preset.configs()
    assert len(configs) == 7
    providers = {cfg.provider for _, cfg in configs}
    assert {"openai", "anthropic"} <= providers and len(providers) >= 4
    slugs = [slug for slug, _ in configs]
    assert len(set(slugs)) == 7
    for _, cfg in configs:
        assert cfg.model and cfg.max_tokens
        if cfg.thinking_budget is not None:
            assert cfg.max_tokens > cfg.thinking_budget


def test_preset_overrides_and_user_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        'name = "mine"\n[defaults]\nsamples = 3\n[[models]]\nslug = "a"\nprovider = "vllm"\n'
        'model = "m"\nbase_url = "http://127.0.0.1:1/v1"\ntemperature = false\n'
    )
    [(slug, cfg)] = load_preset(str(path)).configs(samples=5, backend=None)
    assert slug == "a" and cfg.samples == 5 and cfg.temperature is None and cfg.backend == "cuda"


def test_prices_bundled_and_user_override(tmp_path):
    prices = load_prices()
    assert prices.cost("openai", "gpt-5", 1_000_000, 0) is not None
    assert prices.cost("x", "unknown-model", 10, 10) is None
    user = tmp_path / "prices.toml"
    user.write_text('[models."unknown-model"]\ninput = 2.0\noutput = 4.0\n')
    assert load_prices(str(user)).cost("x", "unknown-model", 1_000_000, 500_000) == pytest.approx(4.0)


def test_templates_and_examples_are_valid_python():
    from importlib import resources

    folder = Path(str(resources.files("kbv.generate") / "templates"))
    for example in folder.glob("*.py.txt"):
        ast.parse(example.read_text())


def test_placeholder_keys_are_not_scrubbed(monkeypatch):
    from kbv.generate._providers import known_secrets

    monkeypatch.setenv("OPENAI_API_KEY", "x")
    monkeypatch.setenv("MY_KEY", "a-real-looking-key-0123456789")
    assert known_secrets("MY_KEY") == ["a-real-looking-key-0123456789"]
