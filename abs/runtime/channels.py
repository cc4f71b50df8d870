"""Channels: framing of stream elements, input gates with bounded per-channel buffers, and
senders (local: straight into the downstream gate; remote: framed over TCP).

Elements on a channel are Arrow record batches, :class:`Barrier`, :class:`CancelMarker`,
:class:`StepMarker` and :data:`EOS`, strictly FIFO per channel. With unaligned checkpoints a
sender also *announces* each barrier ahead of its queued elements (:class:`Announcement`: on
a connection of its own for a remote channel, straight into the gate for a local one), with
the number of elements it sent before it; the gate then lets that many elements in without
waiting for room and captures those the task had not taken at its snapshot (the checkpoint's
channel state, :mod:`abs.runtime.unaligned`).

A remote channel's in-flight data is bounded on both sides of its TCP connection
(:func:`connect_channel`, :func:`accept_channel`): the gate holds at most its capacity of
elements, and the kernel's socket buffers at most :data:`SOCKET_BUFFER_BYTES` each.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import select
import socket
import struct
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import pyarrow as pa

from .capture import CaptureComplete, ChannelStateCapture

__all__ = [
    "Barrier",
    "CancelMarker",
    "StepMarker",
    "Announcement",
    "CaptureComplete",
    "EOS",
    "encode",
    "decode",
    "InputGate",
    "LocalSender",
    "RemoteSender",
    "GateClosed",
    "GATE_ROWS",
    "SOCKET_BUFFER_BYTES",
    "connect_channel",
    "accept_channel",
    "no_delay",
]


@dataclasses.dataclass(frozen=True)
class Barrier:
    """Checkpoint barrier ``checkpoint_id``: everything before it on a channel belongs to
    the snapshot, everything after it does not. ``base`` is the newest checkpoint that was
    complete when the coordinator triggered this one: a task that has not yet heard of
    ``base``'s completion treats the barrier as that notice first, so that its incremental
    snapshot always builds on ``base`` (which the coordinator keeps from GC meanwhile)."""

    checkpoint_id: int
    base: int = 0


@dataclasses.dataclass(frozen=True)
class CancelMarker:
    """Checkpoint ``checkpoint_id`` was aborted upstream; stop aligning it."""

    checkpoint_id: int


@dataclasses.dataclass(frozen=True)
class StepMarker:
    """Reconfiguration step ``step`` (:mod:`abs.reconfig`): every record before it on a
    channel went to the key groups' old owners, every record after it goes to their new ones.
    ``moves``: (key group, new owner) pairs, so that every task derives its new routing;
    ``base``: the newest complete checkpoint when the driver started the step (taken as its
    completion notice, as :attr:`Barrier.base`). A rescale's steps also carry ``workers``, the
    number of workers from this step on, and their ``phase`` (:mod:`abs.reconfig.plan`: a join
    adds the senders to the new workers at the marker, a drain stops spreading records over the
    leaving ones, a retire ends the channels to them)."""

    step: int
    moves: tuple[tuple[int, int], ...]
    base: int = 0
    workers: int = 0
    phase: str = ""


_PHASES = ("", "join", "drain", "retire")


@dataclasses.dataclass(frozen=True)
class Announcement:
    """Barrier ``barrier`` was sent on this channel after ``seq`` elements (its own index on
    the channel is ``seq``): delivered ahead of the elements queued in front of it."""

    barrier: Barrier
    seq: int


class _Eos:
    def __repr__(self) -> str:
        return "EOS"


EOS = _Eos()

# the type tag is padded to 8 bytes so that the Arrow IPC body that follows stays 8-byte
# aligned in the receive buffer (compute kernels warn about, and copy, unaligned buffers)
_BATCH, _BARRIER, _CANCEL, _EOS, _STEP, _ANNOUNCE = b"B" * 8, b"R" * 8, b"C" * 8, b"E" * 8, b"S" * 8, b"A" * 8
_TAG = 8
_ID = struct.Struct("<q")
_IDS = struct.Struct("<qq")


class GateClosed(Exception):
    """The gate was closed (the task is shutting down)."""


def encode(item: Any) -> Any:
    """Frame one element as bytes-like: a type byte, then the payload."""
    if isinstance(item, pa.RecordBatch):
        sink = pa.BufferOutputStream()
        sink.write(_BATCH)
        with pa.ipc.new_stream(sink, item.schema) as writer:
            writer.write_batch(item)
        return sink.getvalue()
    if isinstance(item, Barrier):
        return _BARRIER + _IDS.pack(item.checkpoint_id, item.base)
    if isinstance(item, CancelMarker):
        return _CANCEL + _ID.pack(item.checkpoint_id)
    if isinstance(item, StepMarker):
        flat = [v for pair in item.moves for v in pair]
        return (_STEP + _IDS.pack(item.step, item.base) + _IDS.pack(item.workers, _PHASES.index(item.phase))
                + _ID.pack(len(item.moves)) + struct.pack(f"<{len(flat)}q", *flat))
    if item is EOS:
        return _EOS
    if isinstance(item, Announcement):
        return _ANNOUNCE + _IDS.pack(item.barrier.checkpoint_id, item.barrier.base) + _ID.pack(item.seq)
    raise TypeError(f"cannot send {type(item).__name__} on a channel")


def decode(frame: bytes) -> Any:
    kind = frame[:_TAG]
    if kind == _BATCH:
        return pa.ipc.open_stream(pa.py_buffer(frame)[_TAG:]).read_next_batch()
    if kind == _BARRIER:
        return Barrier(*_IDS.unpack_from(frame, _TAG))
    if kind == _CANCEL:
        return CancelMarker(_ID.unpack_from(frame, _TAG)[0])
    if kind == _STEP:
        step, base = _IDS.unpack_from(frame, _TAG)
        workers, phase = _IDS.unpack_from(frame, _TAG + _IDS.size)
        (n,) = _ID.unpack_from(frame, _TAG + 2 * _IDS.size)
        flat = struct.unpack_from(f"<{2 * n}q", frame, _TAG + 2 * _IDS.size + _ID.size)
        return StepMarker(step, tuple(zip(flat[0::2], flat[1::2])), base, workers, _PHASES[phase])
    if kind == _EOS:
        return EOS
    if kind == _ANNOUNCE:
        cid, base = _IDS.unpack_from(frame, _TAG)
        return Announcement(Barrier(cid, base), _ID.unpack_from(frame, _TAG + _IDS.size)[0])
    raise ValueError(f"corrupt channel frame (type byte {kind!r})")


GATE_ROWS = 24_576
"""The records a task's input gate holds, shared out evenly over its channels: a channel is
full at ``capacity`` elements, or at its share of this many rows once it holds two elements
(one being taken while the next waits, whatever the batches' size).

A barrier waits behind what its channel holds. In the checkpoints of 100 k string keys every
second (``scripts/bench_checkpoint_interval.py``), with 8 batches of 8,192 records a channel the
barrier reached the keyed task 0.064 s (0.041..0.236) after the trigger at p=1 and 0.131 s
(0.015..0.308) at p=2; with this bound (three batches at p=1, three of the ~4,096-record slices
a channel at p=2) 0.035 s (0.028..0.195) and 0.072 s (0.005..0.111): medians (ranges) of 6
interleaved rounds. Throughput of the reference job (``process``, 2 M events) and CPU per event
did not change beyond the machine's noise (paired ratios 0.4..2.3, their medians 0.9..1.2)."""

WAKE_AT = 1
"""A sender waiting for room in a full channel is woken once the channel holds at most this
many elements, not at the first element taken: it then fills the channel in one go instead of
being woken for every element. Where sender and receiver are threads of one worker (p=1: the
source and the keyed task), waking the sender at every batch made the two threads trade the
GIL inside every batch; on the reference aggregate job's batches (100 k string keys, 8,192
records) a source thread and an aggregate thread so coupled took 13-37 % more CPU than one
thread doing both (3 runs; waking at 0 or 2 of 8 elements: 0-10 %)."""


class InputGate(ChannelStateCapture):
    """The inputs of one task: ``n`` FIFO channels with at most ``capacity`` buffered
    elements each (and their share of ``rows`` records, see :data:`GATE_ROWS`), plus a queue
    of control events that always go first.

    ``take(blocked)`` returns the next element of a channel that is not blocked (round
    robin, so no channel starves), which is how barrier alignment stops only the channels
    that delivered the barrier.
    """

    def __init__(self, num_channels: int, capacity: int = 8, unbounded: frozenset[int] = frozenset(),
                 rows: int = GATE_ROWS) -> None:
        if capacity < 1 or rows < 1:
            raise ValueError(f"an input gate holds at least one element and one row a channel (got capacity "
                             f"{capacity}, rows {rows}): give positive values")
        self._cond = threading.Condition()
        self._queues: list[collections.deque] = [collections.deque() for _ in range(num_channels)]
        self._rows = [0] * num_channels  # records queued per channel
        self._sender_waits = [False] * num_channels  # a sender waits for room (woken at WAKE_AT)
        self._control: collections.deque = collections.deque()
        self._capacity = capacity
        self._gate_rows = rows
        # an iteration head's feedback channels never block their sender: with bounded buffers
        # all round a loop, the head waiting on the body and the body on the head would deadlock
        self._unbounded = unbounded
        # unaligned checkpoints: elements put and taken per channel (their indices), barrier
        # announcements for the task, how far a channel may go past its capacity (up to an
        # announced barrier) and the channel state being captured per checkpoint
        self._received = [0] * num_channels
        self._taken = [0] * num_channels
        self._priority: collections.deque = collections.deque()
        self._overdraft = [0] * num_channels
        self._captures: dict[int, Any] = {}
        self._next = 0
        self._closed = False

    @property
    def num_channels(self) -> int:
        return len(self._queues)

    def add_channel(self, notice: Any) -> int:
        """A channel more (a worker joined a running job): its index; ``notice(index)`` is
        queued as a control event in the same step, so the task hears of the channel before
        anything arrives on it (control events go first)."""
        with self._cond:
            self._queues.append(collections.deque())
            for counts in (self._received, self._taken, self._overdraft, self._rows):
                counts.append(0)
            self._sender_waits.append(False)
            channel = len(self._queues) - 1
            self._control.append(notice(channel))
            self._cond.notify_all()
            return channel

    def _over(self, channel: int) -> bool:
        """``channel`` holds its capacity of elements or of rows (see :data:`GATE_ROWS`)."""
        n = len(self._queues[channel])
        return n >= self._capacity or (n >= 2 and self._rows[channel] * len(self._queues) >= self._gate_rows)

    def put(self, channel: int, item: Any) -> None:
        """Append to a channel; blocks while that channel's buffer is full (backpressure)."""
        with self._cond:
            q = self._queues[channel]
            while (self._over(channel) and not self._closed and channel not in self._unbounded
                   and self._received[channel] >= self._overdraft[channel]):
                self._sender_waits[channel] = True
                self._cond.wait()
            if self._closed:
                raise GateClosed()
            q.append(item)
            if isinstance(item, pa.RecordBatch):
                self._rows[channel] += item.num_rows
            index = self._received[channel]
            self._received[channel] = index + 1
            if self._captures:
                self._capture(channel, index, item, item is EOS)
            self._cond.notify_all()

    def put_control(self, event: Any) -> None:
        with self._cond:
            self._control.append(event)
            self._cond.notify_all()

    def take_batches(self, channels: "frozenset[int] | set[int]", max_rows: int) -> list:
        """``(channel, batch)`` for the record batches at the head of ``channels``' queues, in
        order, up to about ``max_rows`` rows (an iteration head merges the small batches that
        came round before processing them; nothing behind a barrier or marker is taken)."""
        out: list = []
        with self._cond:
            for ch in sorted(channels):
                q = self._queues[ch]
                while q and max_rows > 0 and isinstance(q[0], pa.RecordBatch):
                    batch = q.popleft()
                    self._taken[ch] += 1
                    self._rows[ch] -= batch.num_rows
                    max_rows -= batch.num_rows
                    out.append((ch, batch))
            if out:
                self._cond.notify_all()
        return out

    def has_room(self, channel: int) -> bool:
        """``channel`` takes an element without waiting (read without the lock: a moment's view)."""
        return (not self._over(channel) or channel in self._unbounded
                or self._received[channel] < self._overdraft[channel])

    def put_priority(self, channel: int, announcement: "Announcement") -> None:
        """A barrier announced ahead of its channel's queued elements: the task hears of it
        before them, and the channel takes the elements in front of it without waiting."""
        with self._cond:
            self._priority.append((channel, announcement))
            self._overdraft[channel] = max(self._overdraft[channel], announcement.seq)
            self._cond.notify_all()

    def take(self, blocked: "frozenset[int] | set[int]", timeout: float) -> "tuple[int, Any] | None":
        """Next ``(channel, element)`` from an unblocked channel, ``(-1, event)`` for a control
        event, or ``None`` after ``timeout`` seconds without either."""
        with self._cond:
            waited = False
            while True:
                if self._control:
                    return -1, self._control.popleft()
                if self._priority:
                    return self._priority.popleft()
                n = len(self._queues)
                for step in range(n):
                    ch = (self._next + step) % n
                    q = self._queues[ch]
                    if q and ch not in blocked:
                        self._next = (ch + 1) % n
                        item = q.popleft()
                        self._taken[ch] += 1
                        if isinstance(item, pa.RecordBatch):
                            self._rows[ch] -= item.num_rows
                        if self._sender_waits[ch] and len(q) <= WAKE_AT:  # see WAKE_AT
                            self._sender_waits[ch] = False
                            self._cond.notify_all()
                        return ch, item
                if waited:
                    return None
                self._cond.wait(timeout)
                waited = True

    def wait_control(self, timeout: float) -> "Any | None":
        """Wait up to ``timeout`` for a control event (source tasks have no channels)."""
        with self._cond:
            if not self._control and timeout > 0:
                self._cond.wait(timeout)
            return self._control.popleft() if self._control else None

    def buffered(self) -> list[int]:
        with self._cond:
            return [len(q) for q in self._queues]

    def fill(self) -> float:
        """The share of the input buffers in use (0: nothing queued, 1: every channel full)."""
        with self._cond:
            n = len(self._queues)
            share = self._gate_rows / max(1, n)  # a channel's rows (see GATE_ROWS)
            return sum(min(1.0, max(len(q) / self._capacity, rows / share))
                       for q, rows in zip(self._queues, self._rows)) / max(1, n)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _SendClock:
    """The time a sender spends in its sends (``blocked``: backpressure), the one in progress
    included: a send that waits seconds for room shows while it waits, not only once it returns."""

    _blocked = 0.0
    _since = 0.0  # when the send in progress began (0: none)

    @property
    def blocked(self) -> float:
        since = self._since
        return self._blocked + (time.perf_counter() - since if since else 0.0)

    def _clocked(self, send: Any, payload: Any) -> None:
        t0 = self._since = time.perf_counter()
        send(payload)
        self._since = 0.0
        self._blocked += time.perf_counter() - t0


class LocalSender(_SendClock):
    """A channel to a task in the same worker: elements are handed over without copying.
    ``blocked``: seconds spent in :meth:`send` (waiting while the receiver's buffer is full:
    backpressure), read by the task's load figures."""

    def __init__(self, gate: InputGate, channel: int) -> None:
        self._gate = gate
        self._channel = channel
        self.sent = 0  # elements sent (the index of the next)

    def send(self, item: Any) -> None:
        self._clocked(self._put, item)
        self.sent += 1

    def _put(self, item: Any) -> None:
        self._gate.put(self._channel, item)

    def announce(self, barrier: Barrier) -> None:
        """Announce ``barrier`` ahead of what is queued (it is sent next, in order, too)."""
        self._gate.put_priority(self._channel, Announcement(barrier, self.sent))

    def ready(self) -> bool:
        """The receiving gate has room for an element on this channel (a moment's view)."""
        return self._gate.has_room(self._channel)

    def close(self) -> None:
        pass


class RemoteSender(_SendClock):
    """A channel to a task in another worker over an authenticated connection."""

    def __init__(self, conn: Any, priority: Any = None) -> None:
        self._conn = conn
        self._priority = priority  # the connection announcements go on (unaligned checkpoints)
        self.sent = 0  # blocked: seconds in send_bytes, the socket buffers full (_SendClock)

    def send(self, item: Any) -> None:
        self._clocked(self._conn.send_bytes, encode(item))
        self.sent += 1

    def ready(self) -> bool:
        """The connection's send buffer has room (a send of a batch would not wait long)."""
        try:
            return bool(select.select((), (self._conn,), (), 0)[1])
        except (OSError, ValueError):
            return True  # closed: the send reports it

    def announce(self, barrier: Barrier) -> None:
        if self._priority is None:
            raise RuntimeError("a barrier announced on a channel without a priority connection (a runtime bug)")
        self._priority.send_bytes(encode(Announcement(barrier, self.sent)))

    def close(self) -> None:
        for conn in (self._conn, self._priority):
            try:
                if conn is not None:
                    conn.close()
            except OSError:
                pass


# ------------------------------------------------------------------ remote connections
SOCKET_BUFFER_BYTES = 256 * 1024
"""What each side's kernel may buffer of a remote channel (Linux reserves twice the value).

Left to the kernel, a loopback connection's buffers grow to megabytes (a sender whose
receiver stopped reading got 3.9 MB in; with this bound 0.9 MB), about a hundred batches per
channel that every barrier waits behind: in the 1M-key paper job at p=2 the mean alignment
was 79 ms, 38 ms with the bound (medians of 8 interleaved runs), for the same throughput
within the noise. It also makes the gate's capacity the real bound on a channel's in-flight
data, give or take this much."""


def _bound_buffer(conn: Connection, option: int) -> None:
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))  # a view of the same connection
    except OSError:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
    except OSError:
        pass  # a platform that refuses the option keeps its own buffers: slower barriers, same results
    finally:
        sock.close()  # closes the duplicate descriptor only


