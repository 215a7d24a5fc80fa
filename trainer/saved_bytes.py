"""mem.activations of the step records, measured: the bytes autograd keeps from a forward for its
backward. `SavedBytes` around a micro-step's forward and loss sees every tensor autograd saves
(saved-tensor hooks, on any device), counts each storage once and leaves parameters out (FSDP2's
and ZeRO-3's gathered ones are parameters too, and so are their casts and views). Under activation
checkpointing, torch's own hooks take the checkpointed blocks' saves, so only what is really kept
is seen: the blocks' inputs. Tensors a custom autograd function keeps on its context rather than
saving them are found by walking the loss's graph.

The planner counts with the same class on the meta device (trainer/plan/activations.py).
"""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# Autograd nodes that only cast or re-view one tensor: a saved tensor reached through them from a
# parameter is that parameter (autocast's copies of weights, the transposed weight of a matmul).
_CAST_OR_VIEW = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                 "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "AliasBackward0",
                 "UnsafeViewBackward0", "ReshapeAliasBackward0"}


def is_parameter(t: torch.Tensor) -> bool:
    if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # a frozen weight's view has no grad_fn
        return True
    node = t.grad_fn
    while node is not None and type(node).__name__ in _CAST_OR_VIEW:
        inputs = [n for n, _ in node.next_functions if n is not None]
        node = inputs[0] if len(inputs) == 1 else None
    return node is not None and type(node).__name__ == "AccumulateGrad" and isinstance(node.variable, nn.Parameter)


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself: views of one storage share it, also on meta


class SavedBytes:
    """Within: the bytes of every storage autograd saves for backward, once each, parameters left
    out. A detached alias of a parameter counts: ZeRO-3's release does not free it."""

    def __init__(self):
        self.storages: dict[int, int] = {}  # storage -> bytes
        self.elements: dict[int, int] = {}
        self.where: dict[int, str] = {}  # storage -> "layers" (saved inside a block) or "outside"
        # storage -> the tensors saved of it, weakly: a storage freed within (a graph dropped) is
        # not kept, and its address may come back as another storage's
        self.saved: dict[int, list[weakref.ref]] = {}
        self.part = "outside"
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        if not is_parameter(t):
            self._count(t)
        return t

    def _count(self, t: torch.Tensor) -> None:
        # a DTensor (strategy.tp) has a storage of its whole shape, held nowhere: a rank holds its local tensor
        held = t._local_tensor if isinstance(t, DTensor) else t
        key = storage_key(held)
        if key in self.storages and not self._alive(key):
            self._forget(key)
        if key not in self.storages:
            self.storages[key] = held.untyped_storage().nbytes()
            self.elements[key] = self.storages[key] // held.element_size()
            self.where[key] = self.part
            self.saved[key] = []
        self.saved[key].append(weakref.ref(t))

    def _alive(self, key: int) -> bool:
        return any(ref() is not None for ref in self.saved[key])

    def _forget(self, key: int) -> None:
        for counted in (self.storages, self.elements, self.where, self.saved):
            del counted[key]

    def kept_by_functions(self, output: torch.Tensor) -> None:
        """Tensors that custom autograd functions in `output`'s graph keep as attributes of their
        context (not through save_for_backward, so no hook saw them); and no more the storages whose
        saved tensors are gone (saved by a graph the forward dropped)."""
        seen, todo = set(), [output.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            for value in getattr(node, "__dict__", {}).values():
                if isinstance(value, torch.Tensor) and not is_parameter(value):
                    self._count(value)
            todo.extend(n for n, _ in node.next_functions)
        for key in [k for k in self.storages if not self._alive(k)]:
            self._forget(key)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def bytes_of(self, part: str, elements_at_least: int = 0) -> int:
        return sum(n for k, n in self.storages.items() if self.where[k] == part and self.elements[k] >= elements_at_least)
