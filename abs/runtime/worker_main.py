"""The entry point of a worker process (``python -c "from abs.runtime.worker_main import
main; main()"``, started by an executor, or ``main(boot)`` in a worker forked from the driver,
see :mod:`abs.runtime.forked`): reads its bootstrap JSON from stdin, connects to the driver,
and takes the :class:`~abs.runtime.worker.Worker` through the start-up handshake of
:mod:`abs.runtime.messages`, sending heartbeats (with its restore progress) until it starts."""
from __future__ import annotations

import gc
import json
import os
import sys
import threading
import traceback
from multiprocessing.connection import Client
from typing import Any

from . import messages as m
from .channels import no_delay
from .worker import Worker, WorkerSpec
from .writer import SnapshotWriter

__all__ = ["main", "STARTUP_HEARTBEAT_S"]


def main(boot: dict | None = None) -> None:
    """Entry point of a worker process: ``boot``, or its bootstrap JSON read from stdin."""
    if boot is None:
        boot = json.loads(sys.stdin.readline())
    no_huge_pages()  # before the writer's fork: it inherits the setting
    keep_freed_heap()  # so does this one
    # the writer shares this process's pages: frozen, the objects of both stay out of their
    # collections, which would copy every page they examine (see abs.runtime.forked)
    gc.freeze()
    writer = SnapshotWriter.fork()  # before any thread exists (see abs.runtime.writer)
    # LocalExecutor(pin_cpus=True): set while this is the only thread (threads inherit it);
    # the writer, forked above, stays free
    if boot.get("cpu") is not None:
        os.sched_setaffinity(0, {boot["cpu"]})
    secret = bytes.fromhex(boot["secret"])
    index = boot["index"]
    try:
        conn = Client(tuple(boot["driver"]), authkey=secret)
        no_delay(conn)  # the hello goes out at once (see no_delay)
        conn.send(m.Hello(index, os.getpid()))
        job = conn.recv()
    except (OSError, EOFError) as exc:  # e.g. the driver was killed while its workers started
        _driver_gone(index, boot["driver"], exc)
    import cloudpickle

    # while it starts (loading the job, restoring state: minutes for a large state), a
    # worker tells the driver it is alive, so a hung worker is found in heartbeat time
    send_lock = threading.Lock()
    starting = threading.Event()
    state: dict[str, Any] = {}  # "worker" once it exists: its restore progress goes with the heartbeats
    threading.Thread(target=_startup_heartbeat, args=(conn, send_lock, starting, index, state), daemon=True).start()

    def send(msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    phase = "loading the job"
    try:
        if not isinstance(job, m.JobSpec):
            raise m.unexpected(job, f"worker {index}", "the driver", "JobSpec")
        spec: WorkerSpec = cloudpickle.loads(job.payload)
        worker = Worker(index, conn, spec, secret, job.assignment)
        state["worker"] = worker
        worker._send_lock = send_lock  # one lock for every send on the driver connection
        worker.writer = writer
        worker.bind_host = boot.get("bind_host", "127.0.0.1")  # all interfaces on a cluster
        phase = "opening the storage root"
        worker.build()
        host, port = worker.listener.address[:2]
        send(m.Listening((boot.get("advertise_host") or host, port)))
        phase = "waiting for its peers' addresses"
        peers = conn.recv()
        if not isinstance(peers, m.Peers):
            raise m.unexpected(peers, f"worker {index}", "the driver", "Peers")
        phase = "connecting to its peers"
        worker.connect(list(peers.addresses))
        worker.fault("after_connect", None)
        phase = "restoring its state" if job.assignment.keyed_chains else "creating its tasks"
        stats = worker.create_tasks()
        send(m.Ready(stats))
    except Exception as exc:  # noqa: BLE001 - reported to the driver, whose restart strategy decides
        from .failures import describe, is_permanent

        try:
            send(m.TaskFailed(f"worker{index}", "<startup>", traceback.format_exc(), phase, describe(exc),
                              is_permanent(exc)))
        except (OSError, EOFError):
            pass  # the driver is gone or gave up on this attempt
        sys.exit(1)
    try:
        start = conn.recv()
    except (OSError, EOFError) as exc:
        _driver_gone(index, boot["driver"], exc)
    starting.set()  # from here on the worker's metrics are its heartbeat
    if not isinstance(start, m.Start):
        sys.exit(0)
    worker.run()
    conn.close()
    os._exit(0)


def _driver_gone(index: int, driver: Any, exc: BaseException) -> None:
    """Exit 1 with one line: the driver this worker starts for is gone (killed, or it gave up
    on this attempt) before the worker runs; nothing of the job ran here."""
    host, port = driver[0], driver[1]
    print(f"[abs] worker {index} (pid {os.getpid()}): the driver at {host}:{port} is gone or ended this attempt "
          f"({type(exc).__name__}: {exc or 'connection closed'}); exiting", file=sys.stderr, flush=True)
    sys.exit(1)


def no_huge_pages() -> None:
    """Turn transparent huge pages off for this process and the processes it forks (Linux
    ``PR_SET_THP_DISABLE``; elsewhere a no-op).

    Why: Arrow's allocator (mimalloc) asks for huge pages on its memory (``MADV_HUGEPAGE``), so
    on a kernel that grants them where asked (``transparent_hugepage=madvise``, a common
    default) every region it touches costs 2 MB at once: a worker's first Arrow array took 4 MB,
    each checkpoint made the snapshot writer touch ~6 MB more for ~1.4 MB of Arrow data, and
    writing to a huge page shared with the driver after the fork copied all 2 MB. A worker's
    Arrow memory is a few MB of short-lived buffers, where 4 KB pages cost no measurable speed.
    Memory already in huge pages (the driver's, inherited) is left as it is; a write to it
    now copies 4 KB."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
    except (OSError, AttributeError):
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
KEEP_FREED_HEAP = 32 << 20
"""Freed memory at the top of a worker's heap kept for reuse, at most (glibc's trim threshold)."""
HEAP_BLOCKS_UP_TO = 4 << 20
"""A worker's allocations up to this size come from its heap (glibc's mmap threshold)."""


def keep_freed_heap() -> None:
    """Keep up to :data:`KEEP_FREED_HEAP` of freed memory in this process's heap for its next
    allocations, and take blocks of up to :data:`HEAP_BLOCKS_UP_TO` from the heap (glibc's
    ``mallopt``; elsewhere a no-op). The processes it forks (the snapshot writer) inherit it.

    Why: a snapshot's synchronous part copies each changed key group's keys and values into
    new arrays (8 MB a checkpoint for each task on the ABS paper's workload at p=2), which the
    uploader frees once they are written. glibc gave those pages back to the kernel at once
    (a trim threshold of 128 KB, or twice the largest block freed since), and the next
    checkpoint's copies faulted them in again, 4 KB at a time: half of the synchronous part,
    during which the task stops (at p=2 7.0 ms a checkpoint, 3.8-4.4 ms with the pages kept;
    ``bench_overhead.py --only windows``). Blocks above the mmap threshold are fresh pages at
    every allocation; setting the trim threshold fixes the mmap threshold, which glibc would
    otherwise raise as large blocks are freed, so it is set too."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_HEAP)
        libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCKS_UP_TO)
    except (OSError, AttributeError):
        pass


def _startup_heartbeat(conn: Any, lock: threading.Lock, started: threading.Event, index: int, state: dict) -> None:
    while not started.wait(STARTUP_HEARTBEAT_S):
        worker = state.get("worker")
        with lock:
            try:
                conn.send(m.Heartbeat(index, worker.bytes_restored if worker is not None else 0))
            except (OSError, EOFError):
                return


STARTUP_HEARTBEAT_S = 0.5
"""How often a starting worker tells the driver it is alive (a running one sends metrics)."""
