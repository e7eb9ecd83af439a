"""Errors the user can fix (bad paths, names, files): the CLI turns them into exit status 2."""

from __future__ import annotations

from kbv.candidates import CandidateError
from kbv.devices import DeviceError
from kbv.execute import ExecutorError
from kbv.problems import ProblemError
from kbv.protocol import ProtocolError
from kbv.toolchain import ToolchainError

USAGE_ERRORS: tuple[type[Exception], ...] = (
    CandidateError,
    DeviceError,
    ExecutorError,
    ProblemError,
    ProtocolError,
    # A missing compiler, ninja or CUDA toolkit: the machine's to fix, found before anything runs.
    ToolchainError,
    FileNotFoundError,
)
