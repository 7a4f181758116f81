"""Triton kernels for the CUDA lowering (imported on first use; this package init imports no triton)."""
from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (``TRITON_INTERPRET`` set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
