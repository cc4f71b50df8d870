"""A source task's readers once a rescale moved source splits (:mod:`abs.reconfig.plan`):
the reader it started with, plus one per set of splits another worker handed over to it.
A leaving worker's source task releases every split it reads (their offsets travel to the
new owner, which opens a reader of the same source at exactly those offsets)."""
from __future__ import annotations

from typing import Any

from ..connectors.sources import END, SourceReader

__all__ = ["SourceReaders"]


class SourceReaders(SourceReader):
    """Reads several readers of one source round robin; the end comes once every one ended."""

    def __init__(self, first: SourceReader) -> None:
        self._readers: list[SourceReader] = [first]
        self._ended: list[bool] = [False]
        self._next = 0

    def add(self, reader: SourceReader) -> None:
        self._readers.append(reader)
        self._ended.append(False)

    def release(self) -> dict:
        """Stop reading every split: their offsets now (what was read is before the step's
        marker on every output channel); the readers are closed."""
        offsets = self.offsets()
        self.close()
        self._readers, self._ended = [], []
        return offsets

    def poll(self) -> Any:
        n = len(self._readers)
        if n == 0:
            return None  # released: a leaving worker's source reads nothing until it retires
        for k in range(n):
            i = (self._next + k) % n
            if self._ended[i]:
                continue
            batch = self._readers[i].poll()
            if batch is END:
                self._ended[i] = True
            elif batch is not None:
                self._next = (i + 1) % n
                return batch
        return END if all(self._ended) else None

    def offsets(self) -> dict:
        merged: dict = {}
        for r in self._readers:
            merged.update(r.offsets())
        return merged

    def wait_hint(self) -> float:
        hints = [r.wait_hint() for r, ended in zip(self._readers, self._ended) if not ended]
        return min(hints) if hints else 0.05

    def notify_checkpoint_complete(self, checkpoint_id: int, offsets: Any) -> None:
        for r in self._readers:
            r.notify_checkpoint_complete(checkpoint_id, offsets)

    def lag(self) -> float | None:
        lags = [lag for r in self._readers if (lag := r.lag()) is not None]
        return sum(lags) if lags else None

    def close(self) -> None:
        for r in self._readers:
            r.close()
