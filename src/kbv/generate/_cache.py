"""A content-addressed response cache, so an interrupted or repeated run pays for nothing twice.

The key is the sha256 of the request description (provider, model, base URL, sampling parameters,
prompt) and the sample index; the API key is never part of it. Entries are JSON files written
atomically, one per response, under ``<dir>/<first two hex digits>/<key>.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kbv.generate._providers import ChatRequest, Completion

CACHE_VERSION = 1


def cache_key(request: ChatRequest, sample: int) -> str:
    """The content address of one request and sample."""
    payload = {"v": CACHE_VERSION, "sample": sample, **request.cache_fields()}
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def default_cache_dir() -> Path:
    """The user-wide cache: ``$KBV_CACHE_DIR`` or ``$XDG_CACHE_HOME/kbv/responses``."""
    if os.environ.get("KBV_CACHE_DIR"):
        return Path(os.environ["KBV_CACHE_DIR"]) / "responses"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kbv" / "responses"


class ResponseCache:
    """Completed responses by content address. Only successful responses are stored."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> Completion | None:
        path = self._path(key)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError):
            return None  # a damaged entry is a miss; the fresh response overwrites it
        return Completion.from_json(data.get("completion", {}))

    def put(self, key: str, request: ChatRequest, completion: Completion) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        entry: dict[str, Any] = {
            "version": CACHE_VERSION,
            "provider": request.provider,
            "model": request.model,
            "base_url": request.base_url,
            "completion": completion.to_json(),
        }
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(entry, handle)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
