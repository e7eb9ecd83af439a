"""Several calls' outputs handed to the parent in one reply, each call's as soon as it returns
(:class:`Staged`, for the probes that call the model more than once); the wire format is
:mod:`kbv.handoff`'s, whose :func:`kbv.handoff.receive` reads it."""

from __future__ import annotations

from typing import Any

import torch

from kbv import handoff as _handoff

# Bound at import, before a worker imports the candidate (as kbv.child.probes binds its own).
_plain_copy = _handoff.plain_copy
_hand_over = _handoff.hand_over
_fds_to_send = _handoff.fds_to_send
_hand_over_copies = _handoff.hand_over_copies
_synchronize = torch.cuda.synchronize


class Staged:
    """Several calls' outputs handed over in one reply (a probe's calls), each call's as soon as it
    has returned. With ``cuda_vmm`` (a candidate on a GPU) each call's outputs are copied at once
    into an exported allocation of their own and nothing else of them is kept: a plain copy of each
    call held until all were exported beside them was twice the outputs in the candidate's memory
    (the cache probe's four calls: eight outputs at its peak, 64 GiB for 87_conv_pointwise_2D's
    8 GiB output, more than an 80 GB H100 left the candidate). With any other transport a plain
    copy of each call is kept and all go in one :func:`kbv.handoff.hand_over` at the end."""

    def __init__(self, device: torch.device, path: str, keep: list[Any], transport: str) -> None:
        self.device, self.path, self.keep, self.transport = device, path, keep, transport
        self.sizes: list[int] = []
        self._copies: list[Any] = []
        self._allocations: list[dict[str, int]] = []
        self._items: list[dict[str, Any] | None] = []

    def _exports(self) -> bool:
        return _hand_over_copies(self.device, self.transport)

    def add(self, outputs: list[Any]) -> None:
        """One call's outputs, right after the call returned and was synchronised."""
        self.sizes.append(len(outputs))
        if not self._exports():
            self._copies.extend(_plain_copy(o, self.device) for o in outputs)
            return
        # The export is the copy: the call's own tensors are read once, into the allocation.
        plain = [_plain_copy(o, self.device, copy=False) for o in outputs]
        tensors = [t for t in plain if t is not None]
        if not tensors:
            self._items.extend(None for _ in plain)
            return
        from kbv import _vmm

        _synchronize()
        exported, offsets = _vmm.export(tensors, self.device.index if self.device.index is not None else 0)
        allocation = len(self._allocations)
        self._allocations.append({"fd_index": len(_fds_to_send(self.keep)), "size": exported.size})
        self.keep.append(exported)
        placed = iter(zip(tensors, offsets, strict=True))
        for value in plain:
            if value is None:
                self._items.append(None)
                continue
            tensor, offset = next(placed)
            self._items.append(
                {
                    "dtype": str(tensor.dtype),
                    "shape": list(tensor.shape),
                    "offset_bytes": offset,
                    "allocation": allocation,
                }
            )

    def handed(self) -> dict[str, Any]:
        """``{sizes, outputs}``: the calls' output counts and their hand-over, as a probe replies."""
        if not self._exports():
            return {
                "sizes": self.sizes,
                "outputs": _hand_over(self._copies, self.device, self.path, self.keep, self.transport),
            }
        return {
            "sizes": self.sizes,
            "outputs": {"transport": "cuda_vmm", "allocations": self._allocations, "items": self._items},
        }
