"""``emulated_npu()``: run the NPU lowering on CPU against plain-torch versions of the torch_npu ops.

::

    with emulated_npu(poison=True) as npu:
        out = fused_moe(x, logits, E, k, w13, w2, lowering="npu")
    assert npu.calls["npu_grouped_matmul"] == 2

Inside the context, ``import torch_npu`` gives a stand-in module whose ``npu_*`` attributes are the
``torch.ops.npu.*`` ops defined by :mod:`moe_compile.testing.npu_library`, so code calls them exactly
as on a device and traced graphs hold the same nodes. On exit the ops are deleted and
``sys.modules`` is restored. With ``poison=True`` every value the docs call undefined is NaN (or an
out-of-range integer), so a lowering that reads one shows it.

It refuses to start when a real torch_npu is imported or importable: the stand-in must never shadow
the real ops (notes §4.4).
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections import Counter
from dataclasses import dataclass, field

import torch

from moe_compile.testing import npu_library

EMULATED_TORCH_NPU_VERSION = "2.14.0"  # the torch_npu whose documented semantics are emulated
_MARKER = "__moe_compile_emulated__"
_active: "EmulatedNpu | None" = None


@dataclass
class EmulatedNpu:
    """What ``emulated_npu()`` yields: the op call counts (by op name) and the poison setting."""

    poison: bool
    calls: Counter = field(default_factory=Counter)
    module: types.ModuleType | None = None

    @property
    def op_names(self) -> tuple[str, ...]:
        return tuple(npu_library.SCHEMAS)


def is_emulated_torch_npu(module) -> bool:
    """Whether ``module`` is the emulation's stand-in rather than the real torch_npu."""
    return bool(getattr(module, _MARKER, False))


def npu_unavailable() -> str | None:
    """Why no real NPU is usable here, or None (the check and profile tools' ``--device npu`` and
    ``selfcheck --device npu`` ask this before anything touches the device)."""
    try:
        import torch_npu
    except Exception as exc:  # ImportError, or CANN libraries missing
        return f"torch_npu cannot be imported ({type(exc).__name__}: {exc})"
    if is_emulated_torch_npu(torch_npu):
        return "only the CPU emulation of torch_npu (emulated_npu) is active, no real NPU"
    if not (hasattr(torch, "npu") and torch.npu.is_available()):
        return "torch_npu is imported but torch.npu.is_available() is False (no NPU visible)"
    return None


def real_torch_npu_present() -> str | None:
    """Why a real torch_npu is in reach (imported or importable), or None."""
    loaded = sys.modules.get("torch_npu")
    if loaded is not None:
        return None if is_emulated_torch_npu(loaded) else "torch_npu is already imported"
    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        spec = None
    return None if spec is None else f"torch_npu is importable from {spec.origin}"


def _stand_in_module() -> types.ModuleType:
    module = types.ModuleType("torch_npu", "moe_compile's CPU emulation of the torch_npu MoE ops")
    module.__version__ = EMULATED_TORCH_NPU_VERSION
    setattr(module, _MARKER, True)
    namespace = getattr(torch.ops, npu_library.NAMESPACE)
    for name in npu_library.SCHEMAS:
        setattr(module, name, getattr(namespace, name))
    return module


def _check_can_activate() -> None:
    if _active is not None:
        raise RuntimeError("emulated_npu() is already active; it cannot be nested")
    reason = real_torch_npu_present()
    if reason is not None:
        raise RuntimeError(f"emulated_npu() refuses to run: {reason}; the emulation must never shadow the real "
                           f"torch_npu ops. Run the NPU lowering on the device instead.")
    namespace = getattr(torch.ops, npu_library.NAMESPACE)
    taken = [name for name in npu_library.SCHEMAS if hasattr(namespace, name)]
    if taken:
        raise RuntimeError(f"emulated_npu() refuses to run: torch.ops.npu already defines {taken} "
                           f"(a real or foreign torch_npu registration)")


@contextlib.contextmanager
def emulated_npu(poison: bool = False):
    """Provide the torch_npu MoE ops as plain-torch ``torch.ops.npu.*`` ops for the duration of the block."""
    global _active
    if not isinstance(poison, bool):
        raise TypeError(f"poison must be a bool, but got {type(poison).__name__} {poison!r}")
    _check_can_activate()
    state = EmulatedNpu(poison=poison)
    lib = npu_library.define_ops(state.calls, poison)
    try:
        state.module = _stand_in_module()
        sys.modules["torch_npu"] = state.module
        _active = state
        yield state
    finally:
        _active = None
        if sys.modules.get("torch_npu") is state.module:
            del sys.modules["torch_npu"]
        lib._destroy()
