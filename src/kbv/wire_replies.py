"""What the worker answers on its channel: one frozen dataclass per reply kind, built by the worker
and parsed by the parent (requests: :mod:`kbv.wire`).

The worker's handlers build their request kind's reply dataclass, whose fields are checked when it
is made; the worker's loop adds the envelope (``ok``, ``id``, ``worker_seconds``) and sends it as one
JSON object, as a request is sent. The parent parses every reply it receives here into the dataclass
of the request it answers (:func:`parse`): a reply that lacks a field its kind requires, names one
its kind does not have, or holds a value of the wrong JSON type, raises :class:`kbv.wire.WireError`.
A worker runs its candidate's code, and that code shares the process that writes the replies, so
their contents are untrusted: the parent (``kbv.worker.Worker``) makes a candidate worker's
malformed reply that candidate's failure and a trusted worker's a harness error.

Fields are checked at their top level (a list of strings or integers element by element). What a
field holds inside (a hand-over's description of CUDA IPC handles or an exported allocation, a
timing measurement, a probe's observations) is checked where it is read (``kbv.handoff.receive``,
``kbv.statistics.invalid_samples``, the integrity checks), as it was before the replies were typed.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from kbv import wire
from kbv.wire import WireError

#: The envelope's keys, beside a reply's fields: whether the request succeeded and the id it echoes.
_ENVELOPE = ("ok", "id")


@dataclass(frozen=True, kw_only=True)
class _Message:
    """A message from the worker whose fields are checked against their declared JSON types."""

    op: ClassVar[str] = ""

    def __post_init__(self) -> None:
        what = f"{self.op!r} reply's" if self.op else f"{type(self).__name__} reply's"
        for name, (allowed, items) in _types(type(self)).items():
            value = getattr(self, name)
            wire._check_value(what, name, value, allowed)
            if items is not None and isinstance(value, list):
                for item in value:
                    wire._check_value(what, f"{name}[]", item, items)

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values, as the worker sends them. A field left at its default is left
        out: the parent's parse puts the default back, and the message stays as short as it can."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.default is dataclasses.MISSING or getattr(self, f.name) != f.default
        }


@dataclass(frozen=True, kw_only=True)
class Hello(_Message):
    """The worker's greeting, sent once it has booted and before any problem or candidate is loaded."""

    op: ClassVar[str] = "hello"
    pid: int
    python: str
    torch: str
    cuda_available: bool
    intra_op_threads: int
    confinement: dict[str, Any] | None = None  # kbv.child.confine's account, where it applied any
    device: dict[str, Any] | None = None  # the GPU's name, capability, memory (CUDA only)
    triton: str | None = None


_R = TypeVar("_R", bound="Reply")


@dataclass(frozen=True, kw_only=True)
class Reply(_Message):
    """What every successful reply carries: the worker's seconds on the request (the loop adds
    them), and where they went when a profiling run asked (``steps``)."""

    worker_seconds: float = 0.0
    steps_s: dict[str, Any] | None = None
    #: The worker's CUDA allocator's largest reservation during the request, bytes (the loop adds
    #: it; None off the GPU). Read from the trusted reference only: kbv.evaluation.budget.
    device_reserved_peak: int | None = None

    @classmethod
    def of(cls: type[_R], reply: Reply) -> _R:
        """``reply`` as this kind: what ``kbv.worker.Worker`` parsed the answer to this kind's
        request into (:class:`WireError` otherwise: a reply read for another request)."""
        if not isinstance(reply, cls):
            raise WireError(f"a {cls.__name__} was awaited, not a {type(reply).__name__}")
        return reply


@dataclass(frozen=True, kw_only=True)
class Failed(Reply):
    """The worker's account of a request that raised (``kbv.child.main._describe_error``: ``kind``,
    ``type``, ``message``, ``traceback``), or of a malformed request it refused."""

    error: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ExitReply(Reply):
    op: ClassVar[str] = "exit"


