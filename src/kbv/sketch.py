"""Sketches of a call's outputs: a few random projections of a nonlinear map of every output,
computed the same way by a worker (after every timed call) and by the parent (of the reference).

The parent cannot keep every timed call's outputs (thirty copies of a 1 GB output), and whatever
it picks in advance travels to the candidate's process, which can read it and behave only on the
picked calls. So the worker reduces every timed call's outputs to a sketch of a few hundred bytes,
outside the timed region and the same work for every call, and the parent judges every sketch
against the reference's sketch for the same inputs (``kbv.correctness.judge_sketch``).

Map: ``phi(x) = exp(i * omega * x)`` elementwise (a cosine and a sine), ``omega`` a power of two the
parent sets from the reference output's RMS (:func:`omega_for`). ``|phi(a) - phi(t)| <= omega |a - t|``
for every element, so ``||phi(a) - phi(t)||_2 <= omega ||a - t||_2``: an output that passes the
correctness check's norm bound moves the mapped output by at most ``omega`` times that bound. The map
is not linear: a linear sketch ``<r, A @ B>`` equals ``<A^T r, B>`` and costs a matrix-vector product
instead of the matmul (Freivalds' trick), so a candidate that patches the sketch step could report a
right linear sketch without computing its output; ``exp(i * omega * (A @ B))`` has no such shortcut.

Projections: the output, flattened, is viewed as a (rows, cols) matrix ``X`` (``cols`` the power of
two nearest above ``sqrt(n)``, the leftover elements as one more row). The basis is :data:`VECTORS`
Gaussian row vectors ``u_j`` and as many column vectors ``v_l``; every pair gives one projection
``u_j^T phi(X) v_l``, :data:`PROJECTIONS` of them for ``VECTORS x n`` multiply-adds per map part
(``phi(X) V`` first, then ``U^T`` of that). Any fixed complex matrix ``D`` has ``E |u_j^T D v_l|^2 =
||D||^2``, and the mean over the pairs concentrates: at worst (all of ``D`` in one element) it is the
product of two independent chi-square(VECTORS)/VECTORS variables. A basis costs (rows + cols) x
VECTORS numbers instead of n x PROJECTIONS. The basis comes from a seed the parent sends
with the batch, on the CPU in float64, so the worker's and the parent's bases are bit for bit the
same; everything is computed in float64 (float32 accumulation errs by more than the tolerance of an
fp32 output; TF32 flags do not touch float64). Non-finite values are set to 0 before the map and
described apart (:func:`sketch_tensor`).

Import discipline: stdlib and torch only (the worker imports this module before the candidate);
the torch functions it calls are bound at import, before any candidate code runs.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from kbv.handoff import plain_copy

#: Row vectors and column vectors of the basis; each (row, column) pair is one projection.
VECTORS = 8
#: Projections per output (complex numbers, a cosine and a sine part each), row-major over the pairs.
PROJECTIONS = VECTORS * VECTORS
#: Elements mapped at once: the float64 temporaries of one sketch stay 2 x 32 MB whatever the size.
CHUNK_ELEMENTS = 1 << 22
#: On a GPU, 16x more (temporaries 2 x 128 MB): on the H200 a 1.6e9-element output's sketch took
#: 35.7 ms in chunks of 2^22 elements and 23.1 ms in chunks of 2^24 (its launches, not its bytes,
#: set the smaller chunks' pace); only the order of the float64 sums changes.
CUDA_CHUNK_ELEMENTS = 1 << 24
#: Whether a GPU maps and projects in one Triton kernel (``kbv._sketch_kernel``: 4 bytes of traffic
#: an element instead of 48) where the output is float32, float16 or bfloat16 (its tests run it
#: under Triton's interpreter on the CPU). When on, Triton is imported with this module, before any
#: candidate code runs, a worker compiles the kernel while it boots (:func:`warm`), and each process
#: uses it only after it gave the torch path's projections of a check tensor on that device
#: (:func:`_fused_ready`). Measured on the H200
#: (2026-12-01): 12.5 ms against the torch path's 23.3 ms for 1.6e9 float32 elements (1.85x, not the
#: several times hoped for: its float64 multiply-adds, not its bytes, set its pace), its projections
#: within 1.8e-10 of the torch path's; the float32 and float16 tests passed, the bfloat16 one did not
#: finish within its step's 80 s. It stays off: ~3 s saved on a 1.6e9-element ``verified`` evaluation
#: would cost a compilation in every worker (no on-disk cache may be trusted, see
#: ``kbv._sketch_kernel``), which small problems, the median, would pay for nothing.
FUSED_ON_CUDA = False
#: ``omega`` puts the reference's RMS at this many radians (:func:`omega_for`).
PHASE_AT_RMS = 2.0
#: What the map evaluated in float32 may err by per element, cosine and sine each (float32's sin and
#: cos err by about one ulp of 1, 6e-8; this is eight): the judge adds ``FEATURE_ROUNDING x sqrt(2n)``
#: to the distance it allows (kbv.correctness.judge_sketch).
FEATURE_ROUNDING = 2.0**-21

# Bound at import, before any candidate code runs in a worker.
_cos, _sin, _mm, _matmul = torch.cos, torch.sin, torch.mm, torch.matmul
_isnan, _isinf, _where, _mul = torch.isnan, torch.isinf, torch.where, torch.mul
_view_as_real = torch.view_as_real
_to = torch.Tensor.to
_reshape = torch.Tensor.reshape
_sum = torch.Tensor.sum
_randn = torch.randn
_zeros = torch.zeros
_empty = torch.empty
_Generator = torch.Generator

_FUSED: Any = None
if FUSED_ON_CUDA:
    try:
        from kbv import _sketch_kernel as _FUSED
    except ImportError:  # no Triton here: the torch path
        _FUSED = None

_BASES: dict[tuple[int, int, int, str], tuple[torch.Tensor, torch.Tensor, int]] = {}
_BASES_KEPT = 16


def omega_for(rms: float) -> float:
    """The map's frequency for an output of RMS ``rms``: the power of two that puts ``rms`` nearest
    :data:`PHASE_AT_RMS` radians (1 for an all-zero or non-finite scale). Values near the RMS then
    wrap around the circle, so the map is far from linear where the output lives, and a power of
    two multiplies a float exactly."""
    if not math.isfinite(rms) or rms <= 0:
        return 1.0
    return float(2.0 ** round(math.log2(PHASE_AT_RMS / rms)))


def shape_of(n: int) -> tuple[int, int]:
    """(rows, cols) of the matrix view of ``n`` elements; ``n - rows * cols`` (< cols) are one more row."""
    if n <= 0:
        return 0, 1
    cols = 1 << ((n - 1).bit_length() + 1) // 2
    return n // cols, cols


def _basis(seed: int, index: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(U, V, cols): U is (rows + 1) x VECTORS (the last row for the leftover), V is cols x VECTORS."""
    key = (int(seed), int(index), int(n), str(device))
    found = _BASES.get(key)
    if found is not None:
        return found
    rows, cols = shape_of(n)
    digest = hashlib.sha256(f"kbv-sketch:{int(seed)}:{int(index)}:{int(n)}".encode()).digest()
    generator = _Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    both = _randn((rows + 1 + cols, VECTORS), generator=generator, dtype=torch.float64)
    u, v = _to(both[: rows + 1], device), _to(both[rows + 1 :], device)
    if len(_BASES) >= _BASES_KEPT:
        _BASES.clear()
    _BASES[key] = (u, v, cols)
    return u, v, cols


