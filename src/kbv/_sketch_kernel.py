"""A sketch's map and projections in one Triton kernel: ``U^T phi(X) V`` for the cosine and the
sine part at once, reading each output element once (4 bytes for a float32 output) instead of the
48 bytes an element of :func:`kbv.sketch._project`'s torch path (a scaled copy, cosine and sine
into float64 temporaries, a float64 matrix product). Each program takes a block of columns over a
range of rows and writes its 2 x 8 x 8 share; torch adds the shares, in float64.

Numerics are the torch path's: ``omega * x`` in float32 (``omega`` is a power of two: exact),
cosine and sine in float32 by libdevice (within 2 ulp: inside ``FEATURE_ROUNDING``), every
product and sum in float64 (16 multiply-adds an element), never a tensor-core product (an fp32
matrix product errs by more than a tolerance and follows the candidate's TF32 flags). Only the
order of the float64 sums differs. Compiled here for sm_90a (``ptxas -v``): 72 registers, no spills
at 128 columns and 4 warps a program.

Off (:data:`kbv.sketch.FUSED_ON_CUDA`, which gives its H200 figures and why); the tests run it
under Triton's interpreter on the CPU (``TRITON_INTERPRET=1``) against the torch path. Before it
is switched on, its compiled code must come from where the candidate cannot have written: the
worker's ``TRITON_CACHE_DIR`` is shared by evaluations of the same source, and a candidate that
keeps the parent's uid (where the drop is impossible) can write any cache, so an on-disk binary
could be one an earlier evaluation planted, that passes the check tensor and lies elsewhere.
Compile it before any candidate runs, into a fresh directory or ahead of time for the
device's architecture in the fork server (Triton compiles without a GPU:
``tests/test_sketch.py::test_the_fused_kernel_compiles_for_hopper_without_a_gpu``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# libdevice's cosine and sine on a GPU (within 2 ulp whatever the argument); Triton's interpreter,
# which runs the tests on the CPU, has no libdevice and evaluates tl.cos and tl.sin with numpy.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Bound at import, as kbv.sketch binds its own (before any candidate code runs in a worker).
_empty = torch.empty
_sum = torch.Tensor.sum
_reshape = torch.Tensor.reshape
_contiguous = torch.Tensor.contiguous

#: Columns of the matrix view per program, and rows per program (its loop).
BLOCK_COLS = 128
ROWS_PER_PROGRAM = 256


# Sizes and the output's address are not specialised on (divisibility by 16, alignment): one
# compilation per output dtype, made while the worker boots (kbv.sketch.warm), not inside a bracket.
@triton.jit(do_not_specialize=["n", "cols", "rows_total", "omega"], do_not_specialize_on_alignment=["x_ptr"])
def _sketch_part(
    x_ptr,
    u_ptr,
    v_ptr,
    part_ptr,
    n,
    cols,
    rows_total,
    omega,
    BLOCK_C: tl.constexpr,
    ROWS: tl.constexpr,
    VECTORS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One program's share of ``U^T phi(X) V`` (cosine and sine parts, float64): the columns
    ``[pid_c * BLOCK_C, ...)`` of the rows ``[pid_r * ROWS, ...)``. The loop only multiplies and adds
    (``acc[c, i] += phi[r, c] * U[r, i]``, per column lane, no reduction across threads); the product
    with ``V`` and the sum over the block's columns come once at the end, since
    ``sum_r,c U[r, i] phi[r, c] V[c, j] = sum_c V[c, j] (sum_r U[r, i] phi[r, c])``."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    cc = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ii = tl.arange(0, VECTORS)
    acc_cos = tl.zeros((BLOCK_C, VECTORS), dtype=tl.float64)
    acc_sin = tl.zeros((BLOCK_C, VECTORS), dtype=tl.float64)
    for k in range(0, ROWS):
        r = pid_r * ROWS + k
        offs = r.to(tl.int64) * cols + cc
        mask = (cc < cols) & (offs < n) & (r < rows_total)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        angle = x * omega
        if INTERPRETED:
            cos, sin = tl.cos(angle), tl.sin(angle)
        else:
            cos, sin = libdevice.cos(angle), libdevice.sin(angle)
        mapped_cos = tl.where(mask, cos, 0.0).to(tl.float64)
        mapped_sin = tl.where(mask, sin, 0.0).to(tl.float64)
        u = tl.load(u_ptr + r * VECTORS + ii, mask=(ii < VECTORS) & (r < rows_total), other=0.0)
        acc_cos += mapped_cos[:, None] * u[None, :]
        acc_sin += mapped_sin[:, None] * u[None, :]
    # part[i, j] = sum_c acc[c, i] * v[c, j], one j at a time (a (BLOCK_C, VECTORS) temporary)
    base = part_ptr + (pid_r * tl.num_programs(0) + pid_c) * (2 * VECTORS * VECTORS)
    for j in tl.static_range(VECTORS):
        v_j = tl.load(v_ptr + cc * VECTORS + j, mask=cc < cols, other=0.0)
        tl.store(base + ii * VECTORS + j, tl.sum(acc_cos * v_j[:, None], axis=0))
        tl.store(base + VECTORS * VECTORS + ii * VECTORS + j, tl.sum(acc_sin * v_j[:, None], axis=0))


def project(flat: torch.Tensor, u: torch.Tensor, v: torch.Tensor, cols: int, omega: float) -> torch.Tensor:
    """(2, VECTORS * VECTORS) float64, as :func:`kbv.sketch._project` gives for ``exp(i omega flat)``:
    ``flat`` contiguous and one-dimensional (float32, float16 or bfloat16), ``u`` (rows + 1) x
    VECTORS and ``v`` cols x VECTORS in float64 on its device (the last row of ``u`` for the
    leftover elements)."""
    vectors = v.shape[1]
    rows_total = u.shape[0]
    grid = (triton.cdiv(cols, BLOCK_COLS), triton.cdiv(rows_total, ROWS_PER_PROGRAM))
    parts = _empty((grid[1], grid[0], 2, vectors, vectors), dtype=torch.float64, device=flat.device)
    _sketch_part[grid](
        flat,
        _contiguous(u),
        _contiguous(v),
        parts,
        flat.numel(),
        cols,
        rows_total,
        float(omega),
        BLOCK_C=BLOCK_COLS,  # sizes are arguments: one compilation per output dtype
        ROWS=ROWS_PER_PROGRAM,
        VECTORS=vectors,
        INTERPRETED=_INTERPRETED,
    )
    return _reshape(_sum(parts, dim=(0, 1)), (2, vectors * vectors))
