"""What each worker's allocator may keep cached between requests: one budget, owned by the parent.

The worker hands back what its allocator keeps after every request unless the rule it was sent
(:class:`kbv.wire.MemoryRule`, one field of every request) lets it keep more; the rule is decided
here and nowhere else, and the worker keeps no constant of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kbv import wire
from kbv.protocol import LimitSettings
from kbv.worker._spec import WorkerSpec

#: A worker whose allocator keeps more than this cached hands it back after the request: three
#: workers each keeping the peak of a billion-element request ran the H200 out of memory.
CACHED_BYTES_KEPT = 8 << 30
#: ... except the trusted reference worker while the device has what it keeps free (room for a
#: peer's request as large as its own) and its room for the candidate (:attr:`MemoryBudget.room_bytes`):
#: the candidate's device limit as it stands (widened to 3/4 of the device where the evaluation holds
#: it alone), or 0 during the correctness draws of an evaluation holding its GPU alone, where each of
#: the reference's requests runs beside the candidate's draw (kbv.evaluation.budget._room_for_candidate);
#: where the evaluation names none, the protocols' default device limit (``LimitSettings``, read
#: here, never repeated). What the reference keeps must never make an honest candidate run out of
#: memory below its limit: with a floor of 64 GB alone, a 7.5 GB-input problem's candidate (its limit
#: widened) ran out in its cache probe on the H200 (2026-12-03,
#: benchmarks/results/2026-12-03-h200-verified-cost/). Handing back and allocating again cost the
#: ``expected`` requests of a 1e9-element loss 0.02-0.04 s of release and more of allocation per draw
#: there (tens of draws an evaluation; twice what it keeps was not free beside its candidate). A
#: candidate worker always hands it back: what its allocator keeps counts against its device limit,
#: and a cached block of the wrong size is kept beside a new one.
DEFAULT_ROOM_BYTES = int(LimitSettings().device_memory_gb * (1 << 30))  # GiB, as limits count


@dataclass
class MemoryBudget:
    """The rule every worker of an evaluation is sent with each request (``Worker.budget``; a worker
    outside an evaluation has one of its own). ``room_bytes``: what the reference leaves free for its
    candidate (None: :data:`DEFAULT_ROOM_BYTES`). ``candidate_device_gb``: the candidate's
    device-memory limit in force, GiB (None: the one its worker was launched with); the parent's
    limit poll reads it here (:meth:`limits_of`), so a worker's spec never changes after launch."""

    room_bytes: int | None = None
    candidate_device_gb: float | None = None

    def limits_of(self, spec: WorkerSpec) -> LimitSettings | None:
        """The limits ``spec``'s worker is held to now: those it was launched with, a candidate's
        device-memory limit as this budget has it in force."""
        limits: LimitSettings | None = spec.limits
        if limits is None or spec.role != "candidate" or self.candidate_device_gb is None:
            return limits
        return replace(limits, device_memory_gb=self.candidate_device_gb)

    def widen_device_limit(self, spec: WorkerSpec, total_bytes: int) -> tuple[float, float] | None:
        """Raise the candidate's device-memory limit, for an evaluation that holds its GPU of
        ``total_bytes`` alone, to the protocol's ``device_memory_alone_share`` of it where that is
        more: (the limit before, the share in GiB), or None where it stays (a limit turned off, a
        trusted worker, a share below the protocol's figure)."""
        limits = self.limits_of(spec)
        if spec.role != "candidate" or limits is None or not limits.device_memory_gb or not total_bytes:
            return None
        widened = float(limits.device_memory_alone_share) * total_bytes / (1 << 30)
        if widened <= limits.device_memory_gb:
            return None
        self.candidate_device_gb = round(widened, 1)
        return float(limits.device_memory_gb), widened

    def rule(self, role: str) -> wire.MemoryRule:
        if role != "reference":
            return wire.MemoryRule(cached_bytes_kept=CACHED_BYTES_KEPT)
        room = DEFAULT_ROOM_BYTES if self.room_bytes is None else self.room_bytes
        return wire.MemoryRule(cached_bytes_kept=CACHED_BYTES_KEPT, room_bytes=int(room))