#: Devices the fused kernel runs on (tests add "cpu", under Triton's interpreter), and the output
#: dtypes it reads (each compiled while a worker boots).
FUSED_DEVICES = ("cuda",)
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Per device: whether the fused kernel agreed with the torch path on a check tensor.
_FUSED_AGREES: dict[str, bool] = {}
#: The check: this many elements (a leftover row included), and the largest disagreement allowed,
#: as a share of the rounding the judge allows for a float32 map.
FUSED_CHECK_ELEMENTS = (1 << 16) + 77
FUSED_CHECK_SHARE = 0.1


def _fused_ready(device: torch.device) -> bool:
    """Whether sketches on ``device`` go through the fused kernel: it is loaded, runs on this kind
    of device, and on this device gave the torch path's projections of a check tensor (once per
    process and device). A kernel that disagrees, or fails, is not used again: the torch path is."""
    if _FUSED is None or device.type not in FUSED_DEVICES:
        return False
    key = _device_key(device)
    if key not in _FUSED_AGREES:
        _FUSED_AGREES[key] = _fused_agrees(device)
    return _FUSED_AGREES[key]


def _device_key(device: torch.device) -> str:
    return f"{device.type}:{device.index or 0}"  # "cuda" and "cuda:0" alike (one GPU per worker)


