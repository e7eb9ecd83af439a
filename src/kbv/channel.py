"""The private channel between the parent and a worker: length-prefixed JSON over a socket pair.

JSON, not pickle: the parent must never unpickle bytes a hostile worker wrote. Tensors travel as
files loaded with ``torch.load(weights_only=True)``, which cannot run code.
"""

from __future__ import annotations

import json
import math
import select
import socket
import struct
import time
from typing import Any

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_HEADER = struct.Struct("!I")


class ChannelClosed(ConnectionError):
    """The other end closed the channel or wrote something that is not a message."""


class ChannelTimeout(TimeoutError):
    """No message arrived before the deadline."""


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    payload = json.dumps(message, default=_default).encode()
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def receive(
    sock: socket.socket, deadline: float | None = None, alive: Any = None, poll_s: float = 0.2
) -> dict[str, Any]:
    """Read one message. ``alive()`` is polled every ``poll_s`` while waiting, so a dead peer (or one
    the caller killed for exceeding a limit) is noticed quickly."""
    header = _read_exact(sock, _HEADER.size, deadline, alive, poll_s)
    (size,) = _HEADER.unpack(header)
    if size > MAX_MESSAGE_BYTES:
        raise ChannelClosed(f"message of {size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    body = _read_exact(sock, size, deadline, alive, poll_s)
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChannelClosed(f"malformed message: {exc}") from exc
    if not isinstance(message, dict):
        raise ChannelClosed("malformed message: not a JSON object")
    return message


def _read_exact(
    sock: socket.socket, size: int, deadline: float | None, alive: Any, poll_s: float = 0.2
) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        wait = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
        if wait <= 0:
            raise ChannelTimeout("no reply before the deadline")
        ready, _, _ = select.select([sock], [], [], wait)
        if not ready:
            if alive is not None and not alive():
                # The process is gone; drain what it managed to send before giving up.
                ready, _, _ = select.select([sock], [], [], 0)
                if not ready:
                    raise ChannelClosed("the worker exited without replying")
            continue
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise ChannelClosed("the worker closed the channel")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot send {type(value).__name__} over the worker channel")
