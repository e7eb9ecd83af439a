"""What travels on the worker channel: one frozen dataclass per request kind, sent with an id, and
the check of each reply's id.

Both sides use this module: the parent builds each request as its kind's dataclass and serialises it
here (one place, where the id is added), and the worker parses every message it receives here into
that dataclass before dispatching it, so a request the worker does not know, one that lacks a field
its kind requires, names a field its kind does not take, or holds a value of the wrong JSON type, is
refused instead of being guessed at. The worker's handlers read the request's attributes. A reply
echoes its request's id; the parent checks it, because a reply read for the wrong request (a
pipelined request's reply left unread) would be judged as another request's answer. A wrong id is a
harness error, never a candidate's outcome.

On the socket a request is one JSON object: ``op`` and ``id`` beside its kind's fields.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kbv import channel as _channel

#: The error kind of a worker's refusal of a malformed request (a harness error in the parent).
MALFORMED = "malformed_request"
#: The envelope's own keys: a request's fields may not reuse them.
_ENVELOPE = ("op", "id")


class WireError(ValueError):
    """A message on the worker channel broke the wire format: a harness bug, not a candidate's outcome."""


@dataclass(frozen=True, kw_only=True)
class _Checked:
    """A dataclass whose fields hold JSON values of their declared types, checked when it is made
    (a tuple is kept as the list it becomes on the wire, a NumPy or tensor scalar as a number)."""

    def __post_init__(self) -> None:
        for name, allowed in _types(type(self)).items():
            value = getattr(self, name)
            if not isinstance(value, (str, int, float, bool, type(None), _Checked)):
                value = plain(value)
                object.__setattr__(self, name, value)
            _check_value(self._what(), name, value, allowed)

    def _what(self) -> str:
        return type(self).__name__

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (a nested dataclass as an object)."""
        return {
            f.name: v.to_json() if isinstance(v := getattr(self, f.name), _Checked) else v
            for f in dataclasses.fields(self)
        }


@dataclass(frozen=True, kw_only=True)
class MemoryRule(_Checked):
    """What a worker's allocator may keep cached between requests, decided by the parent's budget
    (``kbv.worker.MemoryBudget``) and sent with every request. After each request the worker keeps
    up to ``cached_bytes_kept``; more only while the device has ``room_bytes`` free beside it (the
    trusted reference's room for its candidate; None: never more). A request without a rule hands
    every cached byte back."""

    cached_bytes_kept: int
    room_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class Request(_Checked):
    """What every request may carry: the parent's memory rule for the worker, and a profiling run's
    wish to know where the request's time went (``steps``: benchmarks/request_trace.py)."""

    op: ClassVar[str] = ""
    memory: MemoryRule | None = None
    steps: bool = False

    def _what(self) -> str:
        return f"{self.op!r} request's"


@dataclass(frozen=True, kw_only=True)
class Exit(Request):
    op: ClassVar[str] = "exit"


@dataclass(frozen=True, kw_only=True)
class Release(Request):
    """Run nothing: what every request does first and last is all it does. The worker lets go of
    what it handed over (the parent has copied it) and applies the memory rule to what its allocator
    keeps, before its next real request (``kbv.evaluation.draws._draws_apart``)."""

    op: ClassVar[str] = "release"


@dataclass(frozen=True, kw_only=True)
class Load(Request):
    """Load the problem (and in a candidate worker the candidate) and build the model."""

    op: ClassVar[str] = "load"
    role: str
    device: str
    problem_source: str
    init_seed: int
    problem_name: str | None = None
    sizes: dict[str, Any] = field(default_factory=dict)
    domain: str = "any"
    structure: list[Any] | None = None
    precision: str = "fp32"
    candidate_path: str | None = None
    handoff: str | None = None


@dataclass(frozen=True, kw_only=True)
class Build(Request):
    """Build the model again under a seed, with the parameters of a file or of the inbox."""

    op: ClassVar[str] = "build"
    init_seed: int
    state_path: str | None = None
    state_inbox: list[Any] | None = None


@dataclass(frozen=True, kw_only=True)
class Redraw(Request):
    op: ClassVar[str] = "redraw"
    distribution: str
    seed: int
    out_path: str
    hand_over: bool = False


@dataclass(frozen=True, kw_only=True)
class Inbox(Request):
    op: ClassVar[str] = "inbox"
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class _Forward(Request):
    distribution: str
    seed: int
    out_path: str
    mix_seed: int | None = None
    precision: str = "native"
    measure_memory: bool = False
    record_operators: bool = False


@dataclass(frozen=True, kw_only=True)
class Run(_Forward):
    """One forward on one draw, its outputs handed over."""

    op: ClassVar[str] = "run"


@dataclass(frozen=True, kw_only=True)
class Expected(_Forward):
    """The trusted reference's truth and realistic baseline (``precision``) of one draw."""

    op: ClassVar[str] = "expected"


@dataclass(frozen=True, kw_only=True)
class Time(Request):
    op: ClassVar[str] = "time"
    distribution: str
    seeds: list[int]
    settings: dict[str, Any]
    precision: str = "native"
    sketch: dict[str, Any] | None = None
    unseen_seeds: list[int] | None = None


@dataclass(frozen=True, kw_only=True)
class TruthSketches(Request):
    op: ClassVar[str] = "truth_sketches"
    distribution: str
    seeds: list[int]
    sketch: dict[str, Any]
    baseline: str | None = None


@dataclass(frozen=True, kw_only=True)
class Identities(Request):
    op: ClassVar[str] = "identities"


@dataclass(frozen=True, kw_only=True)
class _Probe(Request):
    inputs: dict[str, Any]
    precision: str = "fp32"


@dataclass(frozen=True, kw_only=True)
class ProbeObserve(_Probe):
    op: ClassVar[str] = "probe_observe"
    delay_s: float = 0.2
    hand_outputs: bool = True
    out_path: str | None = None
    # The look after delay_s waits for the next request (``probe_observe_late`` hands it over).
    deferred: bool = False


@dataclass(frozen=True, kw_only=True)
class ProbeObserveLate(Request):
    op: ClassVar[str] = "probe_observe_late"
    out_path: str


#: The cache probe's four calls, by index: A, B in A's buffers, B in new buffers, the mix.
CACHE_CALLS = (0, 1, 2, 3)


@dataclass(frozen=True, kw_only=True)
class ProbeCache(Request):
    """The cache probe's calls ``calls`` of its four (``kbv.child.probes.probe_cache``), asked for two
    at a time by the parent: the candidate then holds two calls' outputs while the reference
    answers their draws, not four."""

    op: ClassVar[str] = "probe_cache"
    distribution: str
    seed_a: int
    seed_b: int
    out_path: str
    precision: str = "fp32"
    calls: list[int] = field(default_factory=lambda: list(CACHE_CALLS))

    def __post_init__(self) -> None:
        super().__post_init__()
        calls = self.calls
        if not calls or sorted(set(calls)) != calls or not set(calls) <= set(CACHE_CALLS):
            raise WireError(f"probe_cache's calls must be increasing, among {list(CACHE_CALLS)}: {calls}")
        if 1 in calls and 0 not in calls:
            # call 1 copies draw B into call 0's buffers: the objects the model was given before
            raise WireError("probe_cache's call 1 (B in A's buffers) needs call 0 (A) in the same request")


@dataclass(frozen=True, kw_only=True)
class ProbePoison(_Probe):
    op: ClassVar[str] = "probe_poison"
    out_path: str
    output_nbytes: list[int] | None = None


@dataclass(frozen=True, kw_only=True)
class ProbeFlops(_Probe):
    op: ClassVar[str] = "probe_flops"


@dataclass(frozen=True, kw_only=True)
class ProbeKernels(_Probe):
    op: ClassVar[str] = "probe_kernels"


@dataclass(frozen=True, kw_only=True)
class ProbeCalls(_Probe):
    op: ClassVar[str] = "probe_calls"


#: Every request kind the worker answers (kbv.child.main, kbv.child.probes, kbv.child.calls), by op.
KINDS: dict[str, type[Request]] = {
    kind.op: kind
    for kind in (
        Exit,
        Release,
        Load,
        Build,
        Redraw,
        Inbox,
        Run,
        Expected,
        Time,
        TruthSketches,
        Identities,
        ProbeObserve,
        ProbeObserveLate,
        ProbeCache,
        ProbePoison,
        ProbeFlops,
        ProbeKernels,
        ProbeCalls,
    )
}
OPS = frozenset(KINDS)


def annotations_of(kind: type[Any]) -> dict[str, Any]:
    """The resolved annotation of each field of the dataclass ``kind`` (read once a kind)."""
    known = _HINTS.get(kind)
    if known is None:
        hints = typing.get_type_hints(kind)
        known = _HINTS[kind] = {f.name: hints[f.name] for f in dataclasses.fields(kind)}
    return known


_HINTS: dict[type, dict[str, Any]] = {}


def _types(kind: type[_Checked]) -> dict[str, tuple[type, ...]]:
    """The JSON types each field of ``kind`` may hold, read from its annotations (once a kind)."""
    known = _TYPES.get(kind)
    if known is None:
        known = _TYPES[kind] = {name: _json_types(h) for name, h in annotations_of(kind).items()}
    return known


_TYPES: dict[type, dict[str, tuple[type, ...]]] = {}


def _json_types(hint: Any) -> tuple[type, ...]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _json_types(arg))
    if hint is Any:
        return (object,)
    if hint is float:
        return (int, float)
    return (origin or hint,)


