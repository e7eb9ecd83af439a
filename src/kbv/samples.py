"""What a timed run hands back: raw per-call samples and the regime they were taken under.

The worker's timing recipe (``kbv.child.timing``) fills a :class:`Measurement`; the parent's
statistics (``kbv.statistics``) read one. Stdlib and :mod:`kbv.protocol` only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kbv.protocol import TimingSettings


@dataclass
class Measurement:
    """Raw per-call samples of one timed run, plus the regime they were taken under."""

    recipe: str
    device_ms: list[float] = field(default_factory=list)
    wall_ms: list[float] = field(default_factory=list)
    warmup_calls: int = 0
    n_input_sets: int = 1
    l2_flush: bool = False
    total_wall_s: float = 0.0
    timer: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Measurement fields {sorted(unknown)}; known: {sorted(known)}")
        values = dict(data)
        values["device_ms"] = [float(x) for x in values.get("device_ms", [])]
        values["wall_ms"] = [float(x) for x in values.get("wall_ms", [])]
        return cls(**values)


def recipe_name(settings: TimingSettings) -> str:
    """The regime's name as written into a measurement: graph replays are their own regime."""
    return settings.recipe + ("+graph" if settings.cuda_graph else "")
