"""Containment fixtures, confined and not, as root on this machine (one JSON line per evaluation)."""

import json
import os
import time
from pathlib import Path

from kbv.api import evaluate_paths
from kbv.child import confine
from kbv.protocol import protocol_from_dict

ROOT = Path.cwd()
RELU = ROOT / "src/kbv/suite/problems/level1/1_ReLU.py"
CONTAIN = ROOT / "tests/fixtures/candidates/contain"
small_disk = protocol_from_dict({"name": "small-disk", "base": "standard", "limits": {"disk_gb": 0.0625}})
runs = [
    ("stop_siblings.py", "standard"),
    ("signal_bursts.py", "standard"),
    ("signal_own_child.py", "standard"),
    ("reach_parent_memory.py", "standard"),
    ("honest_scratch_files.py", "standard"),
    ("write_4gib_one_file.py", small_disk),
    ("write_4gib_many_files.py", small_disk),
    ("honest_scratch_files.py", small_disk),
]
print(
    json.dumps({"kernel": os.uname().release, "landlock_abi": confine.landlock_abi(), "euid": os.geteuid()})
)
for mode in ("confined", "unconfined"):
    if mode == "unconfined":
        os.environ["KBV_CONFINE"] = "0"
    for name, protocol in runs:
        started = time.monotonic()
        record = evaluate_paths(RELU, CONTAIN / name, protocol=protocol, device="cpu", timeout_s=60)
        print(
            json.dumps(
                {
                    "mode": mode,
                    "fixture": name,
                    "protocol": protocol if isinstance(protocol, str) else protocol.name,
                    "outcome": str(record.outcome),
                    "seconds": round(time.monotonic() - started, 1),
                    "findings": [
                        (f.check, str(f.severity)) for f in record.findings if str(f.severity) != "info"
                    ],
                    "error_limit": (record.error or {}).get("limit"),
                    "confinement": record.isolation.get("confinement"),
                    "not_enforced": record.isolation.get("not_enforced"),
                }
            ),
            flush=True,
        )