def no_delay(conn: Connection, on: bool = True) -> None:
    """Send ``conn``'s small writes at once (``TCP_NODELAY``), or coalesce them again (``on=False``).

    After the authentication handshake of :mod:`multiprocessing.connection` the connecting
    side has written twice in a row (its last handshake message, then its first message); the
    kernel holds the second until the first is acknowledged, and the peer delays that
    acknowledgement by 40 ms: each connection made at start-up (a worker's hello to the driver,
    every channel's hello to its receiver) waited 40-47 ms for it."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))  # a view of the same connection
    except OSError:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1 if on else 0)
    except OSError:
        pass  # not TCP (or refused): the first message may wait for the peer's acknowledgement
    finally:
        sock.close()  # closes the duplicate descriptor only


def connect_channel(address: tuple, authkey: bytes, hello: bytes | None = None) -> Connection:
    """The sending end of a remote channel: an authenticated connection to ``address`` whose
    send buffer holds at most :data:`SOCKET_BUFFER_BYTES`; ``hello``, when given, is its first
    message, sent at once (:func:`no_delay`). The channel's data is then coalesced as the kernel
    does by default (measured with ``TCP_NODELAY`` left on: no gain, possibly a loss at p=2)."""
    conn = Client(address, authkey=authkey)
    _bound_buffer(conn, socket.SO_SNDBUF)
    if hello is not None:
        no_delay(conn)
        conn.send_bytes(hello)
        no_delay(conn, on=False)
    return conn


def accept_channel(listener: Listener) -> Connection:
    """The receiving end of the next remote channel on ``listener`` (authenticated by it),
    whose receive buffer holds at most :data:`SOCKET_BUFFER_BYTES`."""
    conn = listener.accept()
    _bound_buffer(conn, socket.SO_RCVBUF)
    return conn
