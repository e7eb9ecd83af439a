"""Protocols: named, versioned evaluation settings, resolved once and hashed into every record.

A protocol is pure data. ``standard`` reproduces KernelBench's own settings; ``verified`` is kbv's
stronger protocol. A user's TOML file starts from one of them (``base = "verified"``) and overrides
sections, for example::

    name = "my-protocol"
    version = 1
    base = "verified"
    [timing]
    baselines = ["eager_fp32", "eager_tf32", "compile"]
    [integrity.severity]
    reference_operator = "fail"

This module depends on nothing else in kbv, so every other module may import it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, cast

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


class ProtocolError(ValueError):
    """A protocol name or file that cannot be resolved; the message says how to fix it."""


@dataclass(frozen=True)
class CorrectnessSettings:
    """How outputs are checked.

    ``mode`` selects the comparison: ``allclose`` is KernelBench's fixed tolerance; ``error_model``
    derives the tolerance from the realistic baseline's own error against a float64 truth.
    """

    mode: str = "allclose"
    distributions: tuple[str, ...] = ("original",)
    draws_per_distribution: int = 5
    atol_fp32: float = 1e-4
    rtol_fp32: float = 1e-4
    atol_half: float = 1e-2
    rtol_half: float = 1e-2
    # error_model only: the candidate's error may be this many times the baseline's own error ...
    error_multiple: float = 8.0
    # ... but never has to be below these floors (relative to the output's scale).
    elementwise_floor: float = 1e-5
    norm_floor: float = 1e-6
    # ... and, per output, not below 2**-24 * ceil(reduction length / reduction_block), capped at
    # reduction_floor_cap: the worst-case error of adding one float32 partial sum per block of that
    # many elements into one value, as atomics do (docs/correctness.md, "The reduction floor").
    # 0 turns it off.
    reduction_block: int = 0
    reduction_floor_cap: float = 1e-3
    redraw_parameters: bool = False
    # Distributions drawn only where an output element reduces at least ``long_reduction_min`` input
    # elements (:func:`kbv.correctness.reduction_lengths`, from the first draw's outputs); elsewhere
    # they are recorded as not applicable, with why. ``spiked`` is there for a kernel that reads a
    # subset of a long reduction, which hides under the floors on inputs alike everywhere; where
    # nothing reduces, every other distribution already sees a subset, and the draw only costs time
    # (docs/correctness.md, "Input distributions").
    long_reduction_distributions: tuple[str, ...] = ()
    long_reduction_min: int = 0
    # Re-runs of a failing draw on the same inputs before it counts: a failure that does not repeat
    # is a transient (see docs/correctness.md), reported by the ``transient_mismatch`` check.
    confirm_reruns: int = 2
    # Fresh seeds from the OS per evaluation (stored afterwards for replay); off means KernelBench's
    # fixed, public seeds.
    secret_seeds: bool = False


@dataclass(frozen=True)
class TimingSettings:
    """One explicit timing recipe; its name and settings are written into every record."""

    recipe: str = "events-median"
    warmup_calls: int = 3
    warmup_seconds: float = 0.05
    repeats: int = 30
    max_seconds: float = 5.0
    l2_flush: bool = False
    input_sets: int = 1
    cuda_graph: bool = False
    baselines: tuple[str, ...] = ("eager_fp32",)
    # Pairs of (baseline, candidate) rounds measured alternately; 1 means no interleaving.
    rounds: int = 1
    # More rounds, up to max_rounds, while any series measured in this evaluation (the candidate, a
    # baseline) has a median whose bootstrap 95% interval is wider than +-median_precision of it
    # (relative); 0 (or max_rounds <= rounds) times exactly ``rounds``. Noisy calls get the samples
    # they need, stable ones stop early (docs/timing.md, "Rounds until precise").
    max_rounds: int = 0
    median_precision: float = 0.0
    # With median_precision: stop adding rounds once the target is out of reach within max_rounds.
    # A median's interval narrows about as 1/sqrt(samples), so after r rounds at a worst half-width
    # h the target p needs about r * (h / p)**2 rounds; more than max_rounds and the rounds left
    # would buy timing that still misses it (docs/timing.md, "Rounds until precise").
    stop_when_futile: bool = False
    # With two or more baselines timed: one whose first-round median is at least this many times
    # another's stops after that round (it cannot be the best baseline; its figure comes from the
    # round it had). 0 times every baseline in every round.
    dominated_factor: float = 0.0
    # Warm-up budget of a worker's later batches of one precision in an evaluation (their first
    # batch warms up for warmup_seconds); at least warmup_calls calls either way. Negative: the
    # same as warmup_seconds.
    rewarm_seconds: float = -1.0
    bootstrap_resamples: int = 1000
    # Reuse baseline measurements whose key (problem, inputs, device, driver, torch, these settings)
    # matches; interleaving then applies only to the first candidate that measured them.
    cache_baselines: bool = True
    # Every timed call gets an input set of its own that no earlier call saw, drawn in the worker
    # outside the timed region; warm-up calls rotate over the ``input_sets`` kept sets, which are
    # never timed. Speed that comes from remembering earlier calls then earns nothing
    # (docs/timing.md, "Every timed call on unseen inputs"). Off: timed calls rotate over the kept
    # sets, as KernelBench times one set again and again.
    unseen_inputs: bool = False
    # With ``unseen_inputs``: every timed call is still sketched, but only this many calls of a round
    # (and the phase's first draw) are judged against the float64 truth, picked after the
    # candidate's batch returned from a secret no worker sees (docs/timing.md, "Judging a secret
    # sample of the timed calls"). 0 judges every timed call.
    judged_calls: int = 0


@dataclass(frozen=True)
class IntegritySettings:
    """Which reward-hack checks run, and per-check severity overrides (``fail``/``warn``/``info``/``off``)."""

    static: bool = False
    dynamic: bool = False
    severity: tuple[tuple[str, str], ...] = ()

    def severity_for(self, check: str, default: str) -> str:
        return dict(self.severity).get(check, default)


@dataclass(frozen=True)
class LimitSettings:
    """Resources one candidate worker (with every process it starts) may use; 0 turns a limit off.

    Enforced from outside the candidate (kbv.worker._contain): the parent polls the worker tree's
    resident memory, process count, open files and NVML's per-process device memory while it waits
    for a reply, and kills the worker when one is exceeded (outcome ``resource_limit``).
    """

    host_memory_gb: float = 16.0
    device_memory_gb: float = 64.0
    processes: int = 64
    open_files: int = 4096
    # An evaluation that holds its GPU alone (large inputs or outputs: kbv.evaluation._gpu_hold)
    # raises device_memory_gb to this share of the GPU's memory where that is more; 0 keeps
    # device_memory_gb. The limit keeps one candidate from starving the evaluations sharing its
    # GPU; alone there are none, and the honest reference needed 72 GB on a 7.5 GB-input problem.
    device_memory_alone_share: float = 0.75
    # Bytes (GiB) the candidate's files may take: its scratch (HOME, TMPDIR, output files) and its
    # build directory, measured by the parent's poll, and the size of any one file it writes
    # (RLIMIT_FSIZE). Landlock keeps its writes there (kbv.child.confine). Left out of the
    # protocol's hash at this default (Protocol.to_dict): protocols hash as before it existed.
    disk_gb: float = 16.0


DEFAULT_DISK_GB = LimitSettings().disk_gb

#: The precisions a problem can be evaluated in (``--precision``): its floating inputs and
#: parameters cast to it, as KernelBench's precision option does (docs/precision.md).
PRECISIONS = ("fp32", "bf16", "fp16")
#: Unit roundoff (half an ulp of 1) of each half precision: 2**-p for p significand bits.
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


#: The error model in bf16 and fp16 (docs/correctness.md, "Half precision"). Every honest kernel
#: rounds its outputs (and the eager baseline its intermediates) to a few significant bits, so
#: rounding, not summation order, dominates the baseline's error and is alike for every honest
#: kernel: the multiple of the baseline's error allowed is smaller than fp32's 8, and the floors are
#: counted in unit roundoffs of the precision (an output rounded once on either side), beside the
#: float32 reduction floor (fp32 accumulation in another order).
HALF_ERROR_MULTIPLE = 4.0
HALF_ELEMENTWISE_FLOOR_ULPS = 2.0
HALF_NORM_FLOOR_ULPS = 1.0


@dataclass(frozen=True)
class Protocol:
    name: str
    version: int
    correctness: CorrectnessSettings = field(default_factory=CorrectnessSettings)
    timing: TimingSettings = field(default_factory=TimingSettings)
    integrity: IntegritySettings = field(default_factory=IntegritySettings)
    timeout_s: float = 300.0
    limits: LimitSettings = field(default_factory=LimitSettings)
    precision: str = "fp32"

    def to_dict(self) -> dict[str, Any]:
        data = _jsonable(dataclasses.asdict(self))
        if self.precision == "fp32":
            # fp32 settings hash as they did before precisions existed: same records, same hash
            del data["precision"]
        if self.limits.disk_gb == DEFAULT_DISK_GB:
            # likewise the disk limit at its default: an honest candidate writes far less, so a
            # record judged before the limit existed was judged alike; another value hashes apart
            del data["limits"]["disk_gb"]
        for section, name in _WRITTEN_WHEN_SET:
            if not data[section][name]:
                del data[section][name]
        return cast(dict[str, Any], data)

    def sha256(self) -> str:
        """Hash of the resolved settings: two records with equal hashes were judged alike."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def with_timeout(self, timeout_s: float | None) -> Protocol:
        return self if timeout_s is None else replace(self, timeout_s=float(timeout_s))

    def with_precision(self, precision: str | None) -> Protocol:
        """This protocol evaluated in ``precision`` (None keeps the protocol's own)."""
        if precision is None:
            return self
        check_precision(precision)
        return replace(self, precision=precision, correctness=correctness_in(self.correctness, precision))


