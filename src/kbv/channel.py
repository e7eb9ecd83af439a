"""The private channel between the parent and a worker: length-prefixed JSON over a socket pair.

JSON, not pickle: the parent must never unpickle bytes a hostile worker wrote. Tensors travel as
CUDA IPC handles, as files loaded with ``torch.load(weights_only=True)`` (which cannot run code), or
as file descriptors of exported device memory sent beside a message (``SCM_RIGHTS``, ``fds``): the
receiver takes descriptors only when it asks for them and closes any others at once.
"""

from __future__ import annotations

import array
import contextlib
import json
import math
import os
import select
import socket
import struct
import time
from typing import Any

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Descriptors one message may carry (a reply exports one allocation per hand-over).
MAX_FDS = 8
_HEADER = struct.Struct("!I")
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def memfd_available() -> bool:
    """Whether this system has anonymous memory files (Linux 3.17 and later), whose descriptors a
    trusted worker's reply carries instead of a path (``kbv.handoff``, transport ``memfd``)."""
    return hasattr(os, "memfd_create")


class ChannelClosed(ConnectionError):
    """The other end closed the channel or wrote something that is not a message."""


class ChannelTimeout(TimeoutError):
    """No message arrived before the deadline."""


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """Write one message; ``fds`` travel with its header (the receiver gets its own copies)."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"{len(fds)} descriptors exceed the {MAX_FDS} one message may carry")
    payload = json.dumps(message, default=_default).encode()
    header = _HEADER.pack(len(payload))
    if fds:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([header], rights)
        header = header[sent:]
    sock.sendall(header + payload)


def receive(
    sock: socket.socket,
    deadline: float | None = None,
    alive: Any = None,
    poll_s: float = 0.2,
    fds: list[int] | None = None,
) -> dict[str, Any]:
    """Read one message. ``alive()`` is polled every ``poll_s`` while waiting, so a dead peer (or one
    the caller killed for exceeding a limit) is noticed quickly. Descriptors that came with it are
    appended to ``fds`` (the caller closes them); without ``fds`` they are closed."""
    received: list[int] = []
    try:
        header = _read_exact(sock, _HEADER.size, deadline, alive, poll_s, received)
        (size,) = _HEADER.unpack(header)
        if size > MAX_MESSAGE_BYTES:
            raise ChannelClosed(f"message of {size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
        body = _read_exact(sock, size, deadline, alive, poll_s, received)
    except BaseException:
        close_fds(received)
        raise
    if fds is None:
        close_fds(received)
    else:
        fds.extend(received)
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChannelClosed(f"malformed message: {exc}") from exc
    if not isinstance(message, dict):
        raise ChannelClosed("malformed message: not a JSON object")
    return message


def close_fds(fds: list[int]) -> None:
    """Close every descriptor in ``fds`` (ones already closed are skipped) and empty the list."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _read_exact(
    sock: socket.socket,
    size: int,
    deadline: float | None,
    alive: Any,
    poll_s: float = 0.2,
    received: list[int] | None = None,
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
        try:
            chunk = _recv(sock, min(remaining, 1 << 20), received if received is not None else [])
        except ConnectionResetError as exc:  # it died with a request of ours still unread
            raise ChannelClosed("the worker closed the channel") from exc
        if not chunk:
            raise ChannelClosed("the worker closed the channel")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, size: int, received: list[int]) -> bytes:
    """One read, taking the descriptors that arrived with it (a truncated set is the kernel's to close)."""
    chunk, ancillary, _, _ = sock.recvmsg(size, _FD_SPACE)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % array.array("i").itemsize
            received.extend(array.array("i", data[:usable]))
    if len(received) > MAX_FDS:  # a message read in many chunks could otherwise pile them up
        extra = received[MAX_FDS:]
        del received[MAX_FDS:]
        close_fds(extra)
    return chunk


def _default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot send {type(value).__name__} over the worker channel")
