"""What travels on the worker channel: requests with ids, and the check of each reply's id.

Both sides use this module: the parent serialises every request here (one place, where the id is
added) and the worker parses every message it receives here before dispatching it, so a request
the worker does not know, or one whose envelope has the wrong types, is refused instead of being
guessed at. A reply echoes its request's id; the parent checks it, because a reply read for the
wrong request (a pipelined request's reply left unread) would be judged as another request's
answer. A wrong id is a harness error, never a candidate's outcome.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kbv import channel as _channel

_STR, _INT, _BOOL, _DICT, _LIST = (str,), (int,), (bool,), (dict,), (list,)
_NUMBER = (int, float)
_NONE = (type(None),)
#: What every request may carry: the reference's memory room (``Worker.request_fields``, read after
#: the request) and a profiling run's wish to know where its time went (benchmarks/request_trace.py).
_COMMON: dict[str, tuple[type, ...]] = {"room_bytes": _INT + _NONE, "steps": _BOOL}
_Types = tuple[type, ...]
_DRAW: dict[str, _Types] = {"distribution": _STR, "seed": _INT, "out_path": _STR}
_FORWARD: dict[str, _Types] = {
    **_DRAW,
    "mix_seed": _INT + _NONE,
    "precision": _STR,
    "measure_memory": _BOOL,
    "record_operators": _BOOL,
}
_PROBE: dict[str, _Types] = {"inputs": _DICT, "precision": _STR}
#: The fields of every request the worker answers (kbv.child.main, kbv.child.probes,
#: kbv.child.calls), with the JSON types each may hold: the names its handlers read and the parent
#: sends. A field not listed for its op, or of another type, is refused.
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "exit": {},
    "load": {
        "role": _STR,
        "device": _STR,
        "problem_source": _STR,
        "problem_name": _STR,
        "sizes": _DICT,
        "domain": _STR,
        "init_seed": _INT,
        "structure": _DICT + _LIST + _NONE,
        "precision": _STR,
        "candidate_path": _STR,
        "handoff": _STR,
    },
    "build": {"init_seed": _INT, "state_path": _STR + _NONE, "state_inbox": _LIST + _NONE},
    "redraw": {**_DRAW, "hand_over": _BOOL},
    "inbox": {"nbytes": _INT},
    "run": _FORWARD,
    "expected": _FORWARD,
    "time": {
        "distribution": _STR,
        "seeds": _LIST,
        "precision": _STR,
        "settings": _DICT,
        "sketch": _DICT + _NONE,
        "unseen_seeds": _LIST + _NONE,
    },
    "truth_sketches": {"distribution": _STR, "seeds": _LIST, "sketch": _DICT, "baseline": _STR + _NONE},
    "identities": {},
    "probe_observe": {**_PROBE, "delay_s": _NUMBER, "hand_outputs": _BOOL, "out_path": _STR},
    "probe_cache": {**_DRAW, "seed": _INT, "seed_a": _INT, "seed_b": _INT, "precision": _STR},
    "probe_poison": {**_PROBE, "out_path": _STR, "output_nbytes": _LIST + _NONE},
    "probe_flops": _PROBE,
    "probe_kernels": _PROBE,
    "probe_calls": _PROBE,
}
OPS = frozenset(FIELDS)
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
            _check_field(self.op, key, self.fields[key])

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


def plain(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` as the worker will read them: through JSON, as the channel writes them (a tuple
    arrives as a list, a NumPy or tensor scalar as a number), so the parent validates what is sent."""
    return dict(json.loads(json.dumps(fields, default=_channel._default)))


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


def _check_field(op: str, name: str, value: Any) -> None:
    types = FIELDS[op].get(name) or _COMMON.get(name)
    if types is None:
        known = sorted({*FIELDS[op], *_COMMON})
        raise WireError(f"a {op!r} request has no field {name!r}; it takes {known}")
    wrong_bool = isinstance(value, bool) and bool not in types  # JSON's true is no integer
    if wrong_bool or not isinstance(value, types):
        allowed = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise WireError(f"the {op!r} request's {name!r} must be {allowed}, not {type(value).__name__}")
