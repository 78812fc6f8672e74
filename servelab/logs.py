"""The log handler every servelab process uses: its lines go to the current sys.stderr."""

from __future__ import annotations

import logging
import sys
from typing import TextIO


class _CurrentStderr(logging.StreamHandler[TextIO]):
    """Writes to whatever sys.stderr is when a line is logged, not to the stream it was at set-up
    (a replaced or closed stderr, as under a test's capture, would otherwise lose the line)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def log_to_stderr(fmt: str, level: str | int = logging.INFO, replace: bool = False) -> logging.Logger:
    """servelab's logger with one stderr handler in `fmt` (kept when it already has one, unless
    `replace`), at `level`, not propagated to the root logger."""
    logger = logging.getLogger("servelab")
    if replace or not logger.handlers:
        for old in list(logger.handlers):
            logger.removeHandler(old)
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter(fmt))
        logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    logger.propagate = False
    return logger
