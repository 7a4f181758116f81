"""Capture what ``moe_compile`` logs, for tests.

torch's logging registry owns the ``moe_compile`` logger (``TORCH_LOGS=+moe_compile``) and may stop
it propagating to the root logger, so pytest's ``caplog`` does not always see its records; this
attaches a handler to the logger itself.
"""
from __future__ import annotations

import contextlib
import logging


class _Messages(logging.Handler):
    def __init__(self, level: int):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def captured_logs(level: int = logging.DEBUG, name: str = "moe_compile"):
    """``with captured_logs(logging.INFO) as messages: ...``: the formatted messages logged inside."""
    logger = logging.getLogger(name)
    handler, old_level = _Messages(level), logger.level
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
