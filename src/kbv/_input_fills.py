"""How each hidden input distribution fills a tensor (``kbv.inputs`` picks the distribution, draws
the seed and calls these): every fill writes a freshly allocated tensor on the original's device.

Imported inside the worker process before any candidate code, like ``kbv.inputs``: it depends only
on the standard library and torch.
"""

from __future__ import annotations

import math
import random

import torch

from kbv.seeds import derive_seed

#: Exponent range (base 10) of the ``wide`` magnitudes: log-uniform over [1e-4, 1e4].
WIDE_EXPONENTS = (-4.0, 4.0)
#: Common offset of ``shifted`` (times a random sign); the spread around it is standard normal.
SHIFT_OFFSET = 1e3
#: Number of contiguous chunks (along the flattened tensor) of ``blockwise``: a head and a tail chunk
#: that keep the original draw, and up to ``BLOCKWISE_CHUNKS - 2`` altered chunks between them.
BLOCKWISE_CHUNKS = 8
#: ``sparse`` alters ``clamp(numel // SPARSE_PER, SPARSE_MIN, SPARSE_MAX)`` elements (never more than an
#: eighth of the tensor). At least 8, because each altered value has a random sign: with k of them a
#: sign-sensitive shortcut escapes a draw with probability 2**-k when every one comes out positive.
SPARSE_PER = 4096
SPARSE_MIN = 8
SPARSE_MAX = 64

#: ``spiked`` magnitudes never exceed the dtype's largest value to this power, so a fourth power of
#: one stays finite (float32: 1.4e9; float16: 16).
SPIKED_MAX_ROOT = 4


def _rms(x: torch.Tensor) -> torch.Tensor:
    """RMS of ``x`` as a 0-d float32 tensor on its device; 1 when zero or non-finite (no host sync)."""
    n = max(x.numel(), 1)
    norm = torch.linalg.vector_norm(x, dtype=torch.float32) if x.numel() else torch.zeros((), device=x.device)
    rms = norm / math.sqrt(n)
    return torch.where(torch.isfinite(rms) & (rms > 0), rms, torch.ones_like(rms))


def _fill_signed(y: torch.Tensor, gen: torch.Generator, scale: torch.Tensor | float, positive: bool) -> None:
    y.normal_(0.0, 1.0, generator=gen)
    if positive:
        y.abs_()
    y.mul_(scale)


def _fill_wide(
    y: torch.Tensor,
    gen: torch.Generator,
    positive: bool,
    lo: float = WIDE_EXPONENTS[0],
    hi: float = WIDE_EXPONENTS[1],
) -> None:
    if positive:
        y.uniform_(lo, hi, generator=gen).mul_(math.log(10.0)).exp_()
        return
    # One uniform draw in (-1, 1) carries both the sign and the exponent. The magnitudes are made a
    # chunk at a time: made whole, they were a third input's worth beside the problem's own draw
    # and this one (16 GiB more for 45_Average_Pooling_2D's input).
    y.uniform_(-1.0, 1.0, generator=gen)
    flat = y.view(-1)
    for start in range(0, flat.numel(), WIDE_CHUNK):
        part = flat[start : start + WIDE_CHUNK]
        mag = part.abs().mul_(hi - lo).add_(lo).mul_(math.log(10.0)).exp_()
        part.copy_(mag.copysign_(part))


#: Elements of a ``wide`` fill's magnitudes made at once (64 MiB of float32): a multiple of every
#: SIMD width, so a chunk's elements take the same vector or scalar path as in one pass.
WIDE_CHUNK = 1 << 24


def _fill_shifted(
    y: torch.Tensor, gen: torch.Generator, positive: bool, offset: float = SHIFT_OFFSET
) -> None:
    sign = 1.0
    if not positive:
        coin = torch.empty(1, device=y.device).uniform_(0.0, 1.0, generator=gen)
        sign = 1.0 if float(coin) < 0.5 else -1.0  # one tiny host sync per tensor
    y.normal_(0.0, 1.0, generator=gen)
    y.add_(sign * offset)
    if positive:
        y.abs_()


_BLOCK_MODES = ("large_negative", "shifted", "wide", "tiny", "signed", "negated")


def _fill_block(
    mode: str,
    seg: torch.Tensor,
    orig: torch.Tensor,
    gen: torch.Generator,
    scale: torch.Tensor,
    positive: bool,
) -> None:
    if mode == "large_negative":
        _fill_wide(seg, gen, positive=True, lo=1.0, hi=3.0)
        if not positive:
            seg.neg_()
    elif mode == "shifted":
        _fill_shifted(seg, gen, positive)
    elif mode == "wide":
        _fill_wide(seg, gen, positive)
    elif mode == "tiny":
        _fill_signed(seg, gen, 1e-3, positive)
    elif mode == "signed":
        _fill_signed(seg, gen, scale, positive)
    else:  # negated original
        seg.copy_(orig.abs() if positive else orig.neg())


