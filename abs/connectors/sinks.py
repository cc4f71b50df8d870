"""Sinks: writers with a two-phase-commit protocol driven by checkpoints.

A :class:`Sink` is a picklable description; each worker builds one :class:`SinkWriter`
per subtask. The runtime calls :meth:`SinkWriter.write` for every batch; at a checkpoint
barrier (the synchronous part of the snapshot) :meth:`SinkWriter.pre_commit` makes the
epoch's output durable but invisible and returns a JSON *transaction handle*, stored in the
checkpoint; when checkpoint ``n`` is complete the runtime calls
:meth:`SinkWriter.commit` with the handles of every epoch up to ``n`` not yet committed,
which makes them visible. ``commit`` must be idempotent: after a failure the handles of the
restored checkpoint are committed again (``restored_transactions`` at creation), and
pending output that no restored handle names is discarded by the writer.

With checkpointing off, the runtime calls ``pre_commit`` + ``commit`` once at the end of
input, so bounded jobs still publish their output.

Rolling back (restores that fall back)
    A restore of checkpoint ``c`` replays every record after ``c``. When output of a newer
    checkpoint was already committed (the newer checkpoint turned out broken and was skipped,
    or an older one was asked for), that output would be published twice. Before any worker
    starts, the driver therefore asks each sink with ``supports_rollback = True`` to
    :meth:`Sink.rollback` to ``c``; a sink without it makes such a restore refuse
    (:class:`abs.RepeatedOutputError`) unless ``allow_repeated_output=True`` is passed.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import pyarrow as pa

__all__ = ["Sink", "SinkWriter", "SinkRollback", "CollectSink"]

Transaction = Any  # a JSON value


class SinkWriter(abc.ABC):
    """Writes one sink subtask's output."""

    @abc.abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Buffer or write ``batch`` into the current (uncommitted) epoch."""

    def pre_commit(self, checkpoint_id: int) -> Transaction:
        """Make the current epoch durable but invisible; return its transaction handle."""
        return None

    def commit(self, checkpoint_id: int, transactions: Sequence[Transaction]) -> None:
        """Make ``transactions`` visible (idempotent)."""

    def close(self) -> None:
        """Release resources (called at the end of the job, after the last commit)."""


@dataclass(frozen=True)
class SinkRollback:
    """What :meth:`Sink.rollback` removed: ``items`` (counted in ``unit``, e.g. files) that
    checkpoints ``checkpoints`` had committed."""

    checkpoints: tuple[int, ...] = ()
    items: int = 0
    unit: str = "files"


class Sink(abc.ABC):
    """A picklable sink description.

    ``supports_rollback``: whether the sink can take back committed output (see
    :meth:`rollback`); ``False`` by default. A restore that would publish again what such a
    sink already committed refuses unless ``allow_repeated_output=True``.
    """

    supports_rollback: ClassVar[bool] = False

    def committed_checkpoints(self) -> Sequence[int]:
        """Ids of the checkpoints whose output this sink holds committed, as far as it can tell
        from its own records (a sink with ``supports_rollback``; called in the driver)."""
        return ()

    def rollback(self, to_checkpoint: int) -> SinkRollback:
        """Remove every output committed by a checkpoint with an id above ``to_checkpoint``;
        returns what was removed. Called in the driver, before any worker starts, when the job
        restores checkpoint ``to_checkpoint`` (or, on a restart with no checkpoint to restore,
        with the id before the run's first one). Must be idempotent and safe to repeat after a
        crash part-way: the sink's own record of which checkpoint committed what is the source
        of truth (a skipped checkpoint's manifest may be gone). Only called when
        ``supports_rollback`` is true."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back its output (supports_rollback is False)")

    @abc.abstractmethod
    def create_writer(
        self, subtask: int, parallelism: int, restored_transactions: Sequence[Transaction] = ()
    ) -> SinkWriter:
        """Writer for one subtask. ``restored_transactions``: handles from the restored
        checkpoint, to be committed again idempotently."""


class CollectSink(Sink):
    """Collects every record in the driver: ``JobResult.collected(uid)`` returns them.

    For tests and small results. Exactly-once like :class:`FileSink`: each epoch is staged in
    the driver's memory at the checkpoint barrier and becomes visible when its checkpoint's
    manifest is committed (or at the end of input with checkpointing off); after a restart,
    records since the restored checkpoint are not delivered twice, and a job canceled and
    restored in another process continues exactly where its collected output stopped.

    When a restart falls back past a broken checkpoint, the driver drops what it collected
    for the checkpoints above the one restored. Output collected by an *earlier process* (a
    ``JobResult`` already returned) cannot be taken back: a restore that would repeat it
    refuses unless ``allow_repeated_output=True``.
    """

    def create_writer(
        self, subtask: int, parallelism: int, restored_transactions: Sequence[Transaction] = ()
    ) -> SinkWriter:
        raise NotImplementedError("CollectSink writers are built by the runtime")

