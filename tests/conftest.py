"""Session-wide test setup.

Without CUDA the Triton kernels run under Triton's interpreter. The interpreter flag must be set
before triton is first imported, and many tests import it indirectly (Inductor, the experts
registry), so it is set here, once, for the whole session.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config):
    """Say so up front when the Triton kernel tests cannot run under this install's interpreter."""
    if torch.cuda.is_available():
        return None
    from moe_compile.kernels.triton import interpreter_problem

    problem = interpreter_problem()
    return f"moe_compile: the Triton kernel tests will fail here: {problem}" if problem else None