def _blockwise_bounds(n: int, rng: random.Random) -> tuple[int, int, list[int]]:
    """``(head, tail, bounds)``: the head chunk is ``[0, head)``, the tail chunk ``[n - tail, n)``, and
    ``bounds`` cut the middle into up to ``BLOCKWISE_CHUNKS - 2`` chunks of similar size (each cut
    jittered by at most a quarter of a chunk, so no altered chunk is tiny)."""
    head = max(1, int(n * rng.uniform(1 / 16, 1 / 8)))
    tail = max(1, int(n * rng.uniform(1 / 16, 1 / 8))) if n >= 3 else 0
    lo, hi = head, n - tail
    parts = min(BLOCKWISE_CHUNKS - 2, hi - lo)
    if parts <= 0:
        return head, tail, [lo, hi]
    width = (hi - lo) / parts
    cuts = [lo + round(width * (i + rng.uniform(-0.25, 0.25))) for i in range(1, parts)]
    bounds = sorted({lo, hi, *(min(max(c, lo), hi) for c in cuts)})
    return head, tail, bounds


def _fill_blockwise(
    y: torch.Tensor, x: torch.Tensor, gen: torch.Generator, seed: int, positive: bool
) -> None:
    flat = y.view(-1)
    orig = x.reshape(-1)
    n = flat.numel()
    flat.copy_(orig)
    if positive:
        flat.abs_()
    if n <= 1:
        return
    rng = random.Random(derive_seed(seed, "blockwise-layout", n))
    _, _, bounds = _blockwise_bounds(n, rng)
    altered = len(bounds) - 1
    modes = list(_BLOCK_MODES)
    rng.shuffle(modes)
    where = modes.index("large_negative")
    if where >= altered:  # fewer chunks than modes: one of them is still the obviously different one
        spot = rng.randrange(altered)
        modes[spot], modes[where] = modes[where], modes[spot]
    scale = _rms(x)
    for k in range(altered):
        a, b = bounds[k], bounds[k + 1]
        if b > a:
            _fill_block(modes[k % len(modes)], flat[a:b], orig[a:b], gen, scale, positive)
    # Every last-dim row starts and ends like the original draw too (per-row samplers are caught as well).
    width = y.shape[-1] if y.dim() >= 2 else 0
    if width >= 2:
        keep = max(1, width // 8)
        rows = y.view(-1, width)
        source = x.reshape(-1, width)
        ends = [slice(0, keep)] + ([slice(width - keep, width)] if width >= 3 else [])
        for cols in ends:
            part = source[:, cols]
            rows[:, cols].copy_(part.abs() if positive else part)


def _sparse_count(n: int) -> int:
    return min(SPARSE_MAX, max(SPARSE_MIN, n // SPARSE_PER), max(1, n // 8), n)


def _original_but_a_few(
    y: torch.Tensor, x: torch.Tensor, seed: int, positive: bool, layout: str
) -> tuple[torch.Tensor, torch.Tensor, random.Random] | None:
    """``y`` (flattened) holding the original draw, the seeded positions ``sparse`` and ``spiked``
    alter (``_sparse_count`` of them, drawn in O(k) whatever the size), and the layout's generator
    for any further choice; None for an empty tensor."""
    flat = y.view(-1)
    n = flat.numel()
    flat.copy_(x.reshape(-1))
    if positive:
        flat.abs_()
    if n == 0:
        return None
    rng = random.Random(derive_seed(seed, layout, n))
    positions = sorted(rng.sample(range(n), _sparse_count(n)))
    return flat, torch.tensor(positions, dtype=torch.long, device=y.device), rng


def _fill_sparse(y: torch.Tensor, x: torch.Tensor, gen: torch.Generator, seed: int, positive: bool) -> None:
    picked = _original_but_a_few(y, x, seed, positive, "sparse-layout")
    if picked is None:
        return
    flat, positions, _ = picked
    values = torch.empty(len(positions), dtype=y.dtype, device=y.device)
    _fill_wide(values, gen, positive)
    flat[positions] = values


def _fill_spiked(
    y: torch.Tensor, x: torch.Tensor, gen: torch.Generator, seed: int, positive: bool, dtype: torch.dtype
) -> None:
    """``sparse``'s count of values at positions of its own, sized to the tensor: ``sparse``'s 64
    values of up to 1e4 are about 1e-4 of a Huber mean over 1e9 elements, so a kernel that skips
    half of the elements stays inside the reduction floor there (96_HuberLoss on the H200); these
    carry about half of the sum at any size."""
    picked = _original_but_a_few(y, x, seed, positive, "spiked-layout")
    if picked is None:
        return
    flat, positions, rng = picked
    sign = 1.0 if positive or rng.random() < 0.5 else -1.0
    limit = torch.finfo(dtype).max ** (1.0 / SPIKED_MAX_ROOT)
    magnitude = min(float(_rms(x)) * flat.numel() / len(positions), limit)  # one host sync per tensor
    values = torch.empty(len(positions), dtype=y.dtype, device=y.device).uniform_(0.5, 1.0, generator=gen)
    flat[positions] = values.mul_(sign * magnitude)


def _apply_domain(y: torch.Tensor, domain: str) -> torch.Tensor:
    if domain in ("any", "positive"):
        if domain == "positive":
            tiny = torch.finfo(y.dtype).tiny
            y.clamp_(min=tiny)
        return y
    if domain == "unit-interval":
        y.div_(y + 1.0)
        eps = torch.finfo(y.dtype).eps
        return y.clamp_(min=torch.finfo(y.dtype).tiny, max=1.0 - eps / 2)
    # probabilities: non-negative values renormalised along the last dim
    if y.dim() == 0:
        return y.fill_(1.0)
    total = y.sum(dim=-1, keepdim=True)
    return y.div_(torch.where(total > 0, total, torch.ones_like(total)))
