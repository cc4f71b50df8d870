"""Barrier alignment of one task with several input channels, as a small state machine.

The runtime feeds the events of its input channels to a :class:`BarrierAligner` and carries
out the actions it returns; it never consumes from the channels in
:attr:`BarrierAligner.blocked`.  The aligner is pure: no I/O, no clock.

States (each returns the next state; the channel bookkeeping shared by all of them -- the
live channels, the ids already finished here -- lives in one small context):

* ``Idle``: not aligning. Barrier ``n`` on channel ``c`` starts aligning ``n`` with ``c``
  blocked (with a single live channel the snapshot is triggered at once).
* ``Aligning(n, blocked)``: barrier ``n`` arrived on the blocked channels, the others keep
  flowing. When every live channel has delivered ``n``: :class:`TriggerSnapshot` and all
  channels are unblocked in the same transition.
* ``Finished``: every channel ended (:class:`EndOfInput` was emitted).

Rules:

* A barrier or cancel marker for an id that is already *closed* here (triggered or aborted,
  or older than an id this task has started to align) is ignored: a late barrier of an aborted
  checkpoint never blocks a channel.
* Barrier ``m > n`` while aligning ``n``: ``n`` is aborted (that channel went past ``n``
  without its barrier) and ``m`` starts aligning.
* Cancel marker ``n`` while aligning ``n``: ``n`` is aborted, all channels unblocked.  Cancel
  marker ``m`` newer than the current id: the current checkpoint (if any) and ``m`` are aborted.
* ``abort(n)`` (the coordinator gave up on ``n``): ``n`` is aborted here; the checkpoint
  being aligned is kept when it is another one (with ``max_concurrent > 1`` it may still
  complete).
* End of stream on ``c``: ``c`` is no longer live and counts as aligned for every later
  checkpoint; if that completes an alignment the snapshot is triggered.  When every channel
  has ended: :class:`EndOfInput`.
* :class:`AbortCheckpoint` is emitted at most once per id (the runtime declines the
  checkpoint to the coordinator and forwards a cancel marker downstream); an id is never both
  triggered and aborted.

Protocol violations (an event on a blocked or ended channel, an unknown channel) raise
:class:`~abs.errors.AlignmentError`: they are runtime bugs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from abs.errors import AlignmentError, ConfigError

__all__ = [
    "BarrierAligner",
    "TriggerSnapshot",
    "AbortCheckpoint",
    "EndOfInput",
    "AlignerAction",
]


@dataclass(frozen=True)
class TriggerSnapshot:
    """Every live channel delivered barrier ``checkpoint_id``: take the synchronous snapshot,
    forward the barrier downstream. Channels are already unblocked."""

    checkpoint_id: int


@dataclass(frozen=True)
class AbortCheckpoint:
    """Checkpoint ``checkpoint_id`` cannot complete at this task: decline it to the
    coordinator and forward a cancel marker downstream. Emitted at most once per id."""

    checkpoint_id: int
    reason: str


@dataclass(frozen=True)
class EndOfInput:
    """Every input channel has ended."""


AlignerAction = Union[TriggerSnapshot, AbortCheckpoint, EndOfInput]
_NO_ACTIONS: tuple = ()
_NOTHING_BLOCKED: frozenset[int] = frozenset()


class _Context:
    """Bookkeeping shared by the states: live channels and the ids closed here."""

    __slots__ = ("num_channels", "live", "closed_upto", "aborted_ahead")

    def __init__(self, num_channels: int) -> None:
        self.num_channels = num_channels
        self.live: frozenset[int] = frozenset(range(num_channels))
        self.closed_upto: int | None = None  # every id <= this is closed
        self.aborted_ahead: set[int] = set()  # ids > closed_upto aborted by the coordinator

    def is_closed(self, checkpoint_id: int) -> bool:
        return (
            self.closed_upto is not None and checkpoint_id <= self.closed_upto
        ) or checkpoint_id in self.aborted_ahead

    def close_upto(self, checkpoint_id: int) -> None:
        if self.closed_upto is None or checkpoint_id > self.closed_upto:
            self.closed_upto = checkpoint_id
            if self.aborted_ahead:
                self.aborted_ahead = {c for c in self.aborted_ahead if c > checkpoint_id}


def _start(ctx: _Context, checkpoint_id: int, channel: int) -> tuple["_State", tuple]:
    """Start aligning ``checkpoint_id`` with ``channel`` blocked (trigger at once if alone).

    Every older id is closed: ``channel`` went past it without its barrier.
    """
    ctx.close_upto(checkpoint_id - 1)
    return _Aligning(checkpoint_id, frozenset((channel,))).maybe_trigger(ctx)


def _abort_one(ctx: _Context, checkpoint_id: int, reason: str) -> AbortCheckpoint:
    """Close a single id that is newer than anything closed so far (coordinator abort)."""
    ctx.aborted_ahead.add(checkpoint_id)
    return AbortCheckpoint(checkpoint_id, reason)


class _State:
    blocked: frozenset[int] = _NOTHING_BLOCKED
    aligning: int | None = None

    def on_barrier(self, ctx: _Context, channel: int, checkpoint_id: int) -> tuple["_State", tuple]:
        raise NotImplementedError

    def on_cancel(self, ctx: _Context, channel: int, checkpoint_id: int) -> tuple["_State", tuple]:
        raise NotImplementedError

    def on_end_of_stream(self, ctx: _Context, channel: int) -> tuple["_State", tuple]:
        raise NotImplementedError

    def abort(self, ctx: _Context, checkpoint_id: int, reason: str) -> tuple["_State", tuple]:
        raise NotImplementedError


class _Idle(_State):
    def on_barrier(self, ctx: _Context, channel: int, checkpoint_id: int) -> tuple[_State, tuple]:
        if ctx.is_closed(checkpoint_id):
            return self, _NO_ACTIONS
        return _start(ctx, checkpoint_id, channel)

    def on_cancel(self, ctx: _Context, channel: int, checkpoint_id: int) -> tuple[_State, tuple]:
        if ctx.is_closed(checkpoint_id):
            return self, _NO_ACTIONS
        ctx.close_upto(checkpoint_id)
        return self, (AbortCheckpoint(checkpoint_id, f"cancel marker on channel {channel}"),)

    def on_end_of_stream(self, ctx: _Context, channel: int) -> tuple[_State, tuple]:
        ctx.live = ctx.live - {channel}
        if not ctx.live:
            return _FINISHED, (EndOfInput(),)
        return self, _NO_ACTIONS

    def abort(self, ctx: _Context, checkpoint_id: int, reason: str) -> tuple[_State, tuple]:
        if ctx.is_closed(checkpoint_id):
            return self, _NO_ACTIONS
        return self, (_abort_one(ctx, checkpoint_id, reason),)


_IDLE = _Idle()


class _Aligning(_State):
    __slots__ = ("aligning", "blocked")

    def __init__(self, checkpoint_id: int, blocked: frozenset[int]) -> None:
        self.aligning: int = checkpoint_id
        self.blocked = blocked

    def __repr__(self) -> str:
        return f"Aligning({self.aligning}, blocked={sorted(self.blocked)})"

    def maybe_trigger(self, ctx: _Context) -> tuple[_State, tuple]:
        if self.blocked >= ctx.live:
            ctx.close_upto(self.aligning)
            return _IDLE, (TriggerSnapshot(self.aligning),)
        return self, _NO_ACTIONS

    def _abort_current(self, ctx: _Context, reason: str) -> AbortCheckpoint:
        ctx.close_upto(self.aligning)
        return AbortCheckpoint(self.aligning, reason)

    def on_barrier(self, ctx: _Context, channel: int, checkpoint_id: int) -> tuple[_State, tuple]:
        n = self.aligning
        if checkpoint_id == n:
            return _Aligning(n, self.blocked | {channel}).maybe_trigger(ctx)
        if checkpoint_id < n:
            return self, _NO_ACTIONS  # closed when n started
        aborted = self._abort_current(
            ctx, f"newer barrier {checkpoint_id} on channel {channel} before barrier {n}"
        )
        if ctx.is_closed(checkpoint_id):
            return _IDLE, (aborted,)
        state, actions = _start(ctx, checkpoint_id, channel)
        return state, (aborted, *actions)

    def on_cancel(self, ctx: _Context, channel: int, checkpoint_id: int) -> tuple[_State, tuple]:
        n = self.aligning
        if checkpoint_id < n:
            return self, _NO_ACTIONS
        if checkpoint_id == n:
            return _IDLE, (self._abort_current(ctx, f"cancel marker on channel {channel}"),)
        aborted = self._abort_current(
            ctx, f"cancel marker for newer checkpoint {checkpoint_id} on channel {channel}"
        )
        if ctx.is_closed(checkpoint_id):
            return _IDLE, (aborted,)
        ctx.close_upto(checkpoint_id)
        return _IDLE, (aborted, AbortCheckpoint(checkpoint_id, f"cancel marker on channel {channel}"))

    def on_end_of_stream(self, ctx: _Context, channel: int) -> tuple[_State, tuple]:
        ctx.live = ctx.live - {channel}
        return self.maybe_trigger(ctx)  # blocked channels are live, so live is not empty

    def abort(self, ctx: _Context, checkpoint_id: int, reason: str) -> tuple[_State, tuple]:
        if checkpoint_id == self.aligning:
            return _IDLE, (self._abort_current(ctx, reason),)
        if ctx.is_closed(checkpoint_id) or checkpoint_id < self.aligning:
            return self, _NO_ACTIONS
        return self, (_abort_one(ctx, checkpoint_id, reason),)


class _Finished(_State):
    def abort(self, ctx: _Context, checkpoint_id: int, reason: str) -> tuple[_State, tuple]:
        return self, _NO_ACTIONS


_FINISHED = _Finished()


class BarrierAligner:
    """Barrier alignment for a task with input channels ``0 .. num_channels-1``.

    Each event method returns a tuple of actions (possibly empty) to carry out in order.
    """

    __slots__ = ("_ctx", "_state")

    def __init__(self, num_channels: int) -> None:
        if type(num_channels) is not int or num_channels < 1:
            raise ConfigError(
                f"BarrierAligner needs at least one input channel, got num_channels="
                f"{num_channels!r}; tasks without inputs (sources) do not align barriers"
            )
        self._ctx = _Context(num_channels)
        self._state: _State = _IDLE

    # ------------------------------------------------------------------ views
    @property
    def blocked(self) -> frozenset[int]:
        """Channels the runtime must not consume from."""
        return self._state.blocked

    @property
    def live(self) -> frozenset[int]:
        """Channels that have not ended."""
        return self._ctx.live

    @property
    def aligning(self) -> int | None:
        """Id of the checkpoint being aligned, or None."""
        return self._state.aligning

    @property
    def finished(self) -> bool:
        """True once every channel has ended."""
        return self._state is _FINISHED

    @property
    def num_channels(self) -> int:
        return self._ctx.num_channels

    def __repr__(self) -> str:
        return (
            f"BarrierAligner({type(self._state).__name__.lstrip('_')}, aligning={self.aligning}, "
            f"blocked={sorted(self.blocked)}, live={sorted(self.live)})"
        )

    # ------------------------------------------------------------------ events
    def add_channel(self, channel: int) -> None:
        """Channel ``channel`` (the next index) joins: live from now on, so every checkpoint
        aligned from here waits for its barrier. The runtime adds a channel only between
        alignments (a rescale's join step: every checkpoint before it is closed here, and the
        channel's first element was that step's marker)."""
        ctx = self._ctx
        if channel != ctx.num_channels or self._state.aligning is not None or self._state is _FINISHED:
            raise AlignmentError(
                f"channel {channel} cannot join now (channels 0..{ctx.num_channels - 1}, {self!r}); channels "
                "join between alignments, numbered in order (a runtime bug)"
            )
        ctx.num_channels += 1
        ctx.live = ctx.live | {channel}

    def _check(self, channel: int, what: str) -> None:
        ctx = self._ctx
        if type(channel) is not int or not 0 <= channel < ctx.num_channels:
            raise AlignmentError(
                f"{what} on unknown channel {channel!r}; channels are 0..{ctx.num_channels - 1} "
                "(a runtime bug)"
            )
        if channel not in ctx.live:
            raise AlignmentError(
                f"{what} on channel {channel} after its end of stream; a channel delivers "
                "nothing after end of stream (a runtime bug)"
            )
        if channel in self._state.blocked:
            raise AlignmentError(
                f"{what} on channel {channel}, which is blocked for checkpoint "
                f"{self._state.aligning}; the runtime must not consume from blocked channels "
                "(a runtime bug)"
            )

    def on_barrier(self, channel: int, checkpoint_id: int) -> tuple[AlignerAction, ...]:
        """Barrier ``checkpoint_id`` was consumed from ``channel``."""
        self._check(channel, f"barrier {checkpoint_id}")
        self._state, actions = self._state.on_barrier(self._ctx, channel, checkpoint_id)
        return actions

    def on_cancel(self, channel: int, checkpoint_id: int) -> tuple[AlignerAction, ...]:
        """A cancel marker for ``checkpoint_id`` was consumed from ``channel``."""
        self._check(channel, f"cancel marker {checkpoint_id}")
        self._state, actions = self._state.on_cancel(self._ctx, channel, checkpoint_id)
        return actions

    def on_end_of_stream(self, channel: int) -> tuple[AlignerAction, ...]:
        """``channel`` ended; it counts as aligned for every later checkpoint."""
        self._check(channel, "end of stream")
        self._state, actions = self._state.on_end_of_stream(self._ctx, channel)
        return actions

    def is_closed(self, checkpoint_id: int) -> bool:
        """True when ``checkpoint_id`` was triggered or aborted here (or is older than one that was)."""
        return self._ctx.is_closed(checkpoint_id)

    def give_up(self, checkpoint_id: int) -> frozenset[int]:
        """Alignment of ``checkpoint_id`` took too long (``CheckpointConfig.alignment_timeout``):
        the task snapshots it unaligned instead. Closes it here and unblocks every channel
        without an action; returns the channels that had delivered its barrier (nothing of
        theirs is in front of the barrier any more). Also when no barrier of it arrived yet
        (the task heard of it only by announcements): it is closed here all the same. Refused
        while an older checkpoint aligns."""
        state = self._state
        if state.aligning is not None and state.aligning != checkpoint_id:
            raise AlignmentError(f"checkpoint {checkpoint_id} given up while {state.aligning} aligns (a runtime bug)")
        if state is _FINISHED:
            return _NOTHING_BLOCKED
        self._ctx.close_upto(checkpoint_id)
        self._state = _IDLE
        return state.blocked

    def abort(self, checkpoint_id: int, reason: str = "aborted by the coordinator") -> tuple[AlignerAction, ...]:
        """The coordinator aborted ``checkpoint_id`` (timeout, decline elsewhere, ...)."""
        self._state, actions = self._state.abort(self._ctx, checkpoint_id, reason)
        return actions
