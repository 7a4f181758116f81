"""How many bytes autograd holds for the backward: shared by the training benchmarks and tests."""
from __future__ import annotations

import torch


class SavedBytes:
    """Within ``with SavedBytes(model) as held:``, every tensor autograd saves for backward is counted: ``held.bytes``
    is the size of the storages saved, each storage once, the model's parameters left out (a ``saved_tensors_hooks``
    pack hook that keeps the tensor as it is)."""

    def __init__(self, model: torch.nn.Module):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self._params:
            self._seen[ptr] = max(self._seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
