"""Session-wide test setup.

Inductor's compile caches are off for the session: a graph served from them skips the pass, so a
test that patches the pass (or counts what it does) would depend on which test compiled the same
graph first. ``tests/passes/test_compile_cache.py`` turns them on, in a folder of its own.

Without CUDA the Triton kernels run under Triton's interpreter. The interpreter flag must be set
before triton is first imported, and many tests import it indirectly (Inductor, the experts
registry), so it is set here, once, for the whole session.
"""
import logging
import os

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


def pytest_report_header(config):
    """Say so up front when the Triton kernel tests cannot run under this install's interpreter."""
    if torch.cuda.is_available():
        return None
    from moe_compile.kernels.triton import interpreter_problem

    problem = interpreter_problem()
    return f"moe_compile: the Triton kernel tests will fail here: {problem}" if problem else None


@pytest.fixture
def moe_log(caplog, monkeypatch):
    """``caplog`` for the ``moe_compile`` logger, at INFO. Once the backend registers that logger with
    torch._logging it does not propagate, so caplog's root handler would see nothing; before that it
    does, and a handler of its own would see each record twice. Pinning ``propagate=False`` and attaching
    caplog's handler makes a test's records the same whichever tests ran before it in its worker."""
    logger = logging.getLogger("moe_compile")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="moe_compile"):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)
