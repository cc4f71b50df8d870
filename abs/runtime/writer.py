"""A worker's snapshot writer process: the asynchronous part of its snapshots, out of its GIL.

Why a process: the asynchronous part (Arrow encoding, sorting, zstd, checksums, file writes)
is a long series of short calls that each release and re-take the GIL. In a thread of a
worker whose task threads run Python flat out, every re-take waits for the interpreter's
switch interval (5 ms): encoding 128 key groups took 28 s of wall time for 0.6 s of CPU, and
checkpoints stopped completing once a second. In a process of its own the same work takes the
CPU it needs on whatever core is free, and the worker's uploader thread only hands it the
captured copies (one pickled message per checkpoint, one reply; a large capture of the
columnar aggregate store goes a chunk of key groups per message, see below).

The process is forked at the very start of the worker, before the worker has a thread (so no
lock can be held across the fork) and after its modules are imported (so it starts in a few
milliseconds instead of the half second a fresh interpreter needs to import pyarrow and
fsspec). Protocol on a pipe (worker to writer: :func:`send_frame` frames, pickled with protocol 5
and the numpy buffers of the captured copies out of band, written with one ``writev``; writer to
worker: ``Connection.send``):

* :class:`~abs.runtime.messages.WriterOpen` once, when the job has a storage root;
* :class:`~abs.runtime.messages.WriteSnapshot` ``(checkpoint_id, jobs)``, written with
  :meth:`SnapshotStore.write_key_groups` (one packed file per state and checkpoint instead of
  a file per key group); a job is a :class:`~abs.runtime.messages.WriteJob` ``(operator,
  state, key_group, prev_chain, delta, complete)`` with ``delta`` a
  :class:`~abs.state.ColumnDelta`, a :class:`~abs.state.PickledDelta` (captured copies,
  encoded here) or a ``pyarrow.Table``;
  reply :class:`~abs.runtime.messages.WriteDone` ``([new_chain, ...], cpu_seconds)`` in job
  order with the CPU time the writer spent on receiving and writing them, or
  :class:`~abs.runtime.messages.WriteFailed` ``(message)`` after the first failing job (the
  checkpoint is then declined; files already written are garbage for GC).
  A capture of the columnar aggregate store of more than
  :data:`~abs.state.capture.CHUNK_ROWS` rows (:data:`~abs.state.capture.INT_CHUNK_ROWS` for
  integer keys) is cut in chunks of key groups
  (:meth:`~abs.state.capture.FrozenSlots.chunk`) and goes as one ``WriteSnapshot`` per chunk,
  each answered before the next is sent: the worker cuts chunk ``i + 1`` (gathers its keys,
  copies its values) while the writer encodes chunk ``i``, on the other core, instead of the
  writer waiting for the whole capture to be cut (a full checkpoint of 1 M string keys: the
  critical path of the two CPU parts 333 -> 266 ms). Each chunk is a packed file of its own.

The process exits when the pipe closes (its worker ended or was killed: the read sees EOF)
and, on Linux, when its parent dies (``PR_SET_PDEATHSIG``). A worker whose writer died
writes in its uploader thread again, through an :class:`InThreadWriter` that keeps the same
memory (:func:`write_jobs` is the one write path of both).

The writer is supervised like a worker: :meth:`SnapshotWriter.write` takes a ``timeout``,
and a writer that has not answered by then (stopped, hung, stuck on a dead connection) is
killed (``SIGKILL``: it is the worker's own child) and the write raises
:class:`WriterHungError`; the worker declines that checkpoint and writes in its own thread
from then on, as for a writer that died.
"""
from __future__ import annotations

import functools
import importlib
import io
import multiprocessing
import os
import pickle
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

from abscore.gcpause import gc_paused

from . import messages as m

__all__ = ["FrameReader", "SnapshotWriter", "WriterHungError", "die_with_parent", "recv_frame", "send_frame",
           "writes_in_process"]

_IOV_MAX = 1024  # POSIX guarantees at least 16; Linux and macOS allow 1024
_ALIGN = 64  # every out-of-band buffer starts at a multiple of this in the frame
_IN_BAND = 4096  # smaller numpy buffers are pickled in band (see send_frame)


