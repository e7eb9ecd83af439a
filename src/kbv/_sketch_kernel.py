"""The first half of a sketch's projections in one Triton kernel: ``W = phi(X) V`` for the cosine
and the sine part at once, reading each output element once (4 bytes for a float32 output) instead
of the 48 bytes an element of :func:`kbv.sketch._project`'s torch path (a scaled copy, cosine and
sine into float64 temporaries, a float64 matrix product). ``U^T W`` (rows x 16 numbers) stays in
torch, in float64.

Numerics are the torch path's: ``omega * x`` in float32 (``omega`` is a power of two: exact),
cosine and sine in float32 by libdevice (within 2 ulp: inside ``FEATURE_ROUNDING``), every product
and sum in float64, never a tensor-core product (an fp32 matrix product errs by more than a
tolerance and follows the candidate's TF32 flags). Only the order of the float64 sums differs.

Not used until it has been measured on a GPU (:data:`kbv.sketch.FUSED_ON_CUDA`); the tests run it
under Triton's interpreter on the CPU (``TRITON_INTERPRET=1``) against the torch path.
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

#: Rows of the matrix view per program, and columns per step of a program's loop.
BLOCK_ROWS = 4
BLOCK_COLS = 64


@triton.jit
def _phi_times_v(
    x_ptr,
    v_ptr,
    w_ptr,
    n,
    rows_total,
    omega,
    COLS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    VECTORS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """``w[r] = (cos(omega x[r, :]) @ v, sin(omega x[r, :]) @ v)`` for a block of rows, in float64."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < rows_total
    jj = tl.arange(0, VECTORS)
    acc_cos = tl.zeros((BLOCK_R, VECTORS), dtype=tl.float64)
    acc_sin = tl.zeros((BLOCK_R, VECTORS), dtype=tl.float64)
    for c0 in range(0, COLS, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        offs = rows[:, None].to(tl.int64) * COLS + cc[None, :]
        mask = row_ok[:, None] & (cc[None, :] < COLS) & (offs < n)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        angle = x * omega
        if INTERPRETED:
            cos, sin = tl.cos(angle), tl.sin(angle)
        else:
            cos, sin = libdevice.cos(angle), libdevice.sin(angle)
        mapped_cos = tl.where(mask, cos, 0.0).to(tl.float64)
        mapped_sin = tl.where(mask, sin, 0.0).to(tl.float64)
        v = tl.load(v_ptr + cc[:, None] * VECTORS + jj[None, :], mask=cc[:, None] < COLS, other=0.0)
        acc_cos += tl.sum(mapped_cos[:, :, None] * v[None, :, :], axis=1)
        acc_sin += tl.sum(mapped_sin[:, :, None] * v[None, :, :], axis=1)
    out = w_ptr + rows[:, None] * (2 * VECTORS) + jj[None, :]
    tl.store(out, acc_cos, mask=row_ok[:, None])
    tl.store(out + VECTORS, acc_sin, mask=row_ok[:, None])


def project(flat: torch.Tensor, u: torch.Tensor, v: torch.Tensor, cols: int, omega: float) -> torch.Tensor:
    """(2, VECTORS * VECTORS) float64, as :func:`kbv.sketch._project` gives for ``exp(i omega flat)``:
    ``flat`` contiguous and one-dimensional (float32, float16 or bfloat16), ``u`` (rows + 1) x
    VECTORS and ``v`` cols x VECTORS in float64 on its device (the last row of ``u`` for the
    leftover elements)."""
    vectors = v.shape[1]
    rows_total = u.shape[0]
    w = torch.empty((rows_total, 2 * vectors), dtype=torch.float64, device=flat.device)
    grid = ((rows_total + BLOCK_ROWS - 1) // BLOCK_ROWS,)
    _phi_times_v[grid](
        flat,
        v.contiguous(),
        w,
        flat.numel(),
        rows_total,
        float(omega),
        COLS=cols,  # a power of two: one compilation per size class, kept in Triton's cache
        BLOCK_R=BLOCK_ROWS,
        BLOCK_C=BLOCK_COLS,
        VECTORS=vectors,
        INTERPRETED=_INTERPRETED,
    )
    both = torch.stack((u.T @ w[:, :vectors], u.T @ w[:, vectors:]))
    return both.reshape(2, vectors * vectors)
