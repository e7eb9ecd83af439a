"""What travels on the worker channel: requests with ids, and the check of each reply's id.

Both sides use this module: the parent serialises every request here (one place, where the id is
added) and the worker parses every message it receives here before dispatching it, so a request
the worker does not know, or one whose envelope has the wrong types, is refused instead of being
guessed at. A reply echoes its request's id; the parent checks it, because a reply read for the
wrong request (a pipelined request's reply left unread) would be judged as another request's
answer. A wrong id is a harness error, never a candidate's outcome.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Every request the worker answers (kbv.child.main, kbv.child.probes, kbv.child.calls).
OPS = frozenset(
    {
        "exit",
        "load",
        "build",
        "redraw",
        "inbox",
        "run",
        "expected",
        "time",
        "truth_sketches",
        "identities",
        "probe_observe",
        "probe_cache",
        "probe_poison",
        "probe_flops",
        "probe_kernels",
        "probe_calls",
    }
)
#: The envelope's own keys: a request's fields may not reuse them.
_ENVELOPE = ("op", "id")
#: The error kind of a worker's refusal of a malformed request (a harness error in the parent).
MALFORMED = "malformed_request"


class WireError(ValueError):
    """A message on the worker channel broke the wire format: a harness bug, not a candidate's outcome."""


@dataclass(frozen=True)
class Request:
    """One request: its operation, the id its reply must echo, and the operation's fields."""

    op: str
    id: int
    fields: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_op(self.op)
        _check_id(self.id, "request")
        if not isinstance(self.fields, Mapping):
            kind = type(self.fields).__name__
            raise WireError(f"the fields of a {self.op!r} request must be a mapping, not {kind}")
        for key in self.fields:
            if not isinstance(key, str):
                raise WireError(f"a {self.op!r} request's field names must be strings, not {key!r}")
            if key in _ENVELOPE:
                raise WireError(f"a {self.op!r} request's fields may not carry the envelope's {key!r}")

    def to_json(self) -> dict[str, Any]:
        """The message as sent: the fields at the top level beside ``op`` and ``id`` (the names the
        worker's handlers read)."""
        return {"op": self.op, "id": self.id, **self.fields}

    @classmethod
    def from_json(cls, message: Mapping[str, Any]) -> Request:
        """Parse a received message; :class:`WireError` says what is wrong with it."""
        if not isinstance(message, Mapping):
            raise WireError(f"a request must be a JSON object, not {type(message).__name__}")
        fields = {key: value for key, value in message.items() if key not in _ENVELOPE}
        return cls(op=message.get("op"), id=message.get("id"), fields=fields)  # type: ignore[arg-type]


def reply_id(request: Mapping[str, Any]) -> Any:
    """The id a reply to ``request`` echoes (what the worker can read of it, even a malformed one)."""
    return request.get("id") if isinstance(request, Mapping) else None


def check_reply(reply: Mapping[str, Any], request_id: int) -> None:
    """Raise :class:`WireError` unless ``reply`` answers the request ``request_id`` and is not the
    worker's refusal of a malformed request."""
    if reply.get("id") != request_id or isinstance(reply.get("id"), bool):
        raise WireError(
            f"the worker's reply carries id {reply.get('id')!r} where request {request_id} was awaited: "
            "replies were read out of order (a pipelined request's reply left unread?)"
        )
    error = reply.get("error")
    if not reply.get("ok") and isinstance(error, Mapping) and error.get("kind") == MALFORMED:
        raise WireError(f"the worker refused request {request_id}: {error.get('message')}")


def _check_op(op: Any) -> None:
    if not isinstance(op, str):
        raise WireError(f"a request's op must be a string, not {type(op).__name__}")
    if op not in OPS:
        raise WireError(f"unknown request op {op!r}; the worker answers {sorted(OPS)}")


def _check_id(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WireError(f"a {what}'s id must be a positive integer, not {value!r}")
