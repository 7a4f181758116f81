"""Triton kernels for the CUDA lowering (imported on first use; this package init imports no triton)."""
from __future__ import annotations

import functools
import os
import re


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code: ``triton.cdiv`` is a constexpr function (Triton 3.6 and 3.9)
    whose host call costs ~2.5 µs here, and the op made about a dozen such calls per layer call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0, as ``triton.next_power_of_2``), for host code."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# os.environ keeps its variables in a dict of encoded names and values (CPython on POSIX); a lookup there
# skips os.environ.get's encoding of the name and decoding of the value, ~1 us a call on the H200's host,
# and every launch reads two such switches (interpreter, PDL). os.environ[...] = ... updates that dict.
_ENVIRON_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_KEYS: dict[str, bytes] = {}


def env_value(name: str, default: str) -> str:
    """``os.environ.get(name, default)``, cheaper on the launch path (see above)."""
    data = _ENVIRON_DATA
    if data is None:
        return os.environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.fsencode(name)
    value = data.get(key)
    return default if value is None else os.fsdecode(value)


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (``TRITON_INTERPRET`` set)."""
    return env_value("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)  # the installed versions do not change within a process
def interpreter_problem() -> str:
    """Why Triton's CPU interpreter cannot run these kernels here, or ``""`` when it can.

    Triton 3.6's interpreter turns a run-time loop bound (``range(0, K, BLOCK_K)``) into
    ``int()`` of a one-element array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be
    converted to Python scalars"); Triton 3.7 fixed it. Compiled kernels on a GPU are unaffected.
    Reads the installed versions only (imports neither triton nor numpy).
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton_v, numpy_v = version("triton"), version("numpy")
    except PackageNotFoundError as exc:
        return f"{exc.name} is not installed"

    def major_minor(v: str) -> tuple[int, int]:
        parts = [int(p) for p in re.findall(r"\d+", v)[:2]]
        return (parts + [0, 0])[0], (parts + [0, 0])[1]

    if major_minor(triton_v) < (3, 7) and major_minor(numpy_v) >= (2, 4):
        return (f"Triton {triton_v}'s interpreter cannot run loops over run-time bounds with NumPy {numpy_v} "
                "(fixed in Triton 3.7); install triton>=3.7 or numpy<2.4")
    return ""
