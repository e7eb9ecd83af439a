"""Build-only entry point: ``python -m kbv.child.build CANDIDATE.py``.

Imports the candidate so that its ``load_inline``/``load`` calls compile into ``TORCH_EXTENSIONS_DIR``
(the same directory the evaluation worker will use), then exits. It runs with the worker's scrubbed
environment and no visible GPU, so candidate code run at import time cannot touch a GPU that may be
timing someone else. It decides nothing: a failure here is ignored by the parent, and the
evaluation worker reports it as ``compile_error`` when it builds the candidate itself.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
import uuid


def main(path: str) -> int:
    from kbv.child import confine

    confined = confine.from_environment()  # the candidate's code runs at import: confined first
    if confined is not None and confined["not_enforced"]:
        print(f"kbv: not enforced in this build: {confined['not_enforced']}", file=sys.stderr)
    name = f"kbv_build_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        print(f"{path} cannot be imported as a Python module", file=sys.stderr)
        return 1
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:  # the candidate's failure: the evaluation will report it
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    raise SystemExit(main(sys.argv[1]))
