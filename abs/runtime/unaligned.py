"""Unaligned checkpoints: the barrier overtakes the records queued in front of it, and those
records are stored with the checkpoint as its *channel state*.

Under backpressure an aligned barrier waits behind every queued batch of every stage, so
checkpoints take longest exactly when a job is in trouble. With
``CheckpointConfig(mode="unaligned")``:

1. A task snapshotting checkpoint ``n`` (a source at its trigger, any task below at the first
   barrier ``n`` it hears of) *announces* barrier ``n`` on each output channel before sending
   it in order: the announcement carries the number of elements sent on the channel before
   the barrier and travels ahead of them (a connection of its own per remote channel; straight
   into the gate for a local one). The gate delivers it to the task before any queued element,
   and lets the elements in front of the barrier in without waiting for room (they are in
   flight already: kernel buffers, the sender's blocked write).
2. The task snapshots at once, forwards the barrier the same way, and the gate *captures*,
   per input channel, the record batches the task had not taken at the snapshot up to that
   channel's barrier (:meth:`~abs.runtime.channels.InputGate.start_capture`): those queued now,
   and those still arriving. Nothing waits: the task goes on processing everything, captured
   records included (they are after its snapshot; on restore they are replayed before it).
3. Once every channel's barrier position is known and every element in front of it arrived
   (:class:`~abs.runtime.channels.CaptureComplete`), the captured batches go with the task's
   snapshot to the uploader: a ``channels/`` file of the checkpoint, named by the task's head
   operator (``Manifest.channel_logs``, sized and checksummed; ``stats`` counts them).
4. On restore a task replays the channel state of its head operator before any input: a keyed
   head the rows of its own key groups from every file (another parallelism re-routes them),
   any other head the files of the subtasks it stands for (:func:`abs.runtime.loops.replay_batches`).

``alignment_timeout`` (with ``mode="aligned"``): senders announce barriers too, but a task
aligns as usual; a checkpoint first heard of more than ``alignment_timeout`` seconds ago and
not aligned yet is given up (:meth:`~abs.alignment.BarrierAligner.give_up`) and taken unaligned:
the channels whose barrier arrived have nothing in front of it, the others are captured.

The final checkpoint of a job with unaligned checkpoints must leave nothing in flight (records
captured by it would be processed after it and their output never committed): as for loops,
final checkpoints repeat until one captures nothing (``JobLifecycle``). Not supported yet:
loops with unaligned checkpoints, live reconfiguration of a job that announces barriers.
"""
from __future__ import annotations

import time
from typing import Any

from ..alignment import AbortCheckpoint, BarrierAligner
from .channels import Announcement, Barrier
from .operator_base import OpSnapshot

__all__ = ["UnalignedCheckpoints"]


