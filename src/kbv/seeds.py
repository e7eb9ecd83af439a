"""Secret seeds: fresh ones from the operating system, seeds derived from them by HMAC, and torch
generators seeded on a tensor's own device.

Imported inside the worker process before any candidate code, like ``kbv.inputs``: it depends only
on the standard library and torch.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

import torch

_SEED_MASK = (1 << 63) - 1


def new_seed() -> int:
    """A fresh, unpredictable 63-bit seed from the operating system's CSPRNG."""
    return int.from_bytes(secrets.token_bytes(8), "big") & _SEED_MASK


def derive_seed(master: int, *parts: Any) -> int:
    """A 63-bit seed derived from ``master`` and ``parts`` by HMAC-SHA256.

    The master is the HMAC key, so a derived seed handed to the worker reveals nothing about the
    master or about seeds derived with other parts. Parts are encoded with their type and length, so
    ``derive_seed(m, 1)`` and ``derive_seed(m, "1")`` differ.
    """
    master = int(master)
    if master < 0:
        raise ValueError("derive_seed: the master seed must be a non-negative integer")
    key = master.to_bytes(max(8, (master.bit_length() + 7) // 8), "big")
    message = bytearray()
    for part in parts:
        encoded = f"{type(part).__name__}:{part}".encode()
        message += len(encoded).to_bytes(8, "big") + encoded
    digest = hmac.new(key, bytes(message), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") & _SEED_MASK


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
