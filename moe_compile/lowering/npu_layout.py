"""Weight layouts for the NPU ops, made once per weight and reused on every call.

The expert weights themselves need no change: ``npu_grouped_matmul`` takes ``w13 [E, H, 2I]`` and
``w2 [E, I, H]`` as they come, including as transposed views of HF's ``[E, 2I, H]`` storage (notes
§2.4), and MindIE-SD's unquantised path does no FRACTAL_NZ cast either (§1.7; NZ pays off for the
int8 paths, which this lowering does not take). What does need a derived tensor is the GEMM bias:
torch_npu wants an fp32 bias with bf16 activations (§1.7, and TorchAir's converter fills a missing
bias as fp32). That cast is cached here.

The cache is keyed on the weight's base tensor identity plus its view geometry, and an entry is
recomputed when the tensor's version counter moves (an in-place weight update). Entries die with
the base tensor. While tracing (fake / functional tensors, make_fx, Dynamo) nothing is cached: the
cast becomes one graph node.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch


def _is_tracing(t: torch.Tensor) -> bool:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return True  # FakeTensor, FunctionalTensor, ...
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None or torch.compiler.is_compiling()


class LayoutCache:
    def __init__(self):
        self._entries: dict[tuple, tuple[int, torch.Tensor]] = {}
        self._watched: dict[int, weakref.ref] = {}
        self.misses = 0  # how many derived tensors were built (tests assert reuse)

    def derive(self, t: torch.Tensor, tag: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``make(t)``, computed once per (weight, tag) while ``t`` is unchanged."""
        if _is_tracing(t):
            return make(t)
        base = t._base if t._base is not None else t
        key = (id(base), tag, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        hit = self._entries.get(key)
        if hit is not None and hit[0] == t._version and self._watched.get(id(base), lambda: None)() is base:
            return hit[1]
        value = make(t)
        self.misses += 1
        self._watch(base)
        self._entries[key] = (t._version, value)
        return value

    def _watch(self, base: torch.Tensor) -> None:
        base_id = id(base)
        if base_id in self._watched and self._watched[base_id]() is base:
            return
        entries, watched = self._entries, self._watched

        def forget(ref, base_id=base_id):
            for key in [k for k in entries if k[0] == base_id]:
                del entries[key]
            if watched.get(base_id) is ref:
                del watched[base_id]

        self._forget_stale(base_id)
        self._watched[base_id] = weakref.ref(base, forget)

    def _forget_stale(self, base_id: int) -> None:
        """A dead base whose id was reused: drop what was cached for it."""
        for key in [k for k in self._entries if k[0] == base_id]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def gmm_bias(self, bias_EN: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
        """The bias in the dtype ``npu_grouped_matmul`` wants for ``x_dtype`` activations."""
        want = torch.float32 if x_dtype == torch.bfloat16 else x_dtype
        if bias_EN.dtype == want:
            return bias_EN
        return self.derive(bias_EN, f"gmm_bias:{want}", lambda b: b.to(want))