def warm(device: torch.device) -> None:
    """Compile and check the fused kernel now, for every dtype it reads (a worker calls it while it
    boots, before any candidate code), not inside the first timed batch's bracket. Nothing to do
    when it is off."""
    _fused_ready(device)


def _fused_agrees(device: torch.device) -> bool:
    """Every dtype the kernel reads, against the float64 map of the same values."""
    n = FUSED_CHECK_ELEMENTS
    generator = _Generator(device="cpu")
    generator.manual_seed(n)
    values = _randn((n,), generator=generator, dtype=torch.float32)
    u, v, cols = _basis(0, 0, n, device)
    allowed = FUSED_CHECK_SHARE * FEATURE_ROUNDING * math.sqrt(2 * n)
    for dtype in FUSED_DTYPES:
        x = _to(_to(values, dtype), device)
        try:
            fused = _FUSED.project(x, u, v, cols, 1.0)
        except Exception:  # noqa: BLE001 - a kernel that cannot run here leaves the torch path
            return False
        exact = _project_torch(x, u, v, cols, 1.0, exact=True)
        if not float((fused - exact).pow(2).mean().sqrt()) <= allowed:
            return False
    return True


def _real_flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as one flat real tensor (a complex one as its real and imaginary parts)."""
    if tensor.is_complex():
        tensor = _view_as_real(tensor.resolve_conj())
    return _reshape(tensor, (-1,))


def _feature_dtype(flat: torch.Tensor) -> torch.dtype:
    """The map is evaluated in float32 for outputs of at most 32-bit floats (their values are exact
    there and ``omega`` scales them exactly; the float32 cosine and sine err by under
    :data:`FEATURE_ROUNDING` per element) and in float64 otherwise (the float64 truth, integers)."""
    return (
        torch.float32
        if flat.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.bool)
        else torch.float64
    )


def _project(
    flat: torch.Tensor, u: torch.Tensor, v: torch.Tensor, cols: int, omega: float | None, exact: bool = False
) -> torch.Tensor:
    """(2, PROJECTIONS) float64: the projections of ``exp(i omega flat)`` (cosine row, sine row), or
    with ``omega=None`` of ``flat`` itself (first row; the second is 0). The projections themselves
    are float64 products and sums; ``exact`` evaluates the map in float64 whatever the dtype. A
    float32 map goes through the fused kernel where it is on and agrees (:func:`_fused_ready`)."""
    feature = torch.float64 if exact or omega is None else _feature_dtype(flat)
    fused = omega is not None and feature == torch.float32 and flat.dtype in FUSED_DTYPES
    if fused and flat.is_contiguous() and _fused_ready(flat.device):
        assert omega is not None
        try:
            return _FUSED.project(flat, u, v, cols, omega)
        except Exception:  # noqa: BLE001 - kbv's kernel failed, not the candidate: the torch path
            _FUSED_AGREES[_device_key(flat.device)] = False
    return _project_torch(flat, u, v, cols, omega, exact)


def _project_torch(
    flat: torch.Tensor, u: torch.Tensor, v: torch.Tensor, cols: int, omega: float | None, exact: bool = False
) -> torch.Tensor:
    """:func:`_project` in torch operations, chunk by chunk."""
    n = flat.numel()
    rows = n // cols
    feature = torch.float64 if exact or omega is None else _feature_dtype(flat)
    acc = _zeros((2, VECTORS, VECTORS), dtype=torch.float64, device=flat.device)
    chunk = CUDA_CHUNK_ELEMENTS if flat.device.type == "cuda" else CHUNK_ELEMENTS
    step = max(1, chunk // cols)
    for r0 in range(0, rows + 1, step):
        start, stop = r0 * cols, min(n, (r0 + step) * cols)
        if stop <= start:
            break
        full = (stop - start) // cols  # whole rows in this chunk; a leftover (< cols) is row ``rows``
        pieces = [(r0, full, cols)] if full else []
        if stop - start > full * cols:
            pieces.append((r0 + full, 1, stop - start - full * cols))
        offset = start
        for row, count, width in pieces:
            part = flat[offset : offset + count * width].view(count, width)
            offset += count * width
            u_part = u[row : row + count]
            if omega is None:
                acc[0] += _mm(u_part.T, _mm(_to(part, torch.float64), v[:width]))
                continue
            # omega * x in the map's dtype, in a new tensor (the output itself is left alone)
            x = _mul(part, omega) if part.dtype == feature else _to(part, feature).mul_(omega)
            mapped = _empty((2, count, width), dtype=torch.float64, device=flat.device)
            _cos(x, out=mapped[0])  # evaluated in x's dtype, stored as float64
            _sin(x, out=mapped[1])
            both = _mm(mapped.view(2 * count, width), v[:width]).view(2, count, VECTORS)
            acc += _matmul(u_part.T, both)
    return acc.view(2, PROJECTIONS)


def sketch_tensor(tensor: torch.Tensor, seed: int, index: int, omega: float) -> dict[str, Any]:
    """The sketch of one tensor (an output, or the reference's): ``re`` and ``im``, PROJECTIONS floats
    each. With non-finite values, ``nonfinite`` holds their counts (``nan``, ``posinf``, ``neginf``)
    and projections of where they are (``nan_at``, ``posinf_at``, ``neginf_at``); the map then sees
    0 in their place."""
    flat = _real_flat(tensor)
    n = flat.numel()
    if n == 0:
        zeros = [0.0] * PROJECTIONS
        return {"re": zeros, "im": list(zeros)}
    u, v, cols = _basis(seed, index, n, flat.device)
    proj = _project(flat, u, v, cols, omega)
    entry: dict[str, Any] = {}
    values = proj.tolist()
    if not all(math.isfinite(x) for row in values for x in row):  # non-finite values in the output
        nan, inf = _isnan(flat), _isinf(flat)
        posinf, neginf = inf & (flat > 0), inf & (flat < 0)
        # in float64: a float32 value times omega may overflow where the float64 truth's does not
        proj = _project(_where(nan | inf, 0.0, flat), u, v, cols, omega, exact=True)
        entry["nonfinite"] = {
            "nan": int(_sum(nan)),
            "posinf": int(_sum(posinf)),
            "neginf": int(_sum(neginf)),
            "nan_at": _project(nan, u, v, cols, None)[0].tolist(),
            "posinf_at": _project(posinf, u, v, cols, None)[0].tolist(),
            "neginf_at": _project(neginf, u, v, cols, None)[0].tolist(),
        }
        values = proj.tolist()
    entry["re"], entry["im"] = values
    return entry


def sketch_outputs(outputs: list[Any], spec: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """One entry per output: its type name, and for a tensor its dtype, shape and sketch under
    ``spec`` (``{"seed": int, "omega": [one float per output]}``, from the parent). A tensor
    subclass is sketched as the plain tensor underneath (its type name says what it was)."""
    seed = int(spec["seed"])
    omegas = [float(w) for w in spec.get("omega") or []]
    entries: list[dict[str, Any]] = []
    for index, value in enumerate(outputs):
        entry: dict[str, Any] = {"type": f"{type(value).__module__}.{type(value).__qualname__}"}
        tensor = plain_copy(value, device, copy=False)
        if isinstance(tensor, torch.Tensor):
            entry["dtype"], entry["shape"] = str(tensor.dtype), list(tensor.shape)
            omega = omegas[index] if index < len(omegas) else 1.0
            entry.update(sketch_tensor(tensor, seed, index, omega))
        entries.append(entry)
    return entries
