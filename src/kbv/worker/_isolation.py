"""What a worker's record says of its isolation: how it is contained on this machine, and what
this machine did not allow. ``Worker`` (``kbv.worker._process``) takes ``isolation`` from
:class:`IsolationReport`."""

from __future__ import annotations

import os
from typing import Any

from kbv import wire_replies
from kbv.worker import _contain
from kbv.worker._memory import MemoryBudget
from kbv.worker._spec import WorkerSpec, confinement_off


class IsolationReport:
    """The isolation half of a worker: its attributes are set by ``Worker.__init__`` and its launch."""

    spec: WorkerSpec
    budget: MemoryBudget
    hello: wire_replies.Hello | None
    started_as: str
    uid: int | None
    device_peak_bytes: int | None
    _cgroup: _contain.Cgroup | None
    _no_drop: str | None
    _private_net: bool

    @property
    def isolation(self) -> dict[str, Any]:
        """How this worker is contained here, and what this machine did not allow (for the record)."""
        facts: dict[str, Any] = {
            "process_tree": "cgroup v2, subreaper, marker sweep"
            if self._cgroup
            else "subreaper, marker sweep",
            "user": f"uid {self.uid} (no passwd entry; shared only by evaluations of this source)"
            if self.uid is not None
            else "same as the parent" + (" (root)" if os.geteuid() == 0 else ""),
        }
        if self.started_as:
            facts["start"] = self.started_as
        netns, no_netns = _contain.network_namespace()
        private_net = self._private_net
        facts["network"] = "private namespace (no network)" if private_net else "shared with the parent"
        limits = self.budget.limits_of(self.spec)  # in force: widened where the GPU is held alone
        if limits is not None:
            facts["limits"] = {
                f: getattr(limits, f)
                for f in ("host_memory_gb", "device_memory_gb", "processes", "open_files", "disk_gb")
            }
        not_done = []
        if self._cgroup is None:
            not_done.append(
                "no cgroup: this process cannot create one here, so a process that clears its "
                "environment and leaves the worker's tree is not tracked"
            )
        if self.spec.role == "candidate" and not private_net:
            not_done.append(
                "no private network namespace: "
                f"{no_netns or 'setpriv(1) is missing to drop the uid after it'}"
            )
        if self.spec.role == "candidate":
            confinement = self.hello.confinement if self.hello is not None else None
            if confinement is not None:
                facts["confinement"] = {k: confinement.get(k) for k in ("landlock", "seccomp")}
                not_done.extend(str(item) for item in confinement.get("not_enforced") or [])
            elif confinement_off():
                not_done.append(
                    "Landlock and seccomp turned off (KBV_CONFINE=0): the candidate can signal, trace "
                    "and write wherever its uid may"
                )
        if os.geteuid() == 0 and self.uid is None:
            confined = bool((facts.get("confinement") or {}).get("landlock"))
            reach = (
                "Landlock keeps it from other processes and its writes in its scratch and build "
                "directory, but it reads every file root can"
                if confined
                else "it can read other workers' memory and write kbv's caches"
            )
            not_done.append(
                "the candidate worker runs as root like the parent "
                f"({self._no_drop or 'not a candidate worker'}): {reach} "
                "(docs/architecture.md, 'What isolation does not cover')"
            )
        if (
            limits is not None
            and limits.device_memory_gb
            and self.spec.device.startswith("cuda")
            and self.device_peak_bytes is None
        ):
            not_done.append("device memory not enforced: NVML gave no per-process figure for this worker")
        facts["not_enforced"] = not_done
        return facts