def send_frame(conn: Any, msg: Any) -> None:
    """Send ``msg`` on a ``multiprocessing`` connection, to be read with :func:`recv_frame`.

    Why not ``conn.send``: it pickles with protocol 4, which copies every numpy array of the
    captured state into one growing bytes object while holding the GIL (40 ms for the 19 MB
    of a 1M-key checkpoint; the worker's task threads wait that long). Here the arrays stay
    where they are (pickle protocol 5, out-of-band buffers) and one ``writev`` call, without
    the GIL, hands them to the pipe. The frame is one ``Connection`` message: a length
    header, then ``!QQ`` (pickle length, buffer count), the buffer lengths (``!Q`` each), the
    pickle and the buffers, each at an offset that is a multiple of 64. numpy arrays of fewer
    than :data:`_IN_BAND` bytes go inside the pickle instead (a small key group's: a copy of up
    to 4 KiB costs less than a buffer's place in the frame, on both sides; they arrive at
    Python's allocation alignment, 16 bytes).
    """
    buffers: list = []

    def keep(buffer: pickle.PickleBuffer) -> bool:  # False: out of band
        raw = buffer.raw()
        if raw.nbytes < _IN_BAND and isinstance(raw.obj, np.ndarray):
            return True  # numpy's; Arrow's stay 64-byte aligned (its kernels expect it)
        buffers.append(buffer)
        return False

    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=keep)
    # no memo: the captured state is many small objects (keys, strings), and remembering each
    # one made pickling 6x slower (1M strings: 370 ms, 56 ms without). Nothing the runtime
    # sends refers to itself; should a user's key do so, the ordinary pickler takes over.
    pickler.fast = True
    try:
        pickler.dump(msg)
        data = out.getbuffer()
    except (ValueError, RecursionError):
        buffers.clear()
        data = memoryview(pickle.dumps(msg, protocol=5, buffer_callback=keep))
    views = [b.raw() for b in buffers]
    head = struct.pack(f"!QQ{len(views)}Q", data.nbytes, len(views), *(v.nbytes for v in views))
    parts: list = [head, data]
    at = len(head) + data.nbytes
    for v in views:
        pad = -at % _ALIGN
        if pad:
            parts.append(bytes(pad))
        parts.append(v)
        at += pad + v.nbytes
    size = struct.pack("!i", at) if at <= 0x7FFFFFFF else struct.pack("!iQ", -1, at)
    if not hasattr(os, "writev"):
        conn.send_bytes(b"".join(parts))
        return
    _writev_all(conn.fileno(), [size, *parts])


def _writev_all(fd: int, parts: list) -> None:
    parts = [memoryview(p).cast("B") for p in parts if len(p)]
    i = 0
    while i < len(parts):
        n = os.writev(fd, parts[i:i + _IOV_MAX])  # a blocking pipe takes it all unless interrupted
        while n:
            if n >= parts[i].nbytes:
                n -= parts[i].nbytes
                i += 1
            else:
                parts[i] = parts[i][n:]
                n = 0


