"""A source for tests whose progress follows completed checkpoints instead of the clock.

``PacedSource(inner, per_checkpoint)`` reads ``inner`` but lets each reader emit at most
``per_checkpoint`` records between two completed checkpoints (it hears of them through
``SourceReader.notify_checkpoint_complete``): a job of ``R`` records per reader cannot end
before about ``R / per_checkpoint`` checkpoints completed, however fast or loaded the machine.
A rate-limited source only promises that in wall-clock time, which a busy machine breaks.

``hold`` and ``gate``: a reader that has emitted ``hold`` records waits (it keeps taking
barriers) until the file ``gate`` exists, so that a test can act on a job that is certainly
still running (kill a process, take a savepoint, cancel) and then let it go on with
``open(gate, "w").close()``. ``hold_per_split`` instead of ``hold``: a reader waits once its
splits' offsets (records read from them, by whichever reader) add up to that many per split,
so the hold survives a rescale that hands splits to new readers (integer offsets, as
:class:`abs.GeneratorSource`'s).

Records, splits and offsets are the inner source's: the output is the same as without pacing.
A reader whose allowance runs out exactly at the end of its input hears of the end only after
the next completed checkpoint (it does not poll while it waits): where the final checkpoint
must hold the last output, pick a ``per_checkpoint`` that does not divide a reader's records.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import abs
from abs import END


class PacedSource(abs.Source):
    def __init__(self, inner: abs.Source, per_checkpoint: int, hold: int | None = None,
                 gate: str | None = None, hold_per_split: int | None = None) -> None:
        if per_checkpoint < 1:
            raise ValueError(f"PacedSource: per_checkpoint must be >= 1, got {per_checkpoint}")
        if hold is not None and hold_per_split is not None:
            raise ValueError("PacedSource: give hold or hold_per_split, not both")
        if (hold is None and hold_per_split is None) != (gate is None):
            raise ValueError("PacedSource: give a hold and gate, or neither")
        self.inner = inner
        self.per_checkpoint = per_checkpoint
        self.hold = hold
        self.hold_per_split = hold_per_split
        self.gate = gate

    def splits(self) -> list[str]:
        return self.inner.splits()

    def initial_offset(self, split: str) -> Any:
        return self.inner.initial_offset(split)

    def create_reader(self, splits: Mapping[str, Any], subtask: int, parallelism: int) -> abs.SourceReader:
        return _PacedReader(self.inner.create_reader(splits, subtask, parallelism), self)

    def driver_open(self, context: Any) -> None:
        self.inner.driver_open(context)

    def driver_checkpoint_complete(self, checkpoint_id: int, offsets: Mapping[str, Any]) -> None:
        self.inner.driver_checkpoint_complete(checkpoint_id, offsets)

    def driver_close(self) -> None:
        self.inner.driver_close()

    def driver_hold(self) -> Any:
        return self.inner.driver_hold()

    def driver_savepoint(self, offsets: Mapping[str, Any], dest: str, dest_options: Any) -> None:
        self.inner.driver_savepoint(offsets, dest, dest_options)


class _PacedReader(abs.SourceReader):
    def __init__(self, inner: abs.SourceReader, source: PacedSource) -> None:
        self._inner = inner
        self._source = source
        self._emitted = 0
        self._allowed = source.per_checkpoint

    def _waiting(self) -> bool:
        src = self._source
        if src.hold is not None and self._emitted >= src.hold and not os.path.exists(src.gate):
            return True
        if src.hold_per_split is not None and not os.path.exists(src.gate):
            offsets = self._inner.offsets()
            if sum(int(v) for v in offsets.values()) >= src.hold_per_split * len(offsets):
                return True
        return self._emitted >= self._allowed

    def poll(self) -> Any:
        if self._waiting():
            return None
        batch = self._inner.poll()
        if batch is not None and batch is not END:
            self._emitted += batch.num_rows
        return batch

    def offsets(self) -> dict[str, Any]:
        return self._inner.offsets()

    def lag(self) -> float | None:
        return self._inner.lag()

    def wait_hint(self) -> float:
        return 0.01 if self._waiting() else self._inner.wait_hint()

    def notify_checkpoint_complete(self, checkpoint_id: int, offsets: Mapping[str, Any]) -> None:
        self._allowed = self._emitted + self._source.per_checkpoint
        self._inner.notify_checkpoint_complete(checkpoint_id, offsets)

    def close(self) -> None:
        self._inner.close()
