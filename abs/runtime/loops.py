"""Snapshots of cyclic dataflows: the iteration head's feedback log (the cyclic half of
Asynchronous Barrier Snapshotting).

A loop is built with :meth:`abs.Stream.iterate`: its head task has regular input channels
(the stream entering the loop) and *feedback* channels (the back-edge from the end of the loop
body, :meth:`abs.runtime.plan.TaskPlan.back_channels`). Waiting for a barrier on the feedback
channels would deadlock (the barrier comes round only after the head forwarded it), and the
records circulating in the loop at the snapshot are in no operator's state. So:

1. The head aligns its regular channels only (to the barrier aligner the feedback channels
   are ended from the start). On alignment it takes its snapshot and forwards the barrier
   into the loop, as every task does, and opens a log for that checkpoint.
2. Every record arriving on a feedback channel is processed as usual *and* appended to each
   open log still waiting for its barrier on that channel.
   A barrier can come round *before* this head subtask snapshotted: when the feedback edge
   leaves from the head's own task, another head subtask forwards it as soon as it aligned.
   The records behind it on that channel are after the cut of its sender, so the channel is
   blocked until this head snapshots (it cannot deadlock: feedback channels never block their
   senders), and log ``n`` does not wait on it.
3. When barrier ``n`` has come back on every feedback channel, log ``n`` is complete: the
   records that were in the loop at the snapshot's cut. The head's part of checkpoint ``n``
   (its state, and the log as a ``channels/`` file of the checkpoint) is uploaded and acked
   only then; the manifest names, sizes and checksums the file (``Manifest.channel_logs``).
4. On restore the head processes the restored logs first, before any new input, as if they
   arrived on its feedback channels (into another parallelism too: the head is stateless and
   its output is partitioned again by the body's exchanges, so any head subtask may replay a
   log).

Termination (bounded input): once every source is exhausted the driver asks for checkpoints
(or, without storage, *probes*: the same barriers with nothing written) until one whose logs
are all empty completes. Empty logs mean that nothing circulated at that cut, and with no new
input nothing can circulate later: the loop is quiet, the sources are told to finish, the
end of stream reaches the head and the head ends the loop (see ``JobLifecycle``).

A log of a checkpoint aborted meanwhile is dropped; a cancel marker coming round drops it
too. :class:`FeedbackLogs` is the bookkeeping (pure, no I/O); :class:`IterationHead` the part
of a task that heads a loop.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

import pyarrow as pa

from .channels import EOS, Barrier, CancelMarker
from .operator_base import OpSnapshot

__all__ = ["FeedbackLogs", "IterationHead", "write_log", "replay_batches", "DROP_LOGS_FOR_TESTS"]

DROP_LOGS_FOR_TESTS = "ABS_TEST_DROP_FEEDBACK_LOGS"
"""Set in a job's environment, the heads count their logs but store none: the test that
shows a cyclic job loses records without them. Never set it otherwise."""


class FeedbackLogs:
    """The open logs of an iteration head: per checkpoint, the feedback channels its barrier
    has not come back on yet, the batches logged so far and what the head holds for it (its
    upload job)."""

    def __init__(self, channels: Iterable[int]) -> None:
        self.channels = frozenset(channels)
        self.live = set(self.channels)  # feedback channels that have not ended
        self._open: dict[int, tuple[set[int], list, Any]] = {}
        self._started = 0  # the newest checkpoint this head snapshotted
        self._early: dict[int, int] = {}  # channel -> the barrier that came round before the snapshot

    @property
    def blocked(self) -> frozenset[int]:
        """Feedback channels whose barrier came round before this head snapshotted it."""
        return frozenset(self._early)

    def __bool__(self) -> bool:
        return bool(self._open)

    def start(self, checkpoint_id: int, held: Any) -> list[tuple[int, list, Any]]:
        """The head snapshotted ``checkpoint_id`` and forwarded its barrier: log from now on.
        Returns it at once as finished when no feedback channel is live any more."""
        self._started = max(self._started, checkpoint_id)
        returned = {ch for ch, cid in self._early.items() if cid == checkpoint_id}
        self._early = {ch: cid for ch, cid in self._early.items() if cid > checkpoint_id}
        self._open[checkpoint_id] = (set(self.live) - returned, [], held)
        return self._finished()

    def on_batch(self, channel: int, batch: pa.RecordBatch) -> None:
        for waiting, batches, _held in self._open.values():
            if channel in waiting:
                batches.append(batch)

    def on_barrier(self, channel: int, checkpoint_id: int) -> list[tuple[int, list, Any]]:
        """Barrier ``checkpoint_id`` came back on ``channel``: the logs it completes, as
        ``(checkpoint id, batches, held)``. A barrier of a log no longer open (aborted) is
        ignored; one this head has not snapshotted yet blocks its channel (:attr:`blocked`)."""
        entry = self._open.get(checkpoint_id)
        if entry is not None:
            entry[0].discard(channel)
        elif checkpoint_id > self._started:
            self._early[channel] = checkpoint_id
        return self._finished()

    def on_end(self, channel: int) -> list[tuple[int, list, Any]]:
        """``channel`` ended: no barrier will come back on it."""
        self.live.discard(channel)
        self._early.pop(channel, None)
        for waiting, _batches, _held in self._open.values():
            waiting.discard(channel)
        return self._finished()

    def drop(self, checkpoint_id: int) -> Any:
        """Checkpoint ``checkpoint_id`` was aborted: forget its log; what the head held for it."""
        self._early = {ch: cid for ch, cid in self._early.items() if cid != checkpoint_id}
        entry = self._open.pop(checkpoint_id, None)
        return None if entry is None else entry[2]

    def _finished(self) -> list[tuple[int, list, Any]]:
        done = [cid for cid, (waiting, _b, _h) in self._open.items() if not waiting]
        return [(cid,) + self._open.pop(cid)[1:] for cid in sorted(done)]


MERGE_ROWS = 4096
"""About how many fed-back rows an iteration head merges into one batch."""


def _merged(batches: list) -> list:
    if len(batches) == 1:
        return batches
    try:
        return pa.Table.from_batches(batches).combine_chunks().to_batches()
    except pa.ArrowInvalid:  # batches of differing schemas: one by one
        return batches


class IterationHead:
    """The part of :class:`~abs.runtime.task.Task` that heads a loop: what arrives on its
    feedback channels (``self.loop``: :class:`FeedbackLogs`, set by the worker)."""

    loop: "FeedbackLogs | None"
    _ended: bool
    head: Any
    worker: Any
    gate: Any

    def _fed_back(self, channel: int, item: Any) -> bool:
        """An element on an iteration head's feedback channel (abs.runtime.loops): processed
        and logged for every open log that waits for its barrier on the channel; a barrier
        coming round closes its log there. True when the head is done (its regular inputs
        and the loop have ended)."""
        loop = self.loop
        assert loop is not None
        if isinstance(item, pa.RecordBatch):
            if self._ended:
                raise RuntimeError(
                    f"iteration {self.head.uid!r}: {item.num_rows} record(s) came round after the loop was ended "
                    "(an operator in the loop body emitted records at the end of its input?)"
                )
            self.worker.fault("process", self)
            # what else came round is merged into one batch: in a loop batches shrink with
            # every pass (a key_by splits them), and a batch costs far more than a record
            taken = [(channel, item)] + self.gate.take_batches(loop.channels - loop.blocked, MERGE_ROWS - item.num_rows)
            if loop:
                for ch, batch in taken:
                    loop.on_batch(ch, batch)
                self.worker.fault("during_logging", self)
            for batch in _merged([b for _ch, b in taken]):
                self.head.process(batch)
            return False
        if isinstance(item, Barrier):
            self.worker.fault("before_barrier_returns", self)
            self._logged(loop.on_barrier(channel, item.checkpoint_id))
        elif isinstance(item, CancelMarker):
            loop.drop(item.checkpoint_id)
        elif item is EOS:
            self._logged(loop.on_end(channel))
            return self._ended and not loop.live
        else:
            raise RuntimeError(f"iteration {self.head.uid!r}: {item!r} on a feedback channel (live reconfiguration "
                               "of a job with an iteration is not supported)")
        return False

    def _logged(self, finished: list) -> None:
        """Logs complete: the head's part of those checkpoints goes to the uploader now."""
        for _cid, batches, job in finished:
            job.pieces.append(OpSnapshot(self.head.uid, channel_log=batches))
            self.worker.upload_later(job)


