"""Worker processes forked from the driver: a worker that starts in milliseconds.

A worker started as a fresh interpreter spends 0.3-0.5 s importing numpy, pyarrow and the
runtime before it can say hello; forked from the driver, which has imported them already, it
says hello in a few milliseconds. :class:`~abs.runtime.executors.LocalExecutor` forks when
:func:`fork_refusal` finds it safe and starts a fresh interpreter otherwise.

Fork is safe here when no other thread runs in the driver: a thread holding a lock (an I/O
buffer's, an allocator's) at the moment of the fork leaves that lock held for ever in the
child. So the driver forks only while it is the only Python thread of its process (a job run
with ``abs.run`` from a plain script; not ``abs.submit``, whose driver runs in a thread, nor a
driver with a dashboard or a Spark source's threads). The libraries the worker uses after the
fork (numpy, pyarrow and its allocator) reset their own thread pools and locks in the child.

The child then becomes what a fresh worker process is: it closes every inherited socket and
pipe (the driver's listener, its connections to workers already running, a previous
attempt's), takes the default signal handlers back, flushes nothing it inherited twice (the driver flushes its streams before the
fork), never returns into the driver's code and never runs the driver's exit handlers
(``os._exit``). Regular files and terminals stay open: the application's log files keep
working in the worker.

Memory: the child shares the driver's pages until one of them writes a page (copy on write).
The garbage collector writes to every object it examines, so one full collection in either
process would copy every page of the modules both imported. The driver's objects are
therefore frozen (``gc.freeze``: the collector ignores them) across the fork; the driver
unfreezes its own at once, the worker keeps them frozen (module-level objects it never
frees) and freezes its own again before it forks its snapshot writer
(:mod:`abs.runtime.worker_main`). Measured on the reference workload (``process``, 100 k
string keys, p=1): the job's peak PSS fell from 142-147 MB to 133-137 MB. Likewise the driver
makes pyarrow build its lazily built conversion state before the first fork
(:func:`_warm_pyarrow`, ~5 ms once): the job's peak of distinct pages fell from 163-174 MB to
162-163 MB (PSS 137-140 MB to 130-135 MB).
"""
from __future__ import annotations

import gc
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import traceback

__all__ = ["ForkedWorker", "fork_refusal", "fork_worker"]


def fork_refusal() -> str | None:
    """Why this process must not fork a worker now, or ``None`` when it may."""
    if not hasattr(os, "fork") or not hasattr(os, "pidfd_open") or not os.path.isdir("/proc/self/fd"):
        return "this platform has no fork with process descriptors (Linux 5.3 or later)"
    if not _pidfds_work():
        return "this kernel refuses process descriptors (pidfd_open)"
    if threading.active_count() > 1:
        names = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return f"{len(names)} other thread(s) run in this process ({shown})"
    return None


_PIDFDS: list[bool] = []  # probed once per process


def _pidfds_work() -> bool:
    if not _PIDFDS:
        try:
            os.close(os.pidfd_open(os.getpid()))
            _PIDFDS.append(True)
        except OSError:
            _PIDFDS.append(False)
    return _PIDFDS[0]


def fork_worker(boot: dict) -> "ForkedWorker":
    """Fork a worker running :func:`abs.runtime.worker_main.main` with ``boot``; check
    :func:`fork_refusal` first."""
    from .worker_main import main  # imported here, before the fork: the child finds it loaded

    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # or the child would write the driver's buffered output again
        except (AttributeError, OSError, ValueError):
            pass
    _warm_pyarrow()  # before the fork: its lazily built state is then shared, not built again in each child
    freeze = gc.get_freeze_count() == 0  # an application that froze objects itself keeps its own freeze
    if freeze:
        gc.freeze()  # the worker's collections leave the shared pages alone (see the module docstring)
    try:
        pid = os.fork()
    finally:
        if freeze and os.getpid() == parent:
            gc.unfreeze()
    if pid == 0:  # the worker: never returns
        code = 1
        try:
            _close_inherited_connections()
            _default_signal_handlers()
            main(boot)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported on stderr like an uncaught error of a fresh process
            traceback.print_exc()
        finally:
            try:
                sys.stderr.flush()
                sys.stdout.flush()
            finally:
                os._exit(code)
    return ForkedWorker(pid)


def _warm_pyarrow() -> None:
    """Build once, in the driver, what pyarrow builds on its first conversion of a Python
    sequence or numpy array (~5 MB of memory and the modules its checks import: dateutil,
    numpy.ma), which every worker and its snapshot writer would otherwise build again, each a
    private copy (see the module docstring). Only when the driver has imported pyarrow."""
    pa = sys.modules.get("pyarrow")
    if pa is not None:
        pa.array([0])
        np = sys.modules.get("numpy")
        if np is not None:
            pa.array(np.zeros(1, dtype=np.int64))


def _close_inherited_connections() -> None:
    """Close every socket and pipe the child inherited (see the module docstring)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2:
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue  # the directory's own descriptor, already closed
        if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode):
            os.close(fd)


def _default_signal_handlers() -> None:
    """The handlers a fresh interpreter has: the application's own (a cleanup on SIGTERM, a
    custom SIGINT) belong to the driver, not to its workers."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


class ForkedWorker:
    """A forked worker process as the driver supervises it: ``pid``, ``returncode``,
    ``poll()``, ``wait(timeout)`` and ``kill()`` as :class:`subprocess.Popen` has them.
    Waiting with a timeout blocks on the process descriptor (no polling loop)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd: int | None = os.pidfd_open(pid)
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self._reaped(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and timeout is not None:
            with self._lock:
                fd = self._pidfd
            if fd is not None:
                try:
                    ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
                except (OSError, ValueError):
                    ready = [fd]  # reaped by another thread meanwhile: the wait below returns at once
                if not ready:
                    raise subprocess.TimeoutExpired(f"worker (pid {self.pid})", timeout)
        with self._lock:
            if self.returncode is None:
                _, status = os.waitpid(self.pid, 0)
                self._reaped(status)
            return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        with self._lock:
            if self.returncode is None and self._pidfd is not None:
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)  # never another process with a reused pid
                except ProcessLookupError:
                    pass  # exited, not yet reaped

    def _reaped(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __repr__(self) -> str:
        return f"ForkedWorker(pid={self.pid}, returncode={self.returncode})"
