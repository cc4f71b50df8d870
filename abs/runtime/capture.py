"""Capturing a checkpoint's channel state in an input gate (unaligned checkpoints, see
:mod:`abs.runtime.unaligned`): per channel, the record batches from the first one the task had
not taken at its snapshot up to the barrier's position, those queued then and those arriving
later; a control event once all of them are in. A part of :class:`~abs.runtime.channels.InputGate`
(its lock, queues and per-channel counts of elements put and taken)."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import pyarrow as pa

__all__ = ["CaptureComplete", "ChannelStateCapture"]


@dataclasses.dataclass(frozen=True)
class CaptureComplete:
    """Control event of a gate: every element of checkpoint ``checkpoint_id``'s channel state
    has arrived (see :meth:`InputGate.start_capture`)."""

    checkpoint_id: int


class _Capture:
    """The channel state of one checkpoint being captured: per channel, the index of the
    first element the task had not taken at its snapshot, the index of the barrier once known
    (``None`` before) and the (index, batch) pairs in between."""

    __slots__ = ("channels", "announced")

    def __init__(self) -> None:
        self.channels: dict[int, list] = {}  # channel -> [start, end | None, [(index, batch)]]
        self.announced = False  # CaptureComplete was queued


class ChannelStateCapture:
    """The capture methods of :class:`~abs.runtime.channels.InputGate` (see the module docstring)."""

    _cond: Any
    _queues: list
    _control: Any
    _received: list
    _taken: list
    _captures: dict

    def taken(self, channel: int) -> int:
        """How many elements of ``channel`` the task has taken (the index of the next)."""
        with self._cond:
            return self._taken[channel]

    def start_capture(self, checkpoint_id: int, channels: "Iterable[int]", ends: "dict[int, int]") -> None:
        """The task snapshotted ``checkpoint_id``: capture, per channel, the record batches
        from the first one it has not taken up to the barrier (index ``ends[channel]`` where
        known, else told later with :meth:`end_capture`); queued ones now, later ones as they
        arrive. A :class:`CaptureComplete` control event follows once all are in."""
        with self._cond:
            cap = self._captures[checkpoint_id] = _Capture()
            for ch in channels:
                start = self._taken[ch]
                held = [(start + k, item) for k, item in enumerate(self._queues[ch]) if isinstance(item, pa.RecordBatch)]
                cap.channels[ch] = [start, None, held]
            for ch, end in ends.items():
                self._end(cap, ch, end)
            self._check_capture(checkpoint_id)

    def end_capture(self, checkpoint_id: int, channel: int, end: int) -> None:
        """The barrier of ``checkpoint_id`` is element ``end`` of ``channel``."""
        with self._cond:
            cap = self._captures.get(checkpoint_id)
            if cap is not None and channel in cap.channels:
                self._end(cap, channel, end)
                self._check_capture(checkpoint_id)

    def capturing(self, checkpoint_id: int) -> bool:
        with self._cond:
            return checkpoint_id in self._captures

    def finish_capture(self, checkpoint_id: int) -> "list[pa.RecordBatch] | None":
        """The captured batches (channel by channel, in order), or None when it is not complete."""
        with self._cond:
            cap = self._captures.get(checkpoint_id)
            if cap is None or not self._complete(cap):
                return None
            del self._captures[checkpoint_id]
            return [b for ch in sorted(cap.channels) for _i, b in cap.channels[ch][2]]

    def drop_capture(self, checkpoint_id: int) -> None:
        with self._cond:
            self._captures.pop(checkpoint_id, None)

    def _capture(self, channel: int, index: int, item: Any, ended: bool) -> None:
        for cid, cap in self._captures.items():
            entry = cap.channels.get(channel)
            if entry is None or index < entry[0] or (entry[1] is not None and index >= entry[1]):
                continue
            if ended:  # the channel ended before the barrier: everything up to here
                entry[1] = index
            elif isinstance(item, pa.RecordBatch):
                entry[2].append((index, item))
        for cid in self._captures:
            self._check_capture(cid)

    @staticmethod
    def _end(cap: _Capture, channel: int, end: int) -> None:
        entry = cap.channels[channel]
        end = max(end, entry[0])
        if entry[1] is None or end < entry[1]:
            entry[1] = end
            entry[2] = [(i, b) for i, b in entry[2] if i < end]

    def _complete(self, cap: _Capture) -> bool:
        return all(end is not None and self._received[ch] >= end for ch, (_s, end, _b) in cap.channels.items())

    def _check_capture(self, checkpoint_id: int) -> None:
        cap = self._captures[checkpoint_id]
        if not cap.announced and self._complete(cap):
            cap.announced = True
            self._control.append(CaptureComplete(checkpoint_id))
            self._cond.notify_all()