def correctness_in(settings: CorrectnessSettings, precision: str) -> CorrectnessSettings:
    """``settings`` for an evaluation in ``precision``: in bf16 and fp16 the error model's multiple
    at most :data:`HALF_ERROR_MULTIPLE` and its floors at least the half-precision ones (applying it
    twice changes nothing, so a stored record's settings read back unchanged). ``allclose`` needs
    nothing: it picks ``atol_half``/``rtol_half`` (KernelBench's 1e-2) by the outputs' dtype."""
    if precision == "fp32":
        return settings
    u = UNIT_ROUNDOFF[precision]
    return replace(
        settings,
        error_multiple=min(settings.error_multiple, HALF_ERROR_MULTIPLE),
        elementwise_floor=max(settings.elementwise_floor, HALF_ELEMENTWISE_FLOOR_ULPS * u),
        norm_floor=max(settings.norm_floor, HALF_NORM_FLOOR_ULPS * u),
    )


def check_precision(precision: str) -> str:
    """``precision`` when it is one of :data:`PRECISIONS`; else a ProtocolError saying which are."""
    if precision not in PRECISIONS:
        raise ProtocolError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return precision


#: Settings added after protocols were first hashed: written (and hashed) only when set, so a
#: protocol that leaves them off keeps the hash its records and stores already carry.
_WRITTEN_WHEN_SET = (
    ("correctness", "long_reduction_distributions"),
    ("correctness", "long_reduction_min"),
    ("timing", "unseen_inputs"),
    ("timing", "judged_calls"),
    ("timing", "stop_when_futile"),
)


