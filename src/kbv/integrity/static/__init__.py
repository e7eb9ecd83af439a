"""Static reward-hack checks: pure AST and regex over the candidate's Python and embedded C++/CUDA.

Every check here is registered with ``kind="static"`` and takes a :class:`StaticContext`. Nothing
here imports torch or runs candidate code, so the trusted parent can afford to run all of them.
Each finding quotes the offending line, prefixed ``line N:`` with the line number in the
candidate's Python file (for embedded C++, the Python line that holds the C++ line).

One module per family of checks (importing them registers their checks):

- ``escape``: parse_error, threads_processes, process_control, harness_tampering, introspection,
  file_network_access, dynamic_code
- ``streams``: side_stream, cpp_token_pasting, cuda_graph
- ``outputs``: tensor_subclass, precision_cast, caching
- ``reference``: reference_fallback, inherits_reference, reference_operator, pytorch_only
"""

from __future__ import annotations

from kbv.integrity.static import escape, outputs, reference, streams  # noqa: F401  (registers the checks)
from kbv.integrity.static._common import StaticContext
from kbv.integrity.static.escape import exec_payloads

__all__ = ["StaticContext", "exec_payloads"]
