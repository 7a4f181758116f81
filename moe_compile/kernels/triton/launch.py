"""Launching our Triton kernels with less host work per call.

``kernel[grid](*args, **consts)`` runs Triton's whole launcher on every call, and most of it is the
argument binder: a dict of every parameter and one native specialisation call per argument. On the
H200's host, one launch of a kernel with our GEMM's 53 parameters costs 65.8 µs that way against
11.9 µs for the compiled kernel's C launcher alone (``benchmarks/probe_launch.py``, run 2 of the
twenty-sixth session). An eager MoE call makes 3-6 launches, so at decode sizes this host work, not
the GPU, sets the pace of every step that runs without CUDA graphs.

``launch(kernel, grid, *args, **consts)`` launches the same kernel and keeps the compiled kernel
under a key of its own: the argument types, then for each argument what Triton specialises on
(a tensor's dtype and whether its address is a multiple of 16; an int's divisibility by 16, whether
it is 1 and its 32/64-bit range; a tensor descriptor's block shape, dtype and padding), and the
constexprs and launch options as given. That is at least everything Triton's specialisation reads,
so one of our keys never spans two of Triton's kernels; the key is computed by a small function
generated once per argument-type signature. A key seen before launches through the compiled kernel's
C launcher directly, with the constexprs appended as ``JITFunction.run`` passes them. A new key goes
through ``kernel[grid]`` once (which compiles or finds the kernel, launches it and returns it).

Triton's own compile-time knobs (``TRITON_DEBUG``, instrumentation) are not part of our key: a key keeps the kernel
it first got; ``clear()`` forgets them after such a knob changes within a process.

It takes ``kernel[grid]``'s path every time for an interpreted kernel (``TRITON_INTERPRET``), while
Triton launch hooks are set (profilers such as proton), for argument types it has no key for, or with
``MOE_COMPILE_FAST_LAUNCH=0`` (``ENABLED``, for side-by-side measurements).
"""
from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("MOE_COMPILE_FAST_LAUNCH", "1") != "0"
MAX_ENTRIES = 4096  # keys kept; a full cache is cleared (a miss costs one ordinary launch)
_CACHE: dict = {}
_KEYERS: dict = {}  # argument types -> the generated key function (None: types we do not key)
_RUNTIME = []  # [triton.knobs.runtime], looked up once


def _hooks_set() -> bool:
    if not _RUNTIME:
        from triton import knobs

        _RUNTIME.append(knobs.runtime)
    runtime = _RUNTIME[0]
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # a HookChain with hooks, or a bare hook
            return True
    return False


def _keyer(types: tuple):
    """``f(*args) -> tuple`` of what Triton specialises on, for arguments of these types (or None)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    parts = []
    for i, t in enumerate(types):
        a = f"a{i}"
        if issubclass(t, torch.Tensor):
            parts.append(f"{a}.dtype, {a}.data_ptr() & 15 == 0")
        elif t is bool:
            parts.append(a)
        elif t is int:
            parts.append(f"{a} == 1, {a} & 15 == 0, -2147483648 <= {a} <= 2147483647, {a} <= 9223372036854775807")
        elif t is TensorDescriptor:
            parts.append(f"tuple({a}.block_shape), {a}.base.dtype, {a}.padding")
        elif t is not float and t is not type(None):  # a float is always fp32, None a constexpr None
            return None
    names = ", ".join(f"a{i}" for i in range(len(types)))
    scope: dict = {}
    exec(f"def key({names}):\n    return ({', '.join(parts)}{',' if parts else ''})\n", scope)
    return scope["key"]


def launch(kernel, grid: tuple, *args, **consts) -> None:
    """``kernel[grid](*args, **consts)``, with the compiled kernel looked up by ours on repeat calls."""
    if not ENABLED or not hasattr(kernel, "device_caches") or _hooks_set():
        kernel[grid](*args, **consts)
        return
    types = tuple(map(type, args))
    keyer = _KEYERS.get(types, False)
    if keyer is False:
        keyer = _KEYERS[types] = _keyer(types)
    if keyer is None:
        kernel[grid](*args, **consts)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, types, keyer(*args), tuple(consts.items()))
    entry = _CACHE.get(key)
    if entry is None:
        compiled = kernel.run(*args, grid=grid, warmup=False, **consts)
        if compiled is not None:
            if len(_CACHE) >= MAX_ENTRIES:
                _CACHE.clear()
            _CACHE[key] = (compiled, _constexpr_tail(kernel, len(args), consts))
        return
    _direct(entry[0], entry[1], grid, device, args)


def _constexpr_tail(kernel, given: int, consts: dict) -> tuple:
    """The parameters after the positional ones, as ``JITFunction.run`` passes them: from ``consts``,
    else the parameter's default."""
    return tuple(consts[p.name] if p.name in consts else p.default for p in kernel.params[given:])


def _direct(compiled, tail: tuple, grid: tuple, device: int, args: tuple) -> None:
    """The compiled kernel's C launcher, called as ``JITFunction.run`` calls it (no hooks are set)."""
    size = len(grid)
    stream = torch._C._cuda_getCurrentRawStream(device)
    compiled.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *tail)


def clear() -> None:
    """Forget every cached kernel (tests; the kernels themselves stay in Triton's cache)."""
    _CACHE.clear()


__all__ = ["ENABLED", "MAX_ENTRIES", "clear", "launch"]
