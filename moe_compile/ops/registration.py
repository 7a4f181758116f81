"""Our ``torch.library`` ops, registered so that a call pays one Python dispatch, not three.

``torch.library.custom_op`` wraps an op in three Python layers: an autograd kernel that re-dispatches
below autograd, a ``torch._disable_dynamo`` wrapper, and a per-call aliasing check of the result. Each
re-dispatch converts every argument to the dispatcher's values and back, and our ops take up to 28. On
the H200's host, side by side (``benchmarks/probe_graphed_host.py``, runs 2-3 of the twenty-ninth session), a
graphed Qwen3-30B-A3B one-token ``fused_moe`` call costs 102-130 µs this way against 125-153 µs through
``custom_op``; the router op 41-44 against 62-67. At decode sizes without CUDA graphs the host sets the pace.

``op(qualname)`` defines the op from the function's signature (``torch.library.infer_schema``), as
``custom_op`` does, tags it ``pt2_compliant_tag``, and registers:

- the function as its ``CompositeExplicitAutograd`` kernel (what runs under ``inference_mode``, where
  autograd is skipped altogether);
- an ``Autograd`` kernel that calls the function directly when the next key below autograd is a plain
  backend (CPU, CUDA, or ``PrivateUse1``: the NPU) and autograd has nothing to record: ordinary tensors,
  no tensor subclass, dispatch mode or functionalization in the way, and no input that requires grad with
  grad mode on. Anything else takes ``custom_op``'s own path (``make_autograd_impl``): the re-dispatch
  below autograd, so fake tensors, ``make_fx``, functionalization and modes see the op as before, and a
  call that records autograd gets a graph node whose backward is the one ``register_autograd`` gave
  (``ops/autograd.py``: the fused ops), or raises, naming the op, where none was given.

``register_fake`` and ``_init_fn`` work as on a ``CustomOpDef``. ``MOE_COMPILE_DIRECT_DISPATCH=0``
(or ``DIRECT = False``) always takes the re-dispatch below autograd, for side-by-side measurements.
"""
from __future__ import annotations

import os
from typing import Callable

import torch
from torch._library.autograd import make_autograd_impl

DIRECT = os.environ.get("MOE_COMPILE_DIRECT_DISPATCH", "1") != "0"
_LIB = torch.library.Library("moe_compile", "FRAGMENT")  # kept alive: the registrations live as long as it does
_BELOW = torch._C._after_ADInplaceOrView_keyset
_BACKENDS = frozenset({torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA, torch._C.DispatchKey.PrivateUse1})


class _Backward:
    """``make_autograd_impl``'s view of an op's backward: none (backward raises, naming the op) until
    ``Op.register_autograd`` gives one."""

    def __init__(self):
        self._backward_fn = None
        self._setup_context_fn = None


class Op:
    """One registered op: ``op(...)`` calls it through the dispatcher (``torch.ops.moe_compile.<name>``)."""

    def __init__(self, qualname: str, fn: Callable, tags: tuple = ()):
        namespace, _, name = qualname.partition("::")
        if namespace != _LIB.ns or not name.isidentifier():
            raise ValueError(f"op: qualname={qualname!r}; expected '{_LIB.ns}::<name>'.")
        self._qualname, self._name, self._init_fn = qualname, name, fn
        self._backward = _Backward()
        schema = torch.library.infer_schema(fn, mutates_args=())
        _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag, *tags))
        self._opoverload = getattr(getattr(torch.ops, namespace), name).default
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        _LIB.impl(name, self._autograd_kernel(), "Autograd", with_keyset=True)
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__

    def _autograd_kernel(self) -> Callable:
        fn, slow = self._init_fn, make_autograd_impl(self._opoverload, self._backward)
        any_requires_grad, grad_enabled = torch._C._any_requires_grad, torch.is_grad_enabled

        def kernel(keyset, *args, **kwargs):
            if (DIRECT and (keyset & _BELOW).highestPriorityTypeId() in _BACKENDS
                    and not (grad_enabled() and any_requires_grad(*args, **kwargs))):
                return fn(*args, **kwargs)
            return slow(keyset, *args, **kwargs)

        return kernel

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(self._qualname, fake, lib=_LIB)
        return fake

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """As ``torch.library.register_autograd``: ``setup_context(ctx, inputs, output)`` saves what
        ``backward(ctx, grad)`` needs; calls that record autograd then get this backward."""
        self._backward._backward_fn, self._backward._setup_context_fn = backward, setup_context

    def __call__(self, *args, **kwargs):
        return self._opoverload(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<moe_compile op {self._qualname}>"


def op(qualname: str, tags: tuple = ()) -> Callable[[Callable], Op]:
    """Decorator: ``@op("moe_compile::name")`` over the op's Python body (see the module doc); ``tags``: more
    ``torch.Tag``s than ``pt2_compliant_tag``."""
    return lambda fn: Op(qualname, fn, tags)


__all__ = ["DIRECT", "Op", "op"]