#: The fields of every request kind, with the JSON types each may hold: derived from the dataclasses.
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {op: _types(kind) for op, kind in KINDS.items()}


def request(op: str, **fields: Any) -> Request:
    """The request of kind ``op`` with ``fields``; :class:`WireError` says what is wrong with it."""
    if not isinstance(op, str):
        raise WireError(f"a request's op must be a string, not {type(op).__name__}")
    kind = KINDS.get(op)
    if kind is None:
        raise WireError(f"unknown request op {op!r}; the worker answers {sorted(OPS)}")
    return _made(kind, fields, f"a {op!r} request")


def _made(kind: type[Any], fields: Mapping[str, Any], what: str) -> Any:
    for key in fields:
        if not isinstance(key, str):
            raise WireError(f"{what}'s field names must be strings, not {key!r}")
        if key in _ENVELOPE:
            raise WireError(f"{what}'s fields may not carry the envelope's {key!r}")
    check_fields(kind, fields, what)
    values = dict(fields)
    rule = values.get("memory")
    if isinstance(rule, Mapping):
        values["memory"] = _made(MemoryRule, rule, "a memory rule")
    return kind(**values)


def check_fields(kind: type[Any], fields: Mapping[str, Any], what: str) -> None:
    """Raise :class:`WireError` when ``fields`` names a field the dataclass ``kind`` does not
    declare or lacks one it requires: the one rule for requests and replies alike."""
    declared = {f.name: f for f in dataclasses.fields(kind)}
    for key in fields:
        if key not in declared:
            raise WireError(f"{what} has no field {key!r:.80}; it has {sorted(declared)}")
    required = [n for n, f in declared.items() if dataclasses.MISSING is f.default is f.default_factory]
    missing = [name for name in required if name not in fields]
    if missing:
        raise WireError(f"{what} lacks its field(s) {missing}")


