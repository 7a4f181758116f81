"""Programmatic dependent launch (PDL) for the chain of small kernels one MoE layer runs.

On Hopper and later, a kernel launched with ``launch_pdl=True`` may be scheduled while the kernel
before it in the stream is still finishing; it must not touch that kernel's results before
``gdc_wait()`` (PTX ``griddepcontrol.wait``), which returns once the earlier grid has completed
and its memory is visible. Every kernel of ours launched this way calls ``gdc_wait()`` first
thing (so completion stays transitive along the chain), then ``gdc_launch_dependents()``, which
lets the next kernel's programs start on free SMs as soon as all of this one's are running: the
launch gap and the next kernel's start-up overlap this kernel's last wave instead of following it.

``pdl_enabled(device)``: CUDA with compute capability >= 9.0, a triton that has the ``gdc``
intrinsics, not the interpreter, and ``MOE_COMPILE_PDL`` not ``0``. ``FORCE`` (``None``, ``True``
or ``False``) overrides it, for side-by-side benchmarks.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moe_compile.kernels.triton import env_value, interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # an older triton: PDL stays off (these stand-ins are never traced then)
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

FORCE: bool | None = None


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    if FORCE is not None:
        return FORCE and HAVE_GDC and device.type == "cuda"
    if device.type != "cuda" or interpreting() or not HAVE_GDC or env_value("MOE_COMPILE_PDL", "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


_ON: dict = {"PDL": True, "launch_pdl": True}
_OFF: dict = {}


def pdl_launch(device: torch.device) -> dict:
    """Launch keyword arguments: ``PDL`` (the kernel's constexpr) and ``launch_pdl`` where enabled (a shared
    dict: unpack it, do not change it)."""
    return _ON if pdl_enabled(device) else _OFF


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel that may be launched with PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


__all__ = ["FORCE", "HAVE_GDC", "pdl_enabled", "pdl_enter", "pdl_launch"]