STANDARD = Protocol(
    name="standard",
    version=1,
    correctness=CorrectnessSettings(mode="allclose", distributions=("original",), draws_per_distribution=5),
    timing=TimingSettings(recipe="events-median", repeats=30, baselines=("eager_fp32",)),
    integrity=IntegritySettings(static=False, dynamic=False),
)

# Version 2: the reduction floor (issue 12) and structure-preserving hidden inputs.
# Version 3: rounds of 10 timed calls, 3 to 9 of them until each series' median is known within 2%,
# later batches warmed up by warmup_calls alone, and a baseline 1.5x slower than another after the
# first round timed no further (issue 11; docs/timing.md, "Rounds until precise"). Version 2 timed
# 3 rounds of 30 calls of every baseline.
# Version 4: every timed call on an input set no earlier call saw (``unseen_inputs``, issue 37;
# docs/timing.md, "Every timed call on unseen inputs"). Version 3 timed the same three sets in every
# call, so a candidate that remembered its outputs was credited the lookup's speed.
# Version 5: three timed calls a round judged against the float64 truth, picked in secret after the
# candidate's batch (``judged_calls``; docs/timing.md, "Judging a secret sample of the timed
# calls"). Version 4 judged every timed call: one float64 forward per call in the reference.
# Version 6: no further rounds once the precision target cannot be reached within max_rounds
# (``stop_when_futile``; docs/timing.md, "Rounds until precise"), unless a candidate round has
# disagreed with the parent's bracket (then more rounds give its noise chances to agree). Version 5
# timed all 9 rounds of every problem of the CPU sample, whose medians never came within 2% on two
# shared cores (benchmarks/results/2026-12-06-cpu-verified-cost-cut/).
# Version 8: the observe probe's look after four of the reference's forward times, 20 ms to 0.2 s
# (docs/integrity-dynamic.md, "How long the look waits"). Version 6 always waited 0.2 s. (Version 7,
# the observation moved before timing, was reverted unreleased:
# benchmarks/results/2026-12-06-cpu-verified-cost-ahead/.)
# Version 9: the observe probe counts threads before its call once two counts 5 ms apart agree
# (at most 20 ms) after its warm-up call, not after a fixed 20 ms (docs/integrity-dynamic.md,
# "background_work"); ``inherits_reference`` follows a class the candidate defines itself under a
# problem class's name instead of failing it (docs/integrity-checks.md, "inherits_reference"); the
# futility stop of the timing rounds applies once one candidate round agrees with the parent's
# bracket, not only when none disagreed (docs/timing.md, "Rounds until precise").
# Version 10: the float64 truth's model is the reference's built again with its current values and
# cast, not a deep copy, where the model keeps functions of its own (docs/correctness.md,
# "verified: the error model"): a copy kept the lambda of 44_MiniGPTBlock over its float32 layers,
# and the reference failed its own truth. On the CPU a distribution's next correctness draw is asked
# for while the last is judged (docs/correctness.md, "a distribution's next draw"): a draw that
# fails now has the one asked ahead read, not counted, before its re-runs. ``timing_disagreement``
# fails only a batch that took more than three times its samples' account with its whole allowance
# granted (docs/integrity-dynamic.md, "Timing disagreement on a busy machine"); before, a claimed
# speedup more than twice the bracket's failed, and an honest thread pool per call failed on CI's
# two cores.
# Version 11: the ``spiked`` distribution where an output element reduces 256 input elements or more
# (docs/correctness.md, "Input distributions"). A loss that read every other element of its inputs
# passed every distribution of version 10 at bf16 on an H100 (96_HuberLoss, 2026-12-07,
# results/2026-12-07-h100-bf16-audit-sweeps-acceptance/), as it had v2's in fp32 on the H200.
VERIFIED = Protocol(
    name="verified",
    version=11,
    correctness=CorrectnessSettings(
        mode="error_model",
        reduction_block=256,
        distributions=("original", "signed", "wide", "shifted", "blockwise", "sparse", "spiked"),
        long_reduction_distributions=("spiked",),
        long_reduction_min=256,
        draws_per_distribution=2,
        redraw_parameters=True,
        secret_seeds=True,
    ),
    timing=TimingSettings(
        recipe="flush-unseen-events-median",
        repeats=10,
        l2_flush=True,
        input_sets=3,
        baselines=("eager_fp32", "eager_tf32"),
        rounds=3,
        max_rounds=9,
        median_precision=0.02,
        stop_when_futile=True,
        rewarm_seconds=0.0,
        dominated_factor=1.5,
        unseen_inputs=True,
        judged_calls=3,
    ),
    # A draw that failed once on the same inputs its re-runs passed is a demonstrated wrong output:
    # under verified it fails (docs/correctness.md, "Failing draws are confirmed").
    integrity=IntegritySettings(static=True, dynamic=True, severity=(("transient_mismatch", "fail"),)),
)


