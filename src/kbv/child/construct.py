"""Constructing a model whose parameters are the given ones from the moment ``__init__`` makes them.

A model may derive state from its parameters at construction: a transposed or packed weight, a
BatchNorm folded into a convolution. Loading a state dict after ``__init__`` leaves that state
computed from the values ``__init__`` drew, so a candidate that keeps the reference's names but
caches ``W^T`` would be judged on stale weights. Here the drawn values are put in place while the
model is being built:

- :func:`construct_recording` builds a model normally and notes, for each parameter or buffer
  registration in the order ``__init__`` made them (torch's global registration hooks), the name it
  ends up under in the finished model;
- :func:`construct_with_state` builds it again: the k-th registration gets the drawn value of the
  k-th name (its shape must match), and every in-place write to a given tensor while ``__init__``
  runs (``reset_parameters``, ``nn.init``, ``.uniform_``, ``x[...] = v``) is undone at once by a
  ``TorchFunctionMode``, so whatever ``__init__`` computes from its parameters it computes from the
  drawn values. The finished model's state dict is compared with the drawn one; where they differ
  (``__init__`` replaced a tensor, the order changed) the caller loads the state dict afterwards,
  as before, and says so.

Registration order is matched, not names: a submodule's parameters are registered before the
submodule is attached, when their final name is not yet known.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as _module
from torch.overrides import TorchFunctionMode

#: In-place operations whose names do not end in ``_`` (``x[...] = v``, ``x.data = y``).
_WRITES = frozenset({"__setitem__", "__set__", "__ior__", "__iand__", "__ixor__"})


def construct_recording(construct: Callable[[], Any]) -> tuple[Any, list[str | None]]:
    """``construct()`` and, per registration it made, the state-dict name of what it registered
    (None: replaced later, a ``None`` entry, or not part of the finished model)."""
    registered: list[Any] = []

    def note(_module_: Any, _name: str, value: Any) -> None:
        registered.append(value)

    with _registration_hooks(note):
        model = construct()
    return model, _final_names(model, registered)


def construct_with_state(
    construct: Callable[[], Any], order: list[str | None], state: dict[str, torch.Tensor]
) -> tuple[Any, bool]:
    """``construct()`` with ``state``'s values given to the registrations ``order`` names, and
    whether the finished model holds exactly ``state`` (False: the caller must load it)."""
    given = _Given(order, state)
    with _registration_hooks(given.registered), _KeepGiven(given):
        model = construct()
    return model, given.ok and holds_state(model, state)


def holds_state(model: Any, state: dict[str, torch.Tensor]) -> bool:
    """Whether ``model``'s state dict has exactly ``state``'s names and values (each compared in the
    model's own dtype and device)."""
    if not isinstance(model, torch.nn.Module):
        return False
    own = model.state_dict()
    if set(own) != set(state):
        return False
    for name, value in own.items():
        drawn = state[name]
        if value.shape != drawn.shape:
            return False
        if not torch.equal(value, drawn.to(device=value.device, dtype=value.dtype)):
            return False
    return True


class _Given:
    """The registrations of a construction, answered with the drawn values in their order."""

    def __init__(self, order: list[str | None], state: dict[str, torch.Tensor]) -> None:
        self.order = order
        self.state = state
        self.count = 0
        self.ok = True
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the model's tensor, its value)

    def registered(self, _module_: Any, _name: str, value: Any) -> None:
        index = self.count
        self.count += 1
        key = self.order[index] if index < len(self.order) else None
        if not isinstance(value, torch.Tensor) or key is None or key not in self.state:
            return
        drawn = self.state[key]
        if value.shape != drawn.shape:
            self.ok = False  # built otherwise than when the order was recorded
            return
        with torch.no_grad():
            value.copy_(drawn)
        self.tensors.append((value, drawn))

    def restore(self, written: torch.Tensor) -> None:
        """Put the drawn values back into every given tensor ``written`` is or shares memory with."""
        where = _storage(written)
        for tensor, drawn in self.tensors:
            if (tensor is written or (where and _storage(tensor) == where)) and tensor.shape == drawn.shape:
                with torch.no_grad():
                    tensor.copy_(drawn)


class _KeepGiven(TorchFunctionMode):
    """While ``__init__`` runs: an in-place write to a given tensor is undone as soon as it returns."""

    def __init__(self, given: _Given) -> None:
        super().__init__()
        self.given = given

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)  # this mode is off inside its own handler
        written = _written(func, args, kwargs)
        if written is not None and self.given.tensors:
            self.given.restore(written)
        return result


def _written(func: Any, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name in _WRITES
    if not in_place:
        return None
    # ``nn.init`` functions pass their tensor by keyword (``kaiming_uniform_(tensor=w, ...)``).
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
    return first if isinstance(first, torch.Tensor) else None


def _storage(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


class _registration_hooks:
    """``hook(module, name, value)`` on every parameter and buffer registration in this process."""

    def __init__(self, hook: Callable[[Any, str, Any], None]) -> None:
        self.hook = hook
        self.handles: list[Any] = []

    def __enter__(self) -> None:
        self.handles = [
            _module.register_module_parameter_registration_hook(self.hook),
            _module.register_module_buffer_registration_hook(self.hook),
        ]

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


def _final_names(model: Any, registered: list[Any]) -> list[str | None]:
    if not isinstance(model, torch.nn.Module):
        return [None] * len(registered)
    named: dict[int, str] = {}
    pairs = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    for name, tensor in pairs:
        named.setdefault(id(tensor), name)
    return [named.get(id(value)) if isinstance(value, torch.Tensor) else None for value in registered]
