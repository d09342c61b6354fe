"""Make trainguard's own messages visible without touching the user's logging.

Recoveries, checkpoints and fallbacks are operational facts a user must see.
When neither the ``trainguard`` logger nor the root logger has a handler (a
training script that never configured logging), :func:`setup` gives the
``trainguard`` logger one, writing to stderr at ``TRAINGUARD_LOG_LEVEL``
(default INFO). A script that configured logging keeps full control.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LEVELS", "exit_now", "level", "setup"]

_MARK = "_trainguard_handler"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def level(value: str | None) -> str:
    """``value`` as a level name when it is one (any case), else ``INFO``."""
    name = (value or "INFO").strip().upper()
    return name if name in LEVELS else "INFO"


def setup(who: str = "") -> None:
    """Attach trainguard's stderr handler once, if nothing else would print.

    Args:
        who: a tag for every line, such as ``rank 3`` or ``launcher``.
    """
    logger = logging.getLogger("trainguard")
    if any(getattr(h, _MARK, False) for h in logger.handlers):
        return
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _MARK, True)
    tag = f" {who}" if who else ""
    handler.setFormatter(logging.Formatter(f"[trainguard{tag} %(levelname)s %(asctime)s] %(message)s"))
    logger.addHandler(handler)
    asked = os.environ.get("TRAINGUARD_LOG_LEVEL", "INFO")
    logger.setLevel(level(asked))
    logger.propagate = False
    if level(asked) != asked.strip().upper():  # no traceback for a typo: one line, and INFO
        logger.warning("TRAINGUARD_LOG_LEVEL=%r is no log level (%s): using INFO", asked[:40], ", ".join(LEVELS))


def exit_now(code: int) -> None:
    """End the process with ``code`` after flushing logs and the standard
    streams, without running destructors: process groups whose peer is gone
    block or abort in theirs."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