class UnalignedCheckpoints:
    """The part of :class:`~abs.runtime.task.Task` that takes unaligned checkpoints (see the
    module docstring). State, set by the task: ``unaligned`` (the mode), ``alignment_timeout``,
    ``_held`` (checkpoint -> upload job waiting for its channel state), ``_heard`` (checkpoint
    -> (first heard, base, channel -> barrier index): announcements kept for a timeout),
    ``_last_unaligned`` (the newest checkpoint taken unaligned or canceled here)."""

    unaligned: bool
    alignment_timeout: "float | None"
    _held: dict
    _heard: dict
    _last_unaligned: int
    gate: Any
    aligner: Any
    loop: Any
    head: Any
    worker: Any
    alignment_started: dict
    bases: dict
    outputs: list
    _every: frozenset = frozenset()

    def _outputs_ready(self) -> bool:
        """Every channel this task sends records on has room for one more element (while a
        task would block in a send it could not hear of a barrier: under backpressure that
        delayed an unaligned checkpoint by a downstream batch's time at every stage)."""
        return all(s.ready() for out in self.outputs for s in out.senders[:out.active])

    def _all_channels(self) -> frozenset:
        n = self.gate.num_channels
        if len(self._every) != n:
            self._every = frozenset(range(n))
        return self._every

    def _announced(self, channel: int, ann: Announcement) -> None:
        """A barrier announced ahead of ``channel``'s queued records (abs.runtime.unaligned)."""
        cid = ann.barrier.checkpoint_id
        if cid in self._held:
            self.gate.end_capture(cid, channel, ann.seq)
        elif self.unaligned:
            if cid > self._last_unaligned:
                self._snapshot_unaligned(cid, ann.barrier.base, {channel: ann.seq})
        elif self.aligner is not None and not self.aligner.is_closed(cid):
            # aligned with a timeout: the clock runs from the first announcement, and the
            # announced positions are kept in case the alignment is given up
            heard = self._heard.setdefault(cid, (time.monotonic(), ann.barrier.base, {}))
            heard[2][channel] = ann.seq

    def _unaligned_event(self, channel: int, item: Any) -> bool:
        """A barrier or cancel marker in order on ``channel`` when barriers are announced: True
        when handled here (the checkpoint was taken unaligned, or the mode is unaligned)."""
        cid = item.checkpoint_id
        if isinstance(item, Barrier):
            if cid in self._held:  # snapshotted unaligned: the barrier marks the end of its channel state
                self.gate.end_capture(cid, channel, self.gate.taken(channel) - 1)
                return True
            if not self.unaligned:
                return False
            if cid > self._last_unaligned:
                self._snapshot_unaligned(cid, item.base, {channel: self.gate.taken(channel) - 1})
            return True
        if not self.unaligned and cid not in self._held:
            return False
        if cid in self._held or cid > self._last_unaligned:  # a cancel marker: once per checkpoint
            self._drop_unaligned(cid)
            self._last_unaligned = max(self._last_unaligned, cid)
            self._act((AbortCheckpoint(cid, f"cancel marker on channel {channel}"),))
        return True

    def _check_alignment_timeout(self, aligner: BarrierAligner) -> None:
        """A checkpoint first heard of (announced) more than ``alignment_timeout`` ago and not
        yet aligned is taken unaligned now: channels that delivered its barrier have nothing
        in front of it; the others' records up to their barrier are its channel state."""
        now = time.monotonic()
        for cid in sorted(self._heard):
            at, base, ends = self._heard[cid]
            if aligner.is_closed(cid):
                del self._heard[cid]  # aligned (or aborted) in time
            elif now - at >= self.alignment_timeout and aligner.aligning in (None, cid):
                del self._heard[cid]
                delivered = aligner.give_up(cid)
                ends = {**{ch: self.gate.taken(ch) - 1 for ch in delivered}, **ends}
                self.alignment_started.pop(cid, None)
                self._snapshot_unaligned(cid, self.bases.pop(cid, base), ends, now - at)

    def _snapshot_unaligned(self, cid: int, base: int, ends: dict, alignment_time: float = 0.0) -> None:
        """Snapshot ``cid`` now, without aligning: the barrier goes out ahead of the queued
        records, and the records in front of it on every channel are captured as its channel
        state (the upload waits for them: :class:`CaptureComplete`)."""
        self._last_unaligned = max(self._last_unaligned, cid)
        self._heard = {k: v for k, v in self._heard.items() if k > cid}
        self._catch_up(base)
        job = self._snapshot(cid, base, alignment_time, hold=True)
        self._held[cid] = job
        live = self.aligner.live - (self.loop.channels if self.loop is not None else frozenset())
        self.gate.start_capture(cid, live, {ch: e for ch, e in ends.items() if ch in live})

    def _captured(self, cid: int) -> None:
        batches = self.gate.finish_capture(cid)
        job = self._held.pop(cid, None) if batches is not None else None
        if job is not None:
            job.pieces.append(OpSnapshot(self.head.uid, channel_state=batches))
            self.worker.upload_later(job)

    def _drop_unaligned(self, cid: int) -> None:
        if self._held.pop(cid, None) is not None:
            self.gate.drop_capture(cid)
