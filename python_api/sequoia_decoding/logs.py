"""The package's log (``logging.getLogger("sequoia_decoding")``) and its once-per-message notes."""

from __future__ import annotations

import logging

__all__ = ["log", "say_once"]

log = logging.getLogger("sequoia_decoding")
SAID: set[str] = set()  # the messages said so far in this process


def say_once(msg: str, level: int = logging.WARNING) -> None:
    """One log line per distinct message and process (a plan note is not repeated every call)."""
    if msg not in SAID:
        SAID.add(msg)
        log.log(level, msg)