def timing_settings_from_dict(data: dict[str, Any]) -> TimingSettings:
    """Timing settings sent over a worker's JSON channel (lists back to tuples)."""
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return TimingSettings(**values)


BUILTIN: dict[str, Protocol] = {p.name: p for p in (STANDARD, VERIFIED)}


def load_protocol(spec: str | Path | Protocol) -> Protocol:
    """Resolve ``standard``, ``verified`` or a path to a TOML file into a Protocol."""
    if isinstance(spec, Protocol):
        return spec
    text = str(spec)
    if text in BUILTIN:
        return BUILTIN[text]
    path = Path(text)
    if path.suffix != ".toml":
        raise ProtocolError(
            f"unknown protocol {text!r}: use one of {', '.join(BUILTIN)} or a path to a .toml file"
        )
    if not path.is_file():
        raise ProtocolError(f"protocol file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProtocolError(f"protocol file {path} is not valid TOML: {exc}") from exc
    return protocol_from_dict(data, source=str(path))


def protocol_from_dict(data: dict[str, Any], source: str = "<dict>") -> Protocol:
    """Build a protocol from a mapping (a TOML file or a stored record's ``protocol.settings``)."""
    data = dict(data)
    base_name = data.pop("base", None)
    base = BUILTIN.get(base_name or "standard")
    if base is None:
        raise ProtocolError(f"{source}: base must be one of {', '.join(BUILTIN)}, not {base_name!r}")
    if "name" not in data:
        raise ProtocolError(f'{source}: a protocol needs a name (name = "...")')
    sections = {
        "correctness": CorrectnessSettings,
        "timing": TimingSettings,
        "integrity": IntegritySettings,
        "limits": LimitSettings,
    }
    updates: dict[str, Any] = {}
    for key, value in data.items():
        if key in sections:
            updates[key] = _merge_section(getattr(base, key), value, f"{source} [{key}]")
        elif key in ("name", "version", "timeout_s"):
            updates[key] = value
        elif key == "precision":
            updates[key] = check_precision(str(value))
        else:
            raise ProtocolError(f"{source}: unknown protocol key {key!r}")
    updates.setdefault("version", 1)
    resolved = replace(base, **updates)
    if resolved.timing.cuda_graph and resolved.timing.unseen_inputs:
        raise ProtocolError(
            f"{source} [timing]: cuda_graph replays the inputs it captured, so the timed calls cannot get "
            "unseen inputs: set unseen_inputs = false with cuda_graph = true (a regime of its own)"
        )
    return resolved.with_precision(resolved.precision) if resolved.precision != "fp32" else resolved


#: Checks folded into another one: a protocol file that names the old one is told which (a stored
#: record's protocol is read with the new name, so replays keep working).
_RENAMED_CHECKS = {"timed_output_check": "timed_call_outputs"}


def _merge_section(current: Any, overrides: Any, where: str) -> Any:
    if not isinstance(overrides, dict):
        raise ProtocolError(f"{where}: expected a table of settings")
    known = {f.name: f for f in fields(current)}
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in known:
            raise ProtocolError(f"{where}: unknown setting {key!r}; known: {', '.join(known)}")
        if key == "severity":
            if isinstance(value, list):  # the stored form: [[check, severity], ...]
                value = {_RENAMED_CHECKS.get(str(k), str(k)): str(v) for k, v in value}
            elif isinstance(value, dict) and (renamed := sorted(set(value) & set(_RENAMED_CHECKS))):
                raise ProtocolError(
                    f"{where}: "
                    + "; ".join(f"{old} is now part of {_RENAMED_CHECKS[old]}" for old in renamed)
                    + ": set the severity of that check instead"
                )
            if not isinstance(value, dict):
                raise ProtocolError(f'{where}: severity must be a table of check = "fail|warn|info|off"')
            bad = {k: v for k, v in value.items() if v not in ("fail", "warn", "info", "off")}
            if bad:
                raise ProtocolError(f"{where}: severities must be fail, warn, info or off, not {bad}")
            value = tuple(sorted(value.items()))
        elif isinstance(value, list):
            value = tuple(value)
        changes[key] = value
    return replace(current, **changes)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
