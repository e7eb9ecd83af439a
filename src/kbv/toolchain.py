"""The build toolchain, checked before any candidate runs.

A C++ or CUDA candidate (``torch.utils.cpp_extension.load_inline``) needs a C++ compiler and ninja
on the PATH, and on a GPU a CUDA candidate needs a CUDA toolkit (``nvcc`` under ``CUDA_HOME``).
Without them every such candidate would fail its build and be scored as failed: the machine's
fault blamed on the candidate. So a missing tool is a harness error (:class:`ToolchainError`,
exit 2 from the CLI, before anything runs and before any record is written), with the fix in one
line. Candidates that build nothing (plain PyTorch, Triton) need none of this.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from kbv.candidates import Candidate


class ToolchainError(RuntimeError):
    """A tool the candidates need to build is missing: the machine's fault, not theirs."""


def needs_build(source: str) -> bool:
    """Whether importing the source may build a C++/CUDA extension (the same test as the compile
    stage's ``kbv.worker.builds.needs_build``)."""
    return "cpp_extension" in source or "load_inline" in source


def needs_cuda_toolkit(source: str) -> bool:
    """Whether the source builds CUDA code (``load_inline(cuda_sources=...)``, a ``CUDAExtension``)."""
    return needs_build(source) and ("cuda_sources" in source or "CUDAExtension" in source)


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", os.defpath))


def cuda_home() -> str | None:
    """Where torch will look for the CUDA toolkit: ``CUDA_HOME``/``CUDA_PATH``, else nvcc's parent."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = _which("nvcc")
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent)
    return "/usr/local/cuda" if Path("/usr/local/cuda").is_dir() else None


def toolchain_problems(candidates: Iterable[Candidate], device: str) -> list[str]:
    """One line per missing tool (what is missing, for how many candidates, and the fix); empty
    when every candidate can be built here."""
    candidates = list(candidates)
    building = [c for c in candidates if needs_build(c.source)]
    if not building:
        return []
    problems = []
    count = f"{len(building)} C++/CUDA candidate{'s need' if len(building) != 1 else ' needs'}"
    compiler = os.environ.get("CXX") or "c++"
    if _which(compiler) is None:
        problems.append(
            f"no C++ compiler ({compiler}) on the PATH, and {count} one to build: install one "
            "(apt-get install g++) or set CXX to a compiler"
        )
    if _which("ninja") is None:
        problems.append(
            f"ninja is not on the PATH, and {count} it to build: pip install ninja "
            "(or apt-get install ninja-build)"
        )
    if device.startswith("cuda"):
        cuda = [c for c in building if needs_cuda_toolkit(c.source)]
        home = cuda_home()
        nvcc = Path(home) / "bin" / "nvcc" if home else None
        if cuda and (nvcc is None or not os.access(nvcc, os.X_OK)):
            where = f"{nvcc}" if nvcc else "CUDA_HOME is not set and no nvcc is on the PATH"
            problems.append(
                f"no usable CUDA toolkit ({where}), and {len(cuda)} CUDA candidate"
                f"{'s need' if len(cuda) != 1 else ' needs'} one to build: install the CUDA toolkit matching "
                "torch's CUDA and set CUDA_HOME to it"
            )
    return problems


def check_toolchain(candidates: Iterable[Candidate], device: str | None = None) -> None:
    """Raise :class:`ToolchainError` when a tool the candidates need is missing (see the module
    docstring); the message is one line per tool, each with its fix."""
    if device is None:
        from kbv.evaluation import default_device

        device = default_device()
    problems = toolchain_problems(candidates, device)
    if problems:
        raise ToolchainError("; ".join(problems))
