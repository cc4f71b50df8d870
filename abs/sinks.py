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
"""
from __future__ import annotations

import abc
from typing import Any, Sequence

import pyarrow as pa

__all__ = ["Sink", "SinkWriter", "CollectSink", "FileSink"]

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


class Sink(abc.ABC):
    """A picklable sink description."""

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
    """

    def create_writer(
        self, subtask: int, parallelism: int, restored_transactions: Sequence[Transaction] = ()
    ) -> SinkWriter:
        raise NotImplementedError("CollectSink writers are built by the runtime")


def __getattr__(name: str) -> Any:
    if name == "FileSink":
        from .files import FileSink

        return FileSink
    raise AttributeError(name)