class FrameReader:
    """Reads :func:`send_frame` frames into one reused, 64-byte aligned block.

    Why not ``conn.recv_bytes()``: ``Connection`` reads a message in chunks of the socket's
    buffer size into a ``BytesIO`` and copies it out, and the arrays then need one more copy
    to a 64-byte boundary (Arrow's alignment): three copies and a fresh 10 MB allocation (page
    faults) per checkpoint. Here ``os.readv`` moves the bytes from the socket straight into
    the block: the writer's receive went from ~6.5 to ~2.2 ms of CPU for a 9 MB frame.

    The arrays of a message are views of the block. It is reused only when nothing refers to
    it any more (its reference count is back to this reader's own), so a caller that keeps a
    message alive gets a fresh block for the next one and never sees its arrays overwritten.
    """

    def __init__(self) -> None:
        self._block: np.ndarray | None = None

    def recv(self, conn: Any) -> Any:
        """The message of the next frame on ``conn``; ``EOFError`` when the pipe closed."""
        if not hasattr(os, "readv"):
            raw = conn.recv_bytes()
            view = self._view(len(raw))
            view[:] = raw
            del raw
            return _unpack(view)
        fd = conn.fileno()
        head = bytearray(4)
        _read_exact(fd, memoryview(head))
        (size,) = struct.unpack("!i", head)
        if size == -1:  # the 8-byte length of a frame over 2 GiB (as Connection writes it)
            head = bytearray(8)
            _read_exact(fd, memoryview(head))
            (size,) = struct.unpack("!Q", head)
        view = self._view(size)
        _read_exact(fd, view)
        return _unpack(view)

    def _view(self, size: int) -> memoryview:
        """``size`` bytes of the block, from a 64-byte boundary; a new block when the old one
        is too small, more than 4x too big (one huge checkpoint does not pin its memory for
        good) or still referred to."""
        block = self._block
        need = size + _ALIGN
        # 3: the attribute, the local name and getrefcount's argument; a view of a message
        # refers to the block through its memoryview
        if block is None or not need <= len(block) <= 4 * need or sys.getrefcount(block) > 3:
            block = self._block = np.empty(need + need // 4, dtype=np.uint8)  # room to grow
        start = -block.ctypes.data % _ALIGN
        return memoryview(block)[start:start + size]


def _read_exact(fd: int, view: memoryview) -> None:
    while len(view):
        n = os.readv(fd, [view])
        if not n:
            raise EOFError("the pipe closed")
        view = view[n:]


def _unpack(m: memoryview) -> Any:
    n_data, n_bufs = struct.unpack_from("!QQ", m, 0)
    lengths = struct.unpack_from(f"!{n_bufs}Q", m, 16)
    at = 16 + 8 * n_bufs
    data = m[at:at + n_data]
    at += n_data
    buffers = []
    for length in lengths:
        at += -at % _ALIGN
        buffers.append(m[at:at + length])
        at += length
    return pickle.loads(data, buffers=buffers)


def recv_frame(conn: Any) -> Any:
    """The message of one :func:`send_frame` frame, in a block of its own (see
    :class:`FrameReader`, which reuses one); raises ``EOFError`` when the pipe closed."""
    return FrameReader().recv(conn)


class WriterHungError(RuntimeError):
    """A snapshot writer process did not answer one write within its timeout and was killed.

    Remedy: none needed (the worker declines the checkpoint and writes in its own thread from
    then on); if it recurs, look for what stops the process (a debugger, ``SIGSTOP``, swap) or
    raise ``CheckpointConfig.timeout`` when a healthy write takes that long."""


class WriteFailedError(RuntimeError):
    """The snapshot writer process could not write a snapshot; the message is its reason,
    which names the error it met (e.g. ``StorageUnavailableError: ...``)."""


def writes_in_process(storage_url: str | None) -> bool:
    """Whether a worker hands its uploads to a writer process: not for ``memory://`` (a
    process of its own has a memory file system of its own)."""
    return storage_url is not None and not storage_url.startswith("memory://")


class SnapshotWriter:
    """The worker side of the writer process."""

    def __init__(self, conn: Any, process: Any) -> None:
        self._conn = conn
        self._process = process
        self._lock = threading.Lock()
        self.last_cpu = 0.0  # CPU seconds of the last write, as the writer process measured them
        self._sent = SentKeys()

    @classmethod
    def fork(cls) -> "SnapshotWriter | None":
        """Fork the writer; call before the worker starts a thread. ``None`` where ``fork``
        is not available."""
        if "fork" not in multiprocessing.get_all_start_methods():
            return None
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        # the child gets the worker's end too (fork copies every descriptor): it closes it
        # first, or the worker closing its end would never reach the child as end-of-file
        process = ctx.Process(target=_main, args=(child, parent), name="abs-writer", daemon=True)
        process.start()
        child.close()
        return cls(parent, process)

    @property
    def alive(self) -> bool:
        return self._conn is not None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def open(self, storage_url: str, storage_options: dict | None) -> None:
        with self._lock:
            send_frame(self._conn, m.WriterOpen(storage_url, storage_options))

    def write(self, checkpoint_id: int, jobs: list[m.WriteJob], timeout: float | None = None) -> list[list]:
        """New chains for ``jobs`` (see the module docstring); raises ``RuntimeError`` naming
        the first failure, or when the process died, and :class:`WriterHungError` when it did
        not answer within ``timeout`` seconds (it is then killed; see the module docstring)."""
        with self._lock:
            if self._conn is None:
                raise RuntimeError("the snapshot writer process is closed")
            hung = threading.Event()
            watchdog = None
            if timeout is not None:
                # the send blocks too when the pipe is full and the writer reads nothing: killing
                # the process is what ends both waits (EPIPE / end of file)
                watchdog = threading.Timer(timeout, self._kill_hung, args=(hung,))
                watchdog.daemon = True
                watchdog.start()
            chains: list = []
            cpu = 0.0
            try:
                # no cyclic GC while frames are cut and pickled (objects by the key group, none
                # garbage); it runs while the writer works
                with gc_paused():
                    frames = _frames(jobs)
                    send_frame(self._conn, m.WriteSnapshot(checkpoint_id, self._sent.substitute(frames[0])))
                _release_arrow_memory()  # the keys' Arrow arrays, made in this thread
                for frame in frames[1:]:
                    # cut (and gather) the next chunk while the writer encodes the last one
                    try:
                        with gc_paused():
                            frame = self._sent.substitute(frame)
                    except Exception:
                        self._conn.recv()  # the answer to the frame sent: not left for the next write
                        raise
                    done, done_cpu = self._reply(self._conn.recv())
                    chains.extend(done)
                    cpu += done_cpu
                    with gc_paused():
                        send_frame(self._conn, m.WriteSnapshot(checkpoint_id, frame))
                    _release_arrow_memory()
                reply = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._process.join(timeout=5)
                code = self._process.exitcode
                self._close()
                if hung.is_set():
                    raise WriterHungError(
                        f"the snapshot writer process (pid {self._process.pid}) did not answer checkpoint "
                        f"{checkpoint_id}'s write within {timeout:.3g} s and was killed"
                    ) from exc
                raise RuntimeError(f"the snapshot writer process died (exit code {code}): {exc}") from exc
            finally:
                if watchdog is not None:
                    watchdog.cancel()
            last, last_cpu = self._reply(reply)
            self.last_cpu = cpu + last_cpu
        return chains + last

    def _reply(self, reply: Any) -> tuple[list, float]:
        """(chains, CPU seconds) of a :class:`WriteDone`; a :class:`WriteFailed` raises."""
        match reply:
            case m.WriteDone(chains=chains, cpu=cpu):
                return chains, cpu
            case m.WriteFailed(message=message):
                self._sent.forget()  # what the writer holds is unknown: the next write sends every key
                raise WriteFailedError(message)
            case _:
                raise m.unexpected(reply, "snapshot writer client", "its writer process", "WriteDone or WriteFailed")

    def _kill_hung(self, hung: threading.Event) -> None:
        hung.set()
        try:
            self._process.kill()  # SIGKILL ends a stopped process too
        except (OSError, ValueError, AttributeError):
            pass

    def _close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()

    def close(self, timeout: float = 10.0) -> None:
        """Close the pipe and end the process; when a write still holds the writer after
        ``timeout`` seconds (the process hangs), kill the process, which ends that write."""
        if not self._lock.acquire(timeout=timeout):
            self._kill_hung(threading.Event())
            self._lock.acquire()
        try:
            self._close()
        finally:
            self._lock.release()


def _frames(jobs: list[m.WriteJob]) -> list[list[m.WriteJob]]:
    """``jobs`` in consecutive frames, one per chunk of a columnar capture
    (:meth:`~abs.state.capture.FrozenSlots.chunk`): the worker cuts a chunk's rows while the
    writer encodes the frame before (the two processes work at once, on two cores). Other
    jobs go with the frame they follow. Each frame is written as one ``WriteSnapshot`` (a
    packed file of its own per state)."""
    from abs.state.capture import SlotsDelta

    frames: list[list[m.WriteJob]] = []
    current: list[m.WriteJob] = []
    key: Any = None
    for job in jobs:
        if isinstance(job.delta, SlotsDelta):
            chunk = job.delta.chunk()
            if current and chunk != key:
                frames.append(current)
                current = []
            key = chunk
        current.append(job)
    frames.append(current)
    return frames


def _release_arrow_memory() -> None:
    """Hand back what Arrow's allocator keeps of what this thread freed (well under 1 ms)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


class SentKeys:
    """What a worker remembers of the keys it sent its writer process: per key group, the list
    of ``str`` (or other non-int64) keys of the last full image it sent (the same objects the
    key group holds: 8 bytes a key). A full image whose keys are that list again (equal: a
    C-level comparison that finds the very same objects, ~0.3 ms per 100 k keys) goes as
    :class:`~abs.columns.SameKeys`, and the writer uses the sorted Arrow keys it kept
    (:meth:`abs.columns.KeyOrders.sort_text`). Pickling 100 k string keys cost ~20 ms of the
    worker's uploader thread (holding the GIL) and ~10 ms of the writer, building their Arrow
    array and sorting them ~30 ms more, at every checkpoint of a state whose keys stay. Keys
    it has not sent go as the Arrow array the writer makes of them
    (:meth:`~abs.state.ColumnDelta.with_arrow_keys`: ~3 ms per 100 k string keys here instead
    of ~2 ms of pickling), so that the writer never holds them as Python objects. A probed key
    group (:mod:`abs.state.restored`) captures its restored Arrow keys themselves: the same
    array object again goes as :class:`~abs.columns.SameKeys` too (reference
    job, 100 k string keys, p=1, 4 interleaved rounds: the writer's peak private memory
    24-31 -> 21-26 MB, the job's peak distinct pages 154-161 -> 148-155 MB).

    The writer records the keys of every frame it reads before it writes anything; a write it
    reports as failed makes the worker forget everything (:meth:`forget`), so that the next
    write sends every key again whatever the writer kept."""

    def __init__(self) -> None:
        self._sent: dict[tuple, list] = {}

    def substitute(self, jobs: list[m.WriteJob]) -> list[m.WriteJob]:
        from abs.state import ColumnDelta

        out = []
        for job in jobs:
            delta = job.delta
            keys = delta.full_list_keys() if isinstance(delta, ColumnDelta) else None
            if keys is not None:
                slot = (job.operator, job.state, job.key_group)
                sent = self._sent.get(slot)
                # a probed key group's Arrow keys: the very array again (it never changes)
                if sent is keys or (type(keys) is list and type(sent) is list and sent == keys):
                    delta = delta.with_same_keys()
                else:
                    self._sent[slot] = keys
                    # as the Arrow array the writer would make of them (out of band in the
                    # frame): the writer then never holds them as Python objects
                    delta = delta.with_arrow_keys()
                # not dataclasses.replace: it asks dataclasses.fields() each time (a key group's job)
                job = m.WriteJob(job.operator, job.state, job.key_group, job.prev_chain, delta, job.complete)
            out.append(job)
        return out

    def forget(self) -> None:
        self._sent.clear()


def die_with_parent() -> None:
    """In a child process: be killed (SIGKILL) when the parent dies (Linux
    ``PR_SET_PDEATHSIG``); elsewhere a no-op, and the closed pipe or connection ends it."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _main(conn: Any, workers_end: Any) -> None:
    workers_end.close()
    die_with_parent()
    # pyarrow imports numpy.ma at its first conversion of a numpy array (15-25 ms): now, while
    # the worker starts, rather than in the first checkpoint's write
    importlib.import_module("numpy.ma")
    import pyarrow as pa

    from abs.columns import KeyOrders

    store = None
    opening: Any = None  # the WriterOpen received, while its root did not open
    open_error = None
    orders = KeyOrders()  # the sort order of each key group's keys, from its last full image
    session = None  # what this writer remembers from one write to the next (see write_jobs)
    reader = FrameReader()
    while True:
        # No cyclic garbage collection while a frame is unpacked and written: they make a few
        # objects per key group, all freed by their reference counts, and the collections
        # their allocations set off scanned every live object again and again (32,768 key
        # groups of a few keys: a third of the write's CPU). Collections resume between frames.
        with gc_paused():
            cpu = time.process_time()  # waiting for a frame takes none: the receive is counted
            try:
                msg = reader.recv(conn)
            except (EOFError, OSError):
                return
            if isinstance(msg, m.WriterOpen):
                from storage import CheckpointSession

                opening = msg
                store, open_error = _open_store(opening)
                session = CheckpointSession()
                continue
            if store is None and opening is not None:
                # the root did not open (e.g. the object store was unreachable while the worker
                # started): try again, and decline the write naming why, rather than dying with a
                # traceback on stderr
                store, open_error = _open_store(opening)
            if not isinstance(msg, m.WriteSnapshot):
                reply: Any = m.WriteFailed(str(m.unexpected(msg, "snapshot writer process", "its worker",
                                                               "WriterOpen or WriteSnapshot")))
            else:
                checkpoint_id, jobs = msg.checkpoint_id, msg.jobs
                del msg  # the jobs' arrays are views of the reader's block: none may outlive the write
                reply = (_write(store, orders, checkpoint_id, jobs, session) if open_error is None
                         else m.WriteFailed(f"the snapshot writer process could not open the storage root: "
                                            f"{open_error}"))
                del jobs
                # Arrow's allocator keeps what a write freed for the next one, seconds away: handed
                # back now (~0.2 ms), the writer holds ~12 MB less between checkpoints (100 k string keys)
                pa.default_memory_pool().release_unused()
            if isinstance(reply, m.WriteDone):
                reply = m.WriteDone(reply.chains, time.process_time() - cpu)
            try:
                conn.send(reply)
            except (EOFError, OSError):
                return


def _open_store(msg: Any) -> tuple[Any, str | None]:
    """The store of a :class:`WriterOpen`, or ``None`` and why it did not open."""
    from storage import SnapshotStore

    try:
        return SnapshotStore.open(msg.storage_url, msg.storage_options), None
    except Exception as exc:  # noqa: BLE001 - reported with each write, which the worker declines
        return None, f"{type(exc).__name__}: {exc}"


def _write(store: Any, orders: Any, checkpoint_id: int, jobs: list, session: Any = None) -> Any:
    """:class:`WriteDone` or :class:`WriteFailed` for one :class:`WriteSnapshot` (see :func:`write_jobs`)."""
    if store is None:
        return m.WriteFailed("RuntimeError: the writer process got no storage root")
    try:
        from abs.state import ColumnDelta

        for job in jobs:  # before anything can fail: the keys the worker now knows were received
            if isinstance(job.delta, ColumnDelta):
                job.delta.receive_keys(orders, (job.operator, job.state, job.key_group))
        if session is None:
            from storage import CheckpointSession

            session = CheckpointSession()
        return m.WriteDone(write_jobs(store, orders, checkpoint_id, jobs, session))
    except Exception as exc:  # noqa: BLE001 - reported to the worker, which declines the checkpoint
        return m.WriteFailed(f"{type(exc).__name__}: {exc}")


def write_jobs(store: Any, orders: Any, checkpoint_id: int, jobs: list, session: Any) -> list[list]:
    """Write one checkpoint's ``jobs`` (see the module docstring; in the worker's own thread a
    ``delta`` may also be any lazy delta with ``to_table``) through ``session`` (a
    :class:`storage.CheckpointSession` the caller keeps from one write to the next) and
    return their new chains in job order; the first failure raises.

    A :class:`~abs.state.ColumnDelta` is encoded in the order :class:`~abs.columns.KeyOrders`
    keeps for its key group, and names its full image's sorted keys (``image_keys``): a full
    image whose keys are still the very array the session saw with the base it last wrote
    for the key group (no insert or delete since) is written as a values image over that
    base, so a state whose keys stay while its values change, such as counters over a fixed
    key set, writes its keys once instead of at every checkpoint. A capture of every row in
    which at least :data:`abs.state.capture.VALUES_IMAGE_SHARE` of the keys changed is
    written as that full image when its keys are the base's (:meth:`ColumnDelta.as_image`):
    a values image instead of a delta the chain would soon be compacted for.
    """
    import pyarrow as pa

    from abs.state import ColumnDelta
    from storage import KeyGroupCapture

    captures = []
    for job in jobs:
        operator, state, kg, prev_chain, delta, complete = (
            job.operator, job.state, job.key_group, job.prev_chain, job.delta, job.complete)
        keys = values = rows = base = None
        if isinstance(delta, pa.Table):
            table, image = delta, None
        elif isinstance(delta, ColumnDelta):
            slot = (operator, state, kg)
            whole = delta.as_image()
            if whole is not None and session.over_base(KeyGroupCapture(
                    operator, state, kg, prev_chain, functools.partial(whole.to_table, orders, slot), True,
                    image_keys=functools.partial(whole.image_keys, orders, slot))) is not None:
                delta = whole  # most keys changed, none came or went: a values image (VALUES_IMAGE_SHARE)
            table, complete = functools.partial(delta.to_table, orders, slot), delta.complete
            image = functools.partial(delta.image, orders, slot)
            keys = functools.partial(delta.image_keys, orders, slot)
            rows, base = delta.num_rows, functools.partial(delta.base, orders, slot)  # the table only if needed
            if delta.typed_image:  # its values image from its columns
                values = functools.partial(_values_image, delta, orders, slot)
        else:  # complete is read after to_table, which may set it
            table = delta.to_table()
            image, complete = getattr(delta, "image", None), getattr(delta, "complete", complete)
        captures.append(KeyGroupCapture(operator, state, kg, prev_chain, table, complete, image, keys, values, rows, base))
    return session.write(store, checkpoint_id, captures)


def _values_image(delta: Any, orders: Any, slot: tuple) -> Any:
    """The values image of a :attr:`~abs.state.ColumnDelta.typed_image` (what
    :func:`storage.values_images.values_image` makes of its normalized table) from its sorted
    keys and values alone. What depends on the keys alone (whether they are unique, their
    digest, the image's schema) is kept from the last image of the same keys
    (:meth:`abs.columns.KeyOrders.derived`), so that a key group whose keys stay costs a gather
    and a byte-stream split of its values (:func:`storage.values_images.split_values_image`):
    per key group of 7.8 k keys ~20 us, against ~50 through the value table and its split copy,
    and ~100 before that through to_table, normalize_delta and values_image."""
    from storage.values_images import split_values_image, values_image_over

    keys, values, nulls = delta.sorted_values(orders, slot)
    form = orders.derived(slot, keys, functools.partial(_image_form, delta.value_type, delta.values_metadata()))
    if form is None:
        return None  # a key repeats: no values image (values_image_over says the same)
    digest, schema, dtype = form
    if schema is not None and nulls is None and values.dtype == dtype:
        return split_values_image(values, schema)
    return values_image_over(keys, delta.values_table(values, nulls), digest)  # nulls, or a type not split


def _image_form(value_type: Any, metadata: dict, keys: Any) -> tuple | None:
    """What a values image over the sorted int64 ``keys`` takes from them alone: None when a
    key repeats, else ``(digest, schema, dtype)``: the schema of the image stored byte-stream
    split and the numpy dtype of its values (both None where its type is not split)."""
    from storage.values_images import int64_digest, split_image_schema, strictly_increasing

    if not strictly_increasing(keys):
        return None
    digest = int64_digest(keys)
    schema = split_image_schema(value_type, metadata, digest)
    return digest, schema, None if schema is None else np.dtype(value_type.to_pandas_dtype())


class InThreadWriter:
    """Writes a worker's snapshots in the calling (uploader) thread, with the memory the writer
    process keeps (each key group's sort order and base, see :func:`write_jobs`): where there
    is no writer process (a ``memory://`` root, no ``fork``, or the process died), values
    images and remembered sort orders still spare the work they spare there. Same ``write``
    as :class:`SnapshotWriter`; ``jobs`` may hold any lazy delta."""

    last_cpu = 0.0  # the CPU is the calling thread's: its caller measures it

    def __init__(self, store: Any) -> None:
        from abs.columns import KeyOrders
        from storage import CheckpointSession

        self._store = store
        self._orders = KeyOrders()
        self._session = CheckpointSession()

    def write(self, checkpoint_id: int, jobs: list[m.WriteJob]) -> list[list]:
        return write_jobs(self._store, self._orders, checkpoint_id, jobs, self._session)