@dataclass(frozen=True, kw_only=True)
class ReleaseReply(Reply):
    op: ClassVar[str] = "release"


@dataclass(frozen=True, kw_only=True)
class LoadReply(Reply):
    op: ClassVar[str] = "load"
    parameters: dict[str, Any]  # the model's state: name -> shape


@dataclass(frozen=True, kw_only=True)
class BuildReply(Reply):
    op: ClassVar[str] = "build"
    parameters: str  # how the parameters came: matched_seed, state_dict, state_dict_after_init


@dataclass(frozen=True, kw_only=True)
class RedrawReply(Reply):
    """New parameters saved to a file (``n_tensors``), or handed over on the device with their names."""

    op: ClassVar[str] = "redraw"
    n_tensors: int | None = None
    names: list[str] | None = None
    outputs: dict[str, Any] | None = None  # a hand-over's description (kbv.handoff)


@dataclass(frozen=True, kw_only=True)
class InboxReply(Reply):
    op: ClassVar[str] = "inbox"
    inbox: dict[str, Any]  # an allocation's description (CUDA IPC handle or exported memory)


@dataclass(frozen=True, kw_only=True)
class RunReply(Reply):
    op: ClassVar[str] = "run"
    types: list[str]
    outputs: dict[str, Any]  # a hand-over's description (kbv.handoff)
    memory: dict[str, Any] | None = None
    tf32_operators: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class ExpectedReply(Reply):
    """The truth handed over, and of the realistic baseline its error and outputs' shapes only."""

    op: ClassVar[str] = "expected"
    types: list[str]
    truth_types: list[str]
    baseline_outputs: list[Any]  # [shape, dtype] or None per output
    baseline_error: dict[str, Any]
    outputs: dict[str, Any]  # the truth's hand-over (kbv.handoff)
    tf32_operators: dict[str, Any] | None = None
    #: Whether the draw's float64 copy was made from a host copy (kbv.child.truth.HOST_UPCAST_BELOW)
    upcast_on_host: bool = False


@dataclass(frozen=True, kw_only=True)
class TimeReply(Reply):
    op: ClassVar[str] = "time"
    measurement: dict[str, Any]  # kbv.child.timing.Measurement; the parent checks its samples
    sketches: list[Any] | None = None


@dataclass(frozen=True, kw_only=True)
class TruthSketchesReply(Reply):
    op: ClassVar[str] = "truth_sketches"
    sets: list[Any]
    omega: list[Any] | None = None
    baseline_outputs: list[Any] | None = None
    types: list[str] | None = None
    baseline_errors: list[Any] | None = None  # one per draw, where a baseline was asked for


@dataclass(frozen=True, kw_only=True)
class IdentitiesReply(Reply):
    op: ClassVar[str] = "identities"
    changed: list[str]


@dataclass(frozen=True, kw_only=True)
class ProbeObserveReply(Reply):
    op: ClassVar[str] = "probe_observe"
    outputs: dict[str, Any] | None  # {sizes, outputs: a hand-over}, None where none was asked for
    types: list[str]
    input_checksums_before: list[Any]
    input_checksums_after: list[Any]
    aliasing: list[Any]
    activity: dict[str, Any]
    threads_started: int
    threads_alive_at_return: int
    flags: dict[str, Any]
    identities_changed: list[str]
    harness_changed: list[str]


@dataclass(frozen=True, kw_only=True)
class ProbeObserveLateReply(Reply):
    """The look a deferred ``probe_observe`` left: the outputs then, and the activity counts."""

    op: ClassVar[str] = "probe_observe_late"
    outputs: dict[str, Any]  # {sizes, outputs: a hand-over}
    after_delay: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ProbeCacheReply(Reply):
    op: ClassVar[str] = "probe_cache"
    calls: int
    outputs: dict[str, Any]  # {sizes, outputs: a hand-over}


