"""Logging of ``abs``, ``storage`` and ``recovery``: one logger per package, each module logs on
a child of it (``logging.getLogger(__name__)``), and a default handler so that who configures
nothing still sees warnings and notices on stderr, as the toolkit printed them before.

- Warnings (and worse) read ``[<package>] warning: <message>``; notices (``INFO``) are the
  message alone.
- The handler writes to ``sys.stderr`` as it is at that moment (a redirected or captured
  stderr gets the lines).
- Records still propagate to the root logger. Who routes logging through their own handlers
  calls :func:`remove_default_handlers` once (before or after importing the packages), so
  that no line appears twice; a package logger that already has a handler when its package
  is imported gets no default one, and a level set on it
  (``logging.getLogger("abs").setLevel(logging.WARNING)``) is kept.
"""
from __future__ import annotations

import logging
import sys

__all__ = ["PACKAGES", "DefaultHandler", "package_logger", "remove_default_handlers"]

PACKAGES = ("abs", "storage", "recovery")


class DefaultHandler(logging.Handler):
    """Writes each record, formatted as the toolkit printed it, to the current ``sys.stderr``."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            package = record.name.partition(".")[0]
            kind = "warning" if record.levelno < logging.ERROR else "error"
            message = f"[{package}] {kind}: {message}"
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
        return message

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            if stream is None:  # pythonw: no stderr at all
                return
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging never raises into the caller
            self.handleError(record)


def package_logger(name: str) -> logging.Logger:
    """The logger of package ``name``, given the default handler if it has no handler yet
    (an application that attached one first, or called :func:`remove_default_handlers`,
    keeps its own) and, unless a level was set on it, level ``INFO`` so that notices show."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        logger.addHandler(DefaultHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return logger


def remove_default_handlers() -> None:
    """Take the default handlers off the package loggers, now and for packages imported
    later (a ``NullHandler`` takes their place); their records then reach only the handlers
    the application configured, e.g. on the root logger."""
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for h in [h for h in logger.handlers if isinstance(h, DefaultHandler)]:
            logger.removeHandler(h)
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())
