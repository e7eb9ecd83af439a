"""Freed memory filled with NaN before a poisoned call (the ``unwritten_output`` check's probe,
``kbv.child.probes.probe_poison``), so that ``torch.empty`` in a candidate hands back NaN, not
stale data: stale data may be an earlier copy of the same inputs, which for an identity on them
(ReLU on ``torch.rand``) is the right answer."""

from __future__ import annotations

import torch

__all__ = ["POISON_BYTES", "poison_freed_memory"]

#: Bytes of NaN written into freed allocator memory before a poisoned call (per block size).
POISON_BYTES = (64 * 1024, 1 << 20, 16 << 20)
#: Expected outputs up to this many bytes get blocks of their own size poisoned (four of each).
EXACT_MAX = 256 << 20
#: glibc's largest dynamic mmap threshold on 64-bit Linux (``DEFAULT_MMAP_THRESHOLD_MAX``).
_MMAP_THRESHOLD_MAX = 32 << 20


def poison_freed_memory(device: torch.device, output_nbytes: list[int] | tuple[int, ...] = ()) -> None:
    """Fill blocks of freed allocator memory with NaN, so ``torch.empty`` hands back NaN, not stale data.

    Blocks of :data:`POISON_BYTES` and of exactly the expected outputs' sizes (in the float64
    truth's bytes: at least the fp32 output's, and half of it) are made, filled and freed. On the
    CPU the allocator returns small blocks to the heap, where the next allocation of that size class
    finds them. On CUDA they stay in the caching allocator, and so does every block an earlier
    request freed: those are filled too (:func:`_fill_cached_free_blocks`).
    """
    sizes = [n for n in output_nbytes if 0 < n <= EXACT_MAX]
    exact = [m for n in sizes for m in (n, n // 2)]
    if device.type == "cpu":
        _raise_mmap_threshold(max([POISON_BYTES[-1], *(n for n in exact if n <= _MMAP_THRESHOLD_MAX)]))
    blocks = [_nan_block(n, device) for n in POISON_BYTES]
    for _ in range(4):
        blocks.extend(_nan_block(n, device) for n in (*POISON_BYTES[:1], *exact))
    del blocks
    if device.type == "cuda":
        _fill_cached_free_blocks(device)


def _nan_block(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.full((max(nbytes // 4, 1),), float("nan"), dtype=torch.float32, device=device)


def _fill_cached_free_blocks(device: torch.device) -> None:
    """Every block the CUDA caching allocator holds free for the current stream, filled with NaN.

    A candidate's output larger than :data:`EXACT_MAX` is served from such a block, and it may hold
    an earlier request's copy of the same draw: ``torch.empty_like`` of a 512 MiB ReLU output passed
    the poisoned runs on an H100 that way (2026-12-07, ``gpu_unwritten_output``). Each free block
    is taken back by asking for exactly its size (block sizes are multiples of 512 bytes, as the
    allocator rounds requests, and it hands back the smallest free block that fits), largest first,
    so no block is split and nothing is newly reserved; the fill costs one memset of what is free.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index).cuda_stream
    sizes = free_block_sizes(torch.cuda.memory_snapshot(), index, stream)
    held = [_nan_block(n, device) for n in sizes]
    del held


def free_block_sizes(snapshot: list[dict], device_index: int, stream: int) -> list[int]:
    """The sizes of the free blocks in ``snapshot`` (``torch.cuda.memory_snapshot()``) that a
    request on ``stream`` of ``device_index`` can take back whole, largest first."""
    return sorted(
        (
            int(block["size"])
            for segment in snapshot
            if segment.get("device") == device_index and segment.get("stream", stream) == stream
            for block in segment.get("blocks", ())
            if block.get("state") == "inactive" and _served_by_its_pool(segment, int(block["size"]))
        ),
        reverse=True,
    )


#: The CUDA caching allocator's largest request served from its small pool (``kSmallSize``).
_SMALL_POOL_MAX = 1 << 20


def _served_by_its_pool(segment: dict, nbytes: int) -> bool:
    """Whether a request of ``nbytes`` goes to the pool of ``segment``: a wholly free 2 MiB segment
    of the small pool is one block no request can take back (a 2 MiB request goes to the large
    pool, which would reserve new memory for it)."""
    small = segment.get("segment_type") == "small"
    return (nbytes <= _SMALL_POOL_MAX) == small


def _raise_mmap_threshold(nbytes: int) -> None:
    """Allocate and free ``nbytes`` without touching them, so the poison's blocks come from the heap.

    glibc serves an allocation at or above its mmap threshold (128 KiB at first) with fresh pages,
    and unmaps it when freed; freeing such a block raises the threshold to its size (up to 32 MiB)
    and the trim threshold to twice that. Without this, the 16 MiB block of a worker's first
    poisoned run is such a block: its pages are faulted in and filled only to be unmapped, its NaN
    lost, and the second run's copy grows the heap by 16 MiB, faulted in again (about 20 ms of a
    worker's first poison, measured 2026-12-06 with one thread, against about 11 ms with it). An
    untouched block costs an mmap and a munmap, no page; after it the filled blocks, up to this
    size, are heap memory that stays when freed (while the heap's free top is under the trim
    threshold), where the candidate's next allocation of that size looks first. Blocks over 32 MiB
    are mapped and unmapped whatever is done here."""
    torch.empty(max(nbytes, 1), dtype=torch.uint8)
