"""A worker's snapshot writer process: the asynchronous part of its snapshots, out of its GIL.

Why a process: the asynchronous part (Arrow encoding, sorting, zstd, checksums, file writes)
is a long series of short calls that each release and re-take the GIL. In a thread of a
worker whose task threads run Python flat out, every re-take waits for the interpreter's
switch interval (5 ms): encoding 128 key groups took 28 s of wall time for 0.6 s of CPU, and
checkpoints stopped completing once a second. In a process of its own the same work takes the
CPU it needs on whatever core is free, and the worker's uploader thread only hands it the
captured copies (one pickled message per checkpoint, one reply).

The process is forked at the very start of the worker, before the worker has a thread (so no
lock can be held across the fork) and after its modules are imported (so it starts in a few
milliseconds instead of the half second a fresh interpreter needs to import pyarrow and
fsspec). Protocol on a pipe:

* ``("open", storage_url, storage_options)`` once, when the job has a storage root;
* ``("write", checkpoint_id, jobs)``; a job is ``(operator, state, key_group, prev_chain,
  delta, complete)`` with ``delta`` a :class:`~abs.state.ColumnDelta` or a ``pyarrow.Table``;
  reply ``("ok", [new_chain, ...])`` in job order, or ``("error", message)`` after the first
  failing job (the checkpoint is then declined; files already written are garbage for GC).

The process exits when the pipe closes (its worker ended or was killed: the read sees EOF)
and, on Linux, when its parent dies (``PR_SET_PDEATHSIG``). A worker whose writer died
writes in its uploader thread again.
"""
from __future__ import annotations

import multiprocessing
import threading
from typing import Any

__all__ = ["SnapshotWriter", "die_with_parent", "writes_in_process"]


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

    def open(self, storage_url: str, storage_options: dict | None) -> None:
        with self._lock:
            self._conn.send(("open", storage_url, storage_options))

    def write(self, checkpoint_id: int, jobs: list[tuple]) -> list[list]:
        """New chains for ``jobs`` (see the module docstring); raises ``RuntimeError`` naming
        the first failure, or when the process died."""
        with self._lock:
            try:
                self._conn.send(("write", checkpoint_id, jobs))
                kind, payload = self._conn.recv()
            except (EOFError, OSError) as exc:
                code = self._process.exitcode
                self._close()
                raise RuntimeError(f"the snapshot writer process died (exit code {code}): {exc}") from exc
        if kind != "ok":
            raise RuntimeError(payload)
        return payload

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

    def close(self) -> None:
        with self._lock:
            self._close()


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
    import pyarrow as pa

    from storage import SnapshotStore

    store = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "open":
            store = SnapshotStore.open(msg[1], msg[2])
            continue
        _, checkpoint_id, jobs = msg
        chains: list = []
        try:
            if store is None:
                raise RuntimeError("the writer process got no storage root")
            for operator, state, kg, prev_chain, delta, complete in jobs:
                if isinstance(delta, pa.Table):
                    table, image = delta, None
                else:
                    table, image, complete = delta.to_table(), delta.image, delta.complete
                chains.append(store.write_key_group(checkpoint_id, operator, state, kg, prev_chain, table,
                                                    complete=complete, image=image))
        except Exception as exc:  # noqa: BLE001 - reported to the worker, which declines the checkpoint
            reply: tuple = ("error", f"{type(exc).__name__}: {exc}")
        else:
            reply = ("ok", chains)
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
