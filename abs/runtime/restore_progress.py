"""Progress of an attempt's restore, in the driver: the workers report the bytes of state they
have read with their start-up heartbeats, against the bytes the restore plan assigned them;
one stage, ``"restore"``, summed over the workers, in KiB. Shown as a bar on stderr when it is
a terminal (``abs.observe.progress``, drawn by ``rich``), or handed to the callback of
``RuntimeOptions(progress=...)``."""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

from abscore.progress import ProgressCallback, ProgressEvent

__all__ = ["RestoreProgress"]

STAGE = "restore"


class RestoreProgress:
    def __init__(self, callback: ProgressCallback, total: int, closing: contextlib.ExitStack) -> None:
        self._callback = callback
        self._total = total
        self._closing = closing
        self._done: dict[int, int] = {}
        self._emit()

    @classmethod
    def start(cls, progress: Any, assignments: Sequence[Any]) -> "RestoreProgress | None":
        """A tracker for this attempt, or None: nothing to restore, ``progress=False``, or no
        terminal to draw on."""
        total = sum(ref.bytes for a in assignments for by_state in (a.keyed_chains or {}).values()
                    for by_kg in by_state.values() for chain in by_kg.values() for ref in chain)
        if not total or progress is False:
            return None
        closing = contextlib.ExitStack()
        callback = progress
        if progress is None:
            from ..observe.progress import terminal_progress

            callback = closing.enter_context(terminal_progress())
            if callback is None:
                closing.close()
                return None
        return cls(callback, total, closing)

    def report(self, worker: int, nbytes: int) -> None:
        """Worker ``worker`` has read ``nbytes`` of its state so far."""
        if nbytes > self._done.get(worker, 0):
            self._done[worker] = nbytes
            self._emit()

    def _emit(self) -> None:
        done = min(sum(self._done.values()), self._total)
        self._callback(ProgressEvent(STAGE, done // 1024, max(self._total // 1024, 1), "KiB"))

    def close(self) -> None:
        self._closing.close()