@dataclass(frozen=True, kw_only=True)
class ProbePoisonReply(Reply):
    op: ClassVar[str] = "probe_poison"
    runs: int
    outputs: dict[str, Any]  # {sizes, outputs: a hand-over}


@dataclass(frozen=True, kw_only=True)
class ProbeFlopsReply(Reply):
    op: ClassVar[str] = "probe_flops"
    flops: int
    input_bytes: int
    output_bytes: int


@dataclass(frozen=True, kw_only=True)
class ProbeKernelsReply(Reply):
    op: ClassVar[str] = "probe_kernels"
    available: bool
    kernels: list[str]
    custom_code: list[str]
    library_kernels: list[str] | None = None
    current_stream: Any = None  # the profiler's stream id (its type is the profiler's)
    kernel_streams: list[Any] | None = None


@dataclass(frozen=True, kw_only=True)
class ProbeCallsReply(Reply):
    op: ClassVar[str] = "probe_calls"
    built: dict[str, Any]
    ran: dict[str, Any]


#: The reply kind of every request kind, by op.
KINDS: dict[str, type[Reply]] = {
    kind.op: kind
    for kind in (
        ExitReply,
        ReleaseReply,
        LoadReply,
        BuildReply,
        RedrawReply,
        InboxReply,
        RunReply,
        ExpectedReply,
        TimeReply,
        TruthSketchesReply,
        IdentitiesReply,
        ProbeObserveReply,
        ProbeObserveLateReply,
        ProbeCacheReply,
        ProbePoisonReply,
        ProbeFlopsReply,
        ProbeKernelsReply,
        ProbeCallsReply,
    )
}


def parse(op: str, message: Any) -> Reply:
    """The reply to a request of kind ``op`` (its id already checked: :func:`kbv.wire.check_reply`):
    :class:`Failed` where the request raised, else ``op``'s reply kind. :class:`WireError` says what
    is wrong with a malformed one."""
    if not isinstance(message, Mapping):
        raise WireError(f"a reply must be a JSON object, not {type(message).__name__}")
    ok = message.get("ok")
    if not isinstance(ok, bool):
        raise WireError(f"a reply's 'ok' must be a bool, not {type(ok).__name__}")
    if not ok:
        return _made(Failed, message, f"the failed {op!r} reply")
    kind = KINDS.get(op)
    if kind is None:
        raise WireError(f"no reply kind answers a {op!r} request")
    return _made(kind, message, f"the {op!r} reply")


def parse_hello(message: Any) -> Hello:
    """The worker's greeting; :class:`WireError` says what is wrong with a malformed one."""
    if not isinstance(message, Mapping) or message.get("op") != Hello.op:
        raise WireError(f"the worker's first message must be its hello, not {message!r:.200}")
    return _made(Hello, {k: v for k, v in message.items() if k != "op"}, "the worker's hello")


def _made(kind: type[Any], message: Mapping[str, Any], what: str) -> Any:
    fields = {key: value for key, value in message.items() if key not in _ENVELOPE}
    wire.check_fields(kind, fields, what)
    return kind(**fields)


def _types(kind: type[Any]) -> dict[str, tuple[tuple[type, ...], tuple[type, ...] | None]]:
    """The JSON types each field of ``kind`` may hold, and those of a list's items where the list's
    are declared as ``str`` or ``int`` (read from the annotations, once a kind)."""
    known = _TYPES.get(kind)
    if known is None:
        known = _TYPES[kind] = {
            name: (wire._json_types(hint), _item_types(hint))
            for name, hint in wire.annotations_of(kind).items()
        }
    return known


_TYPES: dict[type, dict[str, tuple[tuple[type, ...], tuple[type, ...] | None]]] = {}


def _item_types(hint: Any) -> tuple[type, ...] | None:
    for arg in (hint, *typing.get_args(hint)):
        if typing.get_origin(arg) is list and typing.get_args(arg) in ((str,), (int,)):
            return typing.get_args(arg)
    return None
