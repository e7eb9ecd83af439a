"""Finding the candidate's code in a model's response.

Responses mix reasoning, prose and several fenced blocks (a sketch, the kernel alone, the full
answer). The chosen block is the last one that defines ``class ModelNew``, preferring blocks that
parse as Python; reasoning text (``<think>...</think>``) is ignored because drafts live there. A
response with no such block yields ``None``: the caller records a generation failure.
"""

from __future__ import annotations

import ast
import re

_THINK = re.compile(r"<(think|thinking|reasoning)>.*?(</\1>|\Z)", re.DOTALL | re.IGNORECASE)
# An opening fence of 3+ backticks or tildes, an optional info string, the body, and a closing fence
# of the same characters at least as long; an unclosed final fence (a truncated answer) runs to the end.
_FENCE = re.compile(
    r"^[ \t]*(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)\n"
    r"(?P<body>.*?)(?:^[ \t]*(?P=fence)[`~]*[ \t]*$|\Z)",
    re.DOTALL | re.MULTILINE,
)
_MODEL_NEW = re.compile(r"^\s*class\s+ModelNew\b", re.MULTILINE)
_NON_PYTHON = {"cpp", "c++", "c", "cuda", "cu", "text", "bash", "sh", "shell", "json", "console"}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of each fenced block, reasoning removed, in order."""
    visible = _THINK.sub("", text)
    return [(m.group("info").strip().lower(), m.group("body")) for m in _FENCE.finditer(visible)]


def extract_code(text: str) -> str | None:
    """The code of the block defining ``ModelNew``, or ``None`` when the response has none."""
    blocks = [body for info, body in code_blocks(text) if info.split(" ")[0] not in _NON_PYTHON]
    candidates = [body for body in blocks if _MODEL_NEW.search(body)]
    if not candidates:
        bare = _THINK.sub("", text).strip()
        # Some servers return bare code with no fence at all; accept it only when it is valid Python.
        if "```" not in bare and _MODEL_NEW.search(bare) and _parses(bare):
            return bare + "\n"
        return None
    parsing = [body for body in candidates if _parses(body)]
    chosen = (parsing or candidates)[-1]
    return chosen.rstrip() + "\n"


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True