def write_log(store: Any, checkpoint_id: int, task: str, batches: list) -> Any:
    """Store a finished log as a channel file of checkpoint ``checkpoint_id``: its FileRef, or
    None when it is empty or the job does not store checkpoints (a termination probe)."""
    rows = [b for b in batches if b.num_rows]
    if not rows or store is None or os.environ.get(DROP_LOGS_FOR_TESTS):
        return None
    try:
        table = pa.Table.from_batches(rows)
    except pa.ArrowInvalid:  # the body fed back batches of differing schemas: unify them
        table = pa.concat_tables([pa.Table.from_batches([b]) for b in rows], promote_options="permissive")
    return store.write_channel_log(checkpoint_id, task, table)


def replay_batches(store: Any, refs: Iterable[Any], head: Any, subtask: int, parallelism: int) -> list[pa.RecordBatch]:
    """What a restored task replays first: the channel files of its head operator (each read
    and checked against its checksum). A keyed head takes the rows of its own key groups from
    every file, whatever subtask wrote it (the records go to their key group's new owner);
    any other head the files written by subtasks ``subtask``, ``subtask + parallelism``, ...
    (the restore into another parallelism spreads them)."""
    import numpy as np

    from .operators import KeyedOp

    keyed = isinstance(head, KeyedOp)
    owned = None
    if keyed:
        kgs = head.key_group_range
        owned = np.array([kg for kg in range(head.extractor.max_parallelism) if kg in kgs], dtype=np.int64)
    out: list[pa.RecordBatch] = []
    for ref in refs:
        writer = int(ref.location().task.rpartition("#")[2])
        if not keyed and writer % parallelism != subtask:
            continue
        for batch in store.read_file(ref).to_batches():
            if keyed:
                batch = batch.filter(pa.array(np.isin(head.extractor.key_groups(batch), owned)))
            if batch.num_rows:
                out.append(batch)
    return out
