"""Alignment of reconfiguration steps at a task with several input channels (pure).

A step's marker (:class:`~abs.runtime.channels.StepMarker`) arrives once on every input
channel. Like a checkpoint barrier, a channel that delivered marker ``r`` is blocked until
every live channel has delivered it: then everything before ``r`` on every channel has been
processed and nothing after it has, which is the moment a task hands over the key groups it
loses and switches its routing. Unlike a checkpoint, a step is never aborted (its moves are
decided; a failure fails the job and recovery restores a checkpoint).

Steps arrive in increasing order on every channel (the sources inject them in the order the
driver sends them), so at most one step aligns at a time. A channel that ends (``EOS``) no
longer counts.
"""
from __future__ import annotations

from ..errors import AbsError

__all__ = ["StepAligner", "StepOrderError"]


class StepOrderError(AbsError, RuntimeError):
    """A step marker out of order on a channel: a bug of the runtime (markers are FIFO per
    channel and the sources inject them in order); the task fails and the job recovers.
    Remedy: report it."""


class StepAligner:
    def __init__(self, num_channels: int) -> None:
        self.live: set[int] = set(range(num_channels))
        self.aligning: int | None = None
        self.arrived: set[int] = set()
        self.last_aligned = 0
        self._joining: set[int] = set()

    @property
    def blocked(self) -> frozenset[int]:
        """Channels not to read from now (they delivered the step being aligned)."""
        return frozenset(self.arrived | self._joining) if self.aligning is not None else frozenset()

    def add_channel(self, channel: int) -> None:
        """A channel joined (a rescale): it delivers the join step's marker first and counts
        for every step from there. While an earlier step still aligns here (it never comes on
        the new channel) the channel joins once that step is aligned."""
        if self.aligning is not None:
            self._joining.add(channel)
        else:
            self.live.add(channel)

    def on_marker(self, channel: int, step: int) -> bool:
        """Marker of ``step`` on ``channel``; True when the step is now aligned."""
        if channel not in self.live or channel in self.arrived:
            raise StepOrderError(f"step marker {step} on channel {channel}, which has ended or already delivered "
                                 f"step {self.aligning}")
        if self.aligning is None:
            if step <= self.last_aligned:
                raise StepOrderError(f"step marker {step} after step {self.last_aligned} was aligned")
            self.aligning = step
        elif step != self.aligning:
            raise StepOrderError(f"step marker {step} on channel {channel} while step {self.aligning} aligns")
        self.arrived.add(channel)
        return self._done()

    def on_end_of_stream(self, channel: int) -> bool:
        """``channel`` ended; True when that completes the alignment of the current step."""
        self.live.discard(channel)
        self.arrived.discard(channel)
        return self.aligning is not None and self._done()

    def _done(self) -> bool:
        if self.arrived >= self.live:
            self.last_aligned = self.aligning  # type: ignore[assignment]
            self.aligning = None
            self.arrived = set()
            self.live |= self._joining
            self._joining = set()
            return True
        return False