@dataclass(frozen=True)
class Envelope:
    """One message on the channel: a request and the id its reply must echo."""

    id: int
    request: Request

    def __post_init__(self) -> None:
        _check_id(self.id, "request")
        if not isinstance(self.request, Request) or not self.request.op:
            raise WireError(f"an envelope holds a request, not {type(self.request).__name__}")

    def to_json(self) -> dict[str, Any]:
        """The message as sent: the request's fields at the top level beside ``op`` and ``id``."""
        return {"op": self.request.op, "id": self.id, **self.request.to_json()}

    @classmethod
    def from_json(cls, message: Mapping[str, Any]) -> Envelope:
        """Parse a received message; :class:`WireError` says what is wrong with it."""
        if not isinstance(message, Mapping):
            raise WireError(f"a request must be a JSON object, not {type(message).__name__}")
        op, id_ = message.get("op"), message.get("id")
        _check_id(id_, "request")
        fields = {key: value for key, value in message.items() if key not in _ENVELOPE}
        if not isinstance(op, str):
            raise WireError(f"a request's op must be a string, not {type(op).__name__}")
        return cls(id=id_, request=request(op, **fields))  # type: ignore[arg-type]


def plain(value: Any) -> Any:
    """``value`` as the worker will read it: through JSON, as the channel writes it (a tuple arrives
    as a list, a NumPy or tensor scalar as a number), so the parent validates what is sent."""
    return json.loads(json.dumps(value, default=_channel._default))


def reply_id(message: Mapping[str, Any]) -> Any:
    """The id a reply to ``message`` echoes (what the worker can read of it, even a malformed one)."""
    return message.get("id") if isinstance(message, Mapping) else None


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


def _check_id(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WireError(f"a {what}'s id must be a positive integer, not {value!r}")


def _check_value(what: str, name: str, value: Any, allowed: tuple[type, ...]) -> None:
    wrong_bool = isinstance(value, bool) and bool not in allowed and object not in allowed
    if wrong_bool or not isinstance(value, allowed):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        raise WireError(f"the {what} {name!r} must be {names}, not {type(value).__name__}")
