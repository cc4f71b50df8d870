"""Progress of long operations (verify, GC, savepoint copies, re-keys), as plain events.

An operation that can take long takes an optional ``progress`` callback and calls it with a
:class:`ProgressEvent` as it goes: how much of one stage is done, of how much, in what unit.
The layers that do the work never draw anything; a front end (the ``abs-snapshot`` CLI, through
:mod:`abs.observe.progress`) renders the events, or ignores them.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional

__all__ = ["ProgressEvent", "ProgressCallback", "Tracker"]


@dataclasses.dataclass(frozen=True)
class ProgressEvent:
    """``done`` of ``total`` ``unit`` (``"files"``, ``"key groups"``, ...) of ``stage``
    (``"verify"``, ``"gc: delete"``, ...); ``total`` is ``None`` where it is not known."""

    stage: str
    done: int
    total: Optional[int]
    unit: str = "files"


ProgressCallback = Callable[[ProgressEvent], None]


class Tracker:
    """Counts the work of one stage and reports it to ``progress`` (nothing without one).
    Safe to advance from several threads; the events of one tracker arrive with ``done``
    ascending. Reports once when created (``done`` 0) so that a front end shows the stage
    before its first step ends."""

    def __init__(self, progress: ProgressCallback | None, stage: str, total: int | None, unit: str = "files") -> None:
        self._progress, self.stage, self.total, self.unit = progress, stage, total, unit
        self.done = 0
        self._lock = threading.Lock()
        if progress is not None:
            progress(ProgressEvent(stage, 0, total, unit))

    def advance(self, n: int = 1) -> None:
        if self._progress is None:
            return
        with self._lock:
            self.done += n
            self._progress(ProgressEvent(self.stage, self.done, self.total, self.unit))
